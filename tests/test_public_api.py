"""The public surface is chosen: the names of every public module (its ``__all__``) equal the
checked-in list ``tests/public_api.txt``, so that adding or dropping a public name is a
decision; every listed name resolves; and a name that left a public module still imports,
with a ``DeprecationWarning`` that names its new place, until camviz 0.3.

Public modules are ``camviz``, ``camviz.cams``, the modules of ``camviz.PUBLIC_MODULES`` and
every module path that the README or a notebook names (``tests/test_structure.py`` finds
them, and checks that each has ``__all__``); the list names each module by the path users
import. Run this file (``PYTHONPATH=. python tests/test_public_api.py``) to rewrite the list.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path
from types import ModuleType

import pytest
from test_structure import public_modules as public_module_names

import camviz
from camviz._deprecation import MOVED_NAMES

LISTING = Path(__file__).with_name("public_api.txt")
UPDATE = "PYTHONPATH=. python tests/test_public_api.py"


def public_modules() -> dict[str, ModuleType]:
    """``{the path users import: the module}`` of every public module (the modules of
    ``test_structure.public_modules``, each under its short path where it has one)."""
    short = {module: alias for alias, module in camviz.PUBLIC_MODULES.items()}
    return {
        short.get(name, name): importlib.import_module(name)
        for name in sorted(public_module_names())
    }


def public_names() -> list[str]:
    """``module:name`` for every name of every public module's ``__all__``, sorted."""
    return sorted(
        f"{path}:{name}" for path, module in public_modules().items() for name in module.__all__
    )


def test_the_public_names_are_the_checked_in_list():
    listed = LISTING.read_text(encoding="utf-8").splitlines()
    names = public_names()
    added, dropped = sorted(set(names) - set(listed)), sorted(set(listed) - set(names))
    assert names == listed, (
        f"the public API changed: added {added}, dropped {dropped}. If that is a decision, "
        f"rewrite tests/public_api.txt with `{UPDATE}` and say so in CHANGELOG.md; a dropped "
        "name keeps importing until 0.3 through camviz._deprecation.moved_names"
    )


def test_every_public_name_resolves_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for path, module in public_modules().items():
            assert len(set(module.__all__)) == len(module.__all__), f"{path}: a name twice"
            for name in module.__all__:
                assert hasattr(module, name), f"{path}.__all__ lists {name}, which it lacks"


def moved_names() -> list[tuple[str, str, str]]:
    public_modules()  # every module that declares its moved names is imported
    return sorted(
        (module, old, new) for module, table in MOVED_NAMES.items() for old, new in table.items()
    )


def test_every_name_that_left_a_public_module_imports_with_a_warning():
    # One test over every moved name, not one per name: parametrizing would import every
    # public module at collection, seconds paid by each pytest-xdist worker.
    moved = moved_names()
    assert moved
    for module_name, old, new in moved:
        module = importlib.import_module(module_name)
        new_module, attribute = new.split(":")
        assert old not in vars(module) and old not in module.__all__
        moved_to = re.escape(new.replace(":", "."))
        message = rf"^{re.escape(f'{module_name}.{old}')} moved to {moved_to};"
        with pytest.warns(DeprecationWarning, match=message) as caught:
            value = getattr(module, old)
        assert value is getattr(importlib.import_module(new_module), attribute)
        assert caught[0].filename == __file__  # the warning blames the caller's line
        with pytest.raises(AttributeError, match=rf"has no attribute 'no_such_{old}'"):
            getattr(module, f"no_such_{old}")


if __name__ == "__main__":
    LISTING.write_text("".join(f"{name}\n" for name in public_names()), encoding="utf-8")
