"""Real acceptance length and speed-up of the quickstart draft: speculative vs plain decoding of the bundled tiny K3.

    python cli.py fit --config configs/quickstart.yaml     # trains and exports runs/quickstart/draft
    python benchmarks/speculative.py                       # K = 1 3 5 7, greedy, 16 held-out prompts
    python benchmarks/speculative.py --ks 3 7 --temperatures 0 1 --num-prompts 32 --max-new-tokens 64

Prompts are the held-out conversations of the bundled synthetic corpus (the quickstart's 5 % validation split), cut
before each assistant turn. For every (K, temperature) the same prompts are decoded speculatively and with the target
alone in the same process; the table reports τ_real (tokens per target forward), the conditional acceptance rate of
each draft position, tokens per second of both (wall time; speculative also counting only its target forwards) and
their ratios. At temperature 0 it also counts prompts whose speculative output differs from greedy decoding (must be
0). On a shared CPU the absolute numbers are noisy and a tiny target is cheap relative to per-call overhead, so the
wall-clock speed-up understates what τ buys on a real K3; the "target-only" ratio is the speed-up of a free draft.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from lightning_eagle.k3.loader import QUICKSTART_TARGET

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_DRAFT = REPO / "runs" / "quickstart" / "draft"


def load(target_dir: Path, draft_dir: Path):
    from lightning_eagle.draft import KimiK3Eagle3Draft
    from lightning_eagle.k3 import KimiK3ForCausalLM

    missing = [str(p) for p in (target_dir, draft_dir) if not (p / "config.json").is_file()]
    if missing:
        sys.exit(
            "speculative benchmark: missing " + ", ".join(missing) + ".\nIt measures the quickstart draft: build it "
            "with `python cli.py fit --config configs/quickstart.yaml` (exports runs/quickstart/draft against the "
            "bundled target lightning_eagle/assets/k3-tiny-chat), or pass --target/--draft."
        )
    target = KimiK3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    draft = KimiK3Eagle3Draft.from_pretrained(draft_dir, target_embedding=target.model.embed_tokens.weight)
    return target, draft.to(torch.float32).eval()


def table(rows: list[dict]) -> str:
    def f(x, digits=2):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"

    head = (
        "| K | temp | prompts | rounds | τ_real | P(accept draft j ∣ 1..j−1) | spec tok/s | spec tok/s (target only) "
        "| plain tok/s | speed-up | speed-up (target only) | greedy mismatches |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        rep = r["report"]
        rates = " ".join(f(x) for x in rep.acceptance_per_position)
        mism = "–" if rep.greedy_mismatches is None else str(rep.greedy_mismatches)
        lines.append(
            f"| {rep.num_draft_tokens} | {rep.temperature:g} | {rep.num_prompts} | {rep.num_rounds} | {f(rep.tau, 3)} "
            f"| {rates} | {f(rep.spec_tokens_per_s, 1)} | {f(rep.spec_tokens_per_target_s, 1)} "
            f"| {f(rep.plain_tokens_per_s, 1)} | {f(rep.speedup)} | {f(rep.target_speedup)} | {mism} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=QUICKSTART_TARGET)
    parser.add_argument("--draft", type=Path, default=QUICKSTART_DRAFT)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5, 7])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for a tiny model)")
    args = parser.parse_args(argv)

    from lightning_eagle.data.prompts import bundled_held_out_prompts
    from lightning_eagle.inference import DecodingSettings, evaluate_acceptance

    torch.set_num_threads(args.threads)
    target, draft = load(args.target, args.draft)
    prompts = bundled_held_out_prompts(args.num_prompts)
    print(
        f"target {args.target} ({target.config.num_hidden_layers} layers, vocab {target.config.vocab_size}); "
        f"draft {args.draft} (aux ids {draft.config.aux_layer_ids}); "
        f"{len(prompts)} held-out prompts, {args.max_new_tokens} new tokens each, {args.threads} thread(s)\n"
    )
    rows = []
    for temperature in args.temperatures:
        for k in args.ks:
            decoding = DecodingSettings(max_new_tokens=args.max_new_tokens, num_draft_tokens=k, temperature=temperature)
            report = evaluate_acceptance(target, draft, prompts, decoding)
            rows.append({"report": report})
    print(table(rows))


if __name__ == "__main__":
    main()
