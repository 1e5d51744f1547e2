"""The old entry point ``python -m lightning_eagle.data.regenerate``: the command moved to ``commands`` (library code
below the command layer holds no command line). Says where, exits 2, runs nothing."""

import sys

print(
    "moved: use python -m lightning_eagle.commands.regenerate (or lightning-eagle regenerate) with the same arguments",
    file=sys.stderr,
)
raise SystemExit(2)
