"""``lightning-eagle memory-plan --config run.yaml --gpu-gb 80`` (also ``python -m
lightning_eagle.commands.memory_plan``): the per-GPU peak memory of a draft-training run config, before any GPU is
rented.

The config is read by the ``lightning-eagle`` command's own LightningCLI parser (:class:`RunCLI`), stopped after
parsing: jsonargparse applies the classes' own defaults and types (``Trainer``, the family's module, the data
module, ``ExpertParallelStrategy``) exactly as ``fit`` would, and nothing is instantiated (no target is read, no
trainer is built). The parsed config is read into the plan's inputs by the planning layer
(:func:`lightning_eagle.planning.run_config`), which checks what the parser leaves to the plan; every refusal names
the config field (:class:`~lightning_eagle.planning.PlanConfigError`) and exits 2. This command parses, calls the
plan (:mod:`lightning_eagle.planning`) and prints it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from jsonargparse import Namespace

from lightning_eagle.commands.arguments import CommandParser, RunParser
from lightning_eagle.commands.cli import RunCLI, refuse_flat_settings, run_classes
from lightning_eagle.configs import resolve_config_path
from lightning_eagle.parallel.memory import GB
from lightning_eagle.planning import (
    PlanConfigError,
    RunConfig,
    build_plan,
    format_plan,
    plan_header,
    run_config,
    smallest_fit,
    verdict,
)
from lightning_eagle.settings import check_settings


# ---- the config, parsed by the CLI's own parser ----------------------------------------------------------------------
class _ParseOnlyCLI(RunCLI):
    """``RunCLI`` with ``run=False`` that stops once the config is parsed: no seed, no instantiation."""

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


def run_config_from_yaml(path: str | Path, **options) -> RunConfig:
    """Read a LightningCLI YAML (``trainer``, ``model``, ``data``) into the plan's inputs: parsed as ``fit`` parses it
    (:func:`parse_run_config`), then read by :func:`lightning_eagle.planning.run_config` (``options``: its
    ``target_config``, ``world``, ``ep``, ``shard_dense``, ``device``, ``reserve_gb``, ``moe_load_factor``)."""
    return run_config(parse_run_config(path), **options)


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
