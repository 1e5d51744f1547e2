"""``lightning-eagle memory-plan --config run.yaml --gpu-gb 80`` (also ``python -m
lightning_eagle.commands.memory_plan``): the per-GPU peak memory of a draft-training run config, before any GPU is
rented.

The config is read by the ``lightning-eagle`` command's own LightningCLI parser (:class:`Eagle3CLI`), stopped after
parsing: jsonargparse applies the classes' own defaults and types (``Trainer``, ``Eagle3Module``, the data module,
``ExpertParallelStrategy``) exactly as ``fit`` would, and nothing is instantiated (no target is read, no trainer is
built). What it leaves to the plan — counts that must be positive, a GPU count, what the plan does not model — is
checked here. Every refusal names the config field (:class:`PlanConfigError`) and exits 2; the plan itself (library
code taking typed inputs) is :mod:`lightning_eagle.parallel.memory_plan`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

from lightning_eagle.commands.arguments import CommandParser, RunParser
from lightning_eagle.commands.cli import Eagle3CLI, refuse_flat_settings, run_classes
from lightning_eagle.configs import resolve_config_path
from lightning_eagle.draft.config import Eagle3DraftConfig
from lightning_eagle.k3.config import KimiK3TextConfig
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.layout import LAYOUT_SETTINGS, ParallelLayout
from lightning_eagle.parallel.memory import GB
from lightning_eagle.parallel.memory_plan import PlanInputs, build_plan, format_plan, plan_header, smallest_fit, verdict
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.run_settings import DSPARK_MODEL_GROUPS, MODEL_GROUPS, as_settings, is_dspark_class_path
from lightning_eagle.settings import check_settings


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


# ---- the config, parsed by the CLI's own parser ----------------------------------------------------------------------
class _ParseOnlyCLI(Eagle3CLI):
    """``Eagle3CLI`` with ``run=False`` that stops once the config is parsed: no seed, no instantiation."""

    def parse_arguments(self, parser, args) -> None:
        # `args` always comes from `parse_config` (never sys.argv): parsed directly, without LightningCLI's warning
        # about `args` given while sys.argv has words too.
        try:
            self.config = parser.parse_args(args)
        except argparse.ArgumentError as err:
            raise PlanConfigError(*_jsonargparse_refusal(str(err))) from None

    def _parse_ckpt_path(self) -> None:  # run=False: no subcommand, so no checkpoint to read
        pass

    def _set_seed(self) -> None:
        pass

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def after_instantiate_classes(self) -> None:
        pass


_PARSER_KEY = re.compile(r'Parser key "([^"]+)":\n\s*(.*)')
_UNKNOWN_OPTION = re.compile(r"Group '([^']+)' does not accept option '([^']+)'|Option '([^']+)' is not accepted")


def _jsonargparse_refusal(message: str) -> tuple[str, str]:
    """(field, reason) of a jsonargparse error. A value inside a ``class_path`` section (the strategy, the data
    module) is reported as the outer key and then the inner one: ``trainer.strategy`` → ``expert_parallel_size``."""
    keys = _PARSER_KEY.findall(message)
    if keys:
        name = keys[0][0] + "".join(f".init_args.{key}" for key, _ in keys[1:])
        return name, keys[-1][1].strip()
    unknown = _UNKNOWN_OPTION.search(message)
    if unknown:
        group, option, top = unknown.groups()
        return (f"{group}.{option}" if group else top), "not an option of this run config"
    if message.startswith("Unexpected config"):
        return "--config", "the file does not hold a mapping"
    return "--config", message


def parse_run_config(path: str | Path) -> Namespace:
    """The config as ``lightning-eagle fit --config path`` parses it (defaults applied, types checked), unbuilt."""
    file = Path(resolve_config_path(str(path)))
    if not file.is_file():
        raise PlanConfigError("--config", f"{str(path)!r} is not a file")
    try:
        refuse_flat_settings(["--config", str(file)])
    except ValueError as err:
        raise PlanConfigError("--config", str(err)) from None
    cli = _ParseOnlyCLI(
        **run_classes(["--config", str(file)]), run=False, args=["--config", str(file)],
        load_from_checkpoint_support=False,
        parser_kwargs={"exit_on_error": False},
        parser_class=RunParser,
    )  # fmt: skip
    for section in ("trainer", "model", "data"):
        if not isinstance(cli.config.get(section), Namespace):
            raise PlanConfigError(section, f"expected a mapping, got {cli.config.get(section)!r}")
    return cli.config


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


def _settings(model: Namespace, group: str, groups=MODEL_GROUPS):
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


def run_config_from_yaml(
    path: str | Path,
    *,
    target_config: str | None = None,
    world: int | None = None,
    ep: int | None = None,
    shard_dense: bool | None = None,
    device: str = "cuda",
    reserve_gb: float = 4.0,
    moe_load_factor: float = 1.25,
) -> RunConfig:
    """Read a LightningCLI YAML (``trainer``, ``model``, ``data``) into :class:`PlanInputs`: the module's own settings
    groups (defaults included), the strategy's layout, the data module's batch and length."""
    config = parse_run_config(path)
    trainer, model, data = config.trainer, config.model, config.data.init_args
    if "class_path" in model:  # a config naming its family
        dspark = is_dspark_class_path(model.class_path)
        model = model.init_args
        if dspark:
            return _dspark_run_config(trainer, model, config.data, target_config, world, ep, shard_dense, device,
                                      reserve_gb, moe_load_factor)  # fmt: skip
    target = _settings(model, "target")
    draft_settings = _settings(model, "draft")
    objective = _settings(model, "objective")
    target_config_, folder, label, notices = _target_config(target.path, target_config)
    try:
        spec = TargetSpec.from_settings(target, config=target_config_ if folder is None else None)
    except ValueError as err:
        raise PlanConfigError("model.target", str(err)) from None
    nodes, gpus, layout = _layout(trainer, world, ep, shard_dense, spec.num_experts)
    micro_batch = _micro_batch(config.data)
    try:  # as Eagle3Module builds it
        draft = Eagle3DraftConfig.from_target_config(
            spec.config, **draft_settings.config, draft_vocab_size=data.get("draft_vocab_size"),
            aux_hidden_state_stream=spec.aux_stream, aux_layer_ids=list(spec.aux_layer_ids),
        )  # fmt: skip
    except (TypeError, ValueError) as err:
        raise PlanConfigError("model.draft.config", str(err)) from None
    inputs = _plan_inputs(
        spec, draft, (target, draft_settings, objective), layout, trainer, micro_batch,
        device=device, moe_load_factor=moe_load_factor, reserve_bytes=int(reserve_gb * GB),
    )  # fmt: skip
    return RunConfig(inputs, gpus, nodes, notices, label)


def _micro_batch(data: Namespace) -> tuple[int, int]:
    """``(batch_size, max_length)`` of the data module: the plan's micro-batch."""
    for key in ("batch_size", "max_length"):
        if key not in data.init_args:
            raise PlanConfigError("data", f"{data.class_path} has no {key}: the plan needs it")
    return (_positive_int(data.init_args.batch_size, "data.batch_size"),
            _positive_int(data.init_args.max_length, "data.max_length"))  # fmt: skip


