"""A DSpark run's settings groups, typed and validated once (as :mod:`lightning_eagle.run_settings`'s):
``model.draft`` (:class:`DSparkDraftSettings`) and ``model.objective`` (:class:`DSparkObjectiveSettings`); the target
and optimization groups are the shared ones. Also the one refusal of draft sequence parallelism for a block drafter
(the module's ``setup`` and the memory plan call it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_eagle import backends
from lightning_eagle.run_settings import KV_CACHES, MODEL_GROUPS, DraftTrainingSettings, choice
from lightning_eagle.settings import DEFAULT_LOSS_CHUNK, check_positive_int_or_none, check_settings

# DSpark draft config fields that other settings own (the draft config is built from them and the target's config).
DSPARK_CONFIG_ELSEWHERE = {
    "aux_layer_ids": "model.target.aux_layer_ids",
    "aux_stream": "model.target.aux_stream",
    "vocab_size": "the target's config.json (the embedding and LM head are the target's)",
    "target_hidden_size": "the target's config.json",
    "target_num_hidden_layers": "the target's config.json",
}


@dataclass(frozen=True)
class DSparkDraftSettings(DraftTrainingSettings):
    """``model.draft`` of a DSpark run: the block drafter and how it is built and run.

    ``preset``: the architecture to start from (``"k3"``: vLLM's K3 DSpark layout; ``"k3-tiny"``: the quickstart
    target's), checked when the module builds the config; ``config``: its fields to override (``{"block_size": 7}``);
    the taps, their stream, the vocabulary and the target's width and depth come from ``model.target``, never from
    here. ``block_chunk``: anchors per attention call (None: all at once); ``kv_cache``: ``"latent"`` keys (what vLLM
    caches) or the ``"expanded"`` twin; ``activation_checkpointing``: keep only each layer's input and recompute the
    layer in the backward (long rows); ``shard``: FSDP2-shard the drafter's parameters, gradients and AdamW states
    over all ranks (as EAGLE-3's ``model.draft.shard``); and the fields every family has
    (:class:`~lightning_eagle.run_settings.DraftTrainingSettings`: dtype, master weights, init seed, ``init_from``).
    """

    preset: str = "k3"
    config: dict[str, Any] | None = None
    block_chunk: int | None = 64
    kv_cache: Literal[KV_CACHES] = "latent"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.preset, str) or not self.preset:
            raise ValueError(f"model.draft.preset must be a DSpark preset name ('k3', 'k3-tiny'), got {self.preset!r}")
        if self.config is not None and not isinstance(self.config, Mapping):
            raise ValueError(f"model.draft.config must be a mapping of DSpark draft config fields, got {self.config!r}")
        doubled = sorted(set(self.config or {}) & set(DSPARK_CONFIG_ELSEWHERE))
        if doubled:
            where = "; ".join(f"model.draft.config.{k}: set {DSPARK_CONFIG_ELSEWHERE[k]} instead" for k in doubled)
            raise ValueError(f"{where} (a setting has one source of truth)")
        object.__setattr__(self, "config", dict(self.config or {}))
        check_positive_int_or_none("model.draft.block_chunk", self.block_chunk, "anchors per call", "all at once")
        choice("model.draft.kv_cache", self.kv_cache, KV_CACHES)

    def __hash__(self) -> int:  # `config` is a dict: hash what identifies the settings
        config = tuple(sorted(self.config.items(), key=str))
        return hash((self.preset, config, self.block_chunk, self.kv_cache, self.shard))


@dataclass(frozen=True)
class DSparkObjectiveSettings:
    """``model.objective`` of a DSpark run: the anchored-block objective (`dspark.md`, "Training, as implemented").

    ``num_anchors`` blocks sampled per row (the reference's 512); the term weights ``ce`` / ``l1`` / ``confidence``
    and ``slot_decay`` (slot k weighs ``exp(-k / slot_decay)``); ``loss_backend``: ``"plain"`` (full ``[N,V]``
    softmaxes), ``"chunked"`` (``loss_chunk`` rows of ``[*,V]`` at a time, forward and backward) or ``"auto"``;
    ``anchor_seed``: the anchors of micro-batch s on rank r depend only on (anchor_seed, s, r), so a resumed run draws
    what the uninterrupted one would have.
    """

    num_anchors: int = 512
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    slot_decay: float = 4.0
    loss_backend: str = "plain"
    loss_chunk: int = DEFAULT_LOSS_CHUNK
    anchor_seed: int = 0

    def __post_init__(self) -> None:
        check_settings("model.objective", {
            "num_anchors": (self.num_anchors, "positive", int), "ce": (self.ce, "non_negative", float),
            "l1": (self.l1, "non_negative", float), "confidence": (self.confidence, "non_negative", float),
            "slot_decay": (self.slot_decay, "positive", float), "loss_chunk": (self.loss_chunk, "positive", int),
            "anchor_seed": (self.anchor_seed, "non_negative", int),
        })  # fmt: skip
        if self.ce == 0 and self.l1 == 0:
            raise ValueError("model.objective: ce and l1 are both 0: nothing would train the drafter's distribution")
        try:
            backends.LOSS_BACKEND.check(self.loss_backend)
        except ValueError as err:
            raise ValueError(f"model.objective.loss_backend: {err}") from None


def check_dspark_sequence_parallel(size: int) -> None:
    """A DSpark draft has no sequence parallelism: the module's ``setup`` and the memory plan call this one check."""
    if size > 1:
        raise ValueError(
            f"trainer.strategy.init_args.draft_sequence_parallel_size={size} is not supported for a DSpark draft: its "
            "cost is the A x g block rows against the context, not T x T, so there is no sequence to split; use "
            "draft_sequence_parallel_size=1 (long rows: model.objective.num_anchors, model.draft.block_chunk)"
        )


DSPARK_MODEL_GROUPS = {**MODEL_GROUPS, "draft": DSparkDraftSettings, "objective": DSparkObjectiveSettings}
