"""The folder tree is the architecture: imports flow one way, and the README shows every part."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "camviz"

# What each part may import from camviz (besides itself, the package root's __version__ and
# camviz._deprecation, which imports nothing of camviz).
ALLOWED = {
    "core": {"core"},
    "cams": {"core", "cams"},
    "io": {"core", "io"},
    "debug": {"core", "io", "debug"},
    "pipeline": {"core", "cams", "io", "debug", "pipeline"},
    "evaluation": {"core", "cams", "io", "debug", "evaluation"},
    "training": {"core", "cams", "io", "pipeline", "evaluation", "training"},
    "integrations": {"core", "cams", "training", "integrations"},
    "units": {"core", "cams", "io", "debug", "pipeline", "units"},
    "explorer": {"core", "cams", "io", "debug", "pipeline", "evaluation", "explorer"},
    "cli": {"core", "cams", "io", "debug", "pipeline", "evaluation", "explorer", "units", "cli"},
}


ROOT_MODULES = ("__version__", "_deprecation")


def _camviz_imports(path: Path) -> set[str]:
    """The camviz parts a module imports (``camviz.core.hooks`` -> ``core``)."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            pieces = name.split(".")
            if pieces[0] == "camviz" and len(pieces) > 1 and pieces[1] not in ROOT_MODULES:
                parts.add(pieces[1])
    return parts


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_imports_flow_one_way(part: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(_camviz_imports(path) - ALLOWED[part])
        for path in sorted((PACKAGE / part).glob("*.py"))
    }
    assert {path: parts for path, parts in wrong.items() if parts} == {}


def test_the_deprecation_helper_imports_nothing_of_camviz() -> None:
    assert _camviz_imports(PACKAGE / "_deprecation.py") == set()


def test_every_part_is_a_package_named_in_the_readme_tree_and_the_architecture() -> None:
    parts = sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists())
    assert parts == sorted(ALLOWED)
    readme = (ROOT / "README.md").read_text()
    tree = re.search(r"```text\ncamviz/\n(.*?)```", readme, re.S)
    assert tree is not None
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for part in parts:
        assert re.search(rf"^  {part}/ ", tree.group(1), re.M), part
        assert f"  {part}/ " in architecture, part
    for module in sorted(PACKAGE.glob("*/*.py")):
        if module.name != "__init__.py" and module.parent.name not in ("cams", "cli"):
            assert module.name in tree.group(1), f"README tree lacks {module.relative_to(ROOT)}"
