"""The public surface is chosen: the names of every public module (its ``__all__``) equal the
checked-in list ``tests/public_api.txt``, so that adding or dropping a public name is a
decision; every listed name resolves; and a name that left a public module still imports,
with a ``DeprecationWarning`` that names its new place, until camviz 0.3.

Public modules are ``camviz``, ``camviz.cams``, the short paths of
``camviz.PUBLIC_MODULES`` and every module path that the README or a notebook names.
Run this file (``PYTHONPATH=. python tests/test_public_api.py``) to rewrite the list.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import warnings
from pathlib import Path
from types import ModuleType

import pytest

import camviz
from camviz._deprecation import MOVED_NAMES

ROOT = Path(__file__).resolve().parent.parent
LISTING = Path(__file__).with_name("public_api.txt")
UPDATE = "PYTHONPATH=. python tests/test_public_api.py"


def is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:  # a name inside a module: "camviz.render.overlay"
        return False


def documented_module_paths() -> set[str]:
    """The module paths README.md and the notebooks name: ``camviz.core.layers.layer_shapes``
    names ``camviz.core.layers``. Old paths of ``camviz.MOVED_MODULES`` are not public."""
    texts = [(ROOT / "README.md").read_text(encoding="utf-8")]
    texts += [path.read_text(encoding="utf-8") for path in (ROOT / "notebooks").glob("*.ipynb")]
    found = set()
    for dotted in {name for text in texts for name in re.findall(r"\bcamviz(?:\.\w+)+", text)}:
        parts = dotted.split(".")
        prefixes = (".".join(parts[:end]) for end in range(len(parts), 0, -1))
        module = next(prefix for prefix in prefixes if is_module(prefix))
        if module not in camviz.MOVED_MODULES:
            found.add(module)
    return found


def public_modules() -> dict[str, ModuleType]:
    """``{the path users import: the module}`` of every public module."""
    paths = {"camviz", "camviz.cams", *camviz.PUBLIC_MODULES, *documented_module_paths()}
    return {path: importlib.import_module(path) for path in sorted(paths)}


def public_names() -> list[str]:
    """``module:name`` for every name of every public module's ``__all__``, sorted."""
    return sorted(
        f"{path}:{name}"
        for path, module in public_modules().items()
        for name in getattr(module, "__all__", ())
    )


def test_every_public_module_chooses_its_names_with_all():
    without = [path for path, module in public_modules().items() if "__all__" not in vars(module)]
    assert without == [], f"public modules without __all__: {without}; give each one"


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


@pytest.mark.parametrize(("module_name", "old", "new"), moved_names())
def test_a_name_that_left_a_public_module_imports_with_a_warning(module_name, old, new):
    module = importlib.import_module(module_name)
    new_module, attribute = new.split(":")
    assert old not in vars(module) and old not in module.__all__
    message = rf"^{re.escape(f'{module_name}.{old}')} moved to {re.escape(new.replace(':', '.'))};"
    with pytest.warns(DeprecationWarning, match=message) as caught:
        value = getattr(module, old)
    assert value is getattr(importlib.import_module(new_module), attribute)
    assert caught[0].filename == __file__  # the warning blames the caller's line
    with pytest.raises(AttributeError, match=rf"has no attribute 'no_such_{old}'"):
        getattr(module, f"no_such_{old}")


if __name__ == "__main__":
    LISTING.write_text("".join(f"{name}\n" for name in public_names()), encoding="utf-8")
