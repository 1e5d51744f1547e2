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
    """

    path: Path | None
    config: KimiK3TextConfig
    fingerprint: str | None
    dtype: str = "bfloat16"
    expert_storage: str = "dequantized"
    aux_layer_ids: tuple[int, int, int] = (1, 45, 89)
    aux_stream: str = "prefix"
    tap_count: int | None = 3

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
        return cls.from_checkpoint(settings.path, **kwargs)

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
    ) -> TargetSpec:
        """The spec of a checkpoint folder (or ``"quickstart"``): only its ``config.json`` is read."""
        path = resolve_target_path(target)
        text = (path / "config.json").read_text()
        config = text_config_from_dict(json.loads(text), source=str(path))
        return cls.from_config(
            config, path=path, fingerprint=config_fingerprint(text), dtype=dtype, expert_storage=expert_storage,
            aux_layer_ids=aux_layer_ids, aux_stream=aux_stream, tap_count=tap_count,
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
    ) -> TargetSpec:
        """A spec from a config object (a named preset for the memory plan, or a config already read)."""
        if tap_count is None and aux_layer_ids is None:
            raise ValueError("model.target.aux_layer_ids must be set: this draft family has no default taps")
        if tap_count == 3 and getattr(config, "model_type", None) == "kimi_linear":  # else __post_init__ refuses it
            aux_layer_ids = resolve_aux_layer_ids(aux_layer_ids, config.num_hidden_layers)
        return cls(
            path=path, config=config, fingerprint=fingerprint, dtype=dtype, expert_storage=expert_storage,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else (), aux_stream=aux_stream,
            tap_count=tap_count,
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