def _plan_inputs(spec, draft, groups, layout, trainer, micro_batch, **assumptions) -> PlanInputs:
    """:meth:`PlanInputs.for_target` of a run's ``(target, draft, objective)`` settings ``groups``; the inputs' own
    checks (the run settings', the layout's) become a :class:`PlanConfigError` (their messages name the setting)."""
    target, draft_settings, objective = groups
    try:
        return PlanInputs.for_target(
            spec, draft, target, layout=layout, draft_settings=draft_settings, objective=objective,
            batch_size=micro_batch[0], seq_len=micro_batch[1],
            accumulate_grad_batches=_positive_int(trainer.accumulate_grad_batches, "trainer.accumulate_grad_batches"),
            **assumptions,
        )  # fmt: skip
    except PlanConfigError:
        raise
    except ValueError as err:
        raise PlanConfigError(None, str(err)) from None


def _dspark_run_config(trainer, model, data, target_config, world, ep, shard_dense, device, reserve_gb,
                       moe_load_factor) -> RunConfig:  # fmt: skip
    """A DSpark run's :class:`PlanInputs`: its settings groups, the drafter config as ``DSparkModule`` builds it, and
    (once the inputs passed their checks) the census of its drafter step at the planned shapes."""
    from lightning_eagle.training.dspark_memory import dspark_step_census
    from lightning_eagle.training.dspark_module import dspark_run_spec

    groups = tuple(_settings(model, name, DSPARK_MODEL_GROUPS) for name in ("target", "draft", "objective"))
    target_config_, folder, label, notices = _target_config(groups[0].path, target_config)
    try:
        spec, draft = dspark_run_spec(groups[0], groups[1], None if folder else target_config_)
    except ValueError as err:
        raise PlanConfigError(None, str(err)) from None
    nodes, gpus, layout = _layout(trainer, world, ep, shard_dense, spec.num_experts)
    inputs = _plan_inputs(
        spec, draft, groups, layout, trainer, _micro_batch(data),
        device=device, moe_load_factor=moe_load_factor, reserve_bytes=int(reserve_gb * GB),
    )  # fmt: skip
    census = dspark_step_census(
        draft, inputs.draft_settings, inputs.objective, batch_size=inputs.batch_size, seq_len=inputs.seq_len,
        target_dtype=inputs.target_dtype,
    )  # fmt: skip
    return RunConfig(dataclasses.replace(inputs, draft_step=census), gpus, nodes, notices, label)


