"""``TargetSpec``: everything a run knows about its frozen K3 target before any weight is read, built and validated
once, then shared (the module, the feature dumper, the strategy's main-process gate, the memory plan).

A spec is frozen: a setting that reaches it has been checked (text ``model_type``, aux ids against the depth, the
stream name, dtype and expert-storage names), so no reader validates it again.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_eagle.aux_layers import AUX_STREAMS, resolve_aux_layer_ids, validate_aux_layer_ids
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.k3.config import KimiK3TextConfig, text_config_from_dict
from lightning_eagle.k3.loader import config_fingerprint, resolve_target_path
from lightning_eagle.run_settings import EXPERT_STORAGES, TARGET_DTYPES, TargetSettings
from lightning_eagle.text_config import config_value, text_config_of


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """The frozen target of a run.

    Args:
        path: the checkpoint folder (None for a plan made from a named config, which reads no weights).
        config: the resolved **text** config (a multimodal outer config is unwrapped once, here).
        fingerprint: 16 hex digits of ``config.json`` that checkpoints and feature dumps record and compare.
        dtype: the target's compute dtype name (its fp32 islands stay fp32 whatever it is).
        expert_storage: ``"dequantized"`` or ``"mxfp4"`` (routed experts kept packed).
        aux_layer_ids: the 0-based taps, in the draft's input order (EAGLE-3: three, the default
            ``[1, L//2-1, L-4]`` resolved; DSpark: as many as its ``context_proj`` reads).
        aux_stream: ``"prefix"`` or ``"mixed"`` (which AttnRes stream the taps read).
        tap_count: how many taps the draft family needs (3 for EAGLE-3; None: any non-empty number, DSpark).
        source_model_type: the checkpoint's own text ``model_type``: ``kimi_linear`` (K3), or another model's for a
            run that reads only its features and teacher head (``model.target.source: features``, e.g. features a
            serving engine extracted from a model our K3 cannot run); such a spec never loads a target.
    """

    path: Path | None
    config: KimiK3TextConfig
    fingerprint: str | None
    dtype: str = "bfloat16"
    expert_storage: str = "dequantized"
    aux_layer_ids: tuple[int, int, int] = (1, 45, 89)
    aux_stream: str = "prefix"
    tap_count: int | None = 3
    source_model_type: str = "kimi_linear"

    def __post_init__(self) -> None:
        validate_target_config(self.config, self.aux_layer_ids, self.tap_count)
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        for name, value, allowed in (
            ("aux_stream", self.aux_stream, AUX_STREAMS),
            ("dtype", self.dtype, TARGET_DTYPES),
            ("expert_storage", self.expert_storage, EXPERT_STORAGES),
        ):
            if value not in allowed:
                raise ValueError(f"target {name}={value!r} is unknown; choose one of {list(allowed)}")

    @classmethod
    def from_settings(
        cls, settings: TargetSettings, config: KimiK3TextConfig | None = None, tap_count: int | None = 3
    ) -> TargetSpec:
        """The spec of ``model.target``: its checkpoint's ``config.json`` is read, or ``config`` (a named preset the
        memory plan was given for a folder that is not on this machine) stands in for it, with no path.
        ``tap_count``: the family's number of taps (None: explicit ids of any number, which must then be set)."""
        kwargs = dict(dtype=settings.dtype, expert_storage=settings.expert_storage,
                      aux_layer_ids=settings.aux_layer_ids, aux_stream=settings.aux_stream,
                      tap_count=tap_count)  # fmt: skip
        if config is not None:
            return cls.from_config(config, **kwargs)
        return cls.from_checkpoint(settings.path, **kwargs, teacher_only=settings.source == "features")

    @classmethod
    def from_checkpoint(
        cls,
        target: str | Path,
        *,
        dtype: str = "bfloat16",
        expert_storage: str = "dequantized",
        aux_layer_ids=None,
        aux_stream: str = "prefix",
        tap_count: int | None = 3,
        teacher_only: bool = False,
    ) -> TargetSpec:
        """The spec of a checkpoint folder (or ``"quickstart"``): only its ``config.json`` is read. ``teacher_only``:
        the run reads features and the teacher head only, so another model than K3 is accepted
        (:func:`teacher_only_config`)."""
        path = resolve_target_path(target)
        text = (path / "config.json").read_text()
        data = json.loads(text)
        model_type = config_value(text_config_of(data), "model_type") or "kimi_linear"
        if teacher_only and model_type != "kimi_linear":
            config = teacher_only_config(text_config_of(data))
        else:
            config = text_config_from_dict(data, source=str(path))
        return cls.from_config(
            config, path=path, fingerprint=config_fingerprint(text), dtype=dtype, expert_storage=expert_storage,
            aux_layer_ids=aux_layer_ids, aux_stream=aux_stream, tap_count=tap_count, source_model_type=model_type,
        )  # fmt: skip

    @classmethod
    def from_config(
        cls,
        config: KimiK3TextConfig,
        *,
        path: Path | None = None,
        fingerprint: str | None = None,
        dtype: str = "bfloat16",
        expert_storage: str = "dequantized",
        aux_layer_ids=None,
        aux_stream: str = "prefix",
        tap_count: int | None = 3,
        source_model_type: str = "kimi_linear",
    ) -> TargetSpec:
        """A spec from a config object (a named preset for the memory plan, or a config already read)."""
        if tap_count is None and aux_layer_ids is None:
            raise ValueError("model.target.aux_layer_ids must be set: this draft family has no default taps")
        if tap_count == 3 and getattr(config, "model_type", None) == "kimi_linear":  # else __post_init__ refuses it
            aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, config.num_hidden_layers)
        return cls(
            path=path, config=config, fingerprint=fingerprint, dtype=dtype, expert_storage=expert_storage,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else (), aux_stream=aux_stream,
            tap_count=tap_count, source_model_type=source_model_type,
        )  # fmt: skip

    @property
    def torch_dtype(self):
        return DTYPES[self.dtype]

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def is_k3(self) -> bool:
        """False for a teacher-only spec of another model (features and teacher head only, never a forward)."""
        return self.source_model_type == "kimi_linear"

    def require_k3(self, what: str) -> None:
        """Refuse ``what`` (a target forward, a dump) for a teacher-only spec of another model."""
        if not self.is_k3:
            raise ValueError(
                f"{what} needs the Kimi K3 target, and {self.path}/config.json is a {self.source_model_type!r} model: "
                "another model is accepted only as the teacher of features a serving engine extracted "
                "(model.target.source: features)"
            )


