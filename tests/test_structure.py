"""The style rules that keep camviz easy to change, read from the source with ``ast``: no
function over 100 lines, no module over 600, no test of a target's class outside the target
modules, and ``__all__`` in every public module.

Each failure names the file, the line and the rule, one line per place.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import camviz

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "camviz"
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 600

# The target kinds, and every class the target modules define (collected below): only the
# target modules may test a value's class against them; everyone else asks the target.
TARGET_CLASSES = {
    "TopK",
    "Region",
    "Nearest",
    "Contrast",
    "Similarity",
    "Detection",
    "Followed",
    "DenseDetections",
}


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def target_modules() -> list[Path]:
    """``core/targets.py`` (or a ``core/targets*`` module, or a ``core/targets/`` package),
    ``core/detection.py`` and ``core/similarity.py``."""
    core = PACKAGE / "core"
    found = {*core.glob("targets*.py"), *(core / "targets").rglob("*.py")}
    found |= {path for path in (core / "detection.py", core / "similarity.py") if path.exists()}
    return sorted(found)


def target_classes() -> set[str]:
    defined = {
        node.name
        for path in target_modules()
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.ClassDef)
    }
    return TARGET_CLASSES | defined


# --- Functions and modules stay small -------------------------------------------------------


def test_no_function_is_over_100_lines() -> None:
    long = [
        f"{relative(path)}:{node.lineno}: {node.name} is {length} lines "
        f"(rule: no function over {MAX_FUNCTION_LINES} lines)"
        for path in modules()
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := function_lines(node)) > MAX_FUNCTION_LINES
    ]
    assert not long, "\n".join(long)


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """From ``def`` to the last line of the body, docstring included, decorators not."""
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def test_a_functions_lines_run_from_def_to_its_last_line() -> None:
    source = '@cache\ndef f(x):\n    """Doc."""\n\n    return x\nclass A:\n    def g(self): pass\n'
    found = {
        node.name: function_lines(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef)
    }
    assert found == {"f": 4, "g": 1}


def test_no_module_is_over_600_lines() -> None:
    long = [
        f"{relative(path)}:1: {lines} lines (rule: no module over {MAX_MODULE_LINES} lines)"
        for path in modules()
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "\n".join(long)


# --- Targets are asked, not inspected -------------------------------------------------------


def class_tests(tree: ast.Module, classes: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, what)`` for each ``isinstance``/``issubclass`` against one of ``classes``,
    each ``type(x) is X`` (``is not``, ``==``, ``!=``, ``in``) and each ``case X():``."""
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    wanted = classes - own  # a module's own class of the same name is another class

    def named(node: ast.expr) -> set[str]:
        if isinstance(node, ast.Name):
            return {node.id} & wanted
        if isinstance(node, ast.Attribute):
            return {node.attr} & wanted
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return set().union(*(named(element) for element in node.elts))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # A | B
            return named(node.left) | named(node.right)
        return set()

    def is_call_of(node: ast.expr, *functions: str) -> bool:
        return (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in functions
        )

    for node in ast.walk(tree):
        if is_call_of(node, "isinstance", "issubclass"):
            assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            hits = named(node.args[1]) if len(node.args) == 2 else set()
            if hits:
                yield node.lineno, f"{node.func.id}(..., {', '.join(sorted(hits))})"
        elif isinstance(node, ast.Compare) and is_call_of(node.left, "type"):
            hits = set().union(*(named(right) for right in node.comparators))
            if hits:
                yield node.lineno, f"type(...) compared with {', '.join(sorted(hits))}"
        elif isinstance(node, ast.MatchClass) and named(node.cls):
            yield node.lineno, f"case {', '.join(sorted(named(node.cls)))}()"


def test_no_module_outside_the_target_modules_tests_a_targets_class() -> None:
    classes = target_classes()
    allowed = set(target_modules())
    found = [
        f"{relative(path)}:{line}: {what} (rule: only the target modules test a target's "
        "class; ask the target instead)"
        for path in modules()
        if path not in allowed
        for line, what in sorted(class_tests(parsed(path), classes))
    ]
    assert not found, "\n".join(found)


