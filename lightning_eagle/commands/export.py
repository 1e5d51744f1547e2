"""``lightning-eagle export CHECKPOINT OUT_DIR``: a trained draft in the EAGLE-3 serving layout, and how to serve it."""

from __future__ import annotations

import json
import sys

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.dtypes import DTYPES


def main(argv: list[str] | None = None) -> None:
    from lightning_eagle.draft.export import export_draft
    from lightning_eagle.draft.serving_format import CONFIG_NAME, serving_instructions

    parser = CommandParser(
        prog="lightning-eagle export", description="Write a trained draft in the EAGLE-3 serving layout."
    )
    parser.add_argument("checkpoint", help="Lightning checkpoint file or DCP folder written by fit")
    parser.add_argument("out_dir", help="output folder (config.json + model.safetensors), written atomically")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    parser.add_argument("--include-embeddings", action="store_true", help="also write the (frozen) embedding")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    path = export_draft(
        args.checkpoint,
        args.out_dir,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        include_embeddings=True if args.include_embeddings else None,
        overwrite=args.overwrite,
    )
    print(f"exported {args.checkpoint} to {path}")
    for line in serving_instructions(json.loads((path / CONFIG_NAME).read_text()), str(path)):
        print(line)


if __name__ == "__main__":
    main()
