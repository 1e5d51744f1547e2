"""The command line: ``lightning-eagle {fit,validate,test,predict} --config …`` (LightningCLI) and the commands that
are not Trainer methods (:data:`COMMANDS`, one module each in this package):

* ``export CHECKPOINT OUT_DIR``: serving export of a trained draft;
* ``dump --config …``: the target's features, stored once for offline training;
* ``data-report --config …``: what the data looks like before a run;
* ``regenerate IN OUT --target …|--base-url …``: assistant turns rewritten by the target;
* ``memory-plan --config … --gpu-gb 80``: the peak memory per GPU a config's run will need;
* ``acceptance --target … --draft … --benchmarks mt_bench,humaneval``: acceptance per prompt set, as draft cards
  report it (or on the user's own chats).

* ``--config quickstart`` (or ``kimi_k3_eagle3``) names a config shipped inside the package. Every config file is
  read strictly (:mod:`lightning_eagle.commands.strict_yaml`): a syntax error, an unknown tag, a duplicate key, an
  alias bomb or an empty file is one ``error:`` line naming the file and line (exit status 2).
* Everything a run writes lives under ``trainer.default_root_dir`` unless a path is set explicitly: checkpoints in
  ``<root>/checkpoints``, CSV logs in ``<root>/logs/version_N``, the export in ``<root>/draft``.
* A user error (missing file, malformed row, bad value, refused layout, unreadable checkpoint) prints one message
  and exits with status 1; ``--debug`` or ``LIGHTNING_EAGLE_DEBUG=1`` shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from pathlib import Path

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

from lightning_eagle.checkpoint_io import CheckpointLoadError, load_checkpoint_file
from lightning_eagle.commands.arguments import RunParser
from lightning_eagle.commands.strict_yaml import read_config_file
from lightning_eagle.configs import resolve_config_path
from lightning_eagle.draft.family import default_family, load_all_families
from lightning_eagle.errors import DEBUG_ENV, RunError, debug_requested
from lightning_eagle.features.engine_client import EngineError
from lightning_eagle.run_settings import MODEL_GROUPS, refuse_flat_model_keys
from lightning_eagle.training.draft_training import DraftTrainingModule, module_class, training_family
from lightning_eagle.training.preemption import Interrupted, PreemptionCheckpoint
from lightning_eagle.training.progress import StepProgressBar
from lightning_eagle.training.run_folder import RunFolderGuard
from lightning_eagle.training.summary import fit_summary

_CHAT_DATA = "lightning_eagle.data.datamodule.ChatDataModule"
# Commands that are not Trainer methods: name -> (module under lightning_eagle.commands, --help line, whether its
# `main` builds a LightningCLI and so needs to know if the words came from sys.argv). `main` runs them before
# LightningCLI parses anything.
COMMANDS = {
    "export": ("export", "Write a trained draft for serving", False),
    "dump": ("dump", "Store the frozen target's features once, to train drafts without it", True),
    "extract": ("extract", "Store the target's features as a vLLM engine captures them (extract_hidden_states)", True),
    "data-report": (
        "data_report",
        "Rows, refusals, lengths, roles and draft-vocab coverage of the config's data",
        True,
    ),
    "regenerate": ("regenerate", "Rewrite a chat file's assistant turns with the target's own responses", False),
    "memory-plan": ("memory_plan", "Peak memory per GPU of a config's run, before any GPU is rented", False),
    "acceptance": ("acceptance", "Acceptance length of a draft per prompt set and context length", False),
}
# Errors that mean "the input is wrong", not "the library is broken": shown as one line without a traceback.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
               PermissionError, MisconfigurationException, RunError, EngineError, Interrupted)  # fmt: skip


class RunCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # `data:` is a ChatDataModule unless it names another class (HiddenStateDataModule for dumped features).
        # (`model:` is the default family's module unless it names another: `run_classes`.)
        parser.set_defaults({"trainer.precision": "32-true", "data": {"class_path": _CHAT_DATA}})

    def _add_subcommands(self, parser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        for name, (_, text, _) in COMMANDS.items():
            stub = argparse.ArgumentParser(prog=name, add_help=False)
            parser._subcommands_action.add_subcommand(name, stub, help=text)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI merges the checkpoint's hyperparameters over the parsed config here, which silently drops
        # explicit command-line values (--model.objective.ttt_steps 3) and lets a checkpoint switch the run's draft
        # architecture. Ours: the run's config is what runs; the module refuses a checkpoint whose draft differs
        # (DraftTrainingModule.on_load_checkpoint). The file is still read now, so a missing or truncated one is refused
        # by name before the run writes its config and logs.
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path") if self.config.get("subcommand") else None
        if not ckpt_path or ckpt_path in ("last", "best", "hpc", "registry"):
            return
        if not Path(ckpt_path).exists():
            raise CheckpointLoadError(f"checkpoint {str(ckpt_path)!r} does not exist")
        if Path(ckpt_path).is_file():
            load_checkpoint_file(ckpt_path, weights_only=True)  # raises CheckpointLoadError naming the file

    def instantiate_trainer(self, **kwargs):
        """The step-counting progress bar unless the config disables the bar or brings its own; for ``fit``, the
        output-folder claim and the preemption checkpoint unless the config brings its own."""
        config = self._get(self.config_init, "trainer", default={})
        callbacks = list(config.get("callbacks") or [])
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())
        if self.subcommand == "fit":
            callbacks += [kind() for kind in (RunFolderGuard, PreemptionCheckpoint) if not _has(callbacks, kind)]
        config["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)

    def after_instantiate_classes(self) -> None:
        """Put the outputs a config leaves unset under ``trainer.default_root_dir``."""
        trainer, root = self.trainer, self.trainer.default_root_dir
        config = self.config[self.subcommand] if self.subcommand else self.config  # run=False: no subcommand
        configured_logger = config["trainer"].get("logger")
        if configured_logger in (None, True) and trainer.loggers:  # Lightning's default logger: make it CSV
            trainer.loggers = [CSVLogger(root, name="logs")]
        for callback in trainer.callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = os.path.realpath(os.path.join(root, "checkpoints"))

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(fit_summary(self.trainer))


def _has(callbacks: list, kind: type) -> bool:
    return any(isinstance(c, kind) for c in callbacks)


# What every run config describes: a draft family's module and any LightningDataModule (`data.class_path`). A config
# naming no `model.class_path` is the default family's module (every config before a second family, parsed exactly as
# then); one that names a module is parsed in subclass mode over the families' base class. Every registered family's
# modules are imported first (when a run is parsed, not when this module is), so a config may name one by its class
# name alone, and a family module that does not import is one error line of the command.
_DATA_CLASSES = {"datamodule_class": LightningDataModule, "subclass_mode_data": True}


def run_classes(words: list[str]) -> dict:
    """The LightningCLI classes of the run ``words`` describe: the default family's module, or subclass mode over
    every family's when they name a ``model.class_path``."""
    load_all_families()
    if model_class_path(words) is not None:
        return {"model_class": DraftTrainingModule, "subclass_mode_model": True, **_DATA_CLASSES}
    return {"model_class": training_family(default_family().name), **_DATA_CLASSES}


