"""The old entry point ``python -m lightning_eagle.inference``: the acceptance report moved to ``commands`` (library
code below the command layer holds no command line). Says where, exits 2, runs nothing."""

import sys

print("moved: use python -m lightning_eagle.commands.acceptance with the same arguments", file=sys.stderr)
raise SystemExit(2)
