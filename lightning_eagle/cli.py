"""Moved: the command line is :mod:`lightning_eagle.commands.cli` (``lightning-eagle …`` or
``python -m lightning_eagle.commands …``). This name fails loudly instead of forwarding, so no caller keeps the old one.
"""

import sys

_MOVED = (
    "lightning_eagle.cli moved to lightning_eagle.commands.cli: import from there, and run "
    "`lightning-eagle fit …` or `python -m lightning_eagle.commands fit …` (e.g. under torchrun)"
)
if __name__ == "__main__":
    sys.exit(f"error: {_MOVED}")
raise ImportError(_MOVED)
