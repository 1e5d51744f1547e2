"""Interleaved rotary position embedding with DeepSeek's YaRN scaling: what the serving engines' DeepSeek MLA applies
to the rope slice of queries and keys (``is_neox_style=False`` + ``DeepseekScalingRotaryEmbedding``).

Rotation (interleaved / GPT-J pairs). Dimension pairs ``(2i, 2i+1)`` of a ``d``-wide slice rotate by the angle
``θ_i·p`` at position ``p``::

    out[2i]   = m·(x[2i]·cos(θ_i p) − x[2i+1]·sin(θ_i p))
    out[2i+1] = m·(x[2i+1]·cos(θ_i p) + x[2i]·sin(θ_i p))

i.e. the complex number ``x[2i] + j·x[2i+1]`` times ``m·e^{j θ_i p}`` (DeepSeek's own inference code writes it that
way: :func:`apply_interleaved_rotary_complex` is the twin). NeoX style would pair ``(i, i + d/2)`` instead — a
different function of the same weights, so a draft trained with one and served with the other is broken.

Frequencies. ``θ_i = base^(−2i/d)``. With YaRN (``rope_scaling = {"type": "yarn", "factor": s,
"original_max_position_embeddings": L₀, "beta_fast": β_f, "beta_slow": β_s, "mscale": μ, "mscale_all_dim": μ_a}``)
DeepSeek blends interpolated and original frequencies per pair::

    c(r)   = d·ln(L₀ / (2π r)) / (2 ln base)                 # pair index that makes r full turns over L₀
    lo, hi = max(⌊c(β_f)⌋, 0), min(⌈c(β_s)⌉, d − 1)
    ramp_i = clamp((i − lo) / (hi − lo), 0, 1)               # hi == lo → hi += 0.001
    θ_i    = θ_i/s · ramp_i + θ_i · (1 − ramp_i)             # fast pairs keep θ_i, slow pairs are interpolated

and two magnitudes (``mscale(s, μ) = 0.1·μ·ln s + 1`` for ``s > 1``, else 1):

* ``m = mscale(s, μ) / mscale(s, μ_a)`` multiplies cos and sin (1 when ``μ = μ_a``, as in DeepSeek-V3 / Kimi);
* the attention softmax scale becomes ``d_qk^−½ · mscale(s, μ_a)²`` (:func:`attention_scale`) — the "mscale
  correction" the MLA attention applies, on *all* of q·k (nope and rope parts).

Sources (read, not copied): sgl-project/sglang ``python/sglang/srt/layers/rotary_embedding/{yarn,rope_variant,
utils}.py`` (``yarn_find_correction_range``, ``yarn_linear_ramp_mask``, ``DeepseekScalingRotaryEmbedding``,
``apply_rotary_emb``), vllm-project/vllm ``vllm/model_executor/models/deepseek_v2.py`` (``yarn_get_mscale``, the
``self.scaling *= mscale²`` rule) and ``layers/rotary_embedding/__init__.py`` (``get_rope``).

Precision: angles and the rotation run in fp32 (engines precompute an fp32 cos/sin table from the same products
``p·θ_i``), the result is cast back to the input dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

YARN_TYPES = ("yarn", "deepseek_yarn")
# DeepSeek's defaults for absent keys (HF DeepseekV3, SGLang DeepseekScalingRotaryEmbedding, vLLM get_rope).
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
_YARN_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "rope_theta", *YARN_DEFAULTS}


# ---- configuration -----------------------------------------------------------------------------------------------
def normalize_rope_scaling(rope_scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Validate a DeepSeek YaRN ``rope_scaling`` and return it with every key explicit (None stays None).

    Only DeepSeek YaRN is accepted: it is the one scaling the engines' MLA draft heads implement (any ``rope_scaling``
    becomes ``deepseek_yarn`` there). Unknown keys are refused rather than ignored, since an engine might read them.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ValueError(f"rope_scaling must be a dict or null, got {type(rope_scaling).__name__}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in YARN_TYPES:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported: the engines' DeepSeek MLA draft heads implement DeepSeek "
            f"YaRN only (type one of {YARN_TYPES})"
        )
    unknown = sorted(set(rope_scaling) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"rope_scaling has keys DeepSeek YaRN does not define: {unknown}")
    for name in ("factor", "original_max_position_embeddings"):
        if name not in rope_scaling:
            raise ValueError(f"rope_scaling (YaRN) needs {name!r}")
    factor = rope_scaling["factor"]
    original = rope_scaling["original_max_position_embeddings"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise ValueError(f"rope_scaling factor must be a number >= 1, got {factor!r}")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"rope_scaling original_max_position_embeddings must be a positive int, got {original!r}")
    out: dict[str, Any] = {"type": "yarn", "rope_type": "yarn", "factor": float(factor)}
    out["original_max_position_embeddings"] = original
    for name, default in YARN_DEFAULTS.items():
        value = rope_scaling.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"rope_scaling {name} must be a number, got {value!r}")
        out[name] = float(value)
    return out


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude ``0.1·mscale·ln(scale) + 1`` (1 for ``scale ≤ 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original: int) -> tuple[int, int]:
    """Pair indices ``[lo, hi]`` between which YaRN ramps from original to interpolated frequencies."""

    def turns_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(turns_dim(beta_fast)), 0), min(math.ceil(turns_dim(beta_slow)), dim - 1)


def rotary_inverse_frequencies(dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """``θ_i`` for the ``dim // 2`` pairs (fp32), YaRN-blended when ``rope_scaling`` is set."""
    if dim % 2:
        raise ValueError(f"a rotary slice needs an even width, got {dim}")
    theta = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = normalize_rope_scaling(rope_scaling)
    if scaling is None:
        return theta
    lo, hi = yarn_correction_range(
        scaling["beta_fast"], scaling["beta_slow"], dim, base, scaling["original_max_position_embeddings"]
    )
    if lo == hi:
        hi += 0.001  # DeepSeek's guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    return theta / scaling["factor"] * (1 - keep) + theta * keep


