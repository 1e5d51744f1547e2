"""Which final norm rebuilds teacher logits from a stored *pre-norm* hidden state (`chat_and_loss_mask.md` §9).

``logits = lm_head(norm(h_pre))`` needs the family's norm. The table is keyed on the **text** config's
``model_type``: K3's outer ``model_type`` is ``kimi_k3`` but its text config is ``kimi_linear``. ``kimi_k3`` is
deliberately *not* a key, so code that wrongly looks at the outer config finds nothing and fails loudly instead of
silently producing un-normed teacher logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from lightning_eagle.ops.norm import rms_norm
from lightning_eagle.text_config import config_value, text_config_of

FINAL_NORM_TYPES: Mapping[str, str] = MappingProxyType(
    {
        "kimi_linear": "rmsnorm",
        "llama": "rmsnorm",
        "mistral": "rmsnorm",
        "mixtral": "rmsnorm",
        "qwen2": "rmsnorm",
        "qwen3": "rmsnorm",
        "qwen3_moe": "rmsnorm",
        "deepseek_v3": "rmsnorm",
        "kimi_k2": "rmsnorm",
        "kimi_k25": "rmsnorm",
        "minimax_m3_vl_text": "gemma_rmsnorm",
    }
)

K3_FINAL_NORM_KEY = "language_model.model.norm.weight"


def select_final_norm_type(config: Any) -> str | None:
    """``"rmsnorm"`` / ``"gemma_rmsnorm"`` / None for a model config (dict or object); keyed on the text config."""
    if config is None:
        return None
    text = text_config_of(config)
    if config_value(text, "use_gemma_norm", False) is True:
        return "gemma_rmsnorm"
    model_type = config_value(text, "model_type")
    return FINAL_NORM_TYPES.get(model_type) if isinstance(model_type, str) else None


class FinalNorm(nn.Module):
    """The selected final norm: ``rmsnorm`` (fp32 variance, cast back, x weight) or ``gemma_rmsnorm``
    (fp32 normalise, x (1 + weight), then cast)."""

    def __init__(self, norm_type: str, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32):
        super().__init__()
        if norm_type not in ("rmsnorm", "gemma_rmsnorm"):
            raise ValueError(f"unknown final norm type {norm_type!r}; expected 'rmsnorm' or 'gemma_rmsnorm'")
        self.norm_type, self.eps = norm_type, eps
        init = torch.ones if norm_type == "rmsnorm" else torch.zeros
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.norm_type == "rmsnorm":
            return rms_norm(hidden, self.weight, self.eps)
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"{self.norm_type}, {self.weight.shape[0]}, eps={self.eps}"


def build_final_norm(config: Any, dtype: torch.dtype = torch.float32) -> FinalNorm | None:
    """The final norm for ``config`` (hidden size and ``rms_norm_eps`` from its text config), or None."""
    norm_type = select_final_norm_type(config)
    if norm_type is None:
        return None
    text = text_config_of(config)
    return FinalNorm(
        norm_type, int(config_value(text, "hidden_size")), float(config_value(text, "rms_norm_eps", 1e-5)), dtype
    )


def load_final_norm_weight(
    norm: FinalNorm, source: Mapping[str, torch.Tensor] | str | Path, key: str = K3_FINAL_NORM_KEY
) -> FinalNorm:
    """Copy the norm weight from a state dict or a ``.safetensors`` file; a missing key or wrong shape raises."""
    if isinstance(source, (str, Path)):
        from safetensors import safe_open

        with safe_open(str(source), "pt") as f:
            if key not in f.keys():
                raise KeyError(f"{source}: no final-norm weight {key!r} (a {norm.norm_type} final norm needs it)")
            weight = f.get_tensor(key)
    else:
        if key not in source:
            raise KeyError(f"state dict has no final-norm weight {key!r} (a {norm.norm_type} final norm needs it)")
        weight = source[key]
    if tuple(weight.shape) != tuple(norm.weight.shape):
        raise ValueError(
            f"final-norm weight {key!r} has shape {list(weight.shape)}, expected {list(norm.weight.shape)}"
        )
    with torch.no_grad():
        norm.weight.copy_(weight.to(norm.weight.dtype))
    return norm


def apply_final_norm(hidden: torch.Tensor, norm: FinalNorm | None, *, stored_prenorm: bool | None) -> torch.Tensor:
    """Norm a stored hidden state before the LM head when (and only when) it was stored pre-norm.

    ``stored_prenorm`` absent/False -> returned unchanged. True with no selected norm -> ``RuntimeError``: never
    skip the norm silently.
    """
    if not stored_prenorm:
        return hidden
    if norm is None:
        raise RuntimeError(
            "teacher hidden states were stored pre-norm but no final norm is selected for this model: the final-norm "
            f"table (lightning_eagle.data.final_norm.FINAL_NORM_TYPES, keyed on the text config model_type; keys: "
            f"{sorted(FINAL_NORM_TYPES)}) has no entry for it"
        )
    return norm(hidden)
