"""Command line: ``lightning-eagle {fit,validate,test,predict} --config …`` (LightningCLI),
``lightning-eagle export CHECKPOINT OUT_DIR`` (serving export of a trained draft) and
``lightning-eagle dump --config …`` (the target's features, stored once for offline training) and
``lightning-eagle data-report --config …`` (what the data looks like before a run) and
``lightning-eagle regenerate IN OUT --target …|--base-url …`` (assistant turns rewritten by the target).

* ``--config quickstart`` (or ``kimi_k3_eagle3``) names a config shipped inside the package.
* Everything a run writes lives under ``trainer.default_root_dir`` unless a path is set explicitly: checkpoints in
  ``<root>/checkpoints``, CSV logs in ``<root>/logs/version_N``, the export in ``<root>/draft``.
* A user error (missing file, malformed row, bad value, refused layout, unreadable checkpoint) prints one message
  and exits with status 1; ``--debug`` or ``LIGHTNING_EAGLE_DEBUG=1`` shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import json
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
from lightning_eagle.configs import resolve_config_path
from lightning_eagle.data.datamodule import ChatDataModule
from lightning_eagle.dtypes import DTYPES
from lightning_eagle.errors import RunError
from lightning_eagle.training.module import Eagle3Module
from lightning_eagle.training.progress import StepProgressBar
from lightning_eagle.training.summary import fit_summary

DEBUG_ENV = "LIGHTNING_EAGLE_DEBUG"
_CHAT_DATA = "lightning_eagle.data.datamodule.ChatDataModule"
# Errors that mean "the input is wrong", not "the library is broken": shown as one line without a traceback.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
               PermissionError, MisconfigurationException, RunError)  # fmt: skip


class Eagle3CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # `data:` is a ChatDataModule unless it names another class (HiddenStateDataModule for dumped features).
        parser.set_defaults({"trainer.precision": "32-true", "data": {"class_path": _CHAT_DATA}})

    def _add_subcommands(self, parser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        # Listed in --help; `main` runs it before LightningCLI parses anything (it is not a Trainer method).
        extra = {
            "export": "Write a trained draft for serving",
            "dump": "Store the frozen target's features once, to train drafts without it",
            "data-report": "Rows, refusals, lengths, roles and draft-vocab coverage of the config's data",
            "regenerate": "Rewrite a chat file's assistant turns with the target's own responses",
        }
        for name, text in extra.items():
            stub = argparse.ArgumentParser(prog=name, add_help=False)
            parser._subcommands_action.add_subcommand(name, stub, help=text)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI merges the checkpoint's hyperparameters over the parsed config here, which silently drops
        # explicit command-line values (--model.ttt_steps 3) and lets a checkpoint switch the run's draft
        # architecture. Ours: the run's config is what runs; the module refuses a checkpoint whose draft differs
        # (Eagle3Module.on_load_checkpoint). The file is still read now, so a missing or truncated one is refused by
        # name before the run writes its config and logs.
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path") if self.config.get("subcommand") else None
        if not ckpt_path or ckpt_path in ("last", "best", "hpc", "registry"):
            return
        if not Path(ckpt_path).exists():
            raise CheckpointLoadError(f"checkpoint {str(ckpt_path)!r} does not exist")
        if Path(ckpt_path).is_file():
            load_checkpoint_file(ckpt_path, weights_only=True)  # raises CheckpointLoadError naming the file

    def instantiate_trainer(self, **kwargs):
        """The step-counting progress bar unless the config disables the bar or brings its own."""
        config = self._get(self.config_init, "trainer", default={})
        callbacks = list(config.get("callbacks") or [])
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            config["callbacks"] = [*callbacks, StepProgressBar()]
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


def export_main(argv: list[str]) -> None:
    from lightning_eagle.draft.export import export_draft
    from lightning_eagle.draft.serving_format import CONFIG_NAME, serving_instructions

    parser = argparse.ArgumentParser(
        prog="lightning-eagle export", description="Write a trained draft in the EAGLE-3 serving layout."
    )
    parser.add_argument("checkpoint", help="Lightning checkpoint file or DCP folder written by fit")
    parser.add_argument("out_dir", help="output folder (config.json + model.safetensors), written atomically")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--include-embeddings", action="store_true", help="also write the (frozen) embedding")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    import torch

    path = export_draft(
        args.checkpoint,
        args.out_dir,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        include_embeddings=True if args.include_embeddings else None,
        overwrite=args.overwrite,
    )
    print(f"exported {args.checkpoint} to {path}")
    for line in serving_instructions(json.loads((path / CONFIG_NAME).read_text()), str(path)):
        print(line)


def dump_main(words: list[str], from_sys_argv: bool) -> None:
    """``dump --config … [--out DIR]``: the config's target, taps and data; Lightning ``predict`` with a writer."""
    from lightning_eagle.features import format as fmt
    from lightning_eagle.features.dump import dump_features

    parser = argparse.ArgumentParser(
        prog="lightning-eagle dump",
        description="Run the frozen target once over the config's data and store its EAGLE-3 features "
        "(then train with target_source: features, e.g. configs/quickstart_offline.yaml). Other options "
        "(--config, --trainer.*, --model.*, --data.*) are read as for fit.",
    )
    parser.add_argument("--out", default=None, help="features folder (default: <trainer.default_root_dir>/features)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="storage dtype of the states")
    parser.add_argument("--hidden-states", default="prenorm", choices=fmt.HIDDEN_KINDS,
                        help="final hidden before (default) or after the final norm")  # fmt: skip
    parser.add_argument("--shard-rows", type=int, default=256, help="rows per shard file")
    args, rest = parser.parse_known_args(words)
    cli = _make_cli(_resolve_packaged_configs(rest), from_sys_argv, run=False)
    if not isinstance(cli.datamodule, ChatDataModule):
        raise ValueError(
            f"dump reads chats through ChatDataModule, the config's data is {type(cli.datamodule).__name__}"
        )
    trainer = cli.trainer
    out = Path(args.out) if args.out else Path(trainer.default_root_dir) / "features"
    dump_features(cli.model, cli.datamodule, out, trainer, dtype=args.dtype, hidden_states=args.hidden_states,
                  shard_rows=args.shard_rows)  # fmt: skip


def _make_cli(words: list[str], from_sys_argv: bool, run: bool = True) -> Eagle3CLI:
    if from_sys_argv:  # LightningCLI warns when given `args` while sys.argv has arguments too
        sys.argv[1:] = words
    return Eagle3CLI(
        Eagle3Module, LightningDataModule, subclass_mode_data=True, run=run, args=None if from_sys_argv else words,
        save_config_kwargs={"overwrite": True},
    )  # fmt: skip


def _resolve_packaged_configs(words: list[str]) -> list[str]:
    out = list(words)
    for i, word in enumerate(out):
        if word == "--config" and i + 1 < len(out):
            out[i + 1] = str(resolve_config_path(out[i + 1]))
        elif word.startswith("--config="):
            out[i] = "--config=" + str(resolve_config_path(word.split("=", 1)[1]))
    return out


def _run(words: list[str], from_sys_argv: bool) -> None:
    if words and words[0] == "export":
        return export_main(words[1:])
    if words and words[0] == "dump":
        return dump_main(words[1:], from_sys_argv)
    if words and words[0] == "regenerate":
        from lightning_eagle.data.regenerate import main as regenerate_main

        return regenerate_main(words[1:])
    if words and words[0] == "data-report":
        from lightning_eagle.data.report import main as report_main

        return report_main(words[1:], from_sys_argv)
    _make_cli(_resolve_packaged_configs(words), from_sys_argv)


def main(argv: list[str] | None = None) -> None:
    # Lightning 2.6 with torch 2.13 warns about its own use of a deprecated pytree API on every run: not actionable.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    words = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in words or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    words = [w for w in words if w != "--debug"]
    try:
        _run(words, from_sys_argv=argv is None)
    except USER_ERRORS as exc:
        if debug:
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        print(f"error: {_real_reason(message)}\n(full traceback: add --debug or set {DEBUG_ENV}=1)", file=sys.stderr)
        raise SystemExit(1) from None


def _real_reason(message: str) -> str:
    """jsonargparse reports a constructor's own error inside "Does not validate against any of the Union subtypes"
    (one bullet per candidate type): the data module's reason first, the rest after it."""
    if not message.startswith("Does not validate against any of the Union subtypes"):
        return message
    bullets = [line[4:] for line in message.splitlines() if line.startswith("  - ")]
    reasons = [b for b in bullets if not b.startswith("Expected a <class 'NoneType'>")]
    return f"{reasons[0]}\n({message})" if reasons else message


if __name__ == "__main__":
    main()
