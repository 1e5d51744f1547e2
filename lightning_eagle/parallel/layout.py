"""The parallel layout of one run, and the contract between a training module and the strategy that owns it.

``ParallelLayout`` is the one object that says how the frozen target and the draft are placed over ranks, and its
fields are the one list of layout settings (the strategy's keyword arguments and the validator follow it). Every
instance is valid: the constructor runs :func:`validate_layout`, and facts that are not known yet (the world size
before ``Trainer(...)``, the expert count before the module names its target) are ``None`` — never a placeholder. A
strategy *refines* its layout as facts arrive (:meth:`ParallelLayout.refine`), so a refused setting fails at the first
moment it can be judged and always before any target weight is read.

The contract, both ways:

* ``TargetParallelism``: what a draft-training module / ``FeatureDumper`` ask of the strategy.
  ``ExpertParallelStrategy`` implements it; any other strategy gets :class:`ReplicatedTarget` (every rank loads the
  whole target) through :func:`target_parallelism`.
* ``HasTargetSpec``: what the strategy asks of the module before any worker starts — its already validated
  :class:`~lightning_eagle.k3.target_spec.TargetSpec`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import nn

from lightning_eagle.parallel.validate import DISPATCHERS, UnsupportedLayoutError

if TYPE_CHECKING:
    from lightning_eagle.k3.target_spec import TargetSpec

# Fields of ParallelLayout learnt at run time (refine() takes only these); every other field is a setting.
RUN_TIME_FACTS = ("world_size", "num_experts", "device_types")

# the settings below are the strategy's: named as the user types them (--trainer.strategy.<name>)
STRATEGY = "trainer.strategy."


@dataclass(frozen=True)
class ParallelLayout:
    """World, expert-parallel mesh and the refused dimensions (accepted only at their supported values).

    ``data_parallel_size = world_size / expert_parallel_size``: the ranks of one expert-parallel group share the
    target's routed experts. Every rank is data-parallel for the draft unless ``draft_sequence_parallel_size > 1``:
    then the ranks of one draft sequence-parallel group share their rows and split the draft's unroll over the
    sequence (``draft_data_parallel_size = world_size / draft_sequence_parallel_size``).
    """

    expert_parallel_size: int = 1
    target_dispatcher: str = "torch"
    target_shard_dense: bool | None = None  # None: on when the world has more than one rank
    # The draft's own sequence sharding (Ulysses over the TTT unroll, parallel/sequence_parallel.py); the target is
    # never sequence/context-parallel: every rank of a draft SP group runs the same target forward on the same rows.
    draft_sequence_parallel_size: int = 1
    world_size: int | None = None
    num_experts: int | None = None
    device_types: tuple[str, ...] | None = None
    # Refused dimensions: they exist so that a config asking for them fails with the setting's name.
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    sequence_packing: bool = False
    target_backend: str = "colocated"
    p_eagle: bool = False
    target_force_hf: bool = False

    def __post_init__(self) -> None:
        if self.device_types is not None and not isinstance(self.device_types, tuple):
            object.__setattr__(self, "device_types", tuple(self.device_types))
        validate_layout(self)

    @property
    def data_parallel_size(self) -> int | None:
        return None if self.world_size is None else self.world_size // self.expert_parallel_size

    @property
    def draft_data_parallel_size(self) -> int | None:
        """Groups of ranks that train the draft on different rows: ``world_size / draft_sequence_parallel_size``
        (the ranks of one draft sequence-parallel group share their rows)."""
        return None if self.world_size is None else self.world_size // self.draft_sequence_parallel_size

    @property
    def dense_sharded(self) -> bool:
        """Whether the target's dense (non-routed) weights are split over all ranks (FSDP2, gathered per layer)."""
        if self.target_shard_dense is not None:
            return self.target_shard_dense
        return (self.world_size or 1) > 1

    def refine(self, **facts: Any) -> ParallelLayout:
        """This layout with newly known facts (``world_size``, ``num_experts``, ``device_types``), validated."""
        unknown = set(facts) - set(RUN_TIME_FACTS)
        if unknown:
            raise TypeError(f"refine() takes facts learnt at run time, not settings: {sorted(unknown)}")
        return dataclasses.replace(self, **facts)


