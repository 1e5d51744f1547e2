"""Configuration of the DSpark block drafter: exactly what vLLM 0.32's ``K3DSparkConfig``
(``vllm/transformers_utils/configs/k3_dspark.py``) and ``K3DSparkForCausalLM``
(``vllm/models/kimi_k3/nvidia/dspark_mla.py``) read, validated once at construction with vLLM's refusals
(`dspark.md`, "How vLLM serves it").

A plain dataclass, like :class:`~lightning_eagle.draft.Eagle3DraftConfig`: parsing a draft config must not need
``transformers`` and the draft is not the target (its rules are vLLM's ``k3_dspark`` ones, not ``kimi_linear``'s).

* Attention is K3's MLA with q-LoRA and **RoPE** (interleaved, DeepSeek YaRN optional: ``rope_scaling``), no output
  gate, no NoPE, no q/k norm: vLLM builds ``MultiHeadLatentAttention(use_rope=True)`` and refuses the rest.
* ``vocab_size`` is the target's: the embedding and LM head are the frozen target's (vLLM refuses
  ``draft_vocab_size != vocab_size``), so there is no draft vocabulary field.
* ``aux_layer_ids`` (the name of the taps in every family; the export writes vLLM's ``target_layer_ids``) are our
  0-based tap ids (tap ``i`` = the output of target layer ``i``), in ``context_proj``'s input order. vLLM's runner
  adds one to them (``eagle3_utils.get_eagle3_aux_layers_from_config``: DSpark ids are
  "capture-after" ids) and captures the state entering layer ``i + 1`` — our tap ``i`` — in **ascending** order
  (``SupportsEagle3._set_aux_hidden_state_layers`` sorts and de-duplicates), so the ids must ascend; tap ``L`` (the
  pre-norm final state) would be engine id ``L + 1``, which is never captured.
* ``aux_stream``: which K3 AttnRes stream the taps read (``prefix``, vLLM's default, or ``mixed``, its
  ``VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1``); written into the export with the setting it needs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from lightning_eagle.aux_layers import AUX_STREAMS, renamed_fields, validate_aux_layer_ids
from lightning_eagle.draft.materialize import check_initializer_range
from lightning_eagle.ops.rotary import normalize_rope_scaling
from lightning_eagle.settings import is_int

DSPARK_HIDDEN_ACT = "silu"  # KimiMLP of the DSpark layer: SiLU gate/up/down (vLLM passes config.hidden_act)
# The std of the initial weights, as DeepSpec (the DSpark reference trainer) initialises its drafters: its
# ``Qwen3DSparkModel`` is a transformers ``PreTrainedModel`` whose ``post_init()`` runs ``_init_weights`` over every
# module, Markov head (``markov_w1`` embedding, ``markov_w2``) and confidence head included: Linear/Embedding weights
# N(0, config.initializer_range), biases 0, RMSNorm gains 1, no per-module exception
# (deepspec/modeling/dspark/qwen3/modeling.py, markov_head.py, common.py ``AcceptRatePredictor``); the draft config
# is a copy of the target's (qwen3/config.py ``build_draft_config``): Qwen3's ``initializer_range``, 0.02.
DEFAULT_INITIALIZER_RANGE = 0.02
_POSITIVE_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "vocab_size",
    "target_hidden_size",
    "block_size",
    "markov_rank",
    "max_position_embeddings",
)


@dataclass
class DSparkDraftConfig:
    """The architecture of one :class:`~lightning_eagle.draft.dspark.DSparkDrafter` and what its export says.

    ``q_lora_rank`` is required (vLLM: "MLA DSpark does not support q_lora_rank=None"). ``block_size`` is g, the
    number of slots of a block (= vLLM's ``num_speculative_tokens``); slot 0 holds the anchor token, slots 1..g-1
    ``mask_token_id``. ``markov_rank`` is r of the Markov head ``W1 [V,r]``, ``W2 [r,V]``.
    ``enable_confidence_head`` adds ``Linear([h ; W1[x_prev]] -> 1)`` (vLLM loads it only with this flag).
    ``target_num_hidden_layers`` (None: unknown) bounds the taps. ``initializer_range``: the std of the initial
    weights (:meth:`~lightning_eagle.draft.dspark.DSparkDrafter.init_module`), DeepSpec's rule and default
    (:data:`DEFAULT_INITIALIZER_RANGE`)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    markov_rank: int = 256
    enable_confidence_head: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 50000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    target_num_hidden_layers: int | None = None
    aux_stream: str = "prefix"
    hidden_act: str = DSPARK_HIDDEN_ACT
    initializer_range: float = DEFAULT_INITIALIZER_RANGE

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if name == "q_lora_rank" and value is None:
                raise ValueError(
                    "q_lora_rank is required: vLLM's K3DSparkConfig refuses q_lora_rank=None "
                    "('MLA DSpark does not support q_lora_rank=None')"
                )
            if not is_int(value) or value < 1:
                raise ValueError(f"DSpark draft config: {name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.hidden_act != DSPARK_HIDDEN_ACT:
            raise ValueError(
                f"hidden_act must be {DSPARK_HIDDEN_ACT!r}: the DSpark layer's KimiMLP is a SiLU gate/up/down MLP, "
                f"got {self.hidden_act!r}"
            )
        if not isinstance(self.enable_confidence_head, bool):
            raise ValueError(f"enable_confidence_head must be a bool, got {self.enable_confidence_head!r}")
        check_initializer_range(self.initializer_range)
        eps, theta = self.rms_norm_eps, self.rope_theta
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"rms_norm_eps must be a positive finite number, got {eps!r}")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 1):
            raise ValueError(f"rope_theta must be a finite number > 1, got {theta!r}")
        self.rope_theta = float(theta)
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        if not is_int(self.mask_token_id) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id must be a token id in [0, {self.vocab_size}) (the target vocabulary: the mask slots "
                f"are embedded with the target's embedding), got {self.mask_token_id!r}"
            )
        if self.aux_stream not in AUX_STREAMS:
            raise ValueError(f"aux_stream must be one of {AUX_STREAMS}, got {self.aux_stream!r}")
        L = self.target_num_hidden_layers
        if L is not None and (not is_int(L) or L < 1):
            raise ValueError(f"target_num_hidden_layers must be a positive int or null, got {L!r}")
        self.aux_layer_ids = check_taps(self.aux_layer_ids, L)

    # ---- derived -----------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_target_layers(self) -> int:
        """How many target states are concatenated (vLLM's ``num_target_layers``)."""
        return len(self.aux_layer_ids)

    @property
    def context_size(self) -> int:
        """Width of ``context_proj``'s input: ``num_target_layers · target_hidden_size``."""
        return self.num_target_layers * self.target_hidden_size

    @property
    def engine_aux_layer_ids(self) -> list[int]:
        """The capture ids vLLM's runner derives (``aux_layer_ids`` + 1: the state entering that layer)."""
        return [i + 1 for i in self.aux_layer_ids]

    def replace(self, **changes: Any) -> DSparkDraftConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DSparkDraftConfig:
        names, data = {f.name for f in dataclasses.fields(cls)}, renamed_fields(data)
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"DSpark draft config: unknown fields {unknown}")
        return cls(**data)


