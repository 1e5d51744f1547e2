"""``Eagle3Module``: the LightningModule that trains a K3 EAGLE-3 draft against a frozen, colocated K3 target.

One step: the target's outputs (a no-grad forward, or dumped features: :mod:`~lightning_eagle.training.target_source`)
→ one-token shift → the TTT unroll with a chunked teacher (never ``[B,T,V]`` logits) → the weighted soft-CE loss. Only
the draft (with its ``d2t``/``t2d`` map) and the training state are checkpointed
(:mod:`~lightning_eagle.training.draft_checkpoint`); the target is reloaded from its checkpoint.

Research hooks (override in a subclass; each is passed to :func:`~lightning_eagle.training.ttt_loss`):
``compute_teacher``, ``draft_step``, ``step_loss``, ``step_weights``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft, build_draft
from lightning_eagle.draft.export import EAGLE3
from lightning_eagle.draft.materialize import build_on_meta, materialize
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.dense_shard import shard_draft
from lightning_eagle.parallel.frozen_target import root_device
from lightning_eagle.parallel.layout import draft_mesh
from lightning_eagle.run_settings import (
    MODEL_GROUPS,
    DraftSettings,
    ObjectiveSettings,
    OptimizationSettings,
    TargetSettings,
    check_draft_sequence_parallel,
)
from lightning_eagle.training import data_contract
from lightning_eagle.training import draft_checkpoint as ckpt
from lightning_eagle.training.draft_training import DraftTrainingModule
from lightning_eagle.training.finite import stop_unless_finite
from lightning_eagle.training.loss import soft_cross_entropy
from lightning_eagle.training.loss import step_weights as default_step_weights
from lightning_eagle.training.metrics import TTTMetrics
from lightning_eagle.training.run_gates import refuse_unshardable_draft, refuse_unsupported_target_run
from lightning_eagle.training.sequence_parallel_unroll import sum_over_sp_group
from lightning_eagle.training.shift import shift_left
from lightning_eagle.training.target_source import target_source
from lightning_eagle.training.teacher import ChunkedTeacher, Teacher
from lightning_eagle.training.teacher import compute_teacher as default_compute_teacher
from lightning_eagle.training.ttt import TTTOutput, checkpointed_draft_step, tau_sim, ttt_loss
from lightning_eagle.training.ttt import draft_step as default_draft_step

# The frozen target is in eval mode on purpose; Lightning's "modules in eval mode" warning would only alarm users.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


class Eagle3Module(DraftTrainingModule):
    """Train a :class:`~lightning_eagle.draft.KimiK3Eagle3Draft` against a frozen K3 target.

    Args (each a group of ``model:`` in a run config, validated when it is made: :mod:`lightning_eagle.run_settings`):
        target: the frozen K3 (``path``, ``source`` online or dumped features, taps, dtype, expert storage,
            ``token_chunk``).
        draft: the draft (config overrides, TTT attention backend, K/V cache, activation checkpointing, FSDP2
            sharding, init seed, dtype).
        objective: the TTT objective (``ttt_steps``, ``step_decay``, loss backend and chunks).
        optimization: AdamW + warmup-cosine; ``optimizer`` / ``lr_scheduler`` callables replace them (LightningCLI
            ``OptimizerCallable``).

    The strategy places the target (:class:`~lightning_eagle.parallel.TargetParallelism`: expert slices, FSDP2 dense
    shards) and the draft (:class:`~lightning_eagle.parallel.layout.DraftPlacement`: sequence parallelism, the
    mesh an FSDP2-sharded draft splits over); refused layouts are the strategy's business. What it shares with the
    DSpark family (settings, target source, optimizer, checkpoints): :class:`~lightning_eagle.training.
    draft_training.DraftTrainingModule`.
    """

    family = EAGLE3
    settings_groups = MODEL_GROUPS

    def __init__(
        self,
        target: TargetSettings = TargetSettings(),
        draft: DraftSettings = DraftSettings(),
        objective: ObjectiveSettings = ObjectiveSettings(),
        optimization: OptimizationSettings = OptimizationSettings(),
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        groups = {"target": target, "draft": draft, "objective": objective, "optimization": optimization}
        super().__init__(groups, optimizer, lr_scheduler)
        self.train_metrics = TTTMetrics(self.objective.ttt_steps)  # created here, never under a meta-device context
        self.val_metrics = TTTMetrics(self.objective.ttt_steps)
        self.draft: KimiK3Eagle3Draft | None = None

    @property
    def ttt_steps(self) -> int:
        """K, the draft steps each training position unrolls (what evaluation drafts per round by default)."""
        return self.objective.ttt_steps

    @property
    def num_draft_tokens(self) -> int:
        return self.objective.ttt_steps

    def training_record(self) -> dict[str, Any]:
        return {"ttt_steps": self.objective.ttt_steps, "step_decay": self.objective.step_decay}

    # ---- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def run_spec(cls, groups, config=None) -> tuple[TargetSpec, Eagle3DraftConfig]:
        # Read (config.json only) and validated once; the strategy, the feature dumper and the plan use it as is.
        try:
            spec = TargetSpec.from_settings(groups["target"], config=config)
        except ValueError as err:
            raise ValueError(f"model.target: {err}") from None
        try:
            return spec, _draft_config(spec, groups["draft"], draft_vocab_size=None)  # validated without any weight
        except (TypeError, ValueError) as err:  # TypeError: an unknown field
            raise ValueError(f"model.draft.config: {err}") from None

    def _build_draft(self, draft_vocab_size: int | None) -> KimiK3Eagle3Draft:
        self.draft_config = _draft_config(self.target_spec, self.draft_settings, draft_vocab_size)
        settings = self.draft_settings
        return build_draft(self.draft_config, settings.attention_backend, settings.kv_cache,
                           settings.activation_checkpointing)  # fmt: skip

    @override
    def configure_model(self, vocab_mapping=None) -> None:
        """Build the target source (this rank's expert slice of the frozen K3, or the teacher head of dumped
        features) and the draft. Lightning calls it without arguments and the vocabulary map comes from the trainer's
        data module; outside a trainer pass ``vocab_mapping``."""
        if self.draft is not None:  # called once per stage (fit/validate/…): idempotent
            return
        device, settings = root_device(self), self.draft_settings
        self.source = target_source(self, self.target_spec, self.target_settings, device)
        mapping = vocab_mapping if vocab_mapping is not None else self._data_vocabulary()
        # Built on meta and allocated once on the device in its training dtype: no full fp32 host copy. Initial values
        # depend only on (init_seed, parameter name): every rank and every rerun starts from the same draft.
        draft = build_on_meta(lambda: self._build_draft(None if mapping is None else int(mapping.selected.numel())))
        materialize(draft, device, DTYPES[settings.dtype], settings.init_seed, skip=["embed_tokens.weight"])
        draft.copy_embeddings_from(self.source.embedding())  # from the target (gathered if sharded), on the device
        draft.set_vocab_mapping(
            mapping.selected if mapping is not None else torch.arange(self.draft_config.draft_vocab_size)
        )
        self.start_draft(draft)
        if settings.shard:
            shard_draft(draft, draft_mesh(self._trainer), compute_dtype=self.master_compute_dtype)
        self.draft = draft

    def _data_vocabulary(self):
        return data_contract.vocab_mapping(self._trainer, self.target_spec.config.vocab_size)

    def refuse_unsupported_run(self, stage: str) -> None:
        refuse_unsupported_target_run(self)
        check_draft_sequence_parallel(
            self.placement.draft_sequence_parallel_size, num_attention_heads=self.draft_config.num_attention_heads,
            draft=self.draft_settings, target_source=self.target_settings.source, stage=stage,
        )  # fmt: skip
        refuse_unshardable_draft(self)

    # ---- research hooks -------------------------------------------------------------------------------------------
    def compute_teacher(self, draft, loss_mask, **sources) -> Teacher | ChunkedTeacher:
        """Teacher distribution over the draft vocabulary (default: chunked from the target's final hidden).
        ``sources`` holds ``chunked=True`` with ``loss_backend="chunked"``: return a :class:`ChunkedTeacher` then."""
        return default_compute_teacher(
            draft, loss_mask, vocab_chunk=self.objective.teacher_vocab_chunk,
            seq_chunk=self.objective.teacher_seq_chunk, **sources,
        )  # fmt: skip

    def draft_step(self, draft, input_ids, hidden, attention_mask, cache) -> torch.Tensor:
        """One TTT step of the draft; a draft built with ``activation_checkpointing`` (``model.draft.
        activation_checkpointing``, as every family's drafter) has its activations recomputed in the backward (K
        steps' attention/MLP intermediates are never held at once)."""
        if getattr(draft, "activation_checkpointing", False) and torch.is_grad_enabled():
            return checkpointed_draft_step(draft, input_ids, hidden, attention_mask, cache)
        return default_draft_step(draft, input_ids, hidden, attention_mask, cache)

    def step_loss(self, logits, target_probs, position_mask) -> torch.Tensor:
        """Per-step loss L_k (default: soft CE divided by the number of supervised positions)."""
        return soft_cross_entropy(logits, target_probs, position_mask)

    def step_weights(self, ttt_steps: int, decay: float) -> torch.Tensor:
        """Unnormalised step weights (default ``decay**k``); the loss divides by their sum."""
        return default_step_weights(ttt_steps, decay)

    # ---- steps ----------------------------------------------------------------------------------------------------
    def shared_step(self, batch: dict[str, torch.Tensor], return_argmax: bool = False) -> TTTOutput:
        aux_hidden_states, final_hidden, lm_head_weight = self.source.features(batch)
        # Under draft sequence parallelism every rank of the group holds this whole batch (same rows, same target
        # forward) and unrolls only its slots; the loss it returns is its share of the group's.
        placement, objective = self.placement, self.objective
        return ttt_loss(
            self.draft,
            shift_left(batch["input_ids"]),
            batch["attention_mask"],
            shift_left(batch["loss_mask"]),
            aux_hidden_states,
            final_hidden=shift_left(final_hidden),
            lm_head_weight=lm_head_weight,
            teacher_fn=self._teacher_with_full_head,
            draft_step_fn=self.draft_step,
            # the library's own step loss unless a subclass overrides it (the chunked backend fuses exactly that one)
            step_loss_fn=soft_cross_entropy if type(self).step_loss is Eagle3Module.step_loss else self.step_loss,
            step_weights_fn=self.step_weights,
            ttt_steps=objective.ttt_steps,
            step_decay=objective.step_decay,
            return_argmax=return_argmax,
            loss_backend=objective.loss_backend,
            loss_chunk=objective.loss_chunk,
            sequence_shard=placement.sequence_shard(batch["input_ids"].shape[1]),
            sequence_group=placement.draft_sequence_parallel_group,
        )  # fmt: skip

    def _teacher_with_full_head(self, draft, loss_mask, **sources) -> Teacher | ChunkedTeacher:
        """:meth:`compute_teacher` with the target's whole ``lm_head`` for its duration (dense-sharded target)."""
        if sources.get("lm_head_weight") is None:
            return self.compute_teacher(draft, loss_mask, **sources)
        with self.source.full_lm_head(sources["lm_head_weight"]) as weight:
            return self.compute_teacher(draft, loss_mask, **{**sources, "lm_head_weight": weight})

    def _over_group(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return sum_over_sp_group(values, self.placement.draft_sequence_parallel_group)

    def _log_step(self, prefix: str, out: TTTOutput, batch_size: int, on_step: bool) -> None:
        # the SP group's batch loss, not this rank's share of it (the same value on every rank of the group)
        loss, per_step = self._over_group(out.loss, out.per_step_loss)
        options = dict(on_step=on_step, on_epoch=not on_step, batch_size=batch_size, sync_dist=not on_step)
        self.log_dict({f"{prefix}/ploss_{k}": v for k, v in enumerate(per_step)}, prog_bar=False, **options)
        self.log(f"{prefix}/loss", loss, prog_bar=True, **options)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.shared_step(batch)
        stop_unless_finite(self, "the training loss", out.loss, batch_idx)
        self._log_step("train", out, batch["input_ids"].shape[0], on_step=True)
        batch_tau = tau_sim(*self._over_group(out.step_prefix_hits, out.step_valid))
        self.log("train/tau_sim_batch", batch_tau, prog_bar=True, on_step=True, on_epoch=False)
        self.train_metrics.update(out)
        return out.loss

    @override
    def on_train_epoch_end(self) -> None:
        self.log_dict({f"train/{k}": v for k, v in self.train_metrics.compute().items()}, sync_dist=False)
        self.train_metrics.reset()

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluation_step("val", batch)

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_evaluation_metrics("val")

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluation_step("test", batch)

    @override
    def on_test_epoch_end(self) -> None:
        self._log_evaluation_metrics("test")

    def _evaluation_step(self, prefix: str, batch: dict[str, torch.Tensor]) -> None:
        out = self.shared_step(batch)
        self._log_step(prefix, out, batch["input_ids"].shape[0], on_step=False)
        self.val_metrics.update(out)

    def _log_evaluation_metrics(self, prefix: str) -> None:
        metrics = self.val_metrics.compute()  # counts are all-reduced before the division
        tau = metrics.pop("tau_sim")
        self.log_dict({f"{prefix}/{k}": v for k, v in metrics.items()}, sync_dist=False)
        self.log(f"{prefix}/tau_sim", tau, prog_bar=True, sync_dist=False)
        self.val_metrics.reset()

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """The draft's TTT proposals for a batch: ``draft_tokens [K,B,T]`` (target ids; slot t at step k proposes
        the token after ``input_ids[t+k+1]``), the target's greedy tokens ``target_tokens [B,T]`` (same alignment
        as step 0) and the per-step counts behind ``tau_sim``."""
        out = self.shared_step(batch, return_argmax=True)
        return {
            "draft_tokens": self.draft.selected_token_ids[out.draft_argmax],
            "target_tokens": out.teacher.top,
            "per_step_accuracy": out.per_step_accuracy,
            "tau_sim": out.tau_sim,
        }

    # ---- checkpoints: the draft only (the rest: DraftTrainingModule) -----------------------------------------------
    @override
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Strict on the draft (missing or unexpected draft keys raise); the target is never in a checkpoint."""
        return ckpt.load_draft(self, state_dict, self._data_vocabulary(), assign)


def _draft_config(spec: TargetSpec, draft: DraftSettings, draft_vocab_size: int | None) -> Eagle3DraftConfig:
    return Eagle3DraftConfig.from_target_config(
        spec.config, **draft.config, draft_vocab_size=draft_vocab_size, aux_stream=spec.aux_stream,
        aux_layer_ids=list(spec.aux_layer_ids),
    )  # fmt: skip
