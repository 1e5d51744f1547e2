"""The layers ARCHITECTURE.md describes are the ones enforced: its layer block equals the import-linter contract in
pyproject.toml, the contracts hold (function-level imports count, no file-level cycles), and no library file grows
past the size a reader can hold."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from importlinter.cli import lint_imports

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport import-linter itself uses
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MAX_LIBRARY_LINES = 600


def _contract_layers() -> list[str]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return layers


def _architecture_layers() -> list[str]:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = re.search(r"## Layers\n.*?```text\n(.*?)```", text, re.S)
    assert block, "ARCHITECTURE.md has no '## Layers' section with a ```text block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def test_architecture_md_shows_the_enforced_layer_order():
    assert _architecture_layers() == _contract_layers()


def test_every_package_and_module_sits_in_a_layer():
    named = {name.strip() for layer in _contract_layers() for name in re.split(r"[|:]", layer)}
    package = ROOT / "lightning_eagle"
    children = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    children |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert children - named == set()
    assert named <= children


def test_the_import_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)
    # import-linter configures logging with dictConfig, which disables every logger that exists already: the
    # library's warnings would vanish for every later test in this process.
    loggers = [logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    enabled = [logger for logger in loggers if not logger.disabled]
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0
    finally:
        for logger in enabled:
            logger.disabled = False


def test_no_library_file_is_longer_than_a_reader_holds():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "lightning_eagle").rglob("*.py")
    }
    assert not {p: n for p, n in sizes.items() if n > MAX_LIBRARY_LINES}, "split these into files of one idea each"


def _table_rows(text: str, header: str) -> str:
    table = re.search(rf"{re.escape(header)}\n\|[-|]+\|\n((?:\|.*\n)+)", text)
    assert table, f"no table headed {header!r}"
    return table.group(1)


def test_the_docs_name_every_package_and_config():
    """ARCHITECTURE.md's package map names every package and bottom-layer module; the folder table of
    ``docs/layout.md`` (linked from the README) every package and every shipped config (a new one that the docs do not
    mention fails here)."""
    package = ROOT / "lightning_eagle"
    packages = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()} - {"configs", "assets"}
    package_map = _table_rows((ROOT / "ARCHITECTURE.md").read_text(), "| Package | Holds |")
    named = set(re.findall(r"`([a-z0-9_]+)/?`", package_map))
    bottom = {name.strip() for layer in _contract_layers()[-2:] for name in re.split(r"[|:]", layer)}
    assert (packages | bottom) - named == set()
    folders = _table_rows((ROOT / "docs" / "layout.md").read_text(), "| Folder | What |")
    assert {p for p in packages if f"`lightning_eagle/{p}/`" not in folders} == set()
    assert {c.name for c in (package / "configs").glob("*.yaml") if f"`{c.name}`" not in folders} == set()


def test_the_module_stays_small():
    """The LightningModule shows the step; what it is made of lives in files of their own (no mixin kept only to stay
    under the file cap)."""
    assert len((ROOT / "lightning_eagle" / "training" / "module.py").read_text().splitlines()) <= 350
