"""``ExpertParallelStrategy``: data-parallel draft training against a frozen K3 target whose routed experts are
sharded over an ``expert_parallel`` mesh dimension (``k3_target.md`` §5, ``lightning_notes.md`` §2–§10).

Layout: the world is a ``(data_parallel, expert_parallel)`` mesh, ``dp = world / ep``; the ranks of one EP group are
consecutive (on GPUs: inside one node, where all-to-all is cheapest). Every rank

* gets different tokens (the sampler shards over the whole world, not only over ``data_parallel``);
* holds the non-expert target weights (FSDP2-sharded over all ranks by default when there is more than one) plus its
  contiguous slice of routed experts (the module loads them through
  :func:`~lightning_eagle.parallel.frozen_target.load_frozen_target`, which asks :meth:`expert_range`; only those
  expert bytes are read), with MoE layers exchanging tokens through the EP dispatcher;
* holds a full replica of the draft whose gradients are averaged over the world before every optimizer step
  (:meth:`optimizer_step` wraps the closure; see :mod:`lightning_eagle.parallel.grad_sync`). A draft wrapped with
  FSDP2 ``fully_shard`` in ``configure_model`` is the documented alternative: its DTensor gradients are skipped
  here and its checkpoints take ModelParallelStrategy's path.

Checkpoints hold what ``LightningModule.state_dict()`` returns — the module must leave the target out (a guard
refuses state dicts that contain it). A replicated draft is saved as one file by rank 0 with plain
``optimizer.state_dict()`` s, so it resumes on any world size.

The strategy owns the run's :class:`~lightning_eagle.parallel.layout.ParallelLayout` and implements
:class:`~lightning_eagle.parallel.layout.TargetParallelism`. The layout is validated as facts arrive — the static
settings in ``__init__``, the world size (and precision) inside ``Trainer(...)``, the target's expert count in the main
process before workers start (when the module declares its target,
:class:`~lightning_eagle.parallel.layout.HasTargetSpec`) or in :meth:`expert_range`, the device types of all ranks in
:meth:`setup_environment` — always before any target weight is read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import HalfPrecision
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_eagle.k3.target_spec import validate_target_config
from lightning_eagle.parallel.dense_shard import dense_bytes_held, has_sharded_trainable_parameters, shard_dense_weights
from lightning_eagle.parallel.dispatcher import build_dispatcher, check_dispatcher
from lightning_eagle.parallel.launcher import ExpertParallelLauncher
from lightning_eagle.parallel.layout import LAYOUT_SETTINGS, HasTargetSpec, ParallelLayout
from lightning_eagle.parallel.memory import per_rank_memory_report
from lightning_eagle.parallel.sequence_parallel import (
    SequenceShard,
    draft_sequence_parallel_mesh,
    reduce_draft_gradients,
)
from lightning_eagle.parallel.shard import enable_expert_parallel, expert_range
from lightning_eagle.text_config import config_value, text_config_of

START_METHODS = ("popen", "spawn", "fork")


class ExpertParallelStrategy(ModelParallelStrategy):
    """Expert-parallel frozen K3 target + data-parallel draft.

    Args:
        expert_parallel_size: ranks per expert-parallel group; must divide the world size and ``num_experts``.
        target_dispatcher: ``"torch"`` (all-to-all over torch.distributed; gloo and NCCL; the only implemented
            one). ``"deepep"`` / ``"hybridep"`` are reserved names that always fail at construction: with an
            ImportError naming the package when it is missing, else NotImplementedError (no integration yet) —
            never silently replaced by torch.
        target_shard_dense: split the target's dense (non-routed) weights over all ranks with FSDP2, gathered one
            layer at a time (:mod:`lightning_eagle.parallel.dense_shard`); each rank reads only its rows from disk.
            Default (None): on when the world has more than one rank. Routed experts stay expert-parallel.
        draft_sequence_parallel_size: ranks per *draft* sequence-parallel group (``sp``, default 1; must divide the
            world size). The ``sp`` consecutive ranks of a group get the same rows (the sampler shards over
            ``world / sp`` replicas), run the same target forward, and split the draft's TTT unroll over the
            sequence (:mod:`lightning_eagle.parallel.sequence_parallel`); gradients are summed over the group and
            averaged over the ``world / sp`` draft data-parallel groups (:meth:`reduce_gradients`). This is not
            target context parallelism, which stays refused.
        tensor_parallel_size, context_parallel_size, pipeline_parallel_size, sequence_packing, target_backend,
            p_eagle, target_force_hf: accepted only at their supported values (1 / False / ``"colocated"``) so that
            a config asking for them fails loudly with the setting's name.

            These layout settings are :class:`~lightning_eagle.parallel.layout.ParallelLayout`'s fields (name, type,
            default; a test keeps them equal), spelled out here because LightningCLI types
            ``--trainer.strategy.init_args.*`` from this signature.
        start_method: ``"popen"`` (default: re-run the script per rank, as for ``torchrun``-style launches),
            ``"spawn"`` or ``"fork"`` (processes started by Lightning; CPU tests, notebooks).
        save_distributed_checkpoint: only used for an FSDP2-sharded draft (one file per rank); a replicated draft
            is always saved as one file.
        process_group_backend, timeout: as for ``ModelParallelStrategy`` (backend: gloo on CPU, nccl on GPU).
    """

    def __init__(
        self,
        expert_parallel_size: int = 1,
        target_dispatcher: str = "torch",
        target_shard_dense: bool | None = None,
        draft_sequence_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        context_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        sequence_packing: bool = False,
        target_backend: str = "colocated",
        p_eagle: bool = False,
        target_force_hf: bool = False,
        start_method: str = "popen",
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        # The requested layout from the arguments that are layout settings (read off the call's locals, so the
        # field list is ParallelLayout's alone), validated now; refined with the world size in `Trainer(...)`, and
        # with the device types and the target's expert count before any weight is read.
        arguments = locals()
        self._layout = ParallelLayout(**{name: arguments[name] for name in LAYOUT_SETTINGS})
        check_dispatcher(target_dispatcher)
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is unknown; choose one of {START_METHODS}")
        self._start_method = start_method
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._dispatcher = None
        self._world_mesh = None
        self._draft_mesh = None

    # ---- layout ---------------------------------------------------------------------------------------------------
    @property
    def layout(self) -> ParallelLayout:
        """The run's layout, with every fact known so far (world size after ``Trainer(...)``, device types and
        ``num_experts`` once processes have started or the module has named its target)."""
        return self._layout

    def _refine(self, **facts: Any) -> ParallelLayout:
        self._layout = self._layout.refine(**facts)
        return self._layout

    def _refuse_half_precision(self) -> None:
        # HalfPrecision.convert_module casts the whole LightningModule — the frozen target's fp32 router bias,
        # A_log, dt_bias, conv and o_norm weights included (`lightning_notes.md` §6).
        plugin = self.precision_plugin
        if isinstance(plugin, HalfPrecision):
            raise ValueError(
                f"precision={plugin.precision!r} is not supported with ExpertParallelStrategy: it would cast the "
                "frozen K3 target's fp32 tensors (router bias, A_log, dt_bias, ...) to half precision; use "
                "precision='32-true' (target and draft dtypes are managed by the module) or 'bf16-mixed'"
            )

    def _refine_num_experts(self, num_experts: Any) -> None:
        if not isinstance(num_experts, int):
            raise ValueError(f"the target config has no integer num_experts (got {num_experts!r})")
        self._refine(num_experts=num_experts)

    def validate_target(self, config_or_path: Any, aux_layer_ids=None):
        """Gate a target (a checkpoint directory — only its ``config.json`` is read — or a config object) against
        this layout: text ``model_type`` ``kimi_linear``, valid aux ids, ``num_experts % ep == 0``. Returns the
        text config."""
        config = config_or_path
        if isinstance(config_or_path, (str, os.PathLike)):
            from lightning_eagle.k3.loader import read_config

            config = read_config(Path(config_or_path))
        validate_target_config(config, aux_layer_ids)
        text = text_config_of(config)
        self._refine_num_experts(config_value(text, "num_experts"))
        return text

    def validate_module(self, module: Any) -> None:
        """Main-process check before any worker starts, for a module that declares its target
        (:class:`~lightning_eagle.parallel.layout.HasTargetSpec`). Its spec is already validated (model type, aux
        ids), so only the layout's part remains: the expert count against ``expert_parallel_size``."""
        if isinstance(module, HasTargetSpec) and module.target_spec is not None:
            self._refine_num_experts(module.target_spec.config.num_experts)

    # ---- launch and process group -------------------------------------------------------------------------------
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        devices = self.parallel_devices or []
        self._refine(world_size=self.num_nodes * self.num_processes, device_types=[d.type for d in devices] or None)
        self._refuse_half_precision()
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = ExpertParallelLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self._setup_distributed()
        # Identical inputs on every rank → every rank fails the same way, before any collective can deadlock.
        device_types: list[str | None] = [None] * self.world_size
        dist.all_gather_object(device_types, self.root_device.type)
        ep = self._refine(world_size=self.world_size, device_types=device_types).expert_parallel_size
        self._device_mesh = init_device_mesh(
            self.root_device.type, (self.world_size // ep, ep), mesh_dim_names=("data_parallel", "expert_parallel")
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # `self.device_mesh` inside configure_model
        if ep > 1:
            self._dispatcher = build_dispatcher(self._layout.target_dispatcher, self.expert_parallel_group)
        # One flat mesh over every rank: the target's dense weights (and an FSDP2-sharded draft) split world-wide.
        self._world_mesh = init_device_mesh(self.root_device.type, (self.world_size,), mesh_dim_names=("world",))
        sp = self._layout.draft_sequence_parallel_size
        if sp > 1:
            # Consecutive ranks share a sequence (the sampler gives them the same rows: rank // sp).
            self._draft_mesh = draft_sequence_parallel_mesh(self.root_device.type, self.world_size, sp)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # EP ranks are data-parallel for the draft: every rank needs different tokens (`lightning_notes.md` §9) —
        # except the ranks of one draft sequence-parallel group, which split one sequence and so share their rows.
        sp = self._layout.draft_sequence_parallel_size
        return {"num_replicas": self.world_size // sp, "rank": self.global_rank // sp}

    # ---- draft sequence parallelism -----------------------------------------------------------------------------
    @property
    def draft_sequence_parallel_size(self) -> int:
        return self._layout.draft_sequence_parallel_size

    @property
    def draft_sequence_parallel_group(self) -> dist.ProcessGroup | None:
        """The process group of this rank's draft SP group (its ``sp`` consecutive ranks); None when ``sp == 1``
        (nothing to exchange) or before ``setup_environment``."""
        return None if self._draft_mesh is None else self._draft_mesh["draft_sequence_parallel"].get_group()

    @property
    def draft_sequence_parallel_rank(self) -> int:
        """This rank's index in its draft SP group (0 when ``sp == 1``)."""
        return self.global_rank % self._layout.draft_sequence_parallel_size

    @property
    def draft_data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same slot range of different rows (one per SP group); None when ``sp == 1`` (then
        it is the whole world)."""
        return None if self._draft_mesh is None else self._draft_mesh["draft_data_parallel"].get_group()

    def sequence_shard(self, length: int) -> SequenceShard:
        """The slots ``[start, end)`` this rank owns of a length-``length`` (post-shift) sequence."""
        return SequenceShard(self._layout.draft_sequence_parallel_size, self.draft_sequence_parallel_rank, length)

    # ---- the API LightningModule.configure_model uses -----------------------------------------------------------
    @property
    def expert_parallel_size(self) -> int:
        return self._layout.expert_parallel_size

    @property
    def ep_size(self) -> int:
        return self.device_mesh["expert_parallel"].size()

    @property
    def ep_rank(self) -> int:
        return self.device_mesh["expert_parallel"].get_local_rank()

    @property
    def expert_parallel_group(self) -> dist.ProcessGroup:
        return self.device_mesh["expert_parallel"].get_group()

    @property
    def dispatcher(self):
        """The EP dispatcher (``None`` when ``expert_parallel_size == 1``: MoE layers keep their local dispatch)."""
        return self._dispatcher

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """``(start, count)`` of the routed experts this rank loads (``from_pretrained(expert_range=...)``); refuses
        an expert count the layout cannot split before anything is read."""
        self._refine(num_experts=num_experts)
        return expert_range(num_experts, self.ep_size, self.ep_rank)

    @property
    def world_mesh(self):
        """A 1-D device mesh over all ranks (after ``setup_environment``): what FSDP2 shards over."""
        if self._world_mesh is None:
            raise RuntimeError("world_mesh needs the process group: use it after setup_environment()")
        return self._world_mesh

    def dense_sharding(self) -> Callable[[nn.Module], object] | None:
        """FSDP2 over all ranks for the dense target weights (None when they are replicated)."""
        if not self._layout.dense_sharded:
            return None
        return partial(shard_dense_weights, mesh=self.world_mesh)

    def parallelize_target(self, target: nn.Module) -> nn.Module:
        """Install the dispatcher on every MoE layer (after checking each holds this rank's slice) and print the
        per-rank memory of the target (rank 0)."""
        enable_expert_parallel(target, self._dispatcher, self.ep_size, self.ep_rank)
        config = getattr(target, "config", None)
        if config is not None:
            dtype = next((p.dtype for p in target.parameters() if p.dtype not in (torch.float32,)), torch.float32)
            report = str(per_rank_memory_report(config, self.ep_size, dtype))
            if self._layout.dense_sharded:
                held = dense_bytes_held(target)
                report += (
                    f"; dense weights FSDP2-sharded over {self.world_size} ranks: this rank holds {held / 1e9:.3f} GB "
                    "of them (plus one unit gathered at a time)"
                )
            rank_zero_info(report)
        return target

    # ---- draft gradients ----------------------------------------------------------------------------------------
    def reduce_gradients(self) -> int:
        """Average the replicated trainable parameters' gradients over the world (DTensor ones are skipped).

        With ``draft_sequence_parallel_size = sp > 1`` each rank's loss is its share of its group's sequence loss
        (the shares add up to it), so the draft's gradient is the *sum* over the SP group and the *mean* over the
        ``world / sp`` data-parallel groups: the world mean times ``sp`` (exact for powers of two). An FSDP2-sharded
        draft's gradients (averaged over the world by FSDP's reduce-scatter) get the same factor."""
        assert self.lightning_module is not None
        return reduce_draft_gradients(self.lightning_module.parameters(), self._layout.draft_sequence_parallel_size)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        # The closure runs forward + backward; averaging right after it puts the sync after the last micro-batch of
        # gradient accumulation and before `on_before_optimizer_step` and gradient clipping (which then see the
        # averaged gradients). Manual optimization reaches here from `optimizer.step()` as well.
        def closure_then_average():
            result = closure()
            self.reduce_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def _draft_is_sharded(self) -> bool:
        return has_sharded_trainable_parameters(self.model)

    def _refuse_target_in_state_dict(self, state_dict: dict[str, Any]) -> None:
        from lightning_eagle.k3.model import KimiK3ForCausalLM

        module = self.lightning_module
        prefixes = [f"{n}." for n, m in module.named_modules() if isinstance(m, KimiK3ForCausalLM)] if module else []
        leaked = [k for k in state_dict if any(k.startswith(p) for p in prefixes)]
        if leaked:
            raise RuntimeError(
                f"the LightningModule's state_dict() contains {len(leaked)} frozen-target tensor(s) (e.g. "
                f"{leaked[0]!r}): checkpoints must hold only the draft — override state_dict() to drop the target "
                "and set strict_loading=False (`lightning_notes.md` §7)"
            )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._draft_is_sharded():
            state_dict = super().lightning_module_state_dict()
        else:
            state_dict = Strategy.lightning_module_state_dict(self)
        self._refuse_target_in_state_dict(state_dict)
        return state_dict

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        if self._draft_is_sharded():
            return super().optimizer_state(optimizer)
        return Strategy.optimizer_state(self, optimizer)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._draft_is_sharded()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self._draft_is_sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        return Strategy.save_checkpoint(self, checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        if self._draft_is_sharded():
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            raise ValueError(
                f"{path} is a distributed (per-rank) checkpoint, written for an FSDP-sharded draft; this draft is "
                "replicated — convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save"
            )
        return Strategy.load_checkpoint(self, path, weights_only)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self._draft_is_sharded():
            Strategy.load_model_state_dict(self, checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if not self._draft_is_sharded():
            Strategy.load_optimizer_state_dict(self, checkpoint)