# ---- the command line ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Print the plan of a run config; the last line starts with ``fits`` or ``does not fit``. Exit 0 either way,
    2 for a config the plan cannot read (the message names the field)."""
    parser = CommandParser(
        prog="lightning-eagle memory-plan",
        description="Per-GPU peak memory plan of a draft-training run config (LightningCLI YAML).",
    )
    parser.add_argument("--config", required=True, help="the run's YAML (a path or a packaged config name)")
    parser.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU in decimal GB (default 80)")
    parser.add_argument("--target-config", help="preset name (e.g. 'k3') or config.json used when model.target is "
                        "not a checkpoint folder on this machine")  # fmt: skip
    parser.add_argument("--world", type=int, help="override the world size (num_nodes x devices)")
    parser.add_argument("--ep", type=int, help="override expert_parallel_size")
    parser.add_argument(
        "--shard-dense",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override target_shard_dense (default: the config's, else on when world > 1)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="kernels to plan for")
    parser.add_argument("--reserve-gb", type=float, default=None,
                        help="runtime reserve per GPU (default 4 on cuda, for the CUDA context; 0 on cpu)")  # fmt: skip
    parser.add_argument(
        "--moe-load-factor",
        type=float,
        default=1.25,
        help="rows the hottest EP rank receives relative to uniform routing (default 1.25)",
    )
    parser.add_argument("--max-nodes", type=int, default=256, help="largest cluster the fit search tries")
    args = parser.parse_args(argv)
    if args.reserve_gb is None:
        args.reserve_gb = 4.0 if args.device == "cuda" else 0.0
    try:
        check_settings("", {
            "--gpu-gb": (args.gpu_gb, "positive", float), "--reserve-gb": (args.reserve_gb, "non_negative", float),
            "--moe-load-factor": (args.moe_load_factor, "at_least_one", float),
            "--max-nodes": (args.max_nodes, "positive", int),
            **{flag: (value, "positive", int) for flag, value in (("--world", args.world), ("--ep", args.ep))
               if value is not None},
        })  # fmt: skip
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        run = run_config_from_yaml(
            args.config, target_config=args.target_config, world=args.world, ep=args.ep,
            shard_dense=args.shard_dense, device=args.device, reserve_gb=args.reserve_gb,
            moe_load_factor=args.moe_load_factor,
        )  # fmt: skip
    except PlanConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    gpu_bytes = int(args.gpu_gb * GB)
    plan = build_plan(run.inputs)
    fit = None
    if plan.peak_bytes > gpu_bytes:
        fit = smallest_fit(run.inputs, gpu_bytes, run.gpus_per_node, args.max_nodes)
    for notice in run.notices:
        print(notice)
    print(plan_header(run.inputs, run.nodes, run.gpus_per_node, run.target_label))
    print(format_plan(plan))
    print(verdict(plan, gpu_bytes, fit, run.gpus_per_node, args.max_nodes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
