"""The one table of CAM methods, by name.

The CLI's ``--method`` choices, :func:`camviz.explain`'s ``method=``, the README's table
and the tests' parametrisation all read this registry, so a method added here is everywhere.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, TypeVar

from camviz.core.errors import CamvizError

if TYPE_CHECKING:
    from torch import nn

    from camviz.cams.base import CamMethod

_METHODS: dict[str, type[CamMethod]] = {}

M = TypeVar("M", bound="type[CamMethod]")


def register(cls: M) -> M:
    """Class decorator: add a :class:`~camviz.cams.base.CamMethod` under ``cls.name``."""
    if cls.name in _METHODS:
        raise ValueError(f"a CAM method named {cls.name!r} is already registered")
    _METHODS[cls.name] = cls
    return cls


def get(name: str) -> type[CamMethod]:
    """The method class registered as ``name`` (case, ``-``, ``_`` ignored; ``+`` = ``p``)."""
    for registered, cls in _METHODS.items():
        if _key(registered) == _key(name):
            return cls
    raise CamvizError(f"unknown CAM method {name!r}; choose one of: {', '.join(names())}")


def create(name: str, **options: Any) -> CamMethod:
    """The method registered as ``name``, built with ``options`` (its constructor's).

    Raises:
        CamvizError: An unknown name, or an option the method does not take.
    """
    cls = get(name)
    parameters = inspect.signature(cls).parameters.values()
    if any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters):
        return cls(**options)  # a wrapper: it hands the options on to its base method's create
    accepted = [
        parameter.name for parameter in parameters if parameter.kind != parameter.VAR_POSITIONAL
    ]
    unknown = [option for option in options if option not in accepted]
    if unknown:
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes none"
        raise CamvizError(f"{cls.name} has no option {unknown[0]!r}; {takes}")
    return cls(**options)


def _key(name: str) -> str:
    """How names compare: ``Grad-CAM++``, ``gradcam++`` and ``gradcam_pp`` are one method."""
    return name.lower().replace("-", "").replace("_", "").replace("+", "p")


def names(model: nn.Module | None = None) -> list[str]:
    """Every registered method name, in registration order; with a ``model``, only those
    that can explain it (``legrad`` needs a vision transformer)."""
    return [name for name, cls in _METHODS.items() if model is None or cls.applies_to(model)]


def table() -> str:
    """A Markdown table of the methods: name, what it needs, paper."""
    rows = ["| method | needs | paper |", "| --- | --- | --- |"]
    for name, cls in _METHODS.items():
        rows.append(f"| `{name}` | {cls.needs} | {cls.paper} |")
    return "\n".join(rows)
