"""Acceptance report from the command line: real acceptance length and speed-up of a draft on its target.

    python -m lightning_eagle.commands.acceptance --target DIR|quickstart --draft DIR [--data CHATS.jsonl] \\
        [--num-prompts 16] [--max-new-tokens 64] [--num-draft-tokens K] [--temperature 0] [--json OUT]

``--data`` defaults to the held-out split of the bundled synthetic corpus; ``--tokenizer`` (default ``synthetic``) must
be the tokenizer the target was trained with. The numbers are :func:`~lightning_eagle.inference.evaluate_acceptance`'s.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lightning_eagle.dtypes import DTYPES
from lightning_eagle.inference.incremental_target import DEFAULT_PREFILL_CHUNK
from lightning_eagle.inference.speculative import DEFAULT_NUM_DRAFT_TOKENS
from lightning_eagle.settings import check_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_eagle.commands.acceptance",
        description="Speculative decoding of a K3 target with an EAGLE-3 draft: real acceptance length and speed-up.",
    )
    parser.add_argument("--target", required=True, help="K3 checkpoint directory or 'quickstart'")
    parser.add_argument("--draft", required=True, help="exported draft directory (ours or a reference export)")
    parser.add_argument("--data", default=None, help="JSONL/JSON chat file (default: bundled held-out chats)")
    parser.add_argument("--tokenizer", default="synthetic", help="'synthetic' or a Kimi tokenizer directory")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_NUM_DRAFT_TOKENS,
        help=f"K, tokens drafted per round (default {DEFAULT_NUM_DRAFT_TOKENS}; use the model.objective.ttt_steps it "
        "trained with)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, default=None, help="override the draft's record")
    parser.add_argument("--no-thinking", action="store_true", help="render chats with thinking off")
    parser.add_argument("--thinking-effort", default=None, choices=["low", "high", "max"])
    parser.add_argument("--no-plain", action="store_true", help="skip the plain-decoding baseline")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="skip prompts longer than this")
    parser.add_argument(
        "--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
        help=f"prefill long prompts in chunks of this many tokens (default {DEFAULT_PREFILL_CHUNK}; 0: one shot)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run the report; a bad flag, file or checkpoint ends in one ``error:`` line and exit status 1."""
    try:
        _report(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    except (ValueError, KeyError, OSError) as err:  # the input is wrong (the message names it), not the library
        raise SystemExit(f"error: {err.args[0] if isinstance(err, KeyError) and err.args else err}") from None


def _report(args: argparse.Namespace) -> None:
    check_settings("", {  # each numeric flag under its own name, before any model is read
        "--num-prompts": (args.num_prompts, "positive", int),
        "--max-new-tokens": (args.max_new_tokens, "positive", int),
        "--num-draft-tokens": (args.num_draft_tokens, "positive", int),
        "--temperature": (args.temperature, "non_negative", float),
        "--prefill-chunk": (args.prefill_chunk, "non_negative", int),
        **{flag: (value, "positive", int) for flag, value in (("--threads", args.threads),
           ("--max-prompt-tokens", args.max_prompt_tokens)) if value is not None},
    })  # fmt: skip
    # Imported after parsing: `--help` and a bad flag answer without loading the model code.
    from lightning_eagle.draft import KimiK3Eagle3Draft
    from lightning_eagle.inference.acceptance import evaluate_acceptance, save_report
    from lightning_eagle.k3 import KimiK3ForCausalLM
    from lightning_eagle.k3.loader import named_target

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    target = KimiK3ForCausalLM.from_pretrained(named_target(args.target), dtype=dtype, device=args.device)
    draft = KimiK3Eagle3Draft.from_pretrained(
        args.draft, target_embedding=target.model.embed_tokens.weight, dtype=dtype, device=args.device
    )
    report = evaluate_acceptance(
        target,
        draft,
        args.data,
        tokenizer=args.tokenizer,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        temperature=args.temperature,
        seed=args.seed,
        aux_layer_ids=args.aux_layer_ids,
        compare_plain=not args.no_plain,
        thinking=not args.no_thinking,
        thinking_effort=args.thinking_effort,
        max_prompt_tokens=args.max_prompt_tokens,
        prefill_chunk=args.prefill_chunk or None,
    )
    print(report.format())
    if args.json:
        print(f"report written to {save_report(report, args.json)}")


if __name__ == "__main__":
    main()
