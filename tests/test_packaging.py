"""The package's public surface: the type checkers' view of ``camviz`` (its TYPE_CHECKING
imports) is the lazy ``_EXPORTS`` table plus the public module aliases, and every public and
old module path imports as documented."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

import camviz


def type_checking_block() -> tuple[dict[str, tuple[str, str]], list[str]]:
    """``{bound name: (module, imported name)}`` of the ``if TYPE_CHECKING:`` block, and the
    names it adds to ``__all__``."""
    tree = ast.parse(Path(camviz.__file__).read_text(encoding="utf-8"))
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    ]
    imported: dict[str, tuple[str, str]] = {}
    listed: list[str] = []
    for statement in block.body:
        if isinstance(statement, ast.AugAssign):
            assert ast.unparse(statement.target) == "__all__", ast.unparse(statement)
            listed += ast.literal_eval(statement.value)
            continue
        assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
        assert statement.module is not None and statement.level == 0, ast.unparse(statement)
        for alias in statement.names:
            name = alias.asname or alias.name
            assert name not in imported, f"{name} is imported twice"
            imported[name] = (statement.module, alias.name)
    return imported, listed


def test_type_checking_imports_are_the_export_table_and_the_module_aliases():
    imported, _ = type_checking_block()
    expected = {name: tuple(target.split(":")) for name, target in camviz._EXPORTS.items()}
    for alias, target in camviz.PUBLIC_MODULES.items():
        expected[alias.removeprefix("camviz.")] = tuple(target.rsplit(".", 1))
    expected["cams"] = ("camviz", "cams")
    assert imported == expected


def test_type_checkers_see_every_export_as_re_exported():
    # Type checkers cannot evaluate the runtime __all__. For them `from m import x as x`
    # re-exports x (PEP 484); a name imported as another needs its own line in __all__.
    imported, listed = type_checking_block()
    renamed = sorted(name for name, (_, original) in imported.items() if name != original)
    assert listed == renamed


def test_every_export_and_public_module_imports_without_a_warning(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, target in camviz._EXPORTS.items():
            module, attribute = target.split(":")
            assert getattr(camviz, name) is getattr(importlib.import_module(module), attribute)
        for alias, target in camviz.PUBLIC_MODULES.items():
            monkeypatch.delitem(sys.modules, alias, raising=False)  # import it afresh
            module = importlib.import_module(alias)
            assert module is importlib.import_module(target)
            assert module.__name__ == module.__spec__.name == target
            assert getattr(camviz, alias.removeprefix("camviz.")) is module


@pytest.mark.parametrize(("old", "new"), sorted(camviz.MOVED_MODULES.items()))
def test_old_module_paths_warn_and_give_the_moved_module(monkeypatch, old, new):
    monkeypatch.delitem(sys.modules, old, raising=False)  # import it afresh
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} moved to {re.escape(new)};"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new
