"""Old names and module paths that keep working until camviz 0.3, with a warning.

One warning for both (:func:`warn_moved`): the module paths of ``camviz.MOVED_MODULES``
warn when they are imported, and a public module whose names moved answers each old name
with a module ``__getattr__`` built by :func:`moved_names` from a table
``{old name: "new.module:attribute"}``. The module defines that ``__getattr__`` under
``if not TYPE_CHECKING:``, so that type checkers keep refusing unknown names (camviz's own
code uses the new ones).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

#: The release that removes the old names and paths.
REMOVED_IN = "0.3"

#: Every table given to :func:`moved_names`, by module name (read by the tests).
MOVED_NAMES: dict[str, Mapping[str, str]] = {}


def warn_moved(old: str, new: str, stacklevel: int = 1) -> None:
    """Warn that ``old`` (a dotted name or module path) is now ``new``.

    Args:
        old, new: Dotted paths, e.g. ``"camviz.render.clipped"``.
        stacklevel: The caller's frame to blame, counted from the function that calls this.
    """
    warnings.warn(
        f"{old} moved to {new}; the old path goes away in camviz {REMOVED_IN}",
        DeprecationWarning,
        stacklevel=stacklevel + 2,
    )


def moved_names(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that gives each old name of ``moved`` from its new place.

    Args:
        module: The module's ``__name__``.
        moved: ``{old name: "new.module:attribute"}``.

    Returns:
        The function to bind as the module's ``__getattr__``: it warns with
        :func:`warn_moved` and returns the new attribute; any other name raises the usual
        ``AttributeError``.
    """
    MOVED_NAMES[module] = moved

    def __getattr__(name: str) -> Any:  # noqa: N807 - the name Python looks for
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, attribute = moved[name].split(":")
        warn_moved(f"{module}.{name}", f"{new_module}.{attribute}")
        return getattr(importlib.import_module(new_module), attribute)

    return __getattr__
