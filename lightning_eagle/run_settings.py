"""A run's settings, typed and validated once where they are made: the groups of ``model:`` in a run config.

```yaml
model:
  target:       {path: quickstart, aux_layer_ids: [1, 3, 5], dtype: float32, token_chunk: null}
  draft:        {config: {intermediate_size: 256}, attention_backend: auto, activation_checkpointing: false}
  objective:    {ttt_steps: 7, step_decay: 0.8, loss_backend: plain}
  optimization: {lr: 3.0e-3, warmup_ratio: 0.05}
```

Each group is a frozen dataclass: LightningCLI (jsonargparse) reads the YAML into it, the module, the feature dumper,
the acceptance callback, the commands and the memory plan take it as it is, and its ``__post_init__`` is the one
check of its values (messages name the YAML key, ``model.objective.ttt_steps``). Backend names are checked by their
registries (:mod:`lightning_eagle.backends`); what needs the target's config (tap ids against its depth) is checked
when the :class:`~lightning_eagle.k3.target_spec.TargetSpec` is made from these settings.

A run config in the flat shape these groups replaced (``model.ttt_steps``) is refused by
:func:`refuse_flat_model_keys` with the key's place here.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_eagle import backends
from lightning_eagle.aux_layers import AUX_STREAMS
from lightning_eagle.settings import (
    DEFAULT_LOSS_CHUNK,
    DEFAULT_STEP_DECAY,
    DEFAULT_TTT_STEPS,
    check_positive_int_or_none,
    check_settings,
)

TARGET_SOURCES = ("online", "features")
TARGET_DTYPES = ("float32", "bfloat16", "float16")
DRAFT_DTYPES = TARGET_DTYPES
EXPERT_STORAGES = ("dequantized", "mxfp4")
KV_CACHES = ("expanded", "latent")  # the draft K/V cache of both families: per-head K/V, or the MLA latent
MAX_USEFUL_TTT_STEPS = 16  # past this the settings warn: engines draft 3-8 tokens, decay^k leaves later steps ~0


def check_kv_cache(name: str, key: str = "kv_cache") -> str:
    """``name`` if it is one of :data:`KV_CACHES`, else ``ValueError`` naming ``key`` and the choices."""
    choice(key, name, KV_CACHES)
    return name


def choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def flag(key: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")


@dataclass(frozen=True)
class TargetSettings:
    """``model.target``: the frozen K3 and how it runs.

    ``path``: a K3 checkpoint folder (released layout) or ``"quickstart"``; ``source``: ``"online"`` runs the target
    every step, ``"features"`` trains from a dump (``cli.py dump``; only the teacher head is loaded);
    ``aux_layer_ids``: the three 0-based taps (None: ``[1, L//2-1, L-4]``); ``aux_stream``: ``"prefix"`` or
    ``"mixed"``; ``dtype`` (the fp32 islands stay fp32); ``expert_storage``: ``"mxfp4"`` keeps routed experts packed;
    ``token_chunk``: run the target layer by layer in segments of this many tokens (None: the whole sequence).
    """

    path: str = "quickstart"
    source: Literal[TARGET_SOURCES] = "online"
    aux_layer_ids: tuple[int, ...] | None = None
    aux_stream: Literal[AUX_STREAMS] = "prefix"
    dtype: Literal[TARGET_DTYPES] = "bfloat16"
    expert_storage: Literal[EXPERT_STORAGES] = "dequantized"
    token_chunk: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"model.target.path must be a checkpoint folder or 'quickstart', got {self.path!r}")
        choice("model.target.source", self.source, TARGET_SOURCES)
        choice("model.target.aux_stream", self.aux_stream, AUX_STREAMS)
        choice("model.target.dtype", self.dtype, TARGET_DTYPES)
        choice("model.target.expert_storage", self.expert_storage, EXPERT_STORAGES)
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        check_positive_int_or_none("model.target.token_chunk", self.token_chunk, "tokens per segment", "unchunked")


@dataclass(frozen=True)
class DraftTrainingSettings:
    """What ``model.draft`` holds in every family: how the draft is placed, stored, started and recomputed.

    ``activation_checkpointing``: recompute the draft's steps (EAGLE-3) or layers (DSpark) in the backward; ``shard``:
    FSDP2-shard the draft's parameters, gradients and optimizer states over all ranks; ``init_seed``: the random
    init, the same on every rank; ``dtype``: the dtype the draft computes in; ``master_weights``: with a 16-bit
    ``dtype``, keep fp32 master weights and optimizer states (a replicated draft: :class:`~lightning_eagle.training.
    master_weights.MasterWeights`; a sharded one: FSDP2's mixed-precision policy) — ``false`` trains pure 16-bit,
    where an update smaller than half a weight's spacing is lost (warned); ``init_from``: an export folder or a
    training checkpoint of either family whose draft weights this run starts from (weights only: a fresh optimizer and
    schedule; continual training onto a new target checkpoint).
    """

    activation_checkpointing: bool = False
    shard: bool = False
    init_seed: int = 0
    dtype: Literal[DRAFT_DTYPES] = "float32"
    master_weights: bool = True
    init_from: str | None = None

    def __post_init__(self) -> None:
        choice("model.draft.dtype", self.dtype, DRAFT_DTYPES)
        flag("model.draft.activation_checkpointing", self.activation_checkpointing)
        flag("model.draft.shard", self.shard)
        flag("model.draft.master_weights", self.master_weights)
        check_settings("model.draft", {"init_seed": (self.init_seed, "non_negative", int)})
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ValueError(
                f"model.draft.init_from must be the path of a draft export or a training checkpoint, got "
                f"{self.init_from!r}"
            )

    @property
    def master_copy(self) -> bool:
        """Whether the trained parameters have fp32 masters apart from the ``dtype`` they compute in."""
        return self.master_weights and self.dtype != "float32"

    def pure_low_precision_warning(self) -> str | None:
        """The warning a pure 16-bit draft gets (None: the draft keeps fp32 masters, or computes in fp32)."""
        if self.master_weights or self.dtype == "float32":
            return None
        return (
            f"model.draft.dtype={self.dtype} with model.draft.master_weights=false trains the draft's parameters and "
            f"optimizer states in {self.dtype} with no fp32 master copy: an update smaller than half a weight's "
            f"spacing is rounded away (a {self.dtype} norm gain of 1.0 never moves at lr below "
            f"{2.0 ** -(8 if self.dtype == 'bfloat16' else 11):.2g}); set model.draft.master_weights=true"
        )


@dataclass(frozen=True)
class DraftSettings(DraftTrainingSettings):
    """``model.draft`` of an EAGLE-3 run: the draft and how it is built and run (and the fields every family has:
    :class:`DraftTrainingSettings`).

    ``config``: fields of the draft config to override (``{"intermediate_size": 4096, "architecture":
    "deepseek_mla"}``); the taps, their stream and the draft vocabulary come from ``model.target`` and the data
    module, never from here. ``attention_backend``: TTT attention (``"auto"`` per device, or ``"eager"``,
    ``"flash_lse"``, ``"sdpa_mask"``, ``"flex_attention"``); ``kv_cache``: ``"expanded"`` or ``"latent"``
    (MLA's latent + rope key per step).
    """

    config: dict[str, Any] | None = None
    attention_backend: str = "auto"
    kv_cache: Literal[KV_CACHES] = "expanded"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.config is not None and not isinstance(self.config, Mapping):
            raise ValueError(f"model.draft.config must be a mapping of draft config fields, got {self.config!r}")
        doubled = sorted(set(self.config or {}) & set(DRAFT_CONFIG_ELSEWHERE))
        if doubled:
            where = "; ".join(f"model.draft.config.{k}: set {DRAFT_CONFIG_ELSEWHERE[k]} instead" for k in doubled)
            raise ValueError(f"{where} (a setting has one source of truth)")
        object.__setattr__(self, "config", dict(self.config or {}))
        try:
            backends.TTT_ATTENTION_BACKEND.check(self.attention_backend)
        except ValueError as err:
            raise ValueError(f"model.draft.attention_backend: {err}") from None
        choice("model.draft.kv_cache", self.kv_cache, KV_CACHES)

    def __hash__(self) -> int:  # `config` is a dict: hash what identifies the settings
        return hash((tuple(sorted(self.config.items(), key=str)) if self.config else (), self.attention_backend))


# Draft config fields that other settings own (the draft config is built from them).
DRAFT_CONFIG_ELSEWHERE = {
    "ttt_steps": "model.objective.ttt_steps",
    "step_decay": "model.objective.step_decay",
    "aux_layer_ids": "model.target.aux_layer_ids",
    "aux_stream": "model.target.aux_stream",
    "draft_vocab_size": "data.draft_vocab_size (the data module builds the vocabulary map)",
}


@dataclass(frozen=True)
class ObjectiveSettings:
    """``model.objective``: the EAGLE-3 training-time-test objective.

    ``ttt_steps`` K and ``step_decay`` (loss = Σ decay^k L_k / Σ decay^k, decay in (0, 1]); ``loss_backend``:
    ``"plain"`` (``lm_head`` logits, then soft CE against ``[B,T,N_d]`` teacher probabilities; every research hook)
    or ``"chunked"`` (fused, ``loss_chunk`` rows at a time, teacher recomputed per chunk; long context) or
    ``"auto"``; ``teacher_vocab_chunk`` / ``teacher_seq_chunk``: chunks of the teacher's full-vocabulary argmax.
    """

    ttt_steps: int = DEFAULT_TTT_STEPS
    step_decay: float = DEFAULT_STEP_DECAY
    loss_backend: str = "plain"
    loss_chunk: int = DEFAULT_LOSS_CHUNK
    teacher_vocab_chunk: int = 16384
    teacher_seq_chunk: int = 2048

    def __post_init__(self) -> None:
        check_settings("model.objective", {
            "ttt_steps": (self.ttt_steps, "positive", int), "step_decay": (self.step_decay, "positive", float),
            "loss_chunk": (self.loss_chunk, "positive", int),
            "teacher_vocab_chunk": (self.teacher_vocab_chunk, "positive", int),
            "teacher_seq_chunk": (self.teacher_seq_chunk, "positive", int),
        })  # fmt: skip
        if self.step_decay > 1:  # later steps would outweigh the first, which every accepted draft token needs
            raise ValueError(f"model.objective.step_decay must be in (0, 1], got {self.step_decay!r}")
        try:
            backends.LOSS_BACKEND.check(self.loss_backend)
        except ValueError as err:
            raise ValueError(f"model.objective.loss_backend: {err}") from None
        if self.ttt_steps > MAX_USEFUL_TTT_STEPS:
            warnings.warn(
                f"model.objective.ttt_steps={self.ttt_steps}: engines draft 3-8 tokens and the step weights decay^k "
                f"make steps past ~{MAX_USEFUL_TTT_STEPS} cost compute and memory for almost no signal",
                stacklevel=3,
            )


@dataclass(frozen=True)
class OptimizationSettings:
    """``model.optimization``: AdamW (betas 0.9/0.95) with warmup-cosine; ``model.optimizer`` /
    ``model.lr_scheduler`` callables replace them."""

    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        check_settings("model.optimization", {
            "lr": (self.lr, "positive", float), "weight_decay": (self.weight_decay, "non_negative", float),
            "warmup_ratio": (self.warmup_ratio, "fraction_below_one", float),
            "min_lr_ratio": (self.min_lr_ratio, "fraction", float),
        })  # fmt: skip


MODEL_GROUPS = {"target": TargetSettings, "draft": DraftSettings, "objective": ObjectiveSettings,
                "optimization": OptimizationSettings}  # fmt: skip

# The flat ``model.*`` keys these groups replaced → their place now (refused, never mapped).
FLAT_MODEL_KEYS = {
    "target_source": "model.target.source", "aux_layer_ids": "model.target.aux_layer_ids",
    "aux_stream": "model.target.aux_stream", "target_dtype": "model.target.dtype",
    "target_expert_storage": "model.target.expert_storage", "target_token_chunk": "model.target.token_chunk",
    "attention_backend": "model.draft.attention_backend", "ttt_kv_cache": "model.draft.kv_cache",
    "draft_activation_checkpointing": "model.draft.activation_checkpointing", "draft_shard": "model.draft.shard",
    "draft_init_seed": "model.draft.init_seed", "draft_dtype": "model.draft.dtype",
    **{f.name: f"model.objective.{f.name}" for f in dataclasses.fields(ObjectiveSettings)},
    **{f.name: f"model.optimization.{f.name}" for f in dataclasses.fields(OptimizationSettings)},
}  # fmt: skip
# ``model.draft`` keys renamed so that one concept has one name in every family → their name now (refused, never mapped
# in a run config; a checkpoint's saved hyperparameters are read under the new name by :func:`as_settings`).
RENAMED_DRAFT_KEYS = {"ttt_kv_cache": "kv_cache", "kv_form": "kv_cache"}


def refuse_flat_model_keys(
    model: Mapping[str, Any] | None, where: str, draft_settings: type | None = DraftSettings
) -> None:
    """``ValueError`` naming the first setting of ``model`` (a run config's ``model:`` mapping, from ``where``) that
    is in the flat shape: an old key, ``target: PATH`` instead of ``target: {path: PATH}``, or draft config fields
    directly under ``draft:``. ``draft_settings``: the ``model.draft`` type of the family ``model.class_path`` names
    (its fields are never old keys; None: not known here, so not checked)."""
    if not isinstance(model, Mapping):
        return
    model = model.get("init_args", model) if "class_path" in model else model
    if not isinstance(model, Mapping):
        return
    for key in model:
        if key in FLAT_MODEL_KEYS:
            raise ValueError(f"{where}: model.{key} is now {FLAT_MODEL_KEYS[key]} (run settings are grouped)")
    if "target" in model and isinstance(model["target"], str):
        raise ValueError(f"{where}: model.target is a group now: write model.target.path: {model['target']}")
    draft = model.get("draft")
    if isinstance(draft, Mapping) and draft_settings is not None:
        fields = {f.name for f in dataclasses.fields(draft_settings)}
        for key in draft:
            if key in RENAMED_DRAFT_KEYS and key not in fields:
                raise ValueError(f"{where}: model.draft.{key} is now model.draft.{RENAMED_DRAFT_KEYS[key]}")
            if key not in fields:
                raise ValueError(
                    f"{where}: model.draft.{key} is now model.draft.config.{key} (draft config overrides live under "
                    "model.draft.config)"
                )


# What draft sequence parallelism does not combine with: (setting, whether it is set, why, what to use instead). The
# one table the module's setup and the memory plan both read (through check_draft_sequence_parallel); the promises of
# docs/long_context.md name these rows.
SEQUENCE_PARALLEL_REFUSALS: tuple[tuple[str, Callable[[DraftSettings, str, str], bool], str], ...] = (
    ("model.draft.kv_cache='latent'", lambda draft, source, stage: draft.kv_cache == "latent",
     "the latent cache has one shared head, which Ulysses cannot split over the group; use "
     "model.draft.kv_cache='expanded'"),
    ("model.draft.shard=true", lambda draft, source, stage: bool(draft.shard),
     "the SP gradient reduction of an FSDP2-sharded draft is untested; use model.draft.shard=false (the replicated "
     "draft) with sequence parallelism"),
    ("model.target.source='features'", lambda draft, source, stage: source != "online",
     "the feature data module is not known to give the ranks of a sequence-parallel group the same rows; use "
     "model.target.source='online'"),
    ("predict", lambda draft, source, stage: stage == "predict",
     "predict returns whole-sequence [K,B,T] proposals and a sequence-parallel rank has only its slots; predict with "
     "draft_sequence_parallel_size=1"),
)  # fmt: skip


def check_draft_sequence_parallel(
    size: int, *, num_attention_heads: int, draft: DraftSettings, target_source: str, stage: str = "fit"
) -> None:
    """What training refuses with ``draft_sequence_parallel_size > 1`` (:data:`SEQUENCE_PARALLEL_REFUSALS`), named by
    setting, before any weight is read: the module's ``setup`` and the memory plan call this one check."""
    if size == 1:
        return
    setting = f"trainer.strategy.init_args.draft_sequence_parallel_size={size}"
    if num_attention_heads % size:
        raise ValueError(
            f"{setting} must divide the draft's num_attention_heads ({num_attention_heads}): sequence-parallel "
            "attention gives every rank of the group num_attention_heads / draft_sequence_parallel_size heads over "
            "the whole sequence"
        )
    for name, applies, why in SEQUENCE_PARALLEL_REFUSALS:
        if applies(draft, target_source, stage):
            raise ValueError(f"{setting} with {name} is not supported: {why}")


def as_settings(group: str, value: Any, groups: Mapping[str, type] = MODEL_GROUPS):
    """``value`` as the settings type of ``model.<group>`` in ``groups`` (a family's: :data:`MODEL_GROUPS` for
    EAGLE-3; each family's module says its own): an instance as it is, a mapping of its fields (a checkpoint's
    hyperparameters, a parsed config) made into one — and so checked."""
    kind = groups[group]
    if isinstance(value, Mapping):
        if group == "draft":  # a checkpoint written before a key was renamed (a family's own field is never renamed)
            fields = {f.name for f in dataclasses.fields(kind)}
            value = {k if k in fields else RENAMED_DRAFT_KEYS.get(k, k): v for k, v in value.items()}
        return kind(**value)
    if not isinstance(value, kind):
        raise TypeError(f"model.{group} must be a {kind.__name__} (or a mapping of its fields), got {value!r}")
    return value
