"""Dtype names as configs spell them (``"float32"``, ``"bfloat16"``, ``"float16"``): the one table."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    """``torch.dtype`` for a config name; an unknown name is an error listing the known ones."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]
