"""The config of a run, read by a command that is not a Trainer method (``dump``, ``data-report``): the same
LightningCLI as ``fit`` (packaged config names resolved, ``--data.*`` / ``--trainer.*`` / ``--model.*`` overrides),
built without running anything, and refused unless its data reads chats."""

from __future__ import annotations

from lightning_eagle.commands.cli import RunCLI, make_cli, resolve_packaged_configs
from lightning_eagle.data.datamodule import ChatDataModule


def chat_data_cli(words: list[str], from_sys_argv: bool, command: str) -> RunCLI:
    """The LightningCLI (``run=False``: model, data module and trainer instantiated, nothing run) of ``words``, the
    config options left once ``command`` has taken its own.

    ``from_sys_argv``: True when ``words`` come from ``sys.argv`` (LightningCLI then reads them from there).
    Raises ``ValueError`` naming ``command`` when the config's data is not a ``ChatDataModule`` (e.g. a
    ``HiddenStateDataModule`` of dumped features: there are no chats to read)."""
    cli = make_cli(resolve_packaged_configs(words), from_sys_argv, run=False)
    if not isinstance(cli.datamodule, ChatDataModule):
        raise ValueError(
            f"{command} reads chats through ChatDataModule, the config's data is {type(cli.datamodule).__name__}"
        )
    return cli
