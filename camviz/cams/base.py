"""The contract between the engine and a CAM method.

The engine (:mod:`camviz.cams.engine`) runs the model once, records the target layer's
activations and, if the method asks for them, the exact gradients of the explained score
with respect to those activations. A method only turns that :class:`LayerData` into one
raw map per sample; the engine applies ReLU, normalises and upsamples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass
class LayerData:
    """What a method may use to compute the map of one layer for one target rank.

    Attributes:
        layer: The layer's name.
        activations: ``A``, the layer's output, ``(N, C, h, w)``.
        gradients: ``dy/dA`` for the explained score ``y`` of each sample, same shape, or
            ``None`` for methods that do not ask for gradients.
        model: The network (in eval mode while the method runs).
        inputs: The input batch, ``(N, 3, H, W)``.
        score: Maps a model output to the ``(N,)`` explained scores.
        class_ids: The explained class of each sample, ``(N,)``, or ``None`` when the
            target is a callable.
    """

    layer: str
    activations: torch.Tensor
    gradients: torch.Tensor | None
    model: nn.Module
    inputs: torch.Tensor
    score: Callable[[Any], torch.Tensor]
    class_ids: torch.Tensor | None


class CamMethod:
    """A CAM method. Subclasses set the class attributes and implement :meth:`layer_map`.

    Attributes:
        name: Registry name (``"gradcam"``).
        paper: Title, authors and year of the paper that defines it.
        needs: What it needs from the engine, for the docs table (``"gradients"``).
        uses_gradients: Whether the engine must compute ``dy/dA``.
    """

    name: ClassVar[str]
    paper: ClassVar[str]
    needs: ClassVar[str] = "gradients"
    uses_gradients: ClassVar[bool] = True

    def layer_map(self, data: LayerData) -> torch.Tensor:
        """The raw ``(N, h, w)`` map, before ReLU and normalisation."""
        raise NotImplementedError
