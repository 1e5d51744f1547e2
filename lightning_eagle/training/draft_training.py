"""``DraftTrainingModule``: what every draft family's LightningModule shares, so each has one home — and the
training layer's record of a family: a subclass that sets ``family`` (the name of its
:class:`~lightning_eagle.draft.family.DraftFamily`) is registered by that name when it is defined
(:func:`training_family` looks it up). It shares:

* the run's settings groups, made into their types and saved as plain hyperparameters;
* the frozen target's source (:mod:`~lightning_eagle.training.target_source`), its expert slice and the draft's
  placement (the strategy decides both);
* ``setup``'s refusals (the family's :meth:`refuse_unsupported_run`) and the atomic checkpoint writer;
* the finite-value stops on the gradient norm and the updated weights, AdamW + warmup-cosine (or the callables of a
  run config), the learning-rate and gradient-norm logs;
* checkpoints that hold the draft only (:mod:`~lightning_eagle.training.draft_checkpoint`), the random streams and
  loop counters a resume restores.

``model.class_path`` of a run config picks the family (LightningCLI's subclass mode over this class); a family
defines its ``settings_groups``, how its run spec is made (:meth:`run_spec`: the module and the memory plan call the
same), its decoding K (:attr:`num_draft_tokens`), builds its draft in ``configure_model`` and may add to what its
checkpoint records (:meth:`training_record`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.seed import _set_rng_states
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_eagle import checkpoint_keys as keys
from lightning_eagle.checkpoint_io import AtomicCheckpointIO
from lightning_eagle.draft.family import LayerRecords, default_family, load_all_families
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.parallel.frozen_target import parallelism_of
from lightning_eagle.parallel.layout import DraftPlacement, draft_placement
from lightning_eagle.run_settings import DraftTrainingSettings, as_settings
from lightning_eagle.training import draft_checkpoint as ckpt
from lightning_eagle.training.finite import stop_unless_finite, updated_weights_sum
from lightning_eagle.training.master_weights import MasterWeights
from lightning_eagle.training.resume import micro_batch_rows, rescale_epoch_progress, rng_states_from_checkpoint
from lightning_eagle.training.schedule import warmup_cosine
from lightning_eagle.training.target_source import OnlineTarget, TargetSource
from lightning_eagle.training.warm_start import check_same_draft, read_draft_start, start_draft_from

TRAINING_FAMILIES = LayerRecords("training", "LightningModule")


def training_family(name: str, source: str = "the checkpoint") -> type[DraftTrainingModule]:
    """The LightningModule class registered for the draft family ``name`` (its records loaded first)."""
    return TRAINING_FAMILIES.named(name, source)


def module_class(class_path: str | None) -> type[DraftTrainingModule] | None:
    """The draft-training module a ``model.class_path`` names (a dotted path, or the class name of a registered
    family's module or one of its subclasses); None: the default family's when unset, None when not resolvable here
    (LightningCLI then says why)."""
    if class_path is None:
        return training_family(default_family().name)
    module_name, _, name = class_path.rpartition(".")
    if module_name:
        try:
            found = getattr(importlib.import_module(module_name), name, None)
        except ImportError:
            return None
        return found if isinstance(found, type) and issubclass(found, DraftTrainingModule) else None
    load_all_families()  # a family's module named by its class name alone
    pending, seen = [DraftTrainingModule], set()
    while pending:  # every subclass defined so far (a family's module, a researcher's subclass of one)
        kind = pending.pop()
        if kind.__name__ == name:
            return kind
        seen.add(kind)
        pending += [k for k in kind.__subclasses__() if k not in seen]
    return None


class DraftTrainingModule(pl.LightningModule):
    """The shared part of a draft-training LightningModule against a frozen K3 (module docstring).

    Subclasses set :attr:`family` and :attr:`settings_groups` (``model.<group>`` → settings type), implement
    :meth:`run_spec` (called in ``__init__``: ``target_spec``, ``draft_config``), :attr:`num_draft_tokens`, build
    ``source`` / ``draft`` in ``configure_model``, and implement :meth:`refuse_unsupported_run` and
    ``load_state_dict``."""

    family: ClassVar[str | None] = None  # the family's name: set by the family's module, inherited by its subclasses
    settings_groups: ClassVar[Mapping[str, type]]  # model.<group> → the family's settings type (no default: its own)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("family")
        if name is not None:  # the family's own class (a researcher's subclass inherits the name, not the record)
            if not isinstance(getattr(cls, "settings_groups", None), Mapping):
                raise TypeError(f"{cls.__name__} (draft family {name!r}) must set settings_groups: model.<group> → its "
                                "settings type")  # fmt: skip
            draft = cls.settings_groups.get("draft")
            if not (isinstance(draft, type) and issubclass(draft, DraftTrainingSettings)):
                raise TypeError(f"{cls.__name__} (draft family {name!r}): settings_groups['draft'] must derive from "
                                f"run_settings.DraftTrainingSettings (dtype, shard, init_seed, master_weights, "
                                f"init_from: what every family's draft has), got {draft!r}")  # fmt: skip
            known = TRAINING_FAMILIES.get(name)
            if known is not None and (known.__module__, known.__qualname__) == (cls.__module__, cls.__qualname__):
                TRAINING_FAMILIES.pop(name)  # the same class defined again (its module imported twice): the newer
            TRAINING_FAMILIES.register(name, cls)

    def __init__(
        self,
        groups: Mapping[str, Any],
        optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        super().__init__()
        groups = {name: as_settings(name, value, self.settings_groups) for name, value in groups.items()}
        # plain values in the checkpoint (loadable with weights_only, readable in hparams.yaml); a mapping makes them
        self.save_hyperparameters({k: json.loads(json.dumps(dataclasses.asdict(v))) for k, v in groups.items()})
        self.target_settings, self.draft_settings = groups["target"], groups["draft"]
        self.objective, self.optimization = groups["objective"], groups["optimization"]
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.source: TargetSource | None = None
        self.draft: torch.nn.Module | None = None
        self.strict_loading = False  # the checkpoint holds only the draft; `load_state_dict` checks it strictly
        self.target_spec, self.draft_config = self.run_spec(groups)  # each validated once, before any weight
        self.draft_origin: dict[str, Any] | None = None  # where model.draft.init_from started the draft
        if (warning := self.draft_settings.pure_low_precision_warning()) is not None:
            rank_zero_warn(warning)

    @property
    def target(self):
        """The frozen K3 (None before ``configure_model`` and when training from dumped features)."""
        return self.source.model if isinstance(self.source, OnlineTarget) else None

    @property
    def placement(self) -> DraftPlacement:
        return draft_placement(self._trainer.strategy if self._trainer is not None else None)

    @property
    def master_compute_dtype(self) -> torch.dtype | None:
        """The dtype a draft with fp32 masters computes in (None: its parameters are what it computes with)."""
        return DTYPES[self.draft_settings.dtype] if self.draft_settings.master_copy else None

    def expert_range(self) -> tuple[int, int] | None:
        """This rank's slice of routed experts (None = all); an expert-parallel strategy decides."""
        return parallelism_of(self).expert_range(self.target_spec.num_experts)

    # ---- what a family says ---------------------------------------------------------------------------------------
    @classmethod
    def run_spec(cls, groups: Mapping[str, Any], config=None) -> tuple[Any, Any]:
        """``(TargetSpec, draft config)`` of a run's settings ``groups`` (typed), each validated once. ``config``: the
        target's text config standing in for a checkpoint folder that is not on this machine (the memory plan)."""
        raise NotImplementedError

    @property
    def num_draft_tokens(self) -> int:
        """K: the tokens the family's decoding drafts per verify by default (the acceptance callback's default)."""
        raise NotImplementedError

    def refuse_unsupported_run(self, stage: str) -> None:
        """Raise ``ValueError`` naming the setting when this run cannot train (or ``stage``) as configured."""
        raise NotImplementedError

    def training_record(self) -> dict[str, Any]:
        """How the draft was trained, as its checkpoint and export record it (default: nothing)."""
        return {}

    def start_draft(self, draft: torch.nn.Module) -> None:
        """Give ``draft`` (built, whole) the weights of ``model.draft.init_from`` when set (a family's
        ``configure_model`` calls this before sharding): the same draft is checked first, the start is recorded. A
        resumed run keeps the origin its checkpoint records (its weights come from the checkpoint)."""
        path = self.draft_settings.init_from
        if path is None or (self._trainer is not None and self.trainer.ckpt_path is not None):
            return
        start = read_draft_start(path)
        check_same_draft(start, self.family, self.draft_config.to_dict())
        start_draft_from(draft, start)
        self.draft_origin = start.record()

    def checkpoint_record(self) -> dict[str, Any]:
        """What a checkpoint records of the draft besides its tensors (family, config, :meth:`training_record`)."""
        return ckpt.draft_record(self)

    def check_resume(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint this run cannot continue (another family, target or draft), naming both values."""
        ckpt.check_resume(self, checkpoint)

    # ---- run ------------------------------------------------------------------------------------------------------
    @override
    def setup(self, stage: str) -> None:
        self.refuse_unsupported_run(stage)  # before any weight is read
        if type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # a kill during a save truncates the file
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def rows_rank(self) -> int:
        """The data-parallel rank that owns this rank's rows (what the resumable sampler shards by)."""
        if self._trainer is None:
            return 0
        return int((self.trainer.distributed_sampler_kwargs or {}).get("rank", self.global_rank))

    @override
    def on_before_optimizer_step(self, optimizer) -> None:
        grads = [p.grad for p in self.draft.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            stop_unless_finite(self, "the draft's gradient norm", norm, self.trainer.fit_loop.batch_idx)
            self.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        self.log("train/lr", optimizer.param_groups[0]["lr"], on_step=True, on_epoch=False)

    @override
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # a finite gradient times a huge learning rate can still overflow the weights; stop before a checkpoint
        stop_unless_finite(self, "the sum of |updated draft weights|", updated_weights_sum(self), batch_idx)

    # ---- optimisation ---------------------------------------------------------------------------------------------
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Only the draft's trainable parameters (a frozen embedding copy is excluded)."""
        return [p for p in self.draft.parameters() if p.requires_grad]

    @override
    def configure_optimizers(self):
        params, opt = self.trainable_parameters(), self.optimization

        def make(params):
            if self.optimizer_factory is not None:
                return self.optimizer_factory(params)
            return torch.optim.AdamW(params, lr=opt.lr, betas=(0.9, 0.95), weight_decay=opt.weight_decay)

        # a sharded draft's masters are its fp32 shards (FSDP2's mixed-precision policy): a plain optimizer over them
        replicated_master = self.draft_settings.master_copy and not self.draft_settings.shard
        if replicated_master:  # masters and their states partitioned over the ranks (ZeRO-1) when there are several
            world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
            optimizer = MasterWeights(params, make, group=world)
        else:
            optimizer = make(params)
        if self.scheduler_factory is not None:
            scheduler = self.scheduler_factory(optimizer)
        else:
            total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1
            scheduler = warmup_cosine(optimizer, total, opt.warmup_ratio, opt.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- checkpoints: the draft only ------------------------------------------------------------------------------
    @override
    def state_dict(self, *args, **kwargs):
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        return ckpt.draft_only(super().state_dict(*args, **kwargs), prefix)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint.update(self.checkpoint_record())
        checkpoint.update(ckpt.checkpoint_extras(self, micro_batch_rows(self.trainer)))

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.check_resume(checkpoint)  # brings the keys of an older layout to the shared ones first
        self.draft_origin = checkpoint.get(keys.DRAFT_ORIGIN, self.draft_origin)
        if keys.RNG_STATES in checkpoint and self._trainer is not None and self.trainer.state.fn == "fit":
            _set_rng_states(rng_states_from_checkpoint(checkpoint[keys.RNG_STATES]))
        if self._trainer is not None:  # another world size or batch size: loop counters in this run's micro-batches
            rescale_epoch_progress(checkpoint, micro_batch_rows(self.trainer))
