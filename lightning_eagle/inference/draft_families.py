"""Decoding's record of a draft family, and loading an export for speculative decoding.

A family registers a :class:`DecodingFamily` under its name next to its loop (the draft layer's record,
:class:`~lightning_eagle.draft.family.DraftFamily`, lists that module in ``layers``): its decoding loop (``generate``,
with :func:`~lightning_eagle.inference.speculative_generate`'s signature) and its own K, the tokens it drafts per
verify when the caller says none. :func:`generate_for` picks the loop for a loaded draft (chains for any
:class:`~lightning_eagle.inference.draft_runner.Drafter` no family claims), :func:`decoding_loop` holds it for a
``with`` block in eval mode, and :func:`load_draft` reads an export whatever its family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_eagle.draft.family import draft_family_named, draft_family_of, export_config, load_export

__all__ = ["export_config"]  # re-exported: what a notebook reads of an export


@dataclass(frozen=True)
class DecodingFamily:
    """``generate(target, draft, prompt_ids, max_new_tokens, num_draft_tokens, temperature, seed, aux_layer_ids,
    **options)``: the family's loop; ``num_draft_tokens(draft)``: its own K for a loaded draft."""

    name: str
    generate: Callable[..., Any]
    num_draft_tokens: Callable[[Any], int]


DECODING_FAMILIES: dict[str, DecodingFamily] = {}


def register_decoding_family(family: DecodingFamily) -> DecodingFamily:
    """Add ``family`` (its name must be new)."""
    if family.name in DECODING_FAMILIES:
        raise ValueError(f"decoding of draft family {family.name!r} is already registered")
    DECODING_FAMILIES[family.name] = family
    return family


def decoding_family(name: str, source: str = "the draft") -> DecodingFamily:
    """The decoding record of the family ``name`` (its modules loaded first)."""
    draft_family_named(name, source)
    if name not in DECODING_FAMILIES:
        raise ValueError(f"{source}: draft family {name!r} registers no decoding loop")
    return DECODING_FAMILIES[name]


def load_draft(folder: str | Path, target, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[str, Any]:
    """``(family name, draft)`` for the export at ``folder``, its family read from its ``config.json``."""
    family, draft = load_export(folder, target, dtype, device)
    return family.name, draft


def family_of(draft: Any) -> DecodingFamily | None:
    """The decoding record of a loaded draft's family (None: no family claims it, e.g. a bare Drafter)."""
    family = draft_family_of(draft)
    return None if family is None else decoding_family(family.name)


def default_num_draft_tokens(draft: Any) -> int | None:
    """The K a loaded draft's family drafts per verify by default (None: no family claims the draft)."""
    family = family_of(draft)
    return None if family is None else family.num_draft_tokens(draft)


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
    from lightning_eagle.inference.speculative import speculative_generate

    family = family_of(draft)
    return speculative_generate if family is None else family.generate