def _config_files(words: list[str]) -> list[Path]:
    """The ``--config`` files among ``words`` (read strictly by :func:`read_config_file`, which refuses a duplicate
    key, an alias bomb, a syntax error or an empty file by name before LightningCLI parses anything)."""
    found = []
    for i, word in enumerate(words):
        if word == "--config" and i + 1 < len(words) or word.startswith("--config="):
            path = Path(words[i + 1] if word == "--config" else word.split("=", 1)[1])
            if path.is_file():
                found.append(path)
    return found


def model_class_path(words: list[str]) -> str | None:
    """The ``model.class_path`` the words give (a config file's or ``--model.class_path``; the last wins)."""
    found = None
    for i, word in enumerate(words):
        if word == "--model.class_path" and i + 1 < len(words) or word.startswith("--model.class_path="):
            found = words[i + 1] if "=" not in word else word.split("=", 1)[1]
        for path in _config_files(words[i : i + 2] if word.startswith("--config") else []):
            loaded = read_config_file(path)
            model = loaded.get("model") if isinstance(loaded, dict) else None
            if isinstance(model, dict) and isinstance(model.get("class_path"), str):
                found = model["class_path"]
    return found


def refuse_flat_settings(words: list[str]) -> None:
    """Refuse a run config or an option in the flat ``model.*`` shape (``model.ttt_steps``), naming the setting's
    place in the groups of :mod:`lightning_eagle.run_settings` (of the family ``model.class_path`` names), before
    LightningCLI parses anything."""
    class_path = model_class_path(words)
    kind = module_class(class_path)
    draft_settings = None if kind is None else kind.settings_groups["draft"]
    for path in _config_files(words):
        loaded = read_config_file(path)
        model = loaded.get("model") if isinstance(loaded, dict) else None
        if isinstance(model, dict) and class_path and "class_path" not in model:
            model = {"class_path": class_path, "init_args": model}
        refuse_flat_model_keys(model, str(path), draft_settings)
    for i, word in enumerate(words):
        if word.startswith("--model."):
            keys = word[len("--model.") :].split("=", 1)[0].split(".")
            keys = keys[1:] if keys[0] == "init_args" and len(keys) > 1 else keys
            if keys[0] == "class_path":
                continue
            nested = {keys[0]: {keys[1]: None} if len(keys) > 1 else None}
            nested = {"class_path": class_path, "init_args": nested} if class_path else nested
            groups = MODEL_GROUPS if kind is None else kind.settings_groups
            if len(keys) == 1 and keys[0] in groups:  # a whole group: a mapping or a YAML file of one
                value = word.split("=", 1)[1] if "=" in word else (words[i + 1] if i + 1 < len(words) else "")
                if keys[0] == "target" and not (value.lstrip().startswith("{") or Path(value).is_file()):
                    refuse_flat_model_keys({"target": value}, "the command line", draft_settings)
                continue
            refuse_flat_model_keys(nested, "the command line", draft_settings)


