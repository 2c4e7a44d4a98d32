"""A user's own model: ``package.module:factory`` or ``path/to/file.py:factory``.

The factory is a function that returns an ``nn.Module``, called with the keyword arguments
of ``--model-arg key=value`` (``model_args=`` in Python). ``package.module`` is imported with
the current directory first on ``sys.path``, as ``python -m`` does; a file is run as the
user's own code, with its folder first on ``sys.path`` as ``python file.py`` does (both only
while the model is built). A factory that returns an Ultralytics model is explained as one
(:mod:`camviz.io.sources.ultralytics`).

camviz knows nothing of such a model's preprocessing: the images keep their size, with mean 0
and std 1, unless ``--input-size``, ``--mean``, ``--std`` and ``--channels`` say otherwise;
its classes are ``class 0``, ``class 1``, ... unless ``--classes FILE`` names them.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import nn

from camviz.core.errors import CamvizError, first_line
from camviz.io.checkpoints import load_weights
from camviz.io.sources import ultralytics
from camviz.io.sources.base import ModelSource, SourceOptions

if TYPE_CHECKING:
    from camviz.io.architectures import Task
    from camviz.io.images import Preprocess

__all__ = ["FactorySource", "is_factory"]

# A dotted module path: identifiers joined by dots.
_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_factory(name: str) -> bool:
    """Whether ``name`` reads as ``package.module:factory`` or ``file.py:factory``."""
    where, colon, factory = name.rpartition(":")
    return (
        bool(colon)
        and factory.isidentifier()
        and (where.endswith(".py") or _MODULE_PATH.fullmatch(where) is not None)
    )


class FactorySource(ModelSource):
    """``package.module:factory`` or ``path/to/file.py:factory`` (see the module docstring)."""

    def __init__(self, name: str, options: SourceOptions) -> None:
        self.where, _, self.factory_name = name.rpartition(":")
        # The arguments are part of the name: a folder made with others is another model's.
        arguments = ", ".join(f"{key}={value!r}" for key, value in options.model_args.items())
        self.name = f"{name}({arguments})" if arguments else name
        self.options = options
        self.adapted: ultralytics.Adapted | None = None

    def build(self) -> nn.Module:
        factory = self._factory()
        _check_arguments(factory, self.options.model_args, f"{self.where}:{self.factory_name}")
        with _running_user_code(self.name, self.where):
            model = factory(**self.options.model_args)
        self.adapted = ultralytics.adapted(model)
        if self.adapted is not None:
            model = self.adapted.model
        elif not isinstance(model, nn.Module):
            raise CamvizError(
                f"{self.name} returned {type(model).__name__}, not a torch.nn.Module; the "
                "factory must return the model"
            )
        if self.options.weights is not None:
            load_weights(model, self.options.weights, self.name)
        return model

    def preprocess(self) -> Preprocess:
        from camviz.io.images import Preprocess

        if self.adapted is not None:
            return self.adapted.preprocess
        return Preprocess(mean=(0.0,), std=(1.0,), resize="none")

    def class_names(self, model: nn.Module) -> list[str] | None:
        return None if self.adapted is None else self.adapted.class_names

    def task(self, model: nn.Module) -> Task | None:
        return None if self.adapted is None else self.adapted.task

    def _factory(self) -> Callable[..., Any]:
        module = _file_module(Path(self.where)) if self.where.endswith(".py") else self._module()
        factory = getattr(module, self.factory_name, None)
        if factory is None:
            functions = [
                name for name, value in vars(module).items() if _is_public_callable(name, value)
            ]
            close = difflib.get_close_matches(self.factory_name, functions, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise CamvizError(
                f"{self.where} has no {self.factory_name!r}; {hint}give a function that returns "
                f"the model (its functions: {', '.join(functions[:8]) or 'none'})"
            )
        if not callable(factory):
            raise CamvizError(
                f"{self.name} is a {type(factory).__name__}, not a function; give a function "
                "that returns the model"
            )
        return factory

    def _module(self) -> ModuleType:
        with _first_on_path(Path.cwd()), _running_user_code(self.name, self.where):
            try:
                return importlib.import_module(self.where)
            except ModuleNotFoundError as error:
                if error.name is None or not self.where.startswith(error.name):
                    raise  # the module exists but imports something missing
                raise CamvizError(
                    f"cannot import {self.where} ({first_line(error)}); run camviz from the "
                    f"folder that holds it, or give its file: path/to/file.py:{self.factory_name}"
                ) from None


def _is_public_callable(name: str, value: object) -> bool:
    return not name.startswith("_") and callable(value) and not isinstance(value, type)


def _file_module(path: Path) -> ModuleType:
    """Run the file at ``path`` as a module of its own (its folder first on ``sys.path``)."""
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise CamvizError(f"{path} {what}; give the path of a Python file: FILE.py:factory")
    module_name = f"camviz_factory_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    # Registered so that what the file defines can be pickled and found by its module name.
    sys.modules[module_name] = module
    with _first_on_path(path.resolve().parent), _running_user_code(str(path), str(path)):
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return module


@contextlib.contextmanager
def _first_on_path(folder: Path) -> Iterator[None]:
    """``folder`` first on ``sys.path`` for the block (the rest of ``sys.path`` as it was)."""
    entry = os.fspath(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        sys.path.remove(entry)


@contextlib.contextmanager
def _running_user_code(what: str, where: str) -> Iterator[None]:
    """The user's code runs in the block: an error it raises becomes one line that names it
    and the line of the user's file it came from (camviz's own errors pass unchanged)."""
    try:
        yield
    except CamvizError:
        raise
    except Exception as error:
        frames = [
            frame
            for frame in traceback.extract_tb(error.__traceback__)
            if not frame.filename.startswith(os.path.dirname(__file__))
        ]
        at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise CamvizError(
            f"{what} raised {type(error).__name__}: {first_line(error)}{at}; fix the code in "
            f"{where}"
        ) from error


def _check_arguments(factory: Callable[..., Any], arguments: dict | Any, name: str) -> None:
    """Refuse, in one line, keyword arguments that ``factory`` does not take."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C extension: let the call say it
        return
    try:
        signature.bind(**arguments)
    except TypeError as error:
        parameters = ", ".join(signature.parameters) or "none"
        raise CamvizError(
            f"{name} cannot be called with {dict(arguments)!r} ({first_line(error)}); its "
            f"parameters: {parameters}; pass them as --model-arg key=value"
        ) from None
