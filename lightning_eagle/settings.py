"""Numeric settings checked once, under the name the user typed (``model.optimization.lr``), before anything is
built: a bad value is refused with that name instead of surfacing later as torch's message, a climbing loss or a
silent no-op."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

# The TTT unroll's defaults (`eagle3_training.md` §6): K steps and the step-weight decay. Training uses them, the
# plan models them and inference drafts K tokens per round by default, so they live below all three.
DEFAULT_TTT_STEPS, DEFAULT_STEP_DECAY = 7, 0.8
# Rows per chunk of the chunked TTT loss (``loss_backend="chunked"``; the fastest measured on CPU, 512-4096 alike).
DEFAULT_LOSS_CHUNK = 2048

RULES = {
    "positive": (lambda v: v > 0, "> 0"),
    "non_negative": (lambda v: v >= 0, ">= 0"),
    "fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "fraction_below_one": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "at_least_one": (lambda v: v >= 1, ">= 1"),
}


def check_settings(prefix: str, settings: dict[str, tuple[object, str, type]]) -> None:
    """``settings``: name → (value, rule in :data:`RULES`, ``int`` or ``float``). Raises one ``ValueError`` listing
    every bad value as ``{prefix}.{name} must be … , got …``."""
    problems = []
    for short, (value, rule, kind) in settings.items():
        check, wanted = RULES[rule]
        name = f"{prefix}.{short}" if prefix else short  # no prefix: the name is the whole key (a command's flag)
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if kind is int and not (number and float(value).is_integer()):
            problems.append(f"{name} must be an integer {wanted}, got {value!r}")
        elif not number or not math.isfinite(value) or not check(value):
            problems.append(f"{name} must be {'an integer ' if kind is int else ''}{wanted}, got {value!r}")
    if problems:
        raise ValueError("; ".join(problems))


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an int to Python, never a width to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int_or_none(name: str, value: object, as_int: str, as_none: str) -> int | None:
    """``value`` if it is a positive int (meaning ``as_int``) or None (meaning ``as_none``), else ``ValueError``
    naming ``name`` and both meanings: the shape of every optional size setting (token chunk, prefill chunk, cap)."""
    if value is None or (is_int(value) and value >= 1):
        return value
    raise ValueError(f"{name} must be a positive int ({as_int}) or None ({as_none}), got {value!r}")


def check_mla_heads_and_widths(config: object, owner: str, positive_ints: Iterable[str]) -> None:
    """The head and width rules of a K3-style MLA config — the target's text config and the draft's alike: one K/V
    head per query head (``owner`` names whose MLA in that message), every field of ``positive_ints`` an integer
    ``>= 1``, ``qk_rope_head_dim`` ``>= 0``, ``q_lora_rank`` ``>= 1`` or null. Raises ``ValueError`` naming the field
    and the value, GQA first."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads != heads:
        raise ValueError(
            f"{owner} has one K/V head per query head (no GQA): num_key_value_heads ({kv_heads}) must equal "
            f"num_attention_heads ({heads})"
        )
    for name in positive_ints:
        value = getattr(config, name)
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    rope = config.qk_rope_head_dim
    if not is_int(rope) or rope < 0:
        raise ValueError(f"qk_rope_head_dim must be a non-negative int, got {rope!r}")
    q_lora = config.q_lora_rank
    if q_lora is not None and (not is_int(q_lora) or q_lora < 1):
        raise ValueError(f"q_lora_rank must be a positive int or null, got {q_lora!r}")
