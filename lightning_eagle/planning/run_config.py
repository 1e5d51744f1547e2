"""A run config, parsed as ``fit`` parses it, read into :class:`PlanInputs` (:func:`run_config`): the family's module
(``model.class_path``) makes its settings groups and its run spec exactly as its ``__init__`` does
(:meth:`~lightning_eagle.training.draft_training.DraftTrainingModule.run_spec`), the strategy its
:class:`ParallelLayout`, the data module the micro-batch; the family's planning record
(:class:`~lightning_eagle.planning.family.PlanningFamily`) adds what it needs of the data module and, once the
inputs passed their checks, the census of its draft step.

What the parser leaves to the plan (counts that must be positive, a GPU count, a target folder that is not on this
machine) is checked here; every refusal names the config field (:class:`PlanConfigError`).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from lightning_eagle.draft.family import load_all_families
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.parallel.layout import LAYOUT_SETTINGS, ParallelLayout
from lightning_eagle.parallel.memory import GB
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.planning.family import planning_family
from lightning_eagle.planning.inputs import PlanInputs
from lightning_eagle.run_settings import as_settings
from lightning_eagle.training.draft_training import module_class


class PlanConfigError(ValueError):
    """A run config the plan cannot read; the message names the field."""

    def __init__(self, field_name: str | None, message: str) -> None:
        super().__init__(message if field_name is None else f"{field_name}: {message}")  # None: message names it
        self.field = field_name


@dataclass
class RunConfig:
    """A run config read for planning: the inputs, GPUs per node, and notices to print (e.g. a preset fallback)."""

    inputs: PlanInputs
    gpus_per_node: int
    nodes: int
    notices: list[str] = field(default_factory=list)
    target_label: str = ""


def _named(err: Exception, fallback: str) -> PlanConfigError:
    """``err`` as a :class:`PlanConfigError`: its message when it names a ``model.`` / ``data.`` key, else under
    ``fallback``."""
    message = str(err)
    return PlanConfigError(None if message.startswith(("model.", "data.")) else fallback, message)


# ---- what the parser leaves to the plan ------------------------------------------------------------------------------
def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanConfigError(name, f"expected a positive integer, got {value!r}")
    return value


def _devices(value: Any) -> int | None:
    """GPUs per node from ``trainer.devices``: an int, a list of ids or a digit string; None when not a count."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def _is_expert_parallel(strategy: Any) -> bool:
    if not isinstance(strategy, Namespace):  # a registered name ("auto", "ddp", …): every rank holds the target
        return False
    module, _, name = strategy.class_path.rpartition(".")
    return issubclass(getattr(importlib.import_module(module), name), ExpertParallelStrategy)


def _target_config(value: str, fallback: str | None) -> tuple[KimiK3TextConfig, Path | None, str, list[str]]:
    """The target's text config from ``model.target`` (a checkpoint folder or ``quickstart``), else — stated, never
    silent — from ``--target-config`` (a preset name, a folder or a ``config.json``)."""
    from lightning_eagle.k3 import PRESETS, config_from_name
    from lightning_eagle.k3.loader import CheckpointError, named_target, read_config

    folder = named_target(value)
    try:
        if (folder / "config.json").is_file():
            return read_config(folder), folder, f"{value} ({folder / 'config.json'})", []
        if fallback is None:
            raise PlanConfigError(
                "model.target",
                f"checkpoint folder {str(folder)!r} is not here (no config.json); pass --target-config with a preset "
                f"({', '.join(sorted(PRESETS))}; the published K3 is 'k3') or a config.json to plan with it",
            )
        if fallback in PRESETS:
            config, label = config_from_name(fallback), f"preset {fallback!r}"
        else:
            path = Path(fallback)
            if not path.exists():
                presets = ", ".join(sorted(PRESETS))
                raise PlanConfigError(
                    "--target-config", f"{fallback!r} is neither a preset ({presets}) nor a config.json or a folder"
                )
            config, label = read_config(path.parent if path.name == "config.json" else path), str(path)
    except CheckpointError as err:
        raise PlanConfigError("model.target", str(err)) from None
    notice = f"note: model.target {value!r} is not here (no config.json); planning with --target-config {label}"
    return config, None, label, [notice]


def _settings(model: Namespace, group: str, groups: dict[str, type]):
    """``model.<group>`` made into its settings type (of the family's ``groups``) as ``fit`` makes it
    (``as_settings``: the type's own check)."""
    value = model.get(group)
    try:
        return as_settings(group, vars(value) if isinstance(value, Namespace) else value or {}, groups)
    except (TypeError, ValueError) as err:  # the settings' own messages name their key
        raise PlanConfigError(None if str(err).startswith(f"model.{group}") else f"model.{group}", str(err)) from None


