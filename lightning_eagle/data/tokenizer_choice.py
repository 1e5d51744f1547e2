"""Which tokenizer a setting names: the synthetic K3 / K2 layouts the tests and the quickstart use, or a released
tokenizer directory (read by :mod:`~lightning_eagle.data.tokenizer_files`)."""

from __future__ import annotations

from lightning_eagle.data.synthetic_tokenizer import synthetic_k2_tokenizer, synthetic_k3_tokenizer
from lightning_eagle.data.tokenizer import KimiTokenizer
from lightning_eagle.data.tokenizer_files import load_kimi_tokenizer


def resolve_tokenizer(spec: str | KimiTokenizer) -> KimiTokenizer:
    """``"synthetic"`` (the golden K3 layout), ``"synthetic-k2"``, a tokenizer directory, or a tokenizer object."""
    if not isinstance(spec, str):
        return spec
    if spec in ("synthetic", "synthetic-k3"):
        return synthetic_k3_tokenizer()
    if spec == "synthetic-k2":
        return synthetic_k2_tokenizer()
    return load_kimi_tokenizer(spec)
