"""EAGLE-3 chains against DSpark blocks on the tiny target, under a stated protocol (docs/families.md, "A fair
comparison"):

1. **The same inputs.** The same bundled chats, rows, batches, optimizer steps and seed; both drafts read the same
   three taps ``[1, 3, 5]``; K = g = 7 draft tokens per verify.
2. **The same supervised predictions.** EAGLE-3's training-time test predicts, at every supervised position t, the
   tokens t+1 … t+7 (one per TTT step). DSpark predicts anchor+1 … anchor+7 from each anchor; with
   ``num_anchors`` ≥ the anchor candidates of a row (here 256 = ``max_length``) every supervised position is an anchor,
   so both families are trained on the same (position, offset) pairs, step for step.
3. **Each family's own objective and learning rate** (their quickstart configs'), and one ablation that isolates the
   objective: DSpark trained with cross-entropy alone (``ce 1, l1 0``; the confidence head unchanged).
4. **The same evaluation.** Each export decodes the same held-out prompts with its family's loop, greedy and at
   temperature 1 (rejection sampling, the same seeds): mean acceptance length, and the draft's cost per verify round
   (drafting time only, the target's verify excluded).

    python benchmarks/family_comparison.py --steps 150 --json out.json

The README's table and ``notebooks/draft_families.ipynb`` follow this protocol.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

TAPS = "[1, 3, 5]"
K = 7
EVERY_ANCHOR = ["--model.draft.config.block_size", str(K), "--model.objective.num_anchors", "256"]
RUNS = {
    "EAGLE-3": ("quickstart", []),
    "DSpark": ("quickstart_dspark", EVERY_ANCHOR),
    "DSpark, CE only": ("quickstart_dspark", [*EVERY_ANCHOR, "--model.objective.ce", "1", "--model.objective.l1", "0"]),
}


def fit(config: str, extra: list[str], steps: int, root: Path) -> dict:
    """One family trained through ``cli.py fit`` (the protocol's inputs); its export, wall clock and steps."""
    from lightning_eagle.checkpoint_io import load_checkpoint_file
    from lightning_eagle.commands.cli import main as cli

    words = ["fit", "--config", config, "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
             "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
             "--trainer.enable_model_summary", "false", "--model.target.aux_layer_ids", TAPS, "--seed_everything", "0",
             *extra]  # fmt: skip
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        cli(words)
    checkpoint = load_checkpoint_file(root / "checkpoints" / "last.ckpt", weights_only=False)
    return {"export": root / "draft", "seconds": time.perf_counter() - start, "steps": checkpoint["global_step"]}


def evaluate(export: Path, target, num_prompts: int, max_new_tokens: int) -> dict:
    """Greedy and T = 1 decoding of ``export`` on the first ``num_prompts`` held-out prompts (protocol point 4)."""
    from lightning_eagle.inference import DecodingSettings, evaluate_acceptance
    from lightning_eagle.inference.draft_families import load_draft

    family, draft = load_draft(export, target)
    out = {"family": family}
    for name, temperature in (("greedy", 0.0), ("T=1", 1.0)):
        decoding = DecodingSettings(max_new_tokens=max_new_tokens, num_draft_tokens=K, temperature=temperature)
        report = evaluate_acceptance(target, draft, decoding=decoding, num_prompts=num_prompts,
                                     compare_plain=temperature == 0.0, warmup=temperature == 0.0)  # fmt: skip
        if temperature == 0.0:
            assert report.greedy_mismatches == 0, f"{export}: greedy speculative output differs from plain decoding"
        out[name] = {"tau": report.engine["mean_acceptance_length"],
                     "per_position": list(report.acceptance_per_position),
                     "draft_ms_per_round": 1000 * report.spec_draft_seconds / max(report.num_rounds, 1)}  # fmt: skip
    return out


def compare(steps: int, root: Path, num_prompts: int = 16, max_new_tokens: int = 64) -> dict[str, dict]:
    from lightning_eagle.k3 import KimiK3ForCausalLM
    from lightning_eagle.k3.loader import named_target

    torch.set_num_threads(1)  # the tiny models run fastest on one thread; the drafts' costs compare fairly
    trained = {label: fit(config, extra, steps, root / f"run{i}") for i, (label, (config, extra)) in
               enumerate(RUNS.items())}  # fmt: skip
    target = KimiK3ForCausalLM.from_pretrained(named_target("quickstart"), dtype=torch.float32)
    results = {}
    for label, run in trained.items():
        results[label] = {**evaluate(run["export"], target, num_prompts, max_new_tokens),
                          "seconds": run["seconds"], "steps": run["steps"]}  # fmt: skip
    return results


def table(results: dict[str, dict], steps: int) -> str:
    rows = ["| draft | τ greedy | P(j \\| <j), j = 1..7 (greedy) | τ at T = 1 | draft ms / verify | training |",
            "|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for label, r in results.items():
        per = " ".join("–" if p != p else f"{p:.2f}".lstrip("0") for p in r["greedy"]["per_position"])
        cost = r["greedy"]["draft_ms_per_round"]
        rows.append(f"| {label} | {r['greedy']['tau']:.2f} | {per} | {r['T=1']['tau']:.2f} | {cost:.1f} "
                    f"| {r['steps']} steps, {r['seconds']:.0f} s |")  # fmt: skip
    return "\n".join(rows) + f"\n\n({steps} optimizer steps each; the protocol is this file's docstring)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = compare(args.steps, Path(tmp), args.num_prompts, args.max_new_tokens)
    print(table(results, args.steps))
    if args.json:
        for r in results.values():
            r.pop("export", None)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
