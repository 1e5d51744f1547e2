"""How every command's parser fails: one ``error:`` line naming the bad word, the nearest option for a typo, and where
the full usage is; never a guessed abbreviation and never a screen of usage above the line that matters.

argparse (and jsonargparse under LightningCLI) would print the whole usage (74 lines for ``fit``) before the error and
take ``--model.objective.ttt_step`` as ``ttt_steps``. Both parsers here turn abbreviations off and route errors through
:func:`one_line_error`.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from lightning_eagle.commands.strict_yaml import PARSER_MODE

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_UNKNOWN_OPTION = re.compile(r"does not accept option '([^']+)'")


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--option`` the parser (with its nested groups) knows."""
    return sorted({o for action in parser._actions for o in action.option_strings if o.startswith("--")})


def nearest_option(word: str, options: list[str]) -> str | None:
    """The known option a mistyped ``word`` most likely meant (the one it abbreviates, else difflib's nearest with
    ratio >= 0.75), or None."""
    flag = word.split("=", 1)[0]
    if not flag.startswith("-"):
        flag = "--" + flag
    completions = [o for o in options if o.startswith(flag)]
    if len(completions) == 1:
        return completions[0]
    found = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
    return found[0] if found else None


def with_suggestion(message: str, options: list[str]) -> str:
    """``message`` plus "did you mean --x?" for the first unknown option it names, when one is close."""
    unknown = _UNRECOGNIZED.search(message) or _UNKNOWN_OPTION.search(message)
    if unknown is None:
        return message
    for word in unknown.group(1).split():
        if word.startswith("-") or "." in word:
            nearest = nearest_option(word, options)
            if nearest:
                return f"{message} (did you mean {nearest}?)"
    return message


def one_line_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Print ``error: …`` (with the nearest option for a typo) and a pointer to ``--help``; exit 2 like argparse."""
    prog = parser.prog.replace(" [options]", "")
    sys.stderr.write(f"error: {with_suggestion(message, option_strings(parser))}\n(usage: {prog} --help)\n")
    raise SystemExit(2)


class CommandParser(argparse.ArgumentParser):
    """The parser of the commands that are not Trainer methods (export, memory-plan, …)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        one_line_error(self, message)


class RunParser(LightningArgumentParser):
    """LightningCLI's parser for ``fit``/``validate``/…: the same one-line errors (jsonargparse names the subcommand's
    parser on the exception, whose options are the ones to suggest from). Every config file and value it reads goes
    through :mod:`lightning_eagle.commands.strict_yaml` (duplicate keys, alias bombs and unknown tags refused)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("parser_mode", PARSER_MODE)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)  # raises jsonargparse's ArgumentError for the caller to handle
        one_line_error(getattr(ex, "subcommand_parser", None) or self, family_reason(message))


def family_reason(message: str) -> str:
    """A config naming its draft family (``model.class_path``) is parsed in subclass mode, where jsonargparse wraps
    the class's own complaint in a union report; that complaint, with the key it names under ``model.``."""
    family = re.search(r"Problem with given class_path '([^']+)':\n((?: {8}.*\n?)+)", message)
    if not (message.startswith('Parser key "model":') and family):
        return message
    inner = " ".join(line.strip() for line in family.group(2).splitlines())
    inner = inner.replace('Parser key "', 'Parser key "model.')
    return f"model ({family.group(1)}): {inner}"