# DSpark's rules for its taps, with vLLM's reasons (the one validator: :func:`~lightning_eagle.aux_layers.
# validate_aux_layer_ids`)
TAP_REASONS = {
    "count": "vLLM: 'MLA DSpark requires non-empty target_layer_ids'",
    "ascending": "vLLM sorts and de-duplicates the layers it captures, so context_proj's input chunks arrive in "
    "ascending tap order",
    "range": "vLLM captures tap i as the state entering layer i + 1, so the pre-norm final state is never captured",
}


def check_taps(ids: Any, num_target_layers: int | None) -> list[int]:
    """DSpark's taps (module docstring): one or more distinct ints, ascending, in ``[0, L - 1]`` when the target
    depth ``L`` is known. Returns them as a list."""
    return validate_aux_layer_ids(ids, num_target_layers, None, ascending=True, final=False, why=TAP_REASONS)


# ---- presets -----------------------------------------------------------------------------------------------------
# The real K3 (`dspark.md`, "K3-specific implementation checklist"): 5 layers, 5 taps, block 7, q_lora 1536,
# kv_lora 512, dims 128/64/128, RoPE/YaRN theta 50000 factor 32 over 32K, Markov rank 256, the target's vocabulary
# (163840) and width (7168).
# The taps spread over [1, L - 4] like EAGLE-3's defaults; intermediate_size is DeepSeek-V3's dense width (a choice).
K3_YARN = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 32768,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
DSPARK_PRESETS: dict[str, dict[str, Any]] = {
    "k3": {
        "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 5, "num_attention_heads": 96,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 163840, "target_hidden_size": 7168,
        "aux_layer_ids": [1, 23, 45, 67, 89], "target_num_hidden_layers": 93, "block_size": 7,
        "mask_token_id": 163837, "markov_rank": 256, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "rope_scaling": K3_YARN, "max_position_embeddings": 1048576,
    },
    # The quickstart target (lightning_eagle/assets/k3-tiny-chat: H 128, 6 layers, vocabulary 512 with the
    # tokenizer's reserved ids from 256 up); the mask is a reserved id no chat template renders.
    "k3-tiny": {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 20, "vocab_size": 512, "target_hidden_size": 128, "aux_layer_ids": [1, 3, 4],
        "target_num_hidden_layers": 6, "block_size": 4, "mask_token_id": 500, "markov_rank": 32,
        "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None, "max_position_embeddings": 4096,
    },
}  # fmt: skip


def dspark_config_from_preset(name: str, **overrides: Any) -> DSparkDraftConfig:
    """A preset of :data:`DSPARK_PRESETS` with ``overrides``, validated."""
    if name not in DSPARK_PRESETS:
        raise ValueError(f"unknown DSpark draft preset {name!r}; choose one of {sorted(DSPARK_PRESETS)}")
    return DSparkDraftConfig(**{**DSPARK_PRESETS[name], **overrides})
