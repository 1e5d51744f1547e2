"""Typed configs for the Kimi K3 text model (``kimi_linear``) and its vision-language wrapper (``kimi_k3``).

Defaults are the *published* K3 values (96 MLA heads, dense width 33792), never a library's defaults.
Named presets live in :mod:`lightning_eagle.k3.presets`.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from lightning_eagle.aux_layers import default_aux_layer_ids
from lightning_eagle.settings import check_mla_heads_and_widths
from lightning_eagle.text_config import text_config_of

SUPPORTED_ACTIVATIONS = ("situ",)
MXFP4_GROUP = 32
POSITIVE_INT_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "vocab_size",
    "moe_intermediate_size",
)


def default_full_attn_layers(num_layers: int) -> list[int]:
    """K3's MLA layers (1-based): every 4th layer plus the last one."""
    layers = list(range(4, num_layers + 1, 4))
    if num_layers not in layers:
        layers.append(num_layers)
    return layers


class KimiK3TextConfig(PretrainedConfig):
    """The K3 text model. ``model_type == "kimi_linear"`` is the dispatch key (the outer VLM type is ``kimi_k3``)."""

    model_type = "kimi_linear"

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        num_hidden_layers: int = 93,
        num_attention_heads: int = 96,
        num_key_value_heads: int | None = None,
        intermediate_size: int = 33792,
        hidden_act: str = "situ",
        activation_situ_beta: float | None = 4.0,
        activation_situ_linear_beta: float | None = 25.0,
        rms_norm_eps: float = 1e-5,
        max_position_embeddings: int = 1048576,
        # MLA (NoPE, Q-LoRA, KV latent, output gate)
        q_lora_rank: int | None = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = True,
        # KDA and the layer pattern (1-based lists)
        linear_attn_config: dict[str, Any] | None = None,
        # MoE
        num_experts: int = 896,
        num_experts_per_token: int = 16,
        num_shared_experts: int = 2,
        moe_intermediate_size: int = 3072,
        routed_expert_hidden_size: int | None = 3584,
        latent_moe_use_norm: bool = True,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        moe_router_activation_func: str = "sigmoid",
        topk_method: str = "noaux_tc",
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        moe_renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        # Attention residuals (None = plain pre-norm residual stream)
        attn_res_block_size: int | None = 12,
        num_nextn_predict_layers: int = 0,
        tie_word_embeddings: bool = False,
        quantization_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_nope = mla_use_nope
        self.mla_use_output_gate = mla_use_output_gate
        lac = {
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        }
        lac.update(copy.deepcopy(linear_attn_config or {}))
        if lac.get("full_attn_layers") is None:
            lac["full_attn_layers"] = default_full_attn_layers(num_hidden_layers)
        if lac.get("kda_layers") is None:
            full = set(lac["full_attn_layers"])
            lac["kda_layers"] = [i for i in range(1, num_hidden_layers + 1) if i not in full]
        self.linear_attn_config = lac
        self.num_experts = num_experts
        self.num_experts_per_token = num_experts_per_token
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.moe_router_activation_func = moe_router_activation_func
        self.topk_method = topk_method
        self.use_grouped_topk = use_grouped_topk
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.moe_renormalize = moe_renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.attn_res_block_size = attn_res_block_size
        self.num_nextn_predict_layers = num_nextn_predict_layers
        if quantization_config is not None:
            self.quantization_config = quantization_config
        # K3's real special ids (the reference's text defaults 1/2/0 are wrong for the real tokenizer).
        kwargs.setdefault("bos_token_id", 163584)
        kwargs.setdefault("eos_token_id", 163586)
        kwargs.setdefault("pad_token_id", 163839)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate()

    # ---- derived layout -------------------------------------------------------------------------------------------
    @property
    def kda_layers(self) -> list[int]:
        return list(self.linear_attn_config["kda_layers"])

    @property
    def full_attn_layers(self) -> list[int]:
        return list(self.linear_attn_config["full_attn_layers"])

    def is_kda(self, layer_idx: int) -> bool:
        """``layer_idx`` is 0-based; the config lists are 1-based."""
        return (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    def is_moe(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_hidden_size(self) -> int:
        """Width the routed experts run at (the latent MoE width, or ``hidden_size`` without latent projections)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def experts_are_mxfp4(self) -> bool:
        qc = getattr(self, "quantization_config", None) or {}
        fmt = qc.get("format") or ""
        groups = qc.get("config_groups") or {}
        return "mxfp4" in fmt or any("mxfp4" in str(g.get("format", "")) for g in groups.values())

    def default_aux_layer_ids(self) -> list[int]:
        return default_aux_layer_ids(self.num_hidden_layers)

    def truncated(self, num_hidden_layers: int) -> KimiK3TextConfig:
        """A copy with the first ``num_hidden_layers`` layers; the layer lists are filtered, not regenerated."""
        data = self.to_dict()
        lac = data["linear_attn_config"]
        lac["kda_layers"] = [i for i in lac["kda_layers"] if i <= num_hidden_layers]
        lac["full_attn_layers"] = [i for i in lac["full_attn_layers"] if i <= num_hidden_layers]
        data["num_hidden_layers"] = num_hidden_layers
        return KimiK3TextConfig(**_init_kwargs(data))

    # ---- validation -----------------------------------------------------------------------------------------------
    def validate(self) -> None:  # noqa: C901 - a flat list of independent checks reads best
        """Raise ``ValueError`` naming the field, the expected and the actual value for every inconsistent setting."""
        L = self.num_hidden_layers
        if not isinstance(L, int) or L < 1:
            raise ValueError(f"num_hidden_layers must be a positive int, got {L!r}")
        kda, full = self.linear_attn_config["kda_layers"], self.linear_attn_config["full_attn_layers"]
        for name, layers in (("kda_layers", kda), ("full_attn_layers", full)):
            bad = [i for i in layers if not isinstance(i, int) or not 1 <= i <= L]
            if bad:
                raise ValueError(
                    f"linear_attn_config.{name} holds 1-based layer numbers in [1, {L}] "
                    f"(num_hidden_layers={L}); out of range: {bad}"
                )
            dup = sorted({i for i in layers if layers.count(i) > 1})
            if dup:
                raise ValueError(f"linear_attn_config.{name} lists layers more than once: {dup}")
        overlap = sorted(set(kda) & set(full))
        if overlap:
            raise ValueError(f"layers {overlap} are in both linear_attn_config.kda_layers and full_attn_layers")
        missing = sorted(set(range(1, L + 1)) - set(kda) - set(full))
        if missing:
            raise ValueError(
                f"linear_attn_config.kda_layers and full_attn_layers must partition 1..{L}; missing layers {missing}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unknown hidden_act {self.hidden_act!r}; K3 uses one of {SUPPORTED_ACTIVATIONS}")
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope=False is not K3: its MLA never rotates the rope slice (NoPE)")
        check_mla_heads_and_widths(self, "K3's MLA", POSITIVE_INT_FIELDS)
        lac = self.linear_attn_config
        for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
            if not isinstance(lac.get(name), int) or lac[name] < 1:
                raise ValueError(f"linear_attn_config.{name} must be a positive int, got {lac.get(name)!r}")
        if not lac.get("use_full_rank_gate", True):
            raise ValueError("linear_attn_config.use_full_rank_gate=False (low-rank KDA output gate) is not K3")
        if lac.get("gate_lower_bound") is None or not lac["gate_lower_bound"] < 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound must be < 0, got {lac.get('gate_lower_bound')!r}")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"moe_router_activation_func must be 'sigmoid' or 'softmax', got {self.moe_router_activation_func!r}"
            )
        if self.topk_method != "noaux_tc":
            raise ValueError(f"topk_method must be 'noaux_tc' (K3's router), got {self.topk_method!r}")
        if any(self.is_moe(i) for i in range(L)):
            E, k = self.num_experts, self.num_experts_per_token
            if not isinstance(E, int) or E < 1:
                raise ValueError(f"num_experts must be a positive int, got {E!r}")
            if not isinstance(k, int) or not 1 <= k <= E:
                raise ValueError(f"num_experts_per_token ({k}) must be in [1, num_experts={E}]")
            if self.num_expert_group < 1 or E % self.num_expert_group:
                raise ValueError(f"num_expert_group ({self.num_expert_group}) must divide num_experts ({E})")
            if not 1 <= self.topk_group <= self.num_expert_group:
                raise ValueError(
                    f"topk_group ({self.topk_group}) must be in [1, num_expert_group={self.num_expert_group}]"
                )
            if self.num_expert_group > 1 and self.topk_group * (E // self.num_expert_group) < k:
                raise ValueError(
                    f"group-limited routing keeps {self.topk_group} group(s) of {E // self.num_expert_group} experts, "
                    f"fewer than num_experts_per_token ({k})"
                )
            if self.experts_are_mxfp4:
                for name, width in (
                    ("routed_expert_hidden_size", self.expert_hidden_size),
                    ("moe_intermediate_size", self.moe_intermediate_size),
                ):
                    if width % MXFP4_GROUP:
                        raise ValueError(f"MXFP4 experts need input widths divisible by {MXFP4_GROUP}: {name}={width}")
        if self.first_k_dense_replace < 0 or self.moe_layer_freq < 1:
            raise ValueError("first_k_dense_replace must be >= 0 and moe_layer_freq >= 1")
        bs = self.attn_res_block_size
        if bs is not None and (not isinstance(bs, int) or bs < 1):
            raise ValueError(f"attn_res_block_size must be a positive int or null, got {bs!r}")
        if self.num_nextn_predict_layers:
            raise ValueError("num_nextn_predict_layers > 0 (MTP) is not part of the K3 target")


class KimiK3Config(PretrainedConfig):
    """The released K3 checkpoint's outer config: a ``text_config`` (``kimi_linear``) plus an opaque vision part."""

    model_type = "kimi_k3"
    sub_configs = {"text_config": KimiK3TextConfig}

    def __init__(
        self,
        text_config: dict[str, Any] | KimiK3TextConfig | None = None,
        vision_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if text_config is None:
            text_config = KimiK3TextConfig()
        elif isinstance(text_config, dict):
            text_config = _text_config(text_config, kwargs, "text_config.")
        self.text_config = text_config
        self.vision_config = vision_config
        kwargs.setdefault("bos_token_id", 163584)
        kwargs.setdefault("eos_token_id", 163586)
        kwargs.setdefault("pad_token_id", 163839)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def _init_kwargs(data: dict[str, Any]) -> dict[str, Any]:
    """Drop serialisation-only keys that ``PretrainedConfig.to_dict`` adds."""
    data = dict(data)
    for key in ("model_type", "transformers_version", "_name_or_path"):
        data.pop(key, None)
    return data


def text_config_from_dict(data: dict[str, Any], source: str = "config") -> KimiK3TextConfig:
    """Accept an outer ``kimi_k3`` config dict (or a VLM's ``llm_config``) or a bare ``kimi_linear`` text config dict.

    Dispatch is on the *text* ``model_type`` (``kimi_linear``); ``kimi_k3`` only marks the wrapper.
    Unknown keys (reference runtime knobs) are kept as plain attributes and otherwise ignored.
    """
    return _text_config(text_config_of(data), data, f"{source}: text ")


def _text_config(text: dict[str, Any], outer: dict[str, Any], where: str) -> KimiK3TextConfig:
    """``KimiK3TextConfig`` from the text part of a config dict. The outer config's token ids fill those the text part
    lacks (the reference's text defaults are wrong); ``where`` prefixes the model_type refusal."""
    data = copy.deepcopy(dict(text))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if data.get(key) is None and outer.get(key) is not None:
            data[key] = outer[key]
    model_type = data.get("model_type", "kimi_linear")
    if model_type != "kimi_linear":
        raise ValueError(f"{where}model_type must be 'kimi_linear' (the Kimi K3 text model), got {model_type!r}")
    return KimiK3TextConfig(**_init_kwargs(data))


AutoConfig.register("kimi_k3", KimiK3Config, exist_ok=True)
