"""Run-time failures the library raises on purpose: the command line prints them as one ``error:`` line (like bad
input) instead of a traceback, because the message already says what happened and what to do."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run stopped for a reason its message names (not a bug)."""


class NonFiniteTrainingError(RunError):
    """The loss, the gradients or the updated draft weights became NaN/inf; nothing of that step is checkpointed or
    exported."""