def test_the_class_check_finds_every_form_and_only_target_classes() -> None:
    source = """
import camviz
from camviz.core.targets import Region
isinstance(t, Region)
isinstance(t, (int, camviz.Contrast))
issubclass(kind, TopK | str)
type(t) is Detection
type(t) in (Followed, int)
isinstance(t, int)
match t:
    case Similarity():
        pass
class Nearest: ...
isinstance(t, Nearest)
"""
    found = sorted(class_tests(ast.parse(source), target_classes()))
    assert found == [
        (4, "isinstance(..., Region)"),
        (5, "isinstance(..., Contrast)"),
        (6, "issubclass(..., TopK)"),
        (7, "type(...) compared with Detection"),
        (8, "type(...) compared with Followed"),
        (11, "case Similarity()"),
    ]  # line 9 tests an int; line 15 the module's own class


# --- A public module says what is public ----------------------------------------------------


def public_modules() -> dict[str, str]:
    """The public modules' dotted names, each with why it is public: ``camviz``,
    ``camviz.cams``, the modules of ``camviz.PUBLIC_MODULES``, and every ``camviz.*`` module
    path that README.md or a notebook names (an alias counts as the module it gives)."""
    public = {"camviz": "the package", "camviz.cams": "the method registry"}
    for alias, module in camviz.PUBLIC_MODULES.items():
        public.setdefault(module, f"camviz.PUBLIC_MODULES[{alias!r}]")
    documents = [ROOT / "README.md", *sorted((ROOT / "notebooks").glob("*.ipynb"))]
    for document in documents:
        for dotted in named_paths(document):
            module = module_of(dotted)
            if module is not None:
                public.setdefault(module, f"named in {relative(document)} as {dotted}")
    return public


def named_paths(document: Path) -> set[str]:
    """The dotted ``camviz...`` names a document holds, written out or imported
    (``from camviz import render`` names ``camviz.render``)."""
    text = document.read_text()
    if document.suffix == ".ipynb":
        text = "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
    names = set(re.findall(r"\bcamviz(?:\.\w+)+", text))
    for module, imported in re.findall(
        r"\bfrom\s+(camviz(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]*)", text
    ):
        for name in re.split(r"[\s,()]+", imported):
            if re.fullmatch(r"\w+", name) and name != "as":
                names.add(f"{module}.{name}")
    return names


def module_of(dotted: str) -> str | None:
    """The module that the longest importable prefix of ``dotted`` is (aliases followed)."""
    aliases = {**camviz.MOVED_MODULES, **camviz.PUBLIC_MODULES}
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in aliases:
            return aliases[name]
        if module_file(name) is not None:
            return name
    return None


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def test_every_public_module_has_all() -> None:
    missing = []
    for module, why in sorted(public_modules().items()):
        path = module_file(module)
        assert path is not None, f"{module} ({why}) has no file"
        assigned = [
            node
            for node in parsed(path).body
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign)
            and "__all__" in {target.id for target in assigned_names(node)}
        ]
        if not assigned:
            missing.append(
                f"{relative(path)}:1: no __all__ in {module}, {why} "
                "(rule: every public module lists its public names in __all__)"
            )
    assert not missing, "\n".join(missing)


def assigned_names(node: ast.Assign | ast.AnnAssign | ast.AugAssign) -> list[ast.Name]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [target for target in targets if isinstance(target, ast.Name)]


def test_public_modules_include_the_aliases_and_the_modules_the_documents_name() -> None:
    public = public_modules()
    assert {"camviz", "camviz.cams", "camviz.io.render", "camviz.evaluation.metrics"} <= set(public)
    assert module_of("camviz.render.overlay") == "camviz.io.render"
    assert module_of("camviz.cams.engine.no_such_name") == "camviz.cams.engine"
    assert module_of("camviz.explain") == "camviz"