def rotary_magnitude(rope_scaling: dict[str, Any] | None) -> float:
    """``m`` that multiplies cos and sin: ``mscale(s, μ) / mscale(s, μ_a)`` (1 without scaling)."""
    scaling = normalize_rope_scaling(rope_scaling)
    if scaling is None:
        return 1.0
    s = scaling["factor"]
    return yarn_get_mscale(s, scaling["mscale"]) / yarn_get_mscale(s, scaling["mscale_all_dim"])


def attention_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """The MLA softmax scale ``d_qk^−½``, times ``mscale(s, μ_a)²`` under YaRN (DeepSeek's attention correction)."""
    scale = qk_head_dim**-0.5
    scaling = normalize_rope_scaling(rope_scaling)
    if scaling is not None:
        scale *= yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


# ---- application -------------------------------------------------------------------------------------------------
def rotary_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``p·θ_i`` in fp32: ``positions [...]`` → ``[..., d/2]``."""
    return positions.to(torch.float32)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float32)


def apply_interleaved_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(2i, 2i+1)`` of ``x [..., d]`` by ``cos``/``sin [..., d/2]`` (broadcast; magnitude included).

    Real-valued form, as the engines' ``apply_rotary_emb(..., is_neox_style=False)``; computed in fp32."""
    x32 = x.to(torch.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


def apply_interleaved_rotary_complex(x: torch.Tensor, angles: torch.Tensor, magnitude: float = 1.0) -> torch.Tensor:
    """The twin of :func:`apply_interleaved_rotary`: pairs as complex numbers times ``m·e^{j·angle}`` (DeepSeek's
    ``view_as_complex`` formulation). ``angles [..., d/2]`` broadcast against ``x [..., d]``'s pairs."""
    pairs = torch.view_as_complex(x.to(torch.float32).reshape(*x.shape[:-1], -1, 2).contiguous())
    rotor = torch.polar(torch.full_like(angles, magnitude), angles)
    return torch.view_as_real(pairs * rotor).flatten(-2).to(x.dtype)


class InterleavedRotary(nn.Module):
    """Interleaved rotary of a ``dim``-wide slice at given positions (DeepSeek YaRN optional).

    No parameters and no buffers: the frequencies are a function of the config (engines rebuild them from
    ``rope_theta`` / ``rope_scaling``), computed on first use per device — so a draft built on the meta device and
    loaded with ``assign=True`` has nothing left on meta."""

    def __init__(self, dim: int, base: float = 10000.0, rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.dim, self.base = dim, float(base)
        self.rope_scaling = normalize_rope_scaling(rope_scaling)
        self.magnitude = rotary_magnitude(self.rope_scaling)
        rotary_inverse_frequencies(dim, self.base, self.rope_scaling)  # validates now, not at the first forward
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        device = torch.device(device)
        if device not in self._inv_freq:
            with torch.device("cpu"):  # not a caller's meta-device context
                inv_freq = rotary_inverse_frequencies(self.dim, self.base, self.rope_scaling)
            self._inv_freq[device] = inv_freq.to(device)
        return self._inv_freq[device]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [...]`` → ``cos, sin [..., d/2]`` (fp32, magnitude included)."""
        angles = rotary_angles(positions, self.inv_freq(positions.device))
        return angles.cos() * self.magnitude, angles.sin() * self.magnitude

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [B,h,T,d]`` rotated at ``positions [B,T]`` or ``[T]``."""
        cos, sin = self.cos_sin(positions.to(x.device))
        if cos.dim() == 3:  # [B,T,d/2] → broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        return apply_interleaved_rotary(x, cos, sin)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, rope_scaling={self.rope_scaling}"