def make_cli(words: list[str], from_sys_argv: bool, run: bool = True) -> RunCLI:
    refuse_flat_settings(words)
    if from_sys_argv:  # LightningCLI warns when given `args` while sys.argv has arguments too
        sys.argv[1:] = words
    return RunCLI(
        **run_classes(words),
        run=run,
        args=None if from_sys_argv else words,
        save_config_kwargs={"overwrite": True},
        parser_class=RunParser,
    )


def resolve_packaged_configs(words: list[str]) -> list[str]:
    out = list(words)
    for i, word in enumerate(out):
        if word == "--config" and i + 1 < len(out):
            out[i + 1] = str(resolve_config_path(out[i + 1]))
        elif word.startswith("--config="):
            out[i] = "--config=" + str(resolve_config_path(word.split("=", 1)[1]))
    return out


def _run(words: list[str], from_sys_argv: bool) -> int | None:
    """Run the command ``words`` name; a command's integer return value is its exit status."""
    command = COMMANDS.get(words[0]) if words else None
    if command is None:
        return make_cli(resolve_packaged_configs(words), from_sys_argv)
    module = importlib.import_module(f"lightning_eagle.commands.{command[0]}")
    return module.main(words[1:], from_sys_argv) if command[2] else module.main(words[1:])


def main(argv: list[str] | None = None) -> None:
    # Lightning 2.6 with torch 2.13 warns about its own use of a deprecated pytree API on every run: not actionable.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    words = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in words or debug_requested()
    words = [w for w in words if w != "--debug"]
    try:
        status = _run(words, from_sys_argv=argv is None)
    except USER_ERRORS as exc:
        if debug:
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f"error: {_real_reason(message)}\n(full traceback: add --debug or set {DEBUG_ENV}=1)", file=sys.stderr)
        raise SystemExit(getattr(exc, "exit_status", 1)) from None
    if isinstance(status, int) and status:
        raise SystemExit(status)


def _real_reason(message: str) -> str:
    """jsonargparse reports a constructor's own error inside "Does not validate against any of the Union subtypes"
    (one bullet per candidate type): the data module's reason first, the rest after it."""
    if not message.startswith("Does not validate against any of the Union subtypes"):
        return message
    bullets = [line[4:] for line in message.splitlines() if line.startswith("  - ")]
    reasons = [b for b in bullets if not b.startswith("Expected a <class ")]  # the other union members' type checks
    return f"{reasons[0]}\n({message})" if reasons else message


if __name__ == "__main__":
    main()
