"""Every command of this project that the README or a ``docs/`` page shows still parses, with the project's own parsers
and without running anything.

Commands are read from the shell blocks (```` ```bash ````) and the inline code spans of ``README.md`` and
``docs/*.md``: ``python cli.py …``, ``lightning-eagle …``, ``python -m lightning_eagle.commands[.X] …`` (also after
``torchrun … -m``), and ``python benchmarks/X.py`` (the script exists).

* ``fit`` / ``validate`` / ``test`` / ``predict``: the ``lightning-eagle`` LightningCLI parser (:class:`RunCLI` with
  the run classes of the words, the flat-key refusal and the packaged config names first, as ``cli.main`` does), built
  and asked to parse only: no model, data module or trainer is made, nothing runs; ``--config`` files must exist.
* the other subcommands (``export``, ``dump``, ``extract``, ``data-report``, ``regenerate``, ``memory-plan``,
  ``acceptance``) and the ``python -m`` modules: the command's own :class:`CommandParser`, caught as the command's
  ``main`` first asks it to parse (nothing before that runs anything) and then given the words; what ``dump`` /
  ``extract`` / ``data-report`` leave to the run config, and ``memory-plan``'s ``--config``, are parsed by the
  LightningCLI parser as those commands do.
* an inline span that shows only part of a command (``cli.py acceptance --num-draft-tokens 7 …`` without ``--target``)
  is held to what it shows: the subcommand exists and every option it names is one of the parser's.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

from lightning_eagle.commands.arguments import CommandParser, RunParser, option_strings
from lightning_eagle.commands.cli import (
    COMMANDS,
    RunCLI,
    refuse_flat_settings,
    resolve_packaged_configs,
    run_classes,
)
from lightning_eagle.configs import resolve_config_path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TRAINER_METHODS = ("fit", "validate", "test", "predict")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)  # every fenced block, opening and closing paired
SHELLS = ("bash", "sh", "shell", "console", "")
PROJECT = re.compile(r"\b(cli\.py|lightning-eagle|lightning_eagle\.commands|benchmarks/)")
SUBCOMMANDS = ("fit", "validate", "export", "dump", "extract", "data-report", "regenerate", "memory-plan", "acceptance")


# ---- what the pages show ---------------------------------------------------------------------------------------------
def _invocation(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(what runs, its words) when ``tokens`` invoke this project: ``cli`` for the ``lightning-eagle`` command, a
    module name under ``lightning_eagle.commands``, or ``script`` for ``python benchmarks/X.py``."""
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):  # VAR=value prefixes
        tokens = tokens[1:]
    if not tokens:
        return None
    python = tokens[0] in ("python", "python3")
    if tokens[0] == "lightning-eagle" or tokens[0] == "cli.py":
        return "cli", tokens[1:]
    if python and len(tokens) > 1 and tokens[1] == "cli.py":
        return "cli", tokens[2:]
    if python and len(tokens) > 1 and tokens[1].startswith("benchmarks/"):
        return "script", tokens[1:2]
    if (python or tokens[0] == "torchrun") and "-m" in tokens:
        at = tokens.index("-m")
        module = tokens[at + 1] if at + 1 < len(tokens) else ""
        if module in ("lightning_eagle.commands", "lightning_eagle.commands.cli"):
            return "cli", tokens[at + 2 :]
        if module.startswith("lightning_eagle.commands."):
            return module.removeprefix("lightning_eagle.commands."), tokens[at + 2 :]
    return None


def _commands() -> list[tuple[str, str, list[str], bool]]:
    """(where, what runs, words, whole) for every command the pages show; ``whole``: a shell block's line (it must
    parse as it stands), not an inline span (which may show part of a command)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            if block.group(1) not in SHELLS:
                continue
            line_no = text[: block.start()].count("\n") + 2
            for line in block.group(2).replace("\\\n", " ").splitlines():
                for part in " ".join(shlex.split(line, comments=True)).split(" && "):
                    hit = _invocation(shlex.split(part))
                    if hit:
                        found.append((f"{page.name}:{line_no}: {part}", *hit, True))
                line_no += 1
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
            shown = " ".join(span.group(1).split())
            if not PROJECT.search(shown):
                continue
            if "…" in shown or "<" in shown:
                continue  # a pattern (`lightning-eagle …`, `python -m lightning_eagle.commands.<name>`)
            hit = _invocation(shlex.split(shown))
            if hit and (hit[1] or hit[0] != "cli"):
                line_no = text[: span.start()].count("\n") + 1
                found.append((f"{page.name}:{line_no}: `{shown}`", *hit, False))
    return found


COMMANDS_SHOWN = _commands()


# ---- the project's parsers, asked to parse only ----------------------------------------------------------------------
class _ParseOnlyCLI(RunCLI):
    """The ``lightning-eagle`` LightningCLI that builds its parser and stops: no parsing, seed or instantiation here."""

    def parse_arguments(self, parser, args) -> None:
        self.config = {"subcommand": None}

    def _parse_ckpt_path(self) -> None:
        pass

    def _set_seed(self) -> None:
        pass

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def after_instantiate_classes(self) -> None:
        pass


_PARSERS: dict = {}


def parse_run(words: list[str], subcommands: bool = True):
    """``words`` parsed as ``cli.main`` (subcommands: ``fit`` …) or ``config_cli`` (a run config without a
    subcommand: ``dump``, ``data-report``, ``memory-plan``) would, without building anything. Raises on a bad word."""
    words = resolve_packaged_configs(words)
    for i, word in enumerate(words):
        if word == "--config":
            assert Path(words[i + 1]).is_file(), f"--config {words[i + 1]}: no such file"
    refuse_flat_settings(words)
    classes = run_classes(words)
    key = (subcommands, classes["model_class"])
    if key not in _PARSERS:
        cli = _ParseOnlyCLI(**classes, run=subcommands, args=[], parser_class=RunParser,
                            load_from_checkpoint_support=False, parser_kwargs={"exit_on_error": False})  # fmt: skip
        _PARSERS[key] = cli.parser
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            return _PARSERS[key].parse_args(words)
        except SystemExit as stop:  # --print_config prints the config and exits 0
            if stop.code:
                raise
            return None


class _Asked(BaseException):
    """Raised when a command's ``main`` first asks its parser to parse: the parser and how it was asked."""

    def __init__(self, parser: CommandParser, method: str) -> None:
        self.parser, self.method = parser, method


