"""Smoke run of the K3 target on CPU: build (or load) a checkpoint, run a forward and an EAGLE-3 capture.

python -m lightning_eagle.commands.smoke_target                   # synthetic k3-tiny, written and reloaded
python -m lightning_eagle.commands.smoke_target --checkpoint DIR  # a released-layout checkpoint directory
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.k3.model import KimiK3ForCausalLM
from lightning_eagle.k3.presets import config_from_name
from lightning_eagle.k3.writer import save_k3_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(
        prog="python -m lightning_eagle.commands.smoke_target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", default=None, help="released-layout K3 checkpoint directory")
    parser.add_argument("--preset", default="k3-tiny")
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, default=None)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            model = KimiK3ForCausalLM(config_from_name(args.preset)).init_weights(0)
            path = save_k3_checkpoint(model, f"{tmp}/{args.preset}")
            print(f"wrote a synthetic {args.preset} checkpoint (MXFP4 experts) to {path}")
        start = time.perf_counter()
        target = KimiK3ForCausalLM.from_pretrained(path, dtype=torch.float32)
        print(
            f"loaded in {time.perf_counter() - start:.2f}s: {target.config.num_hidden_layers} layers, "
            f"{sum(p.numel() for p in target.parameters()) / 1e6:.2f}M parameters"
        )
        L = target.config.num_hidden_layers
        ids = args.aux_layer_ids or ([1, L // 2, L - 1] if L <= 8 else None)
        input_ids = torch.randint(0, target.config.vocab_size, (2, args.seq_len))
        mask = torch.ones_like(input_ids)
        mask[1, args.seq_len // 2 :] = 0
        start = time.perf_counter()
        cap = target.capture(input_ids, mask, aux_layer_ids=ids, return_logits=True)
        print(
            f"capture in {time.perf_counter() - start:.3f}s: logits {tuple(cap.logits.shape)}, "
            f"aux {tuple(cap.aux_hidden_states.shape)} (ids {ids}), final_hidden {tuple(cap.final_hidden.shape)}"
        )
        assert torch.isfinite(cap.logits).all()


if __name__ == "__main__":
    main()
