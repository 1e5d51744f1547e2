"""Command line: ``lightning-eagle {fit,validate,test,predict} --config …`` (LightningCLI) and
``lightning-eagle export CHECKPOINT OUT_DIR`` (serving export of a trained draft)."""

from __future__ import annotations

import argparse
import sys

from lightning.pytorch.cli import LightningCLI

from lightning_eagle.data.datamodule import ChatDataModule
from lightning_eagle.training.module import Eagle3Module


class Eagle3CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"trainer.precision": "32-true"})


def export_main(argv: list[str]) -> None:
    from lightning_eagle.draft.export import export_draft

    parser = argparse.ArgumentParser(
        prog="lightning-eagle export", description="Write a trained draft in the EAGLE-3 serving layout."
    )
    parser.add_argument("checkpoint", help="Lightning checkpoint file or DCP folder written by fit")
    parser.add_argument("out_dir", help="output folder (config.json + model.safetensors), written atomically")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--include-embeddings", action="store_true", help="also write the (frozen) embedding")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    import torch

    path = export_draft(
        args.checkpoint,
        args.out_dir,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        include_embeddings=True if args.include_embeddings else None,
        overwrite=args.overwrite,
    )
    print(f"exported {args.checkpoint} to {path}")


def main(argv: list[str] | None = None) -> None:
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] == "export":
        return export_main(words[1:])
    # args=None lets LightningCLI read sys.argv itself (passing both triggers its misuse warning)
    Eagle3CLI(Eagle3Module, ChatDataModule, args=argv, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