def command_parser(module: str, monkeypatch) -> tuple[CommandParser, str]:
    """The parser ``lightning_eagle.commands.<module>.main`` builds, caught before it parses anything."""

    def asked(method):
        def ask(self, *args, **kwargs):
            raise _Asked(self, method)

        return ask

    main = importlib.import_module(f"lightning_eagle.commands.{module}").main
    with monkeypatch.context() as patch:
        for method in ("parse_args", "parse_known_args"):
            patch.setattr(CommandParser, method, asked(method))
        try:
            main([])
        except _Asked as caught:
            return caught.parser, caught.method
    raise AssertionError(f"lightning_eagle.commands.{module}.main never asked its parser to parse")


def _module_of(subcommand: str) -> str:
    assert subcommand in COMMANDS, f"{subcommand!r} is not a lightning-eagle subcommand ({', '.join(COMMANDS)})"
    return COMMANDS[subcommand][0]


def _check_command(module: str, words: list[str], whole: bool, monkeypatch) -> None:
    parser, method = command_parser(module, monkeypatch)
    if not whole and not words:
        return  # `python -m lightning_eagle.commands.smoke_target` as a name: the module and its parser exist
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            parsed = getattr(parser, method)(words)
    except SystemExit:
        message = err.getvalue()
        if whole or "required" not in message:
            raise AssertionError(message.strip()) from None
        known = option_strings(parser)  # part of a command: every option it shows is the parser's
        unknown = [w for w in words if w.startswith("--") and w.split("=", 1)[0] not in known]
        assert not unknown, f"not options of {parser.prog}: {unknown}"
        return
    rest = parsed[1] if method == "parse_known_args" else []
    if module in ("dump", "extract", "data_report"):  # the rest is the run config, read as fit reads it
        if module == "data_report":
            rest = importlib.import_module("lightning_eagle.commands.data_report").with_trainer_overrides(rest)
        parse_run(rest, subcommands=False)
    elif module == "memory_plan":
        parse_run(["--config", str(resolve_config_path(parsed.config))], subcommands=False)
    else:
        assert not rest, rest


# ---- the tests -------------------------------------------------------------------------------------------------------
def test_the_pages_show_commands_of_every_kind():
    shown = {(what, words[0] if what == "cli" and words else what) for _, what, words, _ in COMMANDS_SHOWN}
    subcommands = {sub for what, sub in shown if what == "cli"}
    assert set(SUBCOMMANDS) <= subcommands
    assert len(COMMANDS_SHOWN) >= 30


@pytest.mark.parametrize(
    ("what", "words", "whole"),
    [c[1:] for c in COMMANDS_SHOWN],
    ids=[c[0] for c in COMMANDS_SHOWN],
)
def test_every_command_shown_parses(what, words, whole, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-eagle"])  # a parser never reads pytest's own words
    if what == "script":
        assert (ROOT / words[0]).is_file(), words[0]
    elif what != "cli":
        _check_command(what, words, whole, monkeypatch)
    elif not words or words[0] in TRAINER_METHODS:
        assert words, "a lightning-eagle command names its subcommand"
        parse_run(words)
    else:
        _check_command(_module_of(words[0]), words[1:], whole, monkeypatch)


def test_a_wrong_command_is_caught(monkeypatch):
    """The check is not vacuous: a mistyped option, a missing config and an unknown subcommand all fail it."""
    with pytest.raises(Exception, match="ttt_step"):
        parse_run(["fit", "--config", "configs/quickstart.yaml", "--model.objective.ttt_step", "3"])
    with pytest.raises(AssertionError, match="no such file"):
        parse_run(["fit", "--config", "configs/nowhere.yaml"])
    with pytest.raises(AssertionError, match="--gpu-gbs"):
        _check_command("memory_plan", ["--config", "quickstart", "--gpu-gbs", "80"], True, monkeypatch)
    with pytest.raises(AssertionError, match="not a lightning-eagle subcommand"):
        _module_of("train")
