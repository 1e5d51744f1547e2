"""Does a bf16 draft on fp32 master weights train like an fp32 one? The tiny target, three recipes side by side in one
run, for a family (``--family eagle3|dspark``):

* ``fp32``: the draft's parameters, gradients and AdamW states in fp32 (the reference);
* ``bf16-master``: bf16 compute with fp32 masters (``model.draft.master_weights: true``, the default);
* ``bf16-pure``: bf16 parameters and AdamW states, no master copy (the negative control; warned about).

Each recipe trains the quickstart draft of the family from the same init and data at the K3 configs' learning rate
and reports the training loss (mean of the last tenth of the steps), the validation τ_sim at the end, and the share of
RMSNorm gains and of all weights that ever moved from their initial value (a bf16 gain of 1.0 moves only by an update
≥ 2⁻⁹, so at lr 6e-4 a pure-bf16 gain never does).

    python benchmarks/mixed_precision.py --family eagle3 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from lightning.pytorch import Callback

RECIPES = {
    "fp32": {"dtype": "float32", "master_weights": True},
    "bf16-master": {"dtype": "bfloat16", "master_weights": True},
    "bf16-pure": {"dtype": "bfloat16", "master_weights": False},
}
CONFIGS = {"eagle3": "quickstart", "dspark": "quickstart_dspark"}


class LossRecorder(Callback):
    """The training loss of every step, and the draft's weights before the first one (what moved)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.initial = {n: p.detach().float().clone() for n, p in pl_module.draft.named_parameters() if p.requires_grad}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def train(family: str, recipe: str, steps: int, root: Path, lr: float = 6e-4, max_length: int = 96) -> dict:
    """One recipe's run (module docstring); its numbers."""
    from lightning_eagle.commands.cli import make_cli, resolve_packaged_configs

    torch.set_num_threads(1)  # the tiny models run fastest on one thread (and never oversubscribed)
    draft = RECIPES[recipe]
    words = [
        "--config", CONFIGS[family], "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
        "--trainer.limit_val_batches", "4", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]", "--trainer.default_root_dir",
        str(root / recipe), "--model.optimization.lr", str(lr), "--model.draft.dtype", draft["dtype"],
        "--model.draft.master_weights", str(draft["master_weights"]).lower(), "--data.max_length", str(max_length),
        "--data.batch_size", "4", "--seed_everything", "0",
    ]  # fmt: skip
    cli = make_cli(resolve_packaged_configs(words), False, run=False)
    recorder = LossRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    tau = float(cli.trainer.callback_metrics["val/tau_sim"])
    moved = {n: (p.detach().float() != recorder.initial[n]) for n, p in cli.model.draft.named_parameters()
             if n in recorder.initial}  # fmt: skip
    gains = [m for n, m in moved.items() if n.endswith("norm.weight") or "norm." in n and n.endswith(".weight")]
    tail = recorder.losses[-max(1, steps // 10) :]
    return {
        "family": family, "recipe": recipe, "steps": steps, "lr": lr,
        "loss": sum(tail) / len(tail), "losses": recorder.losses, "tau_sim": tau,
        "norm_gains_moved": float(torch.cat([m.flatten() for m in gains]).float().mean()) if gains else None,
        "weights_moved": float(torch.cat([m.flatten() for m in moved.values()]).float().mean()),
    }  # fmt: skip


def compare(family: str, steps: int, root: Path, lr: float = 6e-4) -> dict[str, dict]:
    """The three recipes of ``family`` (module docstring), each with its gap to fp32."""
    runs = {recipe: train(family, recipe, steps, root, lr) for recipe in RECIPES}
    ref = runs["fp32"]
    for run in runs.values():
        run["loss_gap"] = abs(run["loss"] - ref["loss"]) / ref["loss"]
        run["tau_gap"] = abs(run["tau_sim"] - ref["tau_sim"]) / ref["tau_sim"]
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(CONFIGS), default="eagle3")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = compare(args.family, args.steps, Path(tmp), args.lr)
    print(f"{args.family}, {args.steps} steps at lr {args.lr:g} (loss: mean of the last tenth of the steps)")
    header = ("recipe", "loss", "vs fp32", "tau_sim", "vs fp32", "gains moved", "weights moved")
    print("{:<12} {:>8} {:>8} {:>8} {:>8} {:>12} {:>14}".format(*header))
    for name, r in runs.items():
        gains = "-" if r["norm_gains_moved"] is None else f"{r['norm_gains_moved']:.1%}"
        print(f"{name:<12} {r['loss']:8.4f} {r['loss_gap']:8.2%} {r['tau_sim']:8.3f} {r['tau_gap']:8.2%} "
              f"{gains:>12} {r['weights_moved']:14.1%}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
