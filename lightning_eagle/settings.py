"""Numeric settings checked once, under the name the user typed (``model.lr``), before anything is built: a bad
value is refused with that name instead of surfacing later as torch's message, a climbing loss or a silent no-op."""

from __future__ import annotations

import math
import numbers

RULES = {
    "positive": (lambda v: v > 0, "> 0"),
    "non_negative": (lambda v: v >= 0, ">= 0"),
    "fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "fraction_below_one": (lambda v: 0 <= v < 1, "in [0, 1)"),
}


def check_settings(prefix: str, settings: dict[str, tuple[object, str, type]]) -> None:
    """``settings``: name → (value, rule in :data:`RULES`, ``int`` or ``float``). Raises one ``ValueError`` listing
    every bad value as ``{prefix}.{name} must be … , got …``."""
    problems = []
    for name, (value, rule, kind) in settings.items():
        check, wanted = RULES[rule]
        number = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if kind is int and not (number and float(value).is_integer()):
            problems.append(f"{prefix}.{name} must be an integer {wanted}, got {value!r}")
        elif not number or not math.isfinite(value) or not check(value):
            problems.append(f"{prefix}.{name} must be {'an integer ' if kind is int else ''}{wanted}, got {value!r}")
    if problems:
        raise ValueError("; ".join(problems))
