"""The lazily exported public API is complete for IDEs and type checkers: each package's ``if TYPE_CHECKING:`` block
imports exactly the names of its lazy ``_EXPORTS`` table, from the module the table names, and every name resolves."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

PACKAGES = ["lightning_eagle", "lightning_eagle.parallel"]


def _type_checking_imports(module) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(module))
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.dump(stmt)
                names.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    return names


@pytest.mark.parametrize("name", PACKAGES)
def test_type_checking_block_matches_the_lazy_exports(name):
    package = importlib.import_module(name)
    seen = _type_checking_imports(package)
    assert set(seen) == set(package._EXPORTS)
    for export, home in package._EXPORTS.items():
        assert seen[export] == home or importlib.import_module(seen[export]).__dict__.get(export) is getattr(
            importlib.import_module(home), export
        ), export


@pytest.mark.parametrize("name", [*PACKAGES, "lightning_eagle.training", "lightning_eagle.inference"])
def test_every_public_name_resolves(name):
    package = importlib.import_module(name)
    for export in package.__all__:
        assert getattr(package, export) is not None, export
