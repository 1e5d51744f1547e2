"""Run-time failures the library raises on purpose: the command line prints them as one ``error:`` line (like bad
input) instead of a traceback, because the message already says what happened and what to do."""

from __future__ import annotations

import os

DEBUG_ENV = "LIGHTNING_EAGLE_DEBUG"  # set (not "0"): the command line shows the full traceback instead


def debug_requested() -> bool:
    """Whether the user asked for tracebacks through :data:`DEBUG_ENV`."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class RunError(RuntimeError):
    """A run stopped for a reason its message names (not a bug)."""


class NonFiniteTrainingError(RunError):
    """The loss, the gradients or the updated draft weights became NaN/inf; nothing of that step is checkpointed or
    exported."""


class OutputWriteError(RunError):
    """The operating system refused to write an output (no space, a file-size limit, read-only, not writable): the
    message names the file and the cause; nothing is left under the output's name."""
