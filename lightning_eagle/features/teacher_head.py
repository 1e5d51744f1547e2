"""The three target tensors an offline run needs: ``embed_tokens`` (the draft's frozen embedding), the final norm and
``lm_head`` (the teacher ``lm_head(norm(h))``), read from the target checkpoint without building the target.

The norm type comes from :func:`~lightning_eagle.data.final_norm.select_final_norm_type` on the **text** config
(``kimi_linear`` → rmsnorm; the outer ``kimi_k3`` is deliberately not a key). Features stored pre-norm need a norm:
an unknown type is an error, and so is a known type whose weight the checkpoint lacks — never a silently un-normed
teacher.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lightning_eagle.data.final_norm import FinalNorm, apply_final_norm, select_final_norm_type
from lightning_eagle.k3.loader import CheckpointError, SafetensorsCheckpoint, named_target
from lightning_eagle.text_config import text_config_of

_NAMES = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
_PREFIXES = ("language_model.", "")  # released VLM layout, bare text layout


class TeacherHead(nn.Module):
    """Frozen ``embed_tokens [V,H]``, final ``norm`` (or None when the features are post-norm) and ``lm_head [V,H]``."""

    def __init__(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor, norm: FinalNorm | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Parameter(embed_tokens, requires_grad=False)
        self.lm_head = nn.Parameter(lm_head, requires_grad=False)
        self.norm = norm

    @classmethod
    def from_checkpoint(cls, target: str | Path, prenorm: bool, dtype: torch.dtype = torch.float32) -> TeacherHead:
        """Read the three tensors of ``target`` (a K3 checkpoint folder or ``"quickstart"``), shape-checked."""
        path = named_target(target)
        config = json.loads((path / "config.json").read_text())
        text = text_config_of(config)
        vocab, hidden, eps = int(text["vocab_size"]), int(text["hidden_size"]), float(text.get("rms_norm_eps", 1e-5))
        ckpt = SafetensorsCheckpoint(path)
        tied = bool(text.get("tie_word_embeddings", False))
        embed = _read(ckpt, path, "embed_tokens", (vocab, hidden), dtype)
        lm_head = (
            embed if tied and _find(ckpt, "lm_head") is None else _read(ckpt, path, "lm_head", (vocab, hidden), dtype)
        )
        norm = None
        if prenorm:
            norm_type = select_final_norm_type(config)  # keyed on the text config's model_type
            if norm_type is None:
                raise ValueError(
                    f"{path / 'config.json'}: text model_type {text.get('model_type')!r} has no entry in the final-norm"
                    " table (lightning_eagle.data.final_norm.FINAL_NORM_TYPES): pre-norm features cannot be turned"
                    " into teacher logits; dump post-norm features (--hidden-states postnorm) or register the norm type"
                )
            norm = FinalNorm(norm_type, hidden, eps, dtype=torch.float32)
            with torch.no_grad():
                norm.weight.copy_(_read(ckpt, path, "norm", (hidden,), torch.float32))
        return cls(embed.clone(), lm_head.clone(), norm)

    def final_hidden(self, hidden: torch.Tensor, stored_prenorm: bool) -> torch.Tensor:
        """The teacher's input: ``norm(h)`` for pre-norm features, ``h`` for post-norm ones."""
        return apply_final_norm(hidden, self.norm, stored_prenorm=stored_prenorm)


def _find(ckpt: SafetensorsCheckpoint, name: str) -> str | None:
    keys = set(ckpt.keys())
    return next((p + _NAMES[name] for p in _PREFIXES if p + _NAMES[name] in keys), None)


def _read(ckpt: SafetensorsCheckpoint, path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype):
    key = _find(ckpt, name)
    if key is None:
        raise CheckpointError(f"{path}: no {name} weight ({' or '.join(p + _NAMES[name] for p in _PREFIXES)})")
    tensor = ckpt.get(key)
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"{path}: {key} has shape {tuple(tensor.shape)}, expected {shape} from config.json")
    return tensor.to(dtype)
