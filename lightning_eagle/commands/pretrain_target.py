"""Pretrain a tiny K3 target on chat data, so the quickstart's draft learns from a target that knows its corpus
(a random-weight target has nothing for a draft to predict).

    python -m lightning_eagle.commands.pretrain_target --out lightning_eagle/assets/k3-tiny-chat

Plain next-token cross-entropy over every real token, AdamW + cosine, deterministic for a given seed and thread
count. The result is written in the released layout (VLM wrapper, MXFP4 routed experts) and loaded back through the
real loader by the quickstart.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.data import ChatDataModule
from lightning_eagle.k3.loader import QUICKSTART_TARGET
from lightning_eagle.k3.model import KimiK3ForCausalLM
from lightning_eagle.k3.presets import config_from_name
from lightning_eagle.k3.writer import save_k3_checkpoint, snap_experts_to_mxfp4


def next_token_loss(model: KimiK3ForCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    logits = model(input_ids, attention_mask).logits[:, :-1].float()
    labels = input_ids[:, 1:]
    valid = attention_mask[:, 1:].bool()
    loss = F.cross_entropy(logits[valid], labels[valid])
    accuracy = (logits.argmax(-1)[valid] == labels[valid]).float().mean()
    return loss, accuracy


def pretrain_tiny_target(
    out_dir: str | Path = QUICKSTART_TARGET,
    preset: str = "k3-tiny",
    steps: int = 600,
    batch_size: int = 8,
    max_length: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    train_files: list[str] | None = None,
    log_every: int = 50,
) -> Path:
    torch.manual_seed(seed)
    # Trained KDA gates push decays towards the lower bound; subnormal floats then make CPU training ~5x slower.
    torch.set_flush_denormal(True)
    data = ChatDataModule(
        train_files=train_files,
        tokenizer="synthetic",
        max_length=max_length,
        batch_size=batch_size,
        seed=seed,
        use_cache=False,
        thinking_effort=None,
    )
    data.setup("fit")
    config = config_from_name(
        preset,
        vocab_size=data.vocab_size,
        bos_token_id=data.bos_token_id,
        eos_token_id=data.eos_token_id,
        pad_token_id=data.pad_token_id,
        max_position_embeddings=4096,
    )
    model = KimiK3ForCausalLM(config).init_weights(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    step, start = 0, time.perf_counter()
    while step < steps:
        for batch in data.train_dataloader():
            loss, acc = next_token_loss(model, batch["input_ids"], batch["attention_mask"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            step += 1
            if step % log_every == 0 or step == steps:
                print(
                    f"step {step:5d}  loss {loss.item():.3f}  acc {acc.item():.3f}  {time.perf_counter() - start:.0f}s",
                    flush=True,
                )
            if step >= steps:
                break
    model.eval()
    snap_experts_to_mxfp4(model)
    with torch.no_grad():
        losses = [next_token_loss(model, b["input_ids"], b["attention_mask"]) for b in data.val_dataloader()]
    val_loss = sum(loss.item() for loss, _ in losses) / len(losses)
    val_acc = sum(a.item() for _, a in losses) / len(losses)
    print(f"validation (MXFP4 experts): loss {val_loss:.3f}  next-token accuracy {val_acc:.3f}")
    return save_k3_checkpoint(model, out_dir, mxfp4=True)


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(
        prog="python -m lightning_eagle.commands.pretrain_target",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=str(QUICKSTART_TARGET))
    parser.add_argument("--preset", default="k3-tiny")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = pretrain_tiny_target(args.out, args.preset, args.steps, args.batch_size, args.max_length, args.lr, args.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
