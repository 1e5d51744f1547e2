"""Configuration of the K3 EAGLE-3 draft (`eagle3_training.md` §3).

Two layer architectures share the EAGLE-3 frame (``fc`` / ``fc_norm`` / embeddings / ``norm`` / ``lm_head`` /
``d2t``·``t2d``, the TTT cache and its attention backends):

* ``"k3"`` (default) — K3-faithful: NoPE MLA with an unrotated rope slice and a sigmoid output gate, SiTU MLP,
  K3 RMSNorm. No serving engine runs it (export architecture ``Eagle3KimiK3ForCausalLM``, §14.2).
* ``"deepseek_mla"`` — what the served K3 drafts are: one DeepSeek-V3 MLA layer (interleaved RoPE, optional DeepSeek
  YaRN), SwiGLU (``silu``), plain RMSNorm, no gate; exported as ``Eagle3DeepseekV2ForCausalLM``, which SGLang and
  vLLM load (:mod:`lightning_eagle.draft.deepseek_mla`, :mod:`lightning_eagle.draft.serving_format`).

The draft's dimensions are explicit fields that default to the target's text config (the reference builds the draft
from the target config). This is a plain dataclass, not a ``PretrainedConfig``: ``KimiK3TextConfig`` validates the
*target's* rules and would reject a draft override before the draft could name its own problem, and parsing a draft
``config.json`` must not need ``transformers``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_eagle.aux_layers import AUX_STREAMS, renamed_fields, resolve_default_aux_layer_ids
from lightning_eagle.aux_layers import validate_aux_layer_ids as validate_taps
from lightning_eagle.draft.materialize import check_initializer_range
from lightning_eagle.settings import check_mla_heads_and_widths

NUM_AUX_HIDDEN_STATES = 3  # EAGLE-3 taps three target layers (fixed)
DEFAULT_DRAFT_VOCAB_SIZE = 32000
# Training settings that checkpoints and exports written before they left the draft config stored among its fields.
TRAINING_SETTINGS = ("ttt_steps", "step_decay")
ARCHITECTURES = ("k3", "deepseek_mla")
DEFAULT_ROPE_THETA = 10000.0  # every engine's default base (vLLM's Eagle3 head falls back to it, see serving_format)
# The std of the initial weights, as SpecForge (the EAGLE-3 reference trainer) initialises its drafts: its
# ``Eagle3DraftModel`` is a transformers ``PreTrainedModel`` whose ``post_init()`` runs ``_init_weights`` (every
# Linear/Embedding weight N(0, config.initializer_range), biases 0, RMSNorm gains 1; specforge/modeling/draft/
# base.py, llama3_eagle.py), and every EAGLE-3 draft config it ships says 0.02 (configs/*-eagle3.json).
DEFAULT_INITIALIZER_RANGE = 0.02

# Fields a draft takes over from the target text config unless overridden.
FIELDS_FROM_TARGET = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "mla_use_nope",
    "mla_use_output_gate",
    "intermediate_size",
    "hidden_act",
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "rms_norm_eps",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

# Fields that describe the K3 layer; a deepseek_mla draft does not take them from the (K3) target but uses these.
DEEPSEEK_MLA_LAYER_VALUES = {
    "hidden_act": "silu",
    "mla_use_nope": False,
    "mla_use_output_gate": False,
    "activation_situ_beta": None,
    "activation_situ_linear_beta": None,
}


# EAGLE-3's rule for its taps beside the one validator's (:func:`~lightning_eagle.aux_layers.validate_aux_layer_ids`)
TAP_REASONS = {"count": f"an EAGLE-3 draft's fc reads exactly {NUM_AUX_HIDDEN_STATES} tapped states"}


@dataclass
class Eagle3DraftConfig:
    """The architecture of one :class:`~lightning_eagle.draft.KimiK3Eagle3Draft`: what builds it, what its export
    describes. How it is trained (``ttt_steps``, ``step_decay``, loss options) is the training code's business.

    ``vocab_size`` is the *target* vocabulary V; ``draft_vocab_size`` is N_d (``None`` → V, the identity map).
    ``aux_layer_ids`` / ``aux_stream`` record which target features the draft was trained on; they are
    ``None`` for a draft imported from a reference export that does not say.

    ``architecture`` picks the decoder layer (``"k3"`` or ``"deepseek_mla"``, module docstring). ``rope_theta``,
    ``rope_scaling`` (DeepSeek YaRN or null) and ``max_position_embeddings`` (the engine's rotary table length;
    None = the target's) apply to ``deepseek_mla`` only; the K3 draft is NoPE. A ``deepseek_mla`` draft has
    ``hidden_act="silu"``, ``mla_use_nope=False`` and ``mla_use_output_gate=False``
    (:meth:`from_target_config` sets them).

    ``initializer_range``: the std of the initial ``fc`` / attention / MLP / ``lm_head`` weights (all N(0, std), norm
    gains 1: :meth:`~lightning_eagle.draft.KimiK3Eagle3Draft.init_module`), SpecForge's rule and default
    (:data:`DEFAULT_INITIALIZER_RANGE`).
    """

    hidden_size: int = 7168
    num_attention_heads: int = 96
    num_key_value_heads: int | None = None
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    intermediate_size: int = 33792
    hidden_act: str = "situ"
    activation_situ_beta: float | None = 4.0
    activation_situ_linear_beta: float | None = 25.0
    rms_norm_eps: float = 1e-5
    vocab_size: int = 163840
    draft_vocab_size: int | None = DEFAULT_DRAFT_VOCAB_SIZE
    target_hidden_size: int | None = None
    target_num_hidden_layers: int | None = None
    fc_norm: bool = False
    norm_output: bool = False
    freeze_embeddings: bool = True
    aux_layer_ids: list[int] | None = None
    aux_stream: str | None = None
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    num_aux_hidden_states: int = field(default=NUM_AUX_HIDDEN_STATES)
    architecture: str = "k3"
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int | None = None
    initializer_range: float = DEFAULT_INITIALIZER_RANGE

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.draft_vocab_size is None or self.draft_vocab_size >= self.vocab_size:
            self.draft_vocab_size = self.vocab_size  # identity map (§9): the buffers are still written
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        if self.architecture == "deepseek_mla" and self.rope_scaling is not None:
            from lightning_eagle.ops.rotary import normalize_rope_scaling

            self.rope_scaling = normalize_rope_scaling(self.rope_scaling)  # every key explicit (and validated)
        self.validate()

    # ---- derived ----------------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_vocab_compression(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    # ---- validation -------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` for a draft this library cannot build (§3.6 messages first)."""
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        positive = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                    "intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size")  # fmt: skip
        check_mla_heads_and_widths(self, "the K3 draft's MLA", positive)
        if self.architecture == "k3":
            self._validate_k3_layer()
        else:
            self._validate_deepseek_mla_layer()
        if self.num_aux_hidden_states != NUM_AUX_HIDDEN_STATES:
            raise ValueError(
                f"EAGLE-3 uses {NUM_AUX_HIDDEN_STATES} aux hidden states, got {self.num_aux_hidden_states}"
            )
        if self.aux_stream is not None and self.aux_stream not in AUX_STREAMS:
            raise ValueError(f"aux_stream must be one of {AUX_STREAMS}, got {self.aux_stream!r}")
        check_initializer_range(self.initializer_range)
        if self.aux_layer_ids is not None:
            validate_taps(self.aux_layer_ids, self.target_num_hidden_layers, NUM_AUX_HIDDEN_STATES, why=TAP_REASONS)

    def _validate_k3_layer(self) -> None:
        served = "; a rotary SwiGLU draft that SGLang/vLLM serve is architecture='deepseek_mla'"
        if not self.mla_use_nope:
            raise ValueError(
                "the K3 draft requires mla_use_nope=True: its MLA never rotates the rope slice, there is no rotary "
                "module and position ids are ignored" + served
            )
        if self.hidden_act != "situ":
            raise ValueError(f"the K3 draft's MLP is SiTU; hidden_act must be 'situ', got {self.hidden_act!r}" + served)
        if self.rope_scaling is not None:
            raise ValueError("rope_scaling applies to architecture='deepseek_mla' only: the K3 draft is NoPE")

    def _validate_deepseek_mla_layer(self) -> None:
        # Each rule is a property of the engines' Eagle3DeepseekV2ForCausalLM (SGLang kimi_k25_eagle3.py, vLLM
        # deepseek_eagle3.py): a draft they cannot run the same way is refused before it is trained.
        what = "architecture='deepseek_mla' (served as Eagle3DeepseekV2ForCausalLM)"
        if self.hidden_act != "silu":
            raise ValueError(f"{what} has a SwiGLU MLP: hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.mla_use_nope or self.mla_use_output_gate:
            raise ValueError(
                f"{what} rotates the rope slice and has no output gate: mla_use_nope and mla_use_output_gate must be "
                f"false, got {self.mla_use_nope} / {self.mla_use_output_gate}"
            )
        if self.q_lora_rank is None:
            raise ValueError(f"{what} needs a Q-LoRA (q_lora_rank): SGLang's Eagle3 MLA layer refuses q_proj")
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"{what} rotates pairs: qk_rope_head_dim must be a positive even int")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or self.rope_theta <= 1:
            raise ValueError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")
        mpe = self.max_position_embeddings
        if mpe is not None and (isinstance(mpe, bool) or not isinstance(mpe, int) or mpe < 1):
            raise ValueError(f"max_position_embeddings must be a positive int or null, got {mpe!r}")

    # ---- construction -----------------------------------------------------------------------------------------------
    @classmethod
    def from_target_config(cls, target_config: Any, **overrides: Any) -> Eagle3DraftConfig:
        """Derive a draft config from a K3 text config (or the outer ``kimi_k3`` config, or any object with the same
        attribute names); ``overrides`` set draft fields explicitly.

        Defaults: N_d = 32000 (identity map when V ≤ 32000), aux ids = the target's ``[1, L//2-1, L-4]`` (tiny targets
        whose default ids collide must pass ``aux_layer_ids``), stream ``"prefix"``. With
        ``architecture="deepseek_mla"`` the K3-layer fields (SiTU, NoPE, gate) are replaced by
        :data:`DEEPSEEK_MLA_LAYER_VALUES` and ``max_position_embeddings`` defaults to the target's.
        """
        text = getattr(target_config, "text_config", None) or target_config
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            moved = sorted(unknown & set(TRAINING_SETTINGS))
            why = f" ({', '.join(moved)}: training settings, not architecture; pass them to the training code)"
            raise TypeError(f"unknown Eagle3DraftConfig fields: {sorted(unknown)}" + (why if moved else ""))
        values: dict[str, Any] = {}
        for name in FIELDS_FROM_TARGET:
            value = getattr(text, name, None)
            if value is not None:
                values[name] = value
        vocab = values.get("vocab_size")
        if vocab is None:
            raise ValueError("the target config has no vocab_size; cannot derive the draft vocabulary")
        values["draft_vocab_size"] = DEFAULT_DRAFT_VOCAB_SIZE if vocab > DEFAULT_DRAFT_VOCAB_SIZE else None
        values["target_hidden_size"] = getattr(text, "hidden_size", None)
        num_layers = getattr(text, "num_hidden_layers", None)
        values["target_num_hidden_layers"] = num_layers
        if "aux_layer_ids" not in overrides and num_layers is not None:
            values["aux_layer_ids"] = resolve_default_aux_layer_ids(num_layers)
        values["aux_stream"] = "prefix"
        if overrides.get("architecture") == "deepseek_mla":
            values.update(DEEPSEEK_MLA_LAYER_VALUES)
            values["max_position_embeddings"] = getattr(text, "max_position_embeddings", None)
        if "num_attention_heads" in overrides and "num_key_value_heads" not in overrides:
            values["num_key_value_heads"] = None  # MLA: K/V heads follow the (overridden) query heads
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], strict: bool = False) -> Eagle3DraftConfig:
        """Build from :meth:`to_dict` output or a draft ``config.json`` (foreign keys ignored unless ``strict``; the
        training settings older checkpoints and exports recorded here are always skipped)."""
        names, data = {f.name for f in dataclasses.fields(cls)}, renamed_fields(data)
        unknown = set(data) - names - set(TRAINING_SETTINGS)
        if strict and unknown:
            raise ValueError(f"unknown Eagle3DraftConfig fields: {sorted(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def replace(self, **changes: Any) -> Eagle3DraftConfig:
        return dataclasses.replace(self, **changes)