# The settings: the fields a strategy's config may set (``--trainer.strategy.init_args.<name>``).
LAYOUT_SETTINGS = tuple(f.name for f in dataclasses.fields(ParallelLayout) if f.name not in RUN_TIME_FACTS)


def validate_layout(layout: ParallelLayout) -> None:
    """Return None for a layout that can serve K3; raise ``ValueError`` (sub)classes naming the offending setting
    otherwise. Facts still ``None`` (world size, expert count, device types) are not judged yet.

    Unsupported-but-sensible layouts raise :class:`~lightning_eagle.parallel.validate.UnsupportedLayoutError`.
    """
    if layout.target_backend != "colocated":
        raise UnsupportedLayoutError(
            "K3 draft training requires target_model_backend='colocated' (got "
            f"target_backend={layout.target_backend!r}): the frozen target runs inside the trainer; sglang/vllm/remote "
            "targets are not supported"
        )
    if layout.target_force_hf:
        raise ValueError(
            "target_force_hf=True is not supported: K3 has no HuggingFace implementation; "
            "lightning_eagle's own KimiK3ForCausalLM is the target"
        )
    for name in ("tensor_parallel_size", "context_parallel_size"):
        size = getattr(layout, name)
        if size != 1:
            raise UnsupportedLayoutError(
                f"{name}={size}: the K3 target supports neither context nor tensor parallelism; shard the target "
                "with expert parallelism (expert_parallel_size) and set tensor_parallel_size=1 and "
                "context_parallel_size=1"
            )
    if layout.pipeline_parallel_size != 1:
        raise UnsupportedLayoutError(
            f"pipeline_parallel_size={layout.pipeline_parallel_size}: Pipeline parallelism is not supported — the "
            "draft's tapped target states come from one non-pipelined target forward; use expert_parallel_size instead"
        )
    if layout.sequence_packing:
        raise UnsupportedLayoutError(
            "sequence_packing=True: Sequence packing is not supported for K3 (its KDA/MLA own the packed attention "
            "and do not accept a [B,1,T,T] block mask); use right-padded rows"
        )
    if layout.p_eagle:
        raise UnsupportedLayoutError("p_eagle=True: Parallel drafting (P-EAGLE) is not supported; use EAGLE-3 (TTT)")
    dispatcher = layout.target_dispatcher
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"{STRATEGY}target_dispatcher={dispatcher!r} is unknown; choose one of {DISPATCHERS}")
    ep, world_size, num_experts = layout.expert_parallel_size, layout.world_size, layout.num_experts
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"{STRATEGY}expert_parallel_size must be a positive int, got {ep!r}")
    if world_size is not None and world_size % ep:
        raise ValueError(
            f"{STRATEGY}expert_parallel_size ({ep}) must divide the world size ({world_size}): expert parallelism is "
            "carved out of the data-parallel ranks"
        )
    if num_experts is not None and num_experts % ep:
        raise ValueError(
            f"num_experts ({num_experts}) is not divisible by expert_parallel_size ({ep}); each rank must hold a "
            "contiguous, equal slice of routed experts"
        )
    sp = layout.draft_sequence_parallel_size
    if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
        raise ValueError(f"{STRATEGY}draft_sequence_parallel_size must be a positive int, got {sp!r}")
    if world_size is not None and world_size % sp:
        raise ValueError(
            f"{STRATEGY}draft_sequence_parallel_size ({sp}) must divide the world size ({world_size}): each group of "
            f"{sp} consecutive ranks shares one sequence of the draft's batch"
        )
    kinds = None if layout.device_types is None else sorted(set(layout.device_types))
    if kinds is not None and len(kinds) > 1:
        raise ValueError(
            f"expert parallelism across mixed device types {kinds} is not supported: every rank of an "
            "expert-parallel group must use the same accelerator"
        )
    if dispatcher != "torch" and kinds is not None and kinds != ["cuda"]:
        raise ValueError(
            f"target_dispatcher={dispatcher!r} needs CUDA devices (got {kinds}); use target_dispatcher='torch' on CPU"
        )


SINGLE_PROCESS = ParallelLayout(world_size=1)


