"""``lightning-eagle data-report --config … [--out DIR] [--vocab-sizes 8192,16384]``: the config's chat data as
``fit`` would tokenize it, reported (:func:`lightning_eagle.data.report.data_report`) before any GPU hour is spent.

The other options (``--config``, ``--data.*``, ``--trainer.*``, ``--model.*``) are read as ``fit`` reads them; the
trainer is always built on one CPU. Writes ``report.txt`` (also printed), ``report.json`` and ``lengths.png`` into
``--out`` (default ``<trainer.default_root_dir>/data_report``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.commands.config_cli import chat_data_cli
from lightning_eagle.data.report import data_report

# The report never runs the trainer: build it on one CPU so a GPU config can be checked from any machine.
TRAINER_OVERRIDES = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.num_nodes", "1",
                     "--trainer.strategy", "auto"]  # fmt: skip


def with_trainer_overrides(words: list[str]) -> list[str]:
    """Insert the CPU trainer settings after the last ``--config`` (so later command-line overrides still win)."""
    at = 0
    for i, word in enumerate(words):
        if word == "--config":
            at = i + 2
        elif word.startswith("--config="):
            at = i + 1
    return words[:at] + TRAINER_OVERRIDES + words[at:]


def parse_sizes(text: str) -> list[int]:
    """``--vocab-sizes``: comma- or space-separated positive integers."""
    try:
        sizes = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(n <= 0 for n in sizes):
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return sizes


def main(argv: list[str] | None = None, from_sys_argv: bool = False) -> None:
    """``argv``: the words after ``data-report`` (None: ``sys.argv[1:]``, as ``python -m`` runs it).

    ``from_sys_argv``: True when ``argv`` is ``sys.argv`` after the subcommand (as ``lightning-eagle`` passes it).
    """
    parser = CommandParser(
        prog="lightning-eagle data-report",
        description="Tokenize the config's chat data as fit would and report rows kept/refused, truncation, "
        "rows and tokens each max_length of 2K-64K would cut, supervised fraction, lengths, roles and draft-vocab "
        "coverage (report.txt, report.json, lengths.png). "
        "Other options (--config, --data.*, --trainer.*, --model.*) are read as for fit.",
    )
    parser.add_argument("--out", default=None, help="output folder (default: <trainer.default_root_dir>/data_report)")
    parser.add_argument("--vocab-sizes", type=parse_sizes, default=None,
                        help="draft vocabulary sizes for the coverage table, e.g. 8192,16384,32000")  # fmt: skip
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    cli = chat_data_cli(with_trainer_overrides(rest), from_sys_argv or argv is None, command="data-report")
    out = Path(args.out) if args.out else Path(cli.trainer.default_root_dir) / "data_report"
    report = data_report(cli.datamodule, out, vocab_sizes=args.vocab_sizes)
    print(report.to_text())


if __name__ == "__main__":
    main()
