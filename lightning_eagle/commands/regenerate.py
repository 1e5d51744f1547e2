"""``lightning-eagle regenerate INPUT OUTPUT (--target PATH|quickstart | --base-url URL) [options]``: every assistant
turn of a chat file replaced by the target's own response (resumable; see :mod:`lightning_eagle.data.regenerate`).

``--target`` decodes with the in-library target (:class:`~lightning_eagle.inference.local_engine.LocalEngine`),
``--base-url`` asks an OpenAI-compatible server (:class:`~lightning_eagle.data.regenerate.EndpointEngine`). Also
``python -m lightning_eagle.commands.regenerate ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.data.regenerate import (
    CONTEXTS,
    EndpointEngine,
    Engine,
    RegenerateSettings,
    read_input_rows,
    regenerate,
)
from lightning_eagle.errors import debug_requested
from lightning_eagle.inference.local_engine import load_local_engine


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-eagle regenerate",
        description="Replace every assistant turn of a chat file by the target's own response (resumable).",
    )
    parser.add_argument("input", help="chat file: JSONL (or a JSON list) of {'messages': [...]} rows")
    parser.add_argument("output", help="output JSONL (written atomically at the end; OUTPUT.progress meanwhile)")
    backend = parser.add_mutually_exclusive_group(required=True)
    backend.add_argument("--target", help="in-library target: a K3 checkpoint folder or 'quickstart'")
    backend.add_argument("--base-url", help="OpenAI-compatible API root, e.g. http://localhost:8000/v1")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", "--max-tokens", type=int, default=1024, help="per turn (default 1024)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", default="0", help="base seed of the per-turn seeds (default 0; 'none' = random)")
    gen.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                     help="K3 thinking on (default) or off; use the render options you train with")  # fmt: skip
    gen.add_argument("--thinking-effort", default="max", help="low|high|max|none (default max, the reference's)")
    gen.add_argument("--context", choices=CONTEXTS, default="generated",
                     help="earlier turns seen by a turn: the regenerated ones (default) or the input's")  # fmt: skip
    local = parser.add_argument_group("in-library target (--target)")
    local.add_argument("--tokenizer", default=None, help="default: synthetic for quickstart, else the target folder")
    local.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    local.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    local.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded per forward (default 8)")
    remote = parser.add_argument_group("endpoint (--base-url)")
    remote.add_argument("--model", default=None, help="served model name (default: the first of GET /models)")
    remote.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    remote.add_argument("--max-concurrency", type=int, default=16, help="requests in flight (default 16)")
    remote.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    remote.add_argument("--max-retries", type=int, default=6, help="retries per request (default 6)")
    remote.add_argument("--retry-backoff", type=float, default=1.0, help="first retry wait in s, doubled each time")
    remote.add_argument("--extra-body", default=None, help="JSON object merged into every request")
    run = parser.add_argument_group("run")
    run.add_argument("--on-bad-row", choices=["raise", "skip"], default="raise")
    run.add_argument("--on-failed-row", choices=["raise", "drop"], default="raise",
                     help="a turn failing after its retries stops the run (default) or drops its row")  # fmt: skip
    run.add_argument("--overwrite", action="store_true", help="replace OUTPUT and discard its progress")
    run.add_argument("--stop-after-rows", type=int, default=None, help="finish this many rows now, resume later")
    run.add_argument("--quiet", action="store_true")
    return parser


def main(argv: list[str]) -> None:
    """``lightning-eagle regenerate …`` (see :func:`build_parser`)."""
    args = build_parser().parse_args(argv)
    effort = None if str(args.thinking_effort).lower() in ("none", "null") else args.thinking_effort
    seed = None if str(args.seed).lower() in ("none", "null") else int(args.seed)
    settings = RegenerateSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=seed,
        thinking=args.thinking,
        thinking_effort=effort if args.thinking else None,
        context=args.context,
    )
    # Validate the input before loading a target or contacting a server.
    read_input_rows(args.input, settings, args.on_bad_row)
    if args.target is not None:
        engine: Engine = load_local_engine(
            args.target, settings, args.tokenizer, args.device, args.dtype, args.max_batch_size
        )
    else:
        extra = None
        if args.extra_body:
            try:
                extra = json.loads(args.extra_body)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--extra-body: not JSON ({exc.msg})") from None
            if not isinstance(extra, dict):
                raise ValueError("--extra-body: expected a JSON object")
        engine = EndpointEngine(
            args.base_url,
            settings,
            model=args.model,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
            max_concurrency=args.max_concurrency,
            timeout=args.timeout,
            max_retries=args.max_retries,
            retry_backoff=args.retry_backoff,
            extra_body=extra,
        )

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    summary = regenerate(
        args.input,
        args.output,
        engine,
        on_bad_row=args.on_bad_row,
        on_failed_row=args.on_failed_row,
        overwrite=args.overwrite,
        stop_after_rows=args.stop_after_rows,
        log=None if args.quiet else log,
    )
    print(summary.describe())
    if summary.rows_failed:  # asked for (--on-failed-row drop), but never only inside the summary
        first = f"; first: {summary.errors[0]}" if summary.errors else ""
        print(f"warning: {summary.rows_failed} row(s) failed and were left out of {args.output} (a later run "
              f"retries them){first}", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":  # python -m lightning_eagle.commands.regenerate …
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        if debug_requested():
            raise
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
