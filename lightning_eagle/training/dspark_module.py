"""``DSparkModule``: the LightningModule that trains a DSpark block drafter (vLLM's ``K3DSparkForCausalLM``) against
a frozen K3 target — the second draft family beside :class:`~lightning_eagle.training.module.Eagle3Module`, sharing
its settings, target source, strategy, optimizer and checkpoints through
:class:`~lightning_eagle.training.draft_training.DraftTrainingModule`.

One step (`dspark.md`, "Training, as implemented"): the target's taps and post-norm final hidden (a no-grad
forward, or dumped features) → anchors drawn from a generator seeded by (``anchor_seed``, micro-batch, rank)
(:mod:`~lightning_eagle.training.dspark_anchors`) → the drafter's blocks against the tap context → the supervised
slots (:func:`~lightning_eagle.training.dspark_objective.supervised_rows`) → the block objective (plain or chunked
over rows, normalised by the global weighted slot count). The embedding and LM head are the frozen target's: never
trained, never in the draft's state, never saved.

Validation logs the objective's own metrics (``val/tau_sim`` = ``1 + Σ_k Π_{i≤k}(1 − TV_i)``, ``val/accept_k``).
Hook for real block speculative decoding (``val/tau_real``, written in ``inference/``): a callback reads this module's
``draft`` (a :class:`~lightning_eagle.draft.dspark.DSparkDrafter`), ``target`` (None with dumped features),
``embedding()`` and ``block_size`` at ``on_validation_epoch_end``, as ``AcceptanceCallback`` does for EAGLE-3.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import override

from lightning_eagle.backends import LOSS_BACKEND
from lightning_eagle.draft.dspark import DSparkDrafter
from lightning_eagle.draft.dspark_config import DSPARK_PRESETS, DSparkDraftConfig, dspark_config_from_preset
from lightning_eagle.draft.dspark_export import DSPARK
from lightning_eagle.draft.materialize import build_on_meta, materialize
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.dense_shard import is_sharded, shard_draft, with_full_parameters
from lightning_eagle.parallel.frozen_target import root_device
from lightning_eagle.parallel.layout import draft_mesh
from lightning_eagle.run_settings import OptimizationSettings, TargetSettings
from lightning_eagle.training import draft_checkpoint as ckpt
from lightning_eagle.training.draft_training import DraftTrainingModule
from lightning_eagle.training.dspark_anchors import anchor_generator, block_targets, sample_anchors
from lightning_eagle.training.dspark_data import check_anchor_rows, check_block_fits
from lightning_eagle.training.dspark_metrics import DSparkMetrics, dspark_block_stats, summarize
from lightning_eagle.training.dspark_objective import (
    DSparkCoefficients,
    DSparkHeads,
    DSparkLoss,
    DSparkRows,
    dspark_loss_chunked,
    dspark_loss_plain,
    global_slot_weight,
    slot_weights,
    supervised_rows,
)
from lightning_eagle.training.dspark_settings import (
    DSPARK_MODEL_GROUPS,
    DSparkDraftSettings,
    DSparkObjectiveSettings,
    check_dspark_sequence_parallel,
)
from lightning_eagle.training.finite import stop_unless_finite
from lightning_eagle.training.run_gates import refuse_unshardable_draft, refuse_unsupported_target_run
from lightning_eagle.training.target_source import target_source

warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


def dspark_run_spec(
    target: TargetSettings, draft: DSparkDraftSettings, config: KimiK3TextConfig | None = None
) -> tuple[TargetSpec, DSparkDraftConfig]:
    """The target spec and drafter config of a DSpark run, each validated once: the taps are
    ``model.target.aux_layer_ids`` (None: the preset's), the vocabulary, width and depth the target's. ``config``:
    the target's text config standing in for a checkpoint folder that is not on this machine (the memory plan)."""
    if draft.preset not in DSPARK_PRESETS:
        raise ValueError(f"model.draft.preset {draft.preset!r} is unknown; choose one of {sorted(DSPARK_PRESETS)}")
    if target.aux_layer_ids is not None and len(target.aux_layer_ids) == 0:
        raise ValueError(
            "model.target.aux_layer_ids is empty: list the drafter's taps, or leave it unset (null) for preset "
            f"{draft.preset!r}'s {list(DSPARK_PRESETS[draft.preset]['aux_layer_ids'])}"
        )
    taps = target.aux_layer_ids or tuple(DSPARK_PRESETS[draft.preset]["aux_layer_ids"])
    where = "model.target.aux_layer_ids" + ("" if target.aux_layer_ids else f" (preset {draft.preset!r}'s)")
    try:
        spec = TargetSpec.from_settings(dataclasses.replace(target, aux_layer_ids=taps), config=config, tap_count=None)
    except ValueError as err:
        raise ValueError(f"{where} {list(taps)}: {err}") from None
    text = spec.config
    try:
        config = dspark_config_from_preset(
            draft.preset, **draft.config, vocab_size=text.vocab_size, target_hidden_size=text.hidden_size,
            target_num_hidden_layers=text.num_hidden_layers, aux_layer_ids=list(spec.aux_layer_ids),
            aux_stream=spec.aux_stream,
        )  # fmt: skip
    except TypeError as err:  # an unknown field
        raise ValueError(f"model.draft.config: {err}") from None
    except ValueError as err:
        raise ValueError(f"model.draft (preset {draft.preset!r}, model.draft.config, {where}): {err}") from None
    return spec, config


def block_objective(
    drafter: DSparkDrafter,
    rows: DSparkRows,
    head: torch.Tensor,
    dtype: torch.dtype,
    *,
    loss_backend: str,
    loss_chunk: int,
    coefficients: DSparkCoefficients,
    normalizer: torch.Tensor,
    world_size: int = 1,
) -> DSparkLoss:
    """The block objective of ``rows`` with the target's ``head`` (the drafter computes in ``dtype``) by
    ``loss_backend`` (``"plain"`` or ``"chunked"``, resolved). It reads the drafter's head weights outside any of
    their calls, so it runs as their forward (:func:`~lightning_eagle.parallel.dense_shard.with_full_parameters`): an
    FSDP2-sharded drafter gathers them for it and for its backward. The training step's and the memory plan's
    (:mod:`~lightning_eagle.planning.dspark_census`) one objective."""
    options = dict(coefficients=coefficients, normalizer=normalizer, world_size=world_size)

    def loss_of(hidden: torch.Tensor) -> tuple[torch.Tensor, DSparkLoss]:
        markov, confidence = drafter.markov_head, drafter.confidence_head
        heads = DSparkHeads(
            lm_head_weight=head.to(dtype), markov_w1=markov.markov_w1.weight, markov_w2=markov.markov_w2.weight,
            confidence_weight=None if confidence is None else confidence.proj.weight,
            confidence_bias=None if confidence is None else confidence.proj.bias, teacher_head_weight=head,
        )  # fmt: skip
        rows_here = dataclasses.replace(rows, hidden=hidden)
        if loss_backend == "chunked":
            loss = dspark_loss_chunked(rows_here, heads, chunk=loss_chunk, **options)
        else:
            loss = dspark_loss_plain(rows_here, heads, **options)
        return loss.loss, loss  # the differentiable output on top, where FSDP hooks the heads' backward gather

    return with_full_parameters(drafter.head_units(), loss_of, rows.hidden)[1]


class DSparkModule(DraftTrainingModule):
    """Train a :class:`~lightning_eagle.draft.dspark.DSparkDrafter` against a frozen K3 target.

    Args (each a group of ``model:`` in a run config, validated when it is made: :mod:`lightning_eagle.run_settings`):
        target: the frozen K3 (as EAGLE-3's; ``aux_layer_ids``: the drafter's taps, ascending, any number).
        draft: the drafter (``preset``, config overrides, ``block_chunk``, ``kv_cache``, ``init_seed``, ``dtype``).
        objective: the block objective (``num_anchors``, ``ce`` / ``l1`` / ``confidence``, ``slot_decay``, loss
            backend and chunk, ``anchor_seed``).
        optimization: AdamW + warmup-cosine; ``optimizer`` / ``lr_scheduler`` callables replace them.
    """

    family = DSPARK
    settings_groups = DSPARK_MODEL_GROUPS

    def __init__(
        self,
        target: TargetSettings = TargetSettings(),
        draft: DSparkDraftSettings = DSparkDraftSettings(),
        objective: DSparkObjectiveSettings = DSparkObjectiveSettings(),
        optimization: OptimizationSettings = OptimizationSettings(),
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        groups = {"target": target, "draft": draft, "objective": objective, "optimization": optimization}
        super().__init__(groups, optimizer, lr_scheduler)
        objective = self.objective
        self.coefficients = DSparkCoefficients.of(objective)
        self.val_metrics = DSparkMetrics(self.block_size)  # created here, never under a meta-device context
        self.draft: DSparkDrafter | None = None
        self._embedding: torch.Tensor | None = None

    @classmethod
    def run_spec(cls, groups, config=None) -> tuple[TargetSpec, DSparkDraftConfig]:
        return dspark_run_spec(groups["target"], groups["draft"], config)

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size  # a block drafter proposes its whole block

    @property
    def block_size(self) -> int:
        """g: the slots of a block, the tokens one draft proposes per verify."""
        return self.draft_config.block_size

    def embedding(self) -> torch.Tensor:
        """The frozen target's input embedding, whole (what the block inputs are looked up in)."""
        return self._embedding

    # ---- construction ---------------------------------------------------------------------------------------------
    def _build_draft(self) -> DSparkDrafter:
        settings = self.draft_settings
        return DSparkDrafter(
            self.draft_config, block_chunk=settings.block_chunk, kv_cache=settings.kv_cache,
            activation_checkpointing=settings.activation_checkpointing,
        )  # fmt: skip

    @override
    def configure_model(self) -> None:
        """Build the target source and the drafter (FSDP2-sharded over all ranks with ``model.draft.shard``); initial
        values depend only on (init_seed, parameter name)."""
        if self.draft is not None:  # called once per stage (fit/validate/…): idempotent
            return
        device, settings = root_device(self), self.draft_settings
        self.source = target_source(self, self.target_spec, self.target_settings, device)
        weight = self.source.embedding()  # whole and in the drafter's dtype (the target's tensor itself if it is)
        weight = (weight.full_tensor() if is_sharded(weight) else weight).detach()
        self._embedding = weight.to(dtype=DTYPES[settings.dtype])
        draft = build_on_meta(self._build_draft)
        self.draft = materialize(draft, device, DTYPES[settings.dtype], settings.init_seed)
        self.start_draft(self.draft)
        if settings.shard:  # after the init: every rank starts from the same whole drafter, then keeps its shard
            shard_draft(self.draft, draft_mesh(self._trainer), compute_dtype=self.master_compute_dtype)

    def refuse_unsupported_run(self, stage: str) -> None:
        refuse_unsupported_target_run(self)
        datamodule = getattr(self.trainer, "datamodule", None)
        draft_vocab = getattr(datamodule, "draft_vocab_size", None)
        if draft_vocab is not None and draft_vocab < self.draft_config.vocab_size:
            raise ValueError(
                f"data.draft_vocab_size={draft_vocab}: a DSpark draft predicts over the target's whole vocabulary "
                f"({self.draft_config.vocab_size}, its LM head is the target's; vLLM refuses a draft vocabulary): "
                "leave data.draft_vocab_size unset"
            )
        check_dspark_sequence_parallel(self.placement.draft_sequence_parallel_size)
        refuse_unshardable_draft(self)
        check_block_fits(self.block_size, getattr(datamodule, "max_length", None))
        if stage == "fit":
            check_anchor_rows(datamodule)

    # ---- steps ----------------------------------------------------------------------------------------------------
    def anchor_stream(self, step: int) -> torch.Generator:
        """The anchors' generator of micro-batch ``step`` on this rank's rows (the same after a resume)."""
        return anchor_generator(self.objective.anchor_seed, step, self.rows_rank())

    def shared_step(self, batch: dict[str, torch.Tensor], generator: torch.Generator):
        """``(loss, blocks, keep)`` of a batch: the :class:`~lightning_eagle.training.dspark_objective.DSparkLoss`
        of its supervised slots, the :class:`~lightning_eagle.training.dspark_anchors.DSparkBlocks` and the anchors'
        ``keep``."""
        context, final_hidden, lm_head_weight = self.source.features(batch)
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        anchors, keep = sample_anchors(loss_mask, self.objective.num_anchors, generator)
        blocks = block_targets(input_ids, loss_mask, anchors, keep, self.block_size)
        embedding = self._embedding
        dtype = embedding.dtype
        slot_hidden = self.draft(context.to(dtype), input_ids, anchors, keep, lambda ids: F.embedding(ids, embedding))
        rows = supervised_rows(blocks, slot_hidden, final_hidden)
        normalizer = global_slot_weight(slot_weights(rows.slots, rows.block_size, self.coefficients.slot_decay).sum())
        with self.source.full_lm_head(lm_head_weight) as head:
            # a gathered (dense-sharded) head is freed when the block ends; the backward needs it: keep a copy
            head = head if head is lm_head_weight else head.detach().clone()
        return self._objective(rows, head.detach(), normalizer), blocks, keep

    def _objective(self, rows: DSparkRows, head: torch.Tensor, normalizer: torch.Tensor) -> DSparkLoss:
        return block_objective(
            self.draft, rows, head, self._embedding.dtype,
            loss_backend=LOSS_BACKEND.resolve(self.objective.loss_backend, rows.hidden.device),
            loss_chunk=self.objective.loss_chunk, coefficients=self.coefficients, normalizer=normalizer,
            world_size=self.trainer.world_size if self._trainer is not None else 1,
        )  # fmt: skip

    def _log_terms(self, prefix: str, loss: DSparkLoss, batch_size: int, on_step: bool) -> None:
        options = dict(on_step=on_step, on_epoch=not on_step, batch_size=batch_size, sync_dist=not on_step)
        self.log(f"{prefix}/loss", loss.loss.detach(), prog_bar=True, **options)
        terms = {"ce": loss.ce, "l1": loss.l1, "confidence": loss.confidence}
        self.log_dict({f"{prefix}/{k}": v for k, v in terms.items()}, **options)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        step = self.trainer.fit_loop.epoch_loop.total_batch_idx if self._trainer is not None else batch_idx
        loss, blocks, keep = self.shared_step(batch, self.anchor_stream(step))
        stop_unless_finite(self, "the training loss", loss.loss, batch_idx)
        self._log_terms("train", loss, batch["input_ids"].shape[0], on_step=True)
        metrics = summarize(dspark_block_stats(blocks.valid, keep, loss))
        tau = metrics.pop("tau_sim")
        self.log_dict({f"train/{k}": v for k, v in metrics.items()}, on_step=True, on_epoch=False)
        self.log("train/tau_sim", tau, prog_bar=True, on_step=True, on_epoch=False)
        return loss.loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluation_step("val", batch, batch_idx)

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_evaluation_metrics("val")

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluation_step("test", batch, batch_idx)

    @override
    def on_test_epoch_end(self) -> None:
        self._log_evaluation_metrics("test")

    def _evaluation_step(self, prefix: str, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        # the same anchors at every evaluation: validation curves compare drafts, not anchor draws
        loss, blocks, keep = self.shared_step(batch, self.anchor_stream(batch_idx))
        self._log_terms(prefix, loss, batch["input_ids"].shape[0], on_step=False)
        self.val_metrics.update(dspark_block_stats(blocks.valid, keep, loss))

    def _log_evaluation_metrics(self, prefix: str) -> None:
        metrics = self.val_metrics.compute()  # sums are all-reduced before the division
        if int(self.val_metrics.blocks) == 0 and not self.trainer.sanity_checking:
            raise ValueError(
                f"{prefix}: no DSpark block in {int(self.val_metrics.rows)} rows (no two consecutive supervised "
                f"tokens): {prefix}/tau_sim would be 0, below its minimum of 1. Check the {prefix} data's loss mask"
            )
        tau = metrics.pop("tau_sim")
        self.log_dict({f"{prefix}/{k}": v for k, v in metrics.items()}, sync_dist=False)
        self.log(f"{prefix}/tau_sim", tau, prog_bar=True, sync_dist=False)
        self.val_metrics.reset()

    # ---- checkpoints: the drafter only (the rest: DraftTrainingModule) --------------------------------------------
    @override
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Strict on the drafter (missing or unexpected keys raise); the target is never in a checkpoint."""
        state = ckpt.draft_state(state_dict)
        if self.draft is not None:
            return self.draft.load_state_dict(state, strict=True, assign=assign)
        with torch.device("meta"):  # before configure_model: every tensor comes from the state, no random init
            draft = self._build_draft()
        result = draft.load_state_dict(state, strict=True, assign=True)
        self.draft = draft.to(dtype=DTYPES[self.draft_settings.dtype])
        return result
