"""``Eagle3Module``: the LightningModule that trains a K3 EAGLE-3 draft against a frozen, colocated K3 target.

One step: a no-grad target capture (aux hidden states + post-norm final hidden, autocast off) → one-token shift →
the TTT unroll with a chunked teacher (never ``[B,T,V]`` logits) → the weighted soft-CE loss. Only the draft (with
its ``d2t``/``t2d`` map) and the training state are checkpointed; the target is reloaded from its checkpoint.

Research hooks (override in a subclass; each is passed to :func:`~lightning_eagle.training.ttt_loss`):
``compute_teacher``, ``draft_step``, ``step_loss``, ``step_weights``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_eagle.checkpoint_io import AtomicCheckpointIO
from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft, build_draft
from lightning_eagle.draft.latent_attention import check_ttt_kv_cache
from lightning_eagle.draft.materialize import build_on_meta, materialize
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.errors import NonFiniteTrainingError
from lightning_eagle.features.teacher_head import TeacherHead
from lightning_eagle.k3.model import KimiK3ForCausalLM, set_token_chunk
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.k3.token_chunks import check_token_chunk
from lightning_eagle.parallel.dense_shard import gathered_weight, is_sharded, shard_draft
from lightning_eagle.parallel.frozen_target import load_frozen_target, parallelism_of, root_device
from lightning_eagle.parallel.sequence_parallel import sum_over_group
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.settings import DEFAULT_STEP_DECAY, DEFAULT_TTT_STEPS, check_settings
from lightning_eagle.training.chunked_loss import DEFAULT_LOSS_CHUNK, LOSS_BACKEND
from lightning_eagle.training.data_contract import DraftVocabulary, DumpedFeatures, run_datamodule
from lightning_eagle.training.loss import soft_cross_entropy
from lightning_eagle.training.loss import step_weights as default_step_weights
from lightning_eagle.training.metrics import TTTMetrics
from lightning_eagle.training.module_checkpoints import (
    DraftCheckpointing,
)
from lightning_eagle.training.schedule import warmup_cosine
from lightning_eagle.training.sequence_parallel_unroll import check_sequence_parallel_settings
from lightning_eagle.training.shift import shift_left
from lightning_eagle.training.teacher import ChunkedTeacher, Teacher
from lightning_eagle.training.teacher import compute_teacher as default_compute_teacher
from lightning_eagle.training.ttt import TTTOutput, checkpointed_draft_step, tau_sim, ttt_loss
from lightning_eagle.training.ttt import draft_step as default_draft_step

log = logging.getLogger(__name__)
# The frozen target is in eval mode on purpose; Lightning's "modules in eval mode" warning would only alarm users.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")

MAX_USEFUL_TTT_STEPS = 16  # past this, warn: engines draft 3-8 tokens, decay^k leaves later steps almost no weight
# Draft-config fields that are module arguments: the module's value is the only one (no second spelling in `draft`).
MODULE_DRAFT_FIELDS = {
    "ttt_steps": "ttt_steps",
    "step_decay": "step_decay",
    "aux_layer_ids": "aux_layer_ids",
    "aux_hidden_state_stream": "aux_stream",
    "draft_vocab_size": "data.draft_vocab_size (the data module builds the vocabulary map)",
}


def _refuse_second_spelling(draft: dict[str, Any] | None) -> None:
    doubled = sorted(set(draft or {}) & set(MODULE_DRAFT_FIELDS))
    if doubled:
        where = "; ".join(f"draft.{k} → set {MODULE_DRAFT_FIELDS[k]} instead" for k in doubled)
        raise ValueError(
            f"draft={{…}} repeats a setting that has its own argument ({where}): a setting has one source of truth"
        )


class Eagle3Module(DraftCheckpointing, pl.LightningModule):
    """Train a :class:`~lightning_eagle.draft.KimiK3Eagle3Draft` against a frozen K3 target.

    Args:
        target: K3 checkpoint directory (released layout) or ``"quickstart"``.
        target_source: ``"online"`` runs the frozen target every step; ``"features"`` trains from a dump
            (``cli.py dump``) read by ``HiddenStateDataModule``: no target forward, only its teacher head
            (``embed_tokens``, final norm, ``lm_head``) is loaded from ``target``.
        aux_layer_ids: the three 0-based target layers whose outputs feed ``fc``; None = ``[1, L//2-1, L-4]``.
        aux_stream: ``"prefix"`` (default; what the reference and public K3 drafts use) or ``"mixed"``.
        ttt_steps / step_decay: TTT unroll length K and step weight decay (loss = Σ decay^k L_k / Σ decay^k).
        draft: overrides of draft config fields (e.g. ``{"intermediate_size": 4096, "fc_norm": true}``).
        attention_backend: TTT attention: ``"auto"`` (per device: ``flex_attention`` on CUDA with Triton, else
            ``sdpa_mask``; ``flash_lse`` on CPU), or one by name: ``"eager"`` (the naive twin), ``"flash_lse"``,
            ``"sdpa_mask"``, ``"flex_attention"``.
        draft_activation_checkpointing: recompute each TTT step's activations in the backward (less memory at
            long T and K, one more draft forward per step; loss and gradients unchanged).
        draft_shard: FSDP2-shard the draft's trained parameters, gradients and AdamW states over all ranks
            (``ExpertParallelStrategy`` with more than one rank; the frozen embedding stays replicated). Checkpoints
            then resume only with ``draft_shard`` on.
        draft_init_seed: seeds the draft's random init (identical on every rank, independent of the global RNG).
        target_dtype / draft_dtype: the target keeps its fp32 islands whatever ``target_dtype`` is.
        target_expert_storage: ``"mxfp4"`` keeps routed experts packed in memory (~3.8x less than bf16), decoded
            per expert in the forward; ``"dequantized"`` decodes them once at load.
        lr / weight_decay / warmup_ratio / min_lr_ratio: AdamW (betas 0.9/0.95) + warmup-cosine defaults;
            ``optimizer`` / ``lr_scheduler`` callables replace them (LightningCLI ``OptimizerCallable``).
        teacher_vocab_chunk / teacher_seq_chunk: chunking of the teacher's full-vocabulary argmax.
        loss_backend: each TTT step's loss: ``"plain"`` (``lm_head`` logits, then the soft CE against ``[B,T,N_d]``
            teacher probabilities; every research hook applies) or ``"chunked"`` (fused, ``loss_chunk`` rows at a
            time, with the teacher's probabilities recomputed per chunk: no ``[B,T,N_d]`` tensor; long context).
        ttt_kv_cache: ``"expanded"`` (per-head K/V per TTT step) or ``"latent"`` (MLA's normalised latent + rope
            key, 576 values per token on the real K3 draft; pair it with ``draft_activation_checkpointing``).
        target_token_chunk: run the frozen target layer by layer in segments of this many tokens (None: the whole
            sequence at once), so its working set grows with the segment, not with T (same outputs).

    Draft sequence parallelism is the strategy's setting ``draft_sequence_parallel_size``
    (:class:`~lightning_eagle.parallel.ExpertParallelStrategy`): the ranks of a group train on the same rows (each
    runs the same target forward) and split the TTT unroll's slots, Ulysses attention between them; the module passes
    its shard to :func:`~lightning_eagle.training.ttt_loss` and logs the group's loss. Works with both loss backends
    and ``draft_activation_checkpointing``; refused with ``draft_shard``, ``target_source="features"``, ``predict``
    and ``ttt_kv_cache="latent"``. The target itself is never context-parallel.

    How ranks share the target is the strategy's business (:class:`~lightning_eagle.parallel.ParallelLayout`,
    refused layouts included); the module only asks it through :func:`load_frozen_target`.
    """

    def __init__(
        self,
        target: str = "quickstart",
        target_source: Literal["online", "features"] = "online",
        aux_layer_ids: list[int] | None = None,
        aux_stream: Literal["prefix", "mixed"] = "prefix",
        ttt_steps: int = DEFAULT_TTT_STEPS,
        step_decay: float = DEFAULT_STEP_DECAY,
        draft: dict[str, Any] | None = None,
        attention_backend: str = "auto",
        draft_activation_checkpointing: bool = False,
        draft_shard: bool = False,
        draft_init_seed: int = 0,
        target_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16",
        target_expert_storage: Literal["dequantized", "mxfp4"] = "dequantized",
        draft_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.05,
        min_lr_ratio: float = 0.1,
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        teacher_vocab_chunk: int = 16384,
        teacher_seq_chunk: int = 2048,
        loss_backend: str = "plain",
        loss_chunk: int = DEFAULT_LOSS_CHUNK,
        ttt_kv_cache: Literal["expanded", "latent"] = "expanded",
        target_token_chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        # Gates first: nothing below reads a weight.
        check_settings("model", {
            "ttt_steps": (ttt_steps, "positive", int), "step_decay": (step_decay, "positive", float),
            "draft_init_seed": (draft_init_seed, "non_negative", int), "lr": (lr, "positive", float),
            "weight_decay": (weight_decay, "non_negative", float),
            "warmup_ratio": (warmup_ratio, "fraction_below_one", float),
            "min_lr_ratio": (min_lr_ratio, "fraction", float),
            "teacher_vocab_chunk": (teacher_vocab_chunk, "positive", int),
            "teacher_seq_chunk": (teacher_seq_chunk, "positive", int),
            "loss_chunk": (loss_chunk, "positive", int),
        })  # fmt: skip
        LOSS_BACKEND.check(loss_backend)
        check_ttt_kv_cache(ttt_kv_cache)
        check_token_chunk(target_token_chunk)
        if step_decay > 1:  # later steps would outweigh the first, which every accepted draft token needs
            raise ValueError(f"model.step_decay must be in (0, 1], got {step_decay!r}")
        if ttt_steps > MAX_USEFUL_TTT_STEPS:
            warnings.warn(
                f"model.ttt_steps={ttt_steps}: engines draft 3-8 tokens and the step weights decay^k make steps past "
                f"~{MAX_USEFUL_TTT_STEPS} cost compute and memory for almost no signal",
                stacklevel=2,
            )
        _refuse_second_spelling(draft)
        # Read (config.json only) and validated once; the strategy, the feature dumper and the plan use it as is.
        self.target_spec = TargetSpec.from_checkpoint(
            target, dtype=target_dtype, expert_storage=target_expert_storage, aux_layer_ids=aux_layer_ids,
            aux_stream=aux_stream,
        )  # fmt: skip
        # Builds (and validates: GQA, NoPE, aux ids) the draft config without any weights.
        self.draft_config = self._draft_config(draft_vocab_size=None)
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.train_metrics = TTTMetrics(ttt_steps)  # created here, never under a meta-device context
        self.val_metrics = TTTMetrics(ttt_steps)
        self.target: KimiK3ForCausalLM | None = None
        self.teacher_head: TeacherHead | None = None
        self.draft: KimiK3Eagle3Draft | None = None
        self.strict_loading = False  # the checkpoint holds only the draft; `load_state_dict` checks it strictly

    # ---- the target (one spec, read-only views) --------------------------------------------------------------------
    @property
    def target_path(self):
        return self.target_spec.path

    @property
    def target_config(self):
        return self.target_spec.config

    @property
    def target_fingerprint(self) -> str:
        return self.target_spec.fingerprint

    @property
    def ttt_steps(self) -> int:
        """K, the draft steps each training position unrolls (what evaluation drafts per round by default)."""
        return self.hparams.ttt_steps

    # ---- construction ---------------------------------------------------------------------------------------------
    def _draft_config(self, draft_vocab_size: int | None) -> Eagle3DraftConfig:
        hp = self.hparams
        overrides = dict(hp.draft or {})
        overrides["draft_vocab_size"] = draft_vocab_size
        overrides["aux_hidden_state_stream"] = self.target_spec.aux_stream
        overrides["aux_layer_ids"] = list(self.target_spec.aux_layer_ids)
        return Eagle3DraftConfig.from_target_config(self.target_config, **overrides)

    def expert_range(self) -> tuple[int, int] | None:
        """This rank's slice of routed experts (None = all); an expert-parallel strategy decides."""
        return parallelism_of(self).expert_range(self.target_config.num_experts)

    @override
    def configure_model(self, vocab_mapping=None) -> None:
        """Build the frozen target (this rank's expert slice) — or, with ``target_source="features"``, only its
        teacher head — and the draft. Lightning calls it without arguments and the vocabulary map comes from the
        trainer's data module; outside a trainer pass ``vocab_mapping``."""
        if self.draft is not None:  # called once per stage (fit/validate/…): idempotent
            return
        device, hp = root_device(self), self.hparams
        if self.hparams.target_source == "features":
            head = TeacherHead.from_checkpoint(self.target_path, prenorm=self._features_prenorm(), dtype=torch.float32)
            self.teacher_head = head.to(device=device, dtype=DTYPES[self.hparams.target_dtype])
            embedding = self.teacher_head.embed_tokens
        else:
            self.target = set_token_chunk(load_frozen_target(self, self.target_spec), hp.target_token_chunk)
            embedding = self.target.model.embed_tokens.weight
        mapping = vocab_mapping if vocab_mapping is not None else self._vocab_mapping()
        self.draft_config = self._draft_config(None if mapping is None else int(mapping.selected.numel()))
        # Built on meta and allocated once on the device in its training dtype: no full fp32 host copy. Initial values
        # depend only on (draft_init_seed, parameter name): every rank and every rerun starts from the same draft.
        draft = build_on_meta(
            lambda: build_draft(self.draft_config, attention_backend=hp.attention_backend, ttt_kv_cache=hp.ttt_kv_cache)
        )
        materialize(draft, device, DTYPES[hp.draft_dtype], hp.draft_init_seed, skip=["embed_tokens.weight"])
        draft.copy_embeddings_from(embedding)  # from the target (gathered if sharded), cast on the device
        selected = mapping.selected if mapping is not None else torch.arange(self.draft_config.draft_vocab_size)
        draft.set_vocab_mapping(selected)
        if hp.draft_shard:
            shard_draft(draft, self._world_mesh())
        self.draft = draft

    def _world_mesh(self):
        strategy = self._trainer.strategy if self._trainer is not None else None
        if not isinstance(strategy, ExpertParallelStrategy) or strategy.world_size < 2:
            raise ValueError(
                "draft_shard=True shards the draft over ranks: use ExpertParallelStrategy with more than one rank "
                f"(got {type(strategy).__name__} with world size {getattr(strategy, 'world_size', 1)})"
            )
        return strategy.world_mesh

    def _features_manifest(self) -> dict[str, Any] | None:
        datamodule = run_datamodule(self._trainer)
        return datamodule.manifest if isinstance(datamodule, DumpedFeatures) else None

    def _features_prenorm(self) -> bool:
        manifest = self._features_manifest()
        return True if manifest is None else manifest["hidden_states"] == "prenorm"

    def _vocab_mapping(self):
        datamodule = run_datamodule(self._trainer)
        if not isinstance(datamodule, DraftVocabulary):
            return None
        vocab = datamodule.vocab_size
        if vocab is not None and vocab != self.target_config.vocab_size:
            raise ValueError(
                f"the data's tokenizer has {vocab} ids but the target's vocab_size is {self.target_config.vocab_size}: "
                "tokenizer and target checkpoint do not belong together"
            )
        return datamodule.vocab_mapping

    @override
    def setup(self, stage: str) -> None:
        precision = str(getattr(self.trainer, "precision", "32-true"))
        if precision in ("bf16-true", "16-true"):
            raise ValueError(
                f"trainer precision {precision!r} would cast the whole module, destroying the target's fp32 "
                "parameters and MXFP4 scales; use precision='32-true' with draft_dtype='bfloat16', or 'bf16-mixed'"
            )
        self._check_target_source()
        strategy = self.trainer.strategy
        self._check_sequence_parallel(stage)
        if type(strategy.checkpoint_io) is TorchCheckpointIO:  # the default: a kill during a save truncates the file
            strategy.checkpoint_io = AtomicCheckpointIO()

    def _check_target_source(self) -> None:
        """Features must come from this target, with these taps; online runs must not be handed features."""
        manifest = self._features_manifest()
        features = self.hparams.target_source == "features"
        if features != (manifest is not None):
            raise ValueError(
                "target_source='features' trains from dumped features: use data.class_path "
                "lightning_eagle.features.HiddenStateDataModule" if features else
                "the data module holds dumped features: set model.target_source='features' (no target forward)"
            )  # fmt: skip
        if not features:
            return
        where = f"the features in {manifest['folder']}"
        if manifest["target"]["config_sha256"] != self.target_fingerprint:
            raise ValueError(
                f"{where} were dumped from another target (config fingerprint {manifest['target']['config_sha256']}, "
                f"this target {self.target_fingerprint} at {self.target_path})"
            )
        if (
            manifest["aux_layer_ids"] != self.draft_config.aux_layer_ids
            or manifest["aux_stream"] != self.target_spec.aux_stream
        ):
            raise ValueError(
                f"{where} tap layers {manifest['aux_layer_ids']} ({manifest['aux_stream']} stream), this module "
                f"trains on {self.draft_config.aux_layer_ids} ({self.target_spec.aux_stream}): dump again or set "
                "aux_layer_ids / aux_stream to the dump's"
            )

    def _sequence_parallel_size(self) -> int:
        strategy = self._trainer.strategy if self._trainer is not None else None
        return getattr(strategy, "draft_sequence_parallel_size", 1)

    def _check_sequence_parallel(self, stage: str) -> None:
        hp = self.hparams
        check_sequence_parallel_settings(
            self._sequence_parallel_size(), num_attention_heads=self.draft_config.num_attention_heads,
            draft_shard=hp.draft_shard, target_source=hp.target_source, stage=stage,
        )  # fmt: skip

    def _sequence_shard(self, length: int):
        """``(shard, group)`` of this rank for a post-shift length, or ``(None, None)`` without sequence
        parallelism."""
        if self._sequence_parallel_size() == 1:
            return None, None
        strategy = self.trainer.strategy
        return strategy.sequence_shard(length), strategy.draft_sequence_parallel_group

    def _over_sequence_group(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Detached ``values`` summed over this rank's SP group (one all-reduce; themselves without SP): a rank's
        loss and counts are its slots' part of the group's batch."""
        values = tuple(v.detach() for v in values)
        if self._sequence_parallel_size() == 1:
            return values
        group = self.trainer.strategy.draft_sequence_parallel_group
        flat = sum_over_group(torch.cat([v.double().reshape(-1) for v in values]), group)
        parts = flat.split([v.numel() for v in values])
        return tuple(p.view(v.shape).to(v.dtype) for p, v in zip(parts, values))

    # ---- research hooks -------------------------------------------------------------------------------------------
    def compute_teacher(self, draft, loss_mask, **sources) -> Teacher | ChunkedTeacher:
        """Teacher distribution over the draft vocabulary (default: chunked from the target's final hidden).
        ``sources`` holds ``chunked=True`` with ``loss_backend="chunked"``: return a :class:`ChunkedTeacher` then."""
        return default_compute_teacher(
            draft, loss_mask, vocab_chunk=self.hparams.teacher_vocab_chunk, seq_chunk=self.hparams.teacher_seq_chunk,
            **sources,
        )  # fmt: skip

    def draft_step(self, draft, input_ids, hidden, attention_mask, cache) -> torch.Tensor:
        """One TTT step of the draft; with ``draft_activation_checkpointing`` its activations are recomputed in the
        backward (K steps' attention/MLP intermediates are never held at once)."""
        if self.hparams.draft_activation_checkpointing and torch.is_grad_enabled():
            return checkpointed_draft_step(draft, input_ids, hidden, attention_mask, cache)
        return default_draft_step(draft, input_ids, hidden, attention_mask, cache)

    def step_loss(self, logits, target_probs, position_mask) -> torch.Tensor:
        """Per-step loss L_k (default: soft CE divided by the number of supervised positions)."""
        return soft_cross_entropy(logits, target_probs, position_mask)

    def step_weights(self, ttt_steps: int, decay: float) -> torch.Tensor:
        """Unnormalised step weights (default ``decay**k``); the loss divides by their sum."""
        return default_step_weights(ttt_steps, decay)

    # ---- steps ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, batch: dict[str, torch.Tensor]):
        """The frozen target's forward: fp32 router/softmax islands stay fp32 (autocast disabled)."""
        with torch.autocast(device_type=self.device.type, enabled=False):
            return self.target.capture(
                batch["input_ids"], batch["attention_mask"], aux_layer_ids=list(self.target_spec.aux_layer_ids),
                aux_stream=self.target_spec.aux_stream,
            )  # fmt: skip

    def target_features(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(aux_hidden_states, post-norm final hidden, lm_head weight)`` for a batch: from the target's forward, or
        from the dumped features (pre-norm hidden normed by the teacher head)."""
        if self.hparams.target_source == "online":
            cap = self.capture(batch)
            return cap.aux_hidden_states, cap.final_hidden, self.target.lm_head.weight
        head, dtype = self.teacher_head, self.teacher_head.lm_head.dtype
        final = head.final_hidden(batch["hidden_states"].to(dtype), stored_prenorm=self._features_prenorm())
        return batch["aux_hidden_states"].to(dtype), final, head.lm_head

    def shared_step(self, batch: dict[str, torch.Tensor], return_argmax: bool = False) -> TTTOutput:
        aux_hidden_states, final_hidden, lm_head_weight = self.target_features(batch)
        attention_mask = batch["attention_mask"]
        # Under draft sequence parallelism every rank of the group holds this whole batch (same rows, same target
        # forward) and unrolls only its slots; the loss it returns is its share of the group's.
        shard, group = self._sequence_shard(batch["input_ids"].shape[1])
        return ttt_loss(
            self.draft,
            shift_left(batch["input_ids"]),
            attention_mask,  # aux states and the attention mask are not shifted
            shift_left(batch["loss_mask"]),
            aux_hidden_states,
            final_hidden=shift_left(final_hidden),
            lm_head_weight=lm_head_weight,
            teacher_fn=self._teacher_with_full_head,
            draft_step_fn=self.draft_step,
            step_loss_fn=self._step_loss_fn(),
            step_weights_fn=self.step_weights,
            ttt_steps=self.hparams.ttt_steps,
            step_decay=self.hparams.step_decay,
            return_argmax=return_argmax,
            loss_backend=self.hparams.loss_backend,
            loss_chunk=self.hparams.loss_chunk,
            sequence_shard=shard,
            sequence_group=group,
        )

    def _step_loss_fn(self):
        """``step_loss`` as ``ttt_loss`` takes it: the library's own function unless a subclass overrides the hook
        (the chunked loss backend fuses exactly that function and refuses any other)."""
        return soft_cross_entropy if type(self).step_loss is Eagle3Module.step_loss else self.step_loss

    def _teacher_with_full_head(self, draft, loss_mask, **sources) -> Teacher | ChunkedTeacher:
        """:meth:`compute_teacher` with the target's ``lm_head`` gathered for its duration (dense-sharded target)."""
        if self.target is None or sources.get("lm_head_weight") is None:
            return self.compute_teacher(draft, loss_mask, **sources)
        with gathered_weight(self.target.lm_head) as weight:
            return self.compute_teacher(draft, loss_mask, **{**sources, "lm_head_weight": weight})

    def _log_step(self, prefix: str, out: TTTOutput, batch_size: int, on_step: bool) -> None:
        # the SP group's batch loss, not this rank's share of it (the same value on every rank of the group)
        loss, per_step = self._over_sequence_group(out.loss, out.per_step_loss)
        values = {f"{prefix}/ploss_{k}": v for k, v in enumerate(per_step)}
        self.log_dict(
            values, on_step=on_step, on_epoch=not on_step, batch_size=batch_size, sync_dist=not on_step, prog_bar=False
        )
        self.log(
            f"{prefix}/loss",
            loss,
            prog_bar=True,
            on_step=on_step,
            on_epoch=not on_step,
            batch_size=batch_size,
            sync_dist=not on_step,
        )

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.shared_step(batch)
        self._stop_unless_finite("the training loss", out.loss, batch_idx)
        self._log_step("train", out, batch["input_ids"].shape[0], on_step=True)
        batch_tau = tau_sim(*self._over_sequence_group(out.step_prefix_hits, out.step_valid))
        self.log("train/tau_sim_batch", batch_tau, prog_bar=True, on_step=True, on_epoch=False)
        self.train_metrics.update(out)
        return out.loss

    def _stop_unless_finite(self, what: str, value: torch.Tensor, batch_idx: int) -> None:
        """Stop the run when ``value`` is NaN/inf on any rank: a step on it makes the draft garbage, which the run
        would otherwise checkpoint and export with exit 0. Checked on the loss (before backward), the gradient norm
        (before the optimizer step) and the updated weights (before any callback can save them)."""
        finite = bool(torch.isfinite(value.detach()).all())
        if self._trainer is not None:  # every rank decides together, or the others hang in the next collective
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            shown = value.detach().float().flatten()[:1].item() if value.numel() else value
            raise NonFiniteTrainingError(
                f"{what} is not finite ({shown}) at global step {self.global_step} (batch {batch_idx}, on this or "
                "another rank): the run is stopped, nothing of this step is checkpointed or exported. Usual causes: "
                "a learning rate that diverges, corrupted or mismatched features, NaN/inf in the inputs; resume from "
                "the last good checkpoint once fixed"
            )

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

    @override
    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad for p in self.draft.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            self._stop_unless_finite("the draft's gradient norm", norm, self.trainer.fit_loop.batch_idx)
            self.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False)

    @override
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # a finite gradient times a huge learning rate can still overflow the weights; stop before a checkpoint
        local = [(p.to_local() if is_sharded(p) else p).detach() for p in self.trainable_parameters()]  # DTensor shards
        total = torch.stack([t.float().abs().sum() for t in local]).sum()
        self._stop_unless_finite("the sum of |updated draft weights|", total, batch_idx)

    # ---- optimisation ---------------------------------------------------------------------------------------------
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Only the draft's trainable parameters (the frozen embedding copy is excluded)."""
        return [p for p in self.draft.parameters() if p.requires_grad]

    @override
    def configure_optimizers(self):
        params = self.trainable_parameters()
        if self.optimizer_factory is not None:
            optimizer = self.optimizer_factory(params)
        else:
            optimizer = torch.optim.AdamW(
                params, lr=self.hparams.lr, betas=(0.9, 0.95), weight_decay=self.hparams.weight_decay
            )
        if self.scheduler_factory is not None:
            scheduler = self.scheduler_factory(optimizer)
        else:
            total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1
            scheduler = warmup_cosine(optimizer, total, self.hparams.warmup_ratio, self.hparams.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
