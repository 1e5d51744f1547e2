"""Decoding's record of a draft family: a family registers a :class:`DecodingFamily` under its name next to its loop
(the draft layer's record, :class:`~lightning_eagle.draft.family.DraftFamily`, lists that module in ``layers``).

It says how the family decodes: its loop (``generate``, with :func:`~lightning_eagle.inference.speculative_generate`'s
signature), its own K (the tokens it drafts per verify when the caller says none), and, for a chain family whose
draft is a model rather than a :class:`~lightning_eagle.inference.draft_runner.Drafter`, the adapter that makes one
(``drafter``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_eagle.draft.family import LayerRecords, draft_family_of


@dataclass(frozen=True)
class DecodingFamily:
    """``generate(target, draft, prompt_ids, max_new_tokens, num_draft_tokens, temperature, seed, aux_layer_ids,
    **options)``: the family's loop; ``num_draft_tokens(draft)``: its own K for a loaded draft; ``drafter(target,
    draft, aux_layer_ids) -> (Drafter, aux_layer_ids, aux_stream)``: what the chain loop drafts with (None: the draft
    is a Drafter itself)."""

    name: str
    generate: Callable[..., Any]
    num_draft_tokens: Callable[[Any], int]
    drafter: Callable[[Any, Any, list[int] | None], tuple[Any, list[int], str]] | None = None


DECODING_FAMILIES = LayerRecords("decoding", "decoding loop")


def register_decoding_family(family: DecodingFamily) -> DecodingFamily:
    """Add ``family`` (its name must be new)."""
    return DECODING_FAMILIES.register(family.name, family)


def decoding_family(name: str, source: str = "the draft") -> DecodingFamily:
    """The decoding record of the family ``name`` (its modules loaded first)."""
    return DECODING_FAMILIES.named(name, source)


def family_of(draft: Any) -> DecodingFamily | None:
    """The decoding record of a loaded draft's family (None: no family claims it, e.g. a bare Drafter)."""
    family = draft_family_of(draft)
    return None if family is None else decoding_family(family.name)


def default_num_draft_tokens(draft: Any) -> int | None:
    """The K a loaded draft's family drafts per verify by default (None: no family claims the draft)."""
    family = family_of(draft)
    return None if family is None else family.num_draft_tokens(draft)