@runtime_checkable
class TargetParallelism(Protocol):
    """How a strategy places the frozen target; what ``load_frozen_target`` asks of ``trainer.strategy``."""

    @property
    def layout(self) -> ParallelLayout: ...

    def expert_range(self, num_experts: int) -> tuple[int, int] | None:
        """``(start, count)`` of the routed experts this rank loads; None = all of them."""
        ...

    def dense_sharding(self) -> Callable[[nn.Module], object] | None:
        """Applied by the loader to the meta-device target before any weight is read (e.g. FSDP2 over all ranks);
        None = the dense weights are replicated."""
        ...

    def parallelize_target(self, target: nn.Module) -> nn.Module:
        """Called once after loading: install whatever the layout needs (e.g. the expert-parallel dispatcher)."""
        ...


class ReplicatedTarget:
    """Every rank holds the whole target: single-device and plain data-parallel (DDP) strategies."""

    def __init__(self, world_size: int = 1) -> None:
        self.layout = dataclasses.replace(SINGLE_PROCESS, world_size=world_size, target_shard_dense=False)

    def expert_range(self, num_experts: int) -> None:
        return None

    def dense_sharding(self) -> None:
        return None

    def parallelize_target(self, target: nn.Module) -> nn.Module:
        return target


@runtime_checkable
class HasTargetSpec(Protocol):
    """A training module that declares its frozen target: what the strategy gates in the main process, before any
    worker starts or any weight is read. The spec is already validated (text ``model_type``, aux ids against the
    depth), so the strategy judges only its own part: the expert count against the layout."""

    target_spec: TargetSpec | None


def target_parallelism(strategy: Any | None) -> TargetParallelism:
    """The strategy itself if it implements :class:`TargetParallelism`, else a replicated target."""
    if isinstance(strategy, TargetParallelism):
        return strategy
    return ReplicatedTarget(getattr(strategy, "world_size", 1) or 1)


DRAFT_PLACEMENT_MEMBERS = ("draft_sequence_parallel_size", "draft_sequence_parallel_group", "sequence_shard",
                           "world_mesh")  # fmt: skip


class DraftPlacement(Protocol):
    """How a strategy places the draft; what a draft-training module asks of ``trainer.strategy`` for it (draft sequence
    parallelism and FSDP2 sharding). ``ExpertParallelStrategy`` implements it; any other strategy gets
    :class:`SingleDraftGroup` through :func:`draft_placement`."""

    @property
    def draft_sequence_parallel_size(self) -> int: ...

    @property
    def draft_sequence_parallel_group(self) -> Any:
        """This rank's draft sequence-parallel process group (None when the size is 1)."""
        ...

    def sequence_shard(self, length: int) -> Any:
        """The slots this rank owns of a length-``length`` (post-shift) sequence."""
        ...

    @property
    def world_mesh(self) -> Any:
        """A 1-D device mesh over all ranks (what an FSDP2-sharded draft splits over)."""
        ...


class SingleDraftGroup:
    """Every rank trains the whole unroll of its own rows; the draft is not sharded."""

    draft_sequence_parallel_size = 1
    draft_sequence_parallel_group = None

    def __init__(self, strategy: Any | None) -> None:
        self.strategy_name = type(strategy).__name__

    def sequence_shard(self, length: int) -> None:
        return None

    @property
    def world_mesh(self) -> Any:
        raise ValueError(
            "model.draft.shard=true shards the draft over ranks: use ExpertParallelStrategy with more than one rank "
            f"(got {self.strategy_name})"
        )


def draft_placement(strategy: Any | None) -> DraftPlacement:
    """The strategy itself if it implements :class:`DraftPlacement`, else :class:`SingleDraftGroup`."""
    # members looked up on the class: an instance's `world_mesh` raises until the process group exists
    if all(hasattr(type(strategy), name) for name in DRAFT_PLACEMENT_MEMBERS):
        return strategy
    return SingleDraftGroup(strategy)


def draft_mesh(trainer: Any | None) -> Any:
    """The mesh an FSDP2-sharded draft splits over (``model.draft.shard``): all ranks of a run of more than one."""
    world = trainer.world_size if trainer is not None else 1
    if world < 2:
        raise ValueError(
            "model.draft.shard=true shards the draft over ranks: use ExpertParallelStrategy with more than one rank "
            f"(got world size {world})"
        )
    return draft_placement(trainer.strategy).world_mesh
