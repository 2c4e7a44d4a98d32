"""The one interface every model source implements, and the options they are loaded with.

A *source* is one kind of ``--model`` name (``resnet50``, ``timm:NAME``, ``hf:DIR``,
``yolo:FILE``, ``package.module:factory``): it builds the model and says how to feed it
(:meth:`ModelSource.preprocess`), what its classes are called and what it does. Everything
after that (the preprocessing options of the command line, the class names file, the task
given by hand, the default layer's dry run) is the same for every source and lives in
:func:`camviz.models.load`, so that the next library is one small module.

A source that needs a library camviz does not install by default imports it with
:func:`import_extra`, which turns its absence into one line naming the ``pip install``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from torch import nn

from camviz.core.errors import CamvizError

if TYPE_CHECKING:
    from camviz.io.architectures import Task
    from camviz.io.images import Preprocess

__all__ = ["ModelSource", "SourceOptions", "import_extra"]


@dataclass(frozen=True)
class SourceOptions:
    """What :func:`camviz.models.load` was asked for besides the model's name.

    Attributes:
        weights: A local state_dict to load into the model.
        model_args: Keyword arguments of a factory (``--model-arg key=value``).
        trust_pickle: Whether a pickled whole model (``yolo:FILE.pt``) may be loaded: it runs
            code when it is unpickled.
        input_size: The images' shorter side (a detector's own resize), in pixels.
        mean: Per-channel mean (one value for all, or one per channel).
        std: Per-channel standard deviation (as ``mean``).
        channels: 3 for RGB images, 1 for grey ones.
        classes: The class names, one per output.
        task: The task, when it is given rather than told from the model.
    """

    weights: Path | None = None
    model_args: Mapping[str, object] = field(default_factory=dict)
    trust_pickle: bool = False
    input_size: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    channels: int | None = None
    classes: Sequence[str] | None = None
    task: Task | None = None


class ModelSource(ABC):
    """One kind of model name. :meth:`build` runs first; the other methods describe the model
    it built.

    Attributes:
        name: The name the model was given by (``"hf:vit-tiny"``), as the manifest shows it.
    """

    name: str

    @abstractmethod
    def build(self) -> nn.Module:
        """The model with its weights (the published ones, or ``options.weights``).

        Raises:
            CamvizError: The model cannot be built or its weights not read; one line that
                says what to do.
        """

    @abstractmethod
    def preprocess(self) -> Preprocess:
        """How an image becomes the model's input, as the model's makers feed it."""

    def class_names(self, model: nn.Module) -> list[str] | None:
        """The name of each output class; ``None`` when the source does not know them."""
        return None

    def task(self, model: nn.Module) -> Task | None:
        """What the model does; ``None``: told from the model (:func:`camviz.models.task_of`)."""
        return None

    def clip_len(self) -> int | None:
        """For a video model, the frames of one clip; ``None``: the default."""
        return None


def import_extra(module: str, extra: str, purpose: str) -> ModuleType:
    """``module``, imported; if it is not installed, one line naming the extra to install.

    Args:
        module: The module to import (``"transformers"``).
        extra: camviz's extra that installs it (``"hf"``).
        purpose: What needs it, as the start of a sentence (``"hf: models"``).

    Raises:
        CamvizError: The module's package is not installed.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module.split(".")[0]:
            raise  # the library is there but broken: its own error says more
        raise CamvizError(
            f"{purpose} need the {error.name} package, which is not installed; run "
            f"`pip install 'camviz[{extra}]'`"
        ) from None
