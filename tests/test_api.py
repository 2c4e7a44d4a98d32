"""The top-level namespace: every export resolves, and none is shadowed by a submodule."""

from __future__ import annotations

import importlib
import pkgutil

import camviz


def test_every_export_resolves_to_what_its_module_defines():
    for name in camviz.__all__:
        if name == "__version__":
            continue
        module, attribute = camviz._EXPORTS[name].split(":")
        assert getattr(camviz, name) is getattr(importlib.import_module(module), attribute)


def test_exports_stay_functions_after_every_submodule_is_imported():
    # Importing a submodule binds it as an attribute of the package; a submodule named
    # like an export would silently replace the function (camviz.features(...) failing).
    for module in pkgutil.walk_packages(camviz.__path__, "camviz."):
        if module.name != "camviz.__main__":
            importlib.import_module(module.name)
    for name in camviz.__all__:
        if name != "__version__":
            assert not hasattr(getattr(camviz, name), "__path__") and not isinstance(
                getattr(camviz, name), type(camviz)
            ), name


def test_readme_methods_table_is_the_registry_table():
    from pathlib import Path

    from camviz import cams

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert cams.table() in readme
