"""The layers ARCHITECTURE.md describes are the ones enforced: its layer block equals the import-linter contract in
pyproject.toml, the contracts hold (function-level imports count, no file-level cycles), and no library file grows
past the size a reader can hold."""

from __future__ import annotations

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
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_no_library_file_is_longer_than_a_reader_holds():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "lightning_eagle").rglob("*.py")
    }
    assert not {p: n for p, n in sizes.items() if n > MAX_LIBRARY_LINES}, "split these into files of one idea each"
