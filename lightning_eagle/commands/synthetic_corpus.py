"""``python -m lightning_eagle.commands.synthetic_corpus [--n N] [--seed S] [--out FILE]``: write the synthetic chat
corpus (:func:`lightning_eagle.data.synthetic_corpus.generate_synthetic_corpus`) as JSONL; without ``--out`` it
regenerates the bundled sample file, which a test checks byte for byte against the generator."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning_eagle.commands.arguments import CommandParser
from lightning_eagle.data.synthetic_corpus import BUNDLED_SAMPLE, SAMPLE_SEED, SAMPLE_SIZE, write_synthetic_corpus


def main(argv: list[str] | None = None) -> None:
    parser = CommandParser(description="Write the synthetic chat corpus as JSONL.")
    parser.add_argument("--n", type=int, default=SAMPLE_SIZE)
    parser.add_argument("--seed", type=int, default=SAMPLE_SEED)
    parser.add_argument("--out", type=Path, default=None, help="default: the bundled sample file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(write_synthetic_corpus(args.out or BUNDLED_SAMPLE, args.n, args.seed))


if __name__ == "__main__":
    main()