def _layout(trainer: Namespace, world: int | None, ep: int | None, shard_dense: bool | None,
            num_experts: int) -> tuple[int, int, ParallelLayout]:  # fmt: skip
    """(nodes, GPUs per node, the layout) from ``trainer`` and the overrides: the strategy's own
    :class:`ParallelLayout` (its settings, checked by it), or a replicated target for any other strategy."""
    nodes = _positive_int(trainer.num_nodes, "trainer.num_nodes")
    gpus = _devices(trainer.devices)
    if world is None:
        if gpus is None:
            raise PlanConfigError("trainer.devices", f"{trainer.devices!r} is not a GPU count; "
                                  "set a number or pass --world")  # fmt: skip
        world = nodes * gpus
    gpus = gpus or max(world // nodes, 1)
    if _is_expert_parallel(trainer.strategy):
        settings = {k: v for k, v in vars(trainer.strategy.init_args).items() if k in LAYOUT_SETTINGS}
    else:  # single device / DDP: every rank holds the whole target
        settings = {"target_shard_dense": False}
    if ep is not None:
        settings["expert_parallel_size"] = ep
    if shard_dense is not None:
        settings["target_shard_dense"] = shard_dense
    try:
        layout = ParallelLayout(**settings, world_size=world, num_experts=num_experts)
    except ValueError as err:
        raise PlanConfigError("trainer.strategy.init_args", str(err)) from None
    return nodes, gpus, layout


def _micro_batch(data: Namespace) -> tuple[int, int]:
    """``(batch_size, max_length)`` of the data module: the plan's micro-batch."""
    for key in ("batch_size", "max_length"):
        if key not in data.init_args:
            raise PlanConfigError("data", f"{data.class_path} has no {key}: the plan needs it")
    return (_positive_int(data.init_args.batch_size, "data.batch_size"),
            _positive_int(data.init_args.max_length, "data.max_length"))  # fmt: skip


def _module_class(model: Namespace):
    """The draft-training module ``model.class_path`` names (the default family's when the config names none)."""
    class_path = model.get("class_path")
    load_all_families()  # a config may name a family's module by its class name
    kind = module_class(class_path)
    if kind is None:
        raise PlanConfigError("model.class_path", f"{class_path!r} is not a draft-training module")
    return kind


# ---- the run config --------------------------------------------------------------------------------------------------
def run_config(
    config: Namespace,
    *,
    target_config: str | None = None,
    world: int | None = None,
    ep: int | None = None,
    shard_dense: bool | None = None,
    device: str = "cuda",
    reserve_gb: float = 4.0,
    moe_load_factor: float = 1.25,
) -> RunConfig:
    """A LightningCLI run config as ``fit`` parses it (``trainer``, ``model``, ``data``; defaults applied, nothing
    built) read into :class:`PlanInputs`: the family's module's own settings groups (defaults included) and run spec,
    the strategy's layout, the data module's batch and length, the family's census of its step where it has one."""
    trainer, model, data = config.trainer, config.model, config.data
    kind = _module_class(model)
    if "class_path" in model:  # a config naming its family
        model = model.init_args
    family = planning_family(kind.family, "model.class_path")
    groups = {name: _settings(model, name, kind.settings_groups) for name in kind.settings_groups}
    target_config_, folder, label, notices = _target_config(groups["target"].path, target_config)
    try:  # as the module makes them in its __init__
        spec, draft = kind.run_spec(groups, None if folder else target_config_)
    except (TypeError, ValueError) as err:
        raise _named(err, "model") from None
    nodes, gpus, layout = _layout(trainer, world, ep, shard_dense, spec.num_experts)
    micro_batch = _micro_batch(data)
    try:  # what the family's draft takes from the data module (EAGLE-3: its vocabulary map)
        draft = family.draft_for_data(draft, vars(data.init_args))
    except (TypeError, ValueError) as err:
        raise _named(err, "data") from None
    try:
        inputs = PlanInputs.for_target(
            spec, draft, groups["target"], family=family.name, draft_settings=groups["draft"],
            objective=groups["objective"], layout=layout, batch_size=micro_batch[0], seq_len=micro_batch[1],
            accumulate_grad_batches=_positive_int(trainer.accumulate_grad_batches, "trainer.accumulate_grad_batches"),
            device=device, moe_load_factor=moe_load_factor, reserve_bytes=int(reserve_gb * GB),
        )  # fmt: skip
    except PlanConfigError:
        raise
    except ValueError as err:  # the inputs' own checks (the run settings', the layout's, the family's) name the setting
        raise PlanConfigError(None, str(err)) from None
    if family.census is not None:
        inputs = dataclasses.replace(inputs, draft_step=family.census(inputs))
    return RunConfig(inputs, gpus, nodes, notices, label)
