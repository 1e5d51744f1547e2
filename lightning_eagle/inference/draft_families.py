"""Loading an export for speculative decoding, and the loop a draft decodes with, whatever its family.

:func:`load_draft` reads an export's family from its ``config.json``
(:func:`~lightning_eagle.draft.family.load_export`); :func:`generate_for` picks the loop of a loaded draft's family
(:mod:`~lightning_eagle.inference.decoding_family`; chains for any
:class:`~lightning_eagle.inference.draft_runner.Drafter` no family claims) and :func:`decoding_loop` holds it for a
``with`` block in eval mode.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_eagle.draft.family import export_config, load_export
from lightning_eagle.inference.decoding_family import default_num_draft_tokens, family_of
from lightning_eagle.inference.speculative import speculative_generate

__all__ = ["decoding_loop", "default_num_draft_tokens", "export_config", "generate_for", "load_draft"]


SWAP_READS = 5  # reads of an export folder that is being swapped before a failure is final


def load_draft(folder: str | Path, target, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[str, Any]:
    """``(family name, draft)`` for the export at ``folder``, its family read from its ``config.json``.

    An export a fit replaces while it is read (the ``ExportDraftCallback`` swaps its whole folder,
    :func:`~lightning_eagle.atomic.atomic_dir`: for a moment the name is missing, then it names another folder) is
    read again: a failure is final only when the same folder (inode and change time) stood there before and after
    the read, or after :data:`SWAP_READS` reads. Within one read each family's loader pairs one write's
    ``config.json`` with that write's weights (their write ids,
    :func:`~lightning_eagle.draft.family.load_export` → the family's ``load_export``)."""
    for attempt in range(SWAP_READS):
        before = _identity(folder)
        try:
            family, draft = load_export(folder, target, dtype, device)
            return family.name, draft
        except (ValueError, OSError):
            if attempt == SWAP_READS - 1 or (before is not None and _identity(folder) == before):
                raise
            time.sleep(0.02 * (attempt + 1))
    raise AssertionError("unreachable")


def _identity(folder: str | Path) -> tuple[int, int, int] | None:
    """Which folder stands at ``folder`` now (None: none)."""
    try:
        stat = os.stat(folder)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_ctime_ns


@contextmanager
def decoding_loop(draft: Any) -> Iterator[Callable[..., Any]]:
    """The loop of ``draft``'s family (:func:`generate_for`) for the ``with`` block, a draft in training mode (the
    acceptance callback's) switched to eval mode for it (no dropout while decoding) and back after."""
    was_training = bool(getattr(draft, "training", False))
    if was_training:
        draft.eval()
    try:
        yield generate_for(draft)
    finally:
        if was_training:
            draft.train()


def generate_for(draft: Any) -> Callable[..., Any]:
    """The decoding loop of ``draft``'s family (chains for anything no family claims: any Drafter object)."""
    family = family_of(draft)
    return speculative_generate if family is None else family.generate
