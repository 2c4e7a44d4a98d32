"""Models known by name: the offline default, torchvision's models and ``timm:NAME``.

The architectures, their published weights and preprocessing are in
:mod:`camviz.io.architectures`; a ``weights=`` checkpoint is loaded by
:func:`camviz.io.checkpoints.from_checkpoint`, which also recognises a classifier trained
for another number of classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from camviz.io.architectures import (
    OFFLINE_MODEL,
    TIMM_PREFIX,
    Architecture,
    offline_architecture,
    timm_architecture,
    torchvision_architecture,
)
from camviz.io.checkpoints import from_checkpoint
from camviz.io.sources.base import ModelSource, SourceOptions

if TYPE_CHECKING:
    from camviz.io.images import Preprocess

__all__ = ["NamedSource"]


class NamedSource(ModelSource):
    """``None``/``"efficientnet_lite0"``, a torchvision name, or ``"timm:NAME"``."""

    def __init__(self, name: str, options: SourceOptions) -> None:
        if name == OFFLINE_MODEL:
            self.architecture: Architecture = offline_architecture()
        elif name.startswith(TIMM_PREFIX):
            self.architecture = timm_architecture(name.removeprefix(TIMM_PREFIX))
        else:
            self.architecture = torchvision_architecture(name)
        self.name = self.architecture.name
        self.options = options
        self.num_classes = self.architecture.num_classes

    def build(self) -> nn.Module:
        if self.options.weights is None:
            return self.architecture.pretrained()
        model, self.num_classes = from_checkpoint(self.architecture, self.options.weights)
        return model

    def preprocess(self) -> Preprocess:
        return self.architecture.preprocess

    def class_names(self, model: nn.Module) -> list[str] | None:
        published = self.architecture.categories
        if published is not None and len(published) == self.num_classes:
            return list(published)
        if self.num_classes == 1000:  # timm's ImageNet models name no classes
            from torchvision.models import ResNet50_Weights

            return list(ResNet50_Weights.DEFAULT.meta["categories"])
        return [f"class {index}" for index in range(self.num_classes)]

    def clip_len(self) -> int | None:
        return self.architecture.clip_len
