"""``lightning-eagle export CHECKPOINT OUT_DIR``: a trained draft in its serving layout, and how to serve it — an
EAGLE-3 draft in the EAGLE-3 layout, a DSpark run's drafter in vLLM's ``K3DSparkModel`` layout (the checkpoint says
which)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.dtypes import DTYPES


def main(argv: list[str] | None = None) -> None:
    from lightning_eagle.checkpoint_io import load_checkpoint_file
    from lightning_eagle.draft.dspark_export import is_dspark_checkpoint
    from lightning_eagle.draft.export import export_draft, load_dcp_checkpoint
    from lightning_eagle.draft.serving_format import CONFIG_NAME, serving_instructions

    parser = CommandParser(prog="lightning-eagle export", description="Write a trained draft in its serving layout.")
    parser.add_argument("checkpoint", help="Lightning checkpoint file or DCP folder written by fit")
    parser.add_argument("out_dir", help="output folder (config.json + model.safetensors), written atomically")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    parser.add_argument(
        "--include-embeddings", action="store_true", help="also write the (frozen) embedding (EAGLE-3 only)"
    )
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    source = args.checkpoint
    if Path(source).is_file():  # read once: its keys say the family
        source = load_checkpoint_file(source, weights_only=False)
    elif (Path(source) / ".metadata").is_file():  # a sharded draft's DCP folder, consolidated once
        source = load_dcp_checkpoint(source)
    if isinstance(source, dict) and is_dspark_checkpoint(source):
        return _export_dspark(source, args)
    path = export_draft(
        source,
        args.out_dir,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        include_embeddings=True if args.include_embeddings else None,
        overwrite=args.overwrite,
    )
    print(f"exported {args.checkpoint} to {path}")
    for line in serving_instructions(json.loads((path / CONFIG_NAME).read_text()), str(path)):
        print(line)


def _export_dspark(checkpoint: dict, args) -> None:
    from lightning_eagle.draft.dspark_export import (
        CONFIG_NAME,
        dspark_drafter_from_checkpoint,
        dspark_serving_command,
        export_dspark_draft,
    )

    if args.include_embeddings:
        raise ValueError(
            "--include-embeddings: a DSpark draft shares the target's embedding and LM head (vLLM refuses its own)"
        )
    dtype = DTYPES[args.dtype] if args.dtype else DTYPES["bfloat16"]
    path = export_dspark_draft(
        dspark_drafter_from_checkpoint(checkpoint), args.out_dir, dtype=dtype, overwrite=args.overwrite
    )
    print(f"exported {args.checkpoint} (a DSpark draft) to {path}")
    print(dspark_serving_command(json.loads((path / CONFIG_NAME).read_text()), str(path)))


if __name__ == "__main__":
    main()
