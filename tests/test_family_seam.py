"""The draft-family seam, enforced: every library module is either family-neutral or a family's (the import-linter
contract "family-neutral modules import no draft family's module" in pyproject.toml lists both sides), and no neutral
module names a family — not in an identifier, not as a string it compares or passes (``family == "dspark"``,
``"DSparkModule"``) — so adding a family never edits shared code. Prose (docstrings, comments, messages that mention
a family as an example) is not code and is not checked."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import tomllib

from lightning_eagle.commands.cli import load_all_families
from lightning_eagle.draft.family import DRAFT_FAMILIES
from lightning_eagle.training.draft_training import TRAINING_FAMILIES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_eagle"
AGGREGATORS = {"lightning_eagle"} | {
    f"lightning_eagle.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
}


def _contract() -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (seam,) = [c for c in contracts if c["name"] == "family-neutral modules import no draft family's module"]
    return seam


def _modules() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _within(module: str, listed: list[str]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in listed)


def _neutral_modules() -> list[str]:
    seam = _contract()
    return sorted(m for m in _modules() if _within(m, seam["source_modules"]) and m not in AGGREGATORS)


def test_every_module_is_neutral_or_a_familys():
    seam = _contract()
    unplaced = sorted(
        m for m in _modules() - AGGREGATORS
        if not _within(m, seam["source_modules"]) and not _within(m, seam["forbidden_modules"])
        and not m.startswith("lightning_eagle.serving")  # its own contract: it imports nothing of ours
    )  # fmt: skip
    assert unplaced == [], "list each new module in pyproject.toml's family seam contract (neutral or a family's)"
    both = sorted(m for m in _modules() if _within(m, seam["source_modules"]) and _within(m, seam["forbidden_modules"]))
    assert both == []


def _code_tokens(path: Path):
    """The NAME tokens and the string literals that are not docstrings, comments or messages (f-strings, and plain
    strings of several words, are prose)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    previous = None
    for token in tokens:
        if token.type == tokenize.NAME:
            yield token
        elif token.type == tokenize.STRING:
            docstring = previous is None or previous.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            body = token.string.lstrip("rbuRBU").strip("'\"")
            if not docstring and not token.string.lower().startswith(("f", "rf")) and " " not in body:
                yield token
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token


def _family_words() -> set[str]:
    load_all_families()
    words = {name.lower() for name in DRAFT_FAMILIES} | {"eagle3", "dspark"}
    words |= {f.config_type.__name__.lower() for f in DRAFT_FAMILIES.values()}
    words |= {kind.__name__.lower() for kind in TRAINING_FAMILIES.values()}
    return words


def test_no_neutral_module_names_a_family():
    pattern = re.compile("|".join(sorted(map(re.escape, _family_words()), key=len, reverse=True)), re.I)
    found = {}
    for module in _neutral_modules():
        path = ROOT / (module.replace(".", "/") + ".py")
        if not path.is_file():
            path = ROOT / module.replace(".", "/") / "__init__.py"
        hits = [f"{t.start[0]}: {t.string}" for t in _code_tokens(path) if pattern.search(t.string)]
        if hits:
            found[module] = hits
    assert found == {}, "family-neutral code looks a family up by name (lightning_eagle.draft.family), never names it"


def test_the_checks_see_a_family_named_in_code(tmp_path):
    """The scan would catch the branch sites this seam removed."""
    pattern = re.compile("|".join(map(re.escape, _family_words())), re.I)
    sample = tmp_path / "sample.py"
    sample.write_text('"""A docstring about DSpark is prose."""\nif family == "dspark":\n    x = isinstance(d, '
                      "DSparkDraftConfig)\nraise ValueError(f\"a {name} DSpark message\")\n")  # fmt: skip
    assert [t.string for t in _code_tokens(sample) if pattern.search(t.string)] == ['"dspark"', "DSparkDraftConfig"]