# What a teacher-only spec keeps of another model's text config: the sizes a draft and a teacher head are made from.
_TEACHER_ONLY_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "rms_norm_eps", "max_position_embeddings", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id",
)  # fmt: skip


def teacher_only_config(text: dict[str, Any]) -> KimiK3TextConfig:
    """A K3 text config carrying another model's sizes (vocabulary, width, depth, attention shapes, norm epsilon), the
    rest K3's defaults: what a draft is sized from when it trains on that model's engine-extracted features. Its
    KDA/MoE fields describe no real model; nothing builds a target from it (:meth:`TargetSpec.require_k3`)."""
    values = {k: text[k] for k in _TEACHER_ONLY_FIELDS if text.get(k) is not None}
    values["pad_token_id"] = text.get("pad_token_id")  # K3's default pad id may lie outside another vocabulary
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if k not in values]
    if missing:
        raise ValueError(f"the target's text config lacks {missing}: a teacher-only target needs its sizes")
    layers = int(values["num_hidden_layers"])
    return KimiK3TextConfig(
        **values,
        linear_attn_config={"kda_layers": [], "full_attn_layers": list(range(1, layers + 1))},
        attn_res_block_size=None,
        num_experts=1,
        num_experts_per_token=1,
        first_k_dense_replace=layers,
    )


def validate_target_config(
    target_config: Any, aux_layer_ids: Sequence[int] | None = None, tap_count: int | None = 3
) -> None:
    """Config-level gates: the text ``model_type`` must be ``kimi_linear`` and the aux ids must be valid.

    Reads every attribute with ``getattr(..., None)`` so a missing/None config gives a clean error, never an
    ``AttributeError``.
    """
    text = text_config_of(target_config)
    model_type = config_value(text, "model_type")
    if model_type != "kimi_linear":
        raise ValueError(
            f"the target's text config must have model_type 'kimi_linear' (Kimi K3), got {model_type!r}"
            + (" (no target config was given)" if text is None else "")
        )
    if aux_layer_ids is not None:
        validate_aux_layer_ids(aux_layer_ids, config_value(text, "num_hidden_layers"), tap_count)
