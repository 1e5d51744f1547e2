"""``lightning-eagle export CHECKPOINT OUT_DIR``: a trained draft in its family's serving layout, and how to serve it
(the checkpoint names its family: :func:`~lightning_eagle.draft.family.checkpoint_family`)."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.dtypes import DTYPES


def main(argv: list[str] | None = None) -> None:
    from lightning_eagle.checkpoint_io import load_checkpoint_file, load_dcp_checkpoint
    from lightning_eagle.draft.family import checkpoint_family, export_config

    parser = CommandParser(prog="lightning-eagle export", description="Write a trained draft in its serving layout.")
    parser.add_argument("checkpoint", help="Lightning checkpoint file or DCP folder written by fit")
    parser.add_argument("out_dir", help="output folder (config.json + model.safetensors), written atomically")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: the family's serving dtype")
    parser.add_argument(
        "--include-embeddings", action="store_true", help="also write the (frozen) embedding (families with their own)"
    )
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    source = args.checkpoint
    if Path(source).is_file():  # read once: its keys say the family
        checkpoint = load_checkpoint_file(source, weights_only=False)
    elif not Path(source).exists():
        raise FileNotFoundError(
            f"export source {source!r} does not exist (a checkpoint file or DCP folder written by fit)"
        )
    else:  # a sharded draft's DCP folder, consolidated once (a folder that is not one is refused by name)
        checkpoint = load_dcp_checkpoint(source)
    family = checkpoint_family(checkpoint, f"checkpoint {source}")
    refuse_non_finite(checkpoint, source)
    path = family.export(
        checkpoint,
        args.out_dir,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        include_embeddings=True if args.include_embeddings else None,
        overwrite=args.overwrite,
    )
    print(f"exported {args.checkpoint} (a {family.name} draft) to {path}")
    for line in family.serve_lines(export_config(path), str(path)):
        print(line)


def refuse_non_finite(checkpoint: dict, source: str) -> None:
    """A NaN or inf in any floating tensor of the checkpoint's state dict (a diverged or corrupt draft) is refused
    before anything is written, naming the checkpoint and the tensor: an engine would serve it."""
    import torch

    state = checkpoint.get("state_dict", checkpoint)
    for key, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.device.type != "meta":
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise ValueError(
                    f"refusing to export checkpoint {str(source)!r}: tensor {key!r} holds {bad} non-finite value(s) "
                    f"(NaN/inf) of {tensor.numel()}: the draft's weights are damaged (a diverged run or a corrupt "
                    "file); nothing was written"
                )


if __name__ == "__main__":
    main()
