"""Ultralytics YOLO models: ``yolo:FILE.yaml`` (built; ``weights=`` a state_dict) or
``yolo:FILE.pt`` (a pickled whole model, loaded only with ``trust_pickle=True``).

A ``.pt`` file of Ultralytics is a pickle of the model object: unpickling it runs whatever
code the file names, so camviz reads it only when the user says they trust it
(``--trust-pickle``). Its state_dicts stay ``weights_only=True``, as everywhere.

A detector is explained as Ultralytics predicts with it: the photo, in ``[0, 1]``, is
letterboxed into a ``size x size`` square inside the model
(:class:`~camviz.core.placement.CentredLetterbox`, so that maps and boxes lie on the photo),
its ``(N, 4 + classes, anchors)`` predictions are decoded with class-wise NMS (confidence
0.25, IoU 0.7, at most 300, Ultralytics' defaults) by
:class:`~camviz.core.detection.DenseDetections`, and the boxes are mapped back to the photo:
the model answers torchvision's list of per-image dicts, so each detected object gets its own
map as for torchvision's detectors. The default layer is found from the network's structure,
as for any model (:mod:`camviz.core.defaults`): the input of the ``Detect`` head, its feature
levels fused. A classifier (``-cls``) takes the photo's shorter side at its size,
mean 0 and std 1.

Ultralytics runs with ``YOLO_OFFLINE=1`` and ``YOLO_AUTOINSTALL=False``: it neither downloads
nor installs anything, and the functions of other libraries it replaces when imported are put
back (:func:`import_ultralytics`). A ``YOLO(...)`` object is unwrapped to the network it holds.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
from PIL import Image
from torch import nn

from camviz.core.errors import CamvizError, first_line
from camviz.core.placement import CentredLetterbox
from camviz.io.checkpoints import load_weights
from camviz.io.sources.base import ModelSource, SourceOptions, import_extra

if TYPE_CHECKING:
    from camviz.io.architectures import Task
    from camviz.io.images import Preprocess

__all__ = [
    "PREFIX",
    "Adapted",
    "UltralyticsSource",
    "YoloDetector",
    "adapted",
    "import_ultralytics",
]

#: Names starting with this are Ultralytics model files (``"yolo:yolov8n.yaml"``).
PREFIX = "yolo:"

# Ultralytics' prediction defaults: image size, confidence, NMS IoU, detections per image.
_DETECT_SIZE, _CLASSIFY_SIZE = 640, 224
_CONFIDENCE, _IOU, _MAX_DETECTIONS = 0.25, 0.7, 300

# Networks explained through their boxes (a -seg or -pose head's extra columns are dropped).
_BOX_MODELS = ("DetectionModel", "SegmentationModel", "PoseModel")


class UltralyticsSource(ModelSource):
    """``yolo:FILE.yaml`` or ``yolo:FILE.pt`` (see the module docstring)."""

    def __init__(self, name: str, options: SourceOptions) -> None:
        self.name = name
        self.options = options
        self.path = Path(name.removeprefix(PREFIX))
        suffix = self.path.suffix.lower()
        if suffix not in (".yaml", ".yml", ".pt"):
            raise CamvizError(
                f"{name}: yolo: takes an Ultralytics model file, FILE.yaml (built, with "
                "--weights for a state_dict) or FILE.pt (with --trust-pickle)"
            )
        self.pickled = suffix == ".pt"
        if self.pickled and not options.trust_pickle:
            raise CamvizError(
                f"{self.path} is a pickle of a whole model, and unpickling it runs code from the "
                "file; pass --trust-pickle (trust_pickle=True) if you trust it, or build the "
                "model from its .yaml and give its state_dict with --weights"
            )
        if self.pickled and options.weights is not None:
            raise CamvizError(f"{self.path} holds its own weights; --weights is for yolo:FILE.yaml")
        self.adapted: Adapted | None = None

    def build(self) -> nn.Module:
        network = self._pickled() if self.pickled else self._built()
        self.adapted = adapted(network)
        assert self.adapted is not None  # _pickled and _built return Ultralytics networks
        return self.adapted.model

    def preprocess(self) -> Preprocess:
        assert self.adapted is not None
        return self.adapted.preprocess

    def class_names(self, model: nn.Module) -> list[str] | None:
        return None if self.adapted is None else self.adapted.class_names

    def task(self, model: nn.Module) -> Task | None:
        return None if self.adapted is None else self.adapted.task

    def _built(self) -> nn.Module:
        tasks = import_ultralytics()
        try:
            config = tasks.yaml_model_load(str(self.path))
        except (OSError, FileNotFoundError) as error:
            raise CamvizError(
                f"cannot read {self.path} ({first_line(error)}); give the path of an "
                "Ultralytics model .yaml"
            ) from None
        kinds = {
            "detect": tasks.DetectionModel,
            "segment": tasks.SegmentationModel,
            "pose": tasks.PoseModel,
            "classify": tasks.ClassificationModel,
        }
        kind = tasks.guess_model_task(config)
        if kind not in kinds:
            raise CamvizError(
                f"{self.path} is an Ultralytics {kind} model; camviz explains detect, segment "
                "(their boxes), pose (their boxes) and classify models"
            )
        try:
            network = kinds[kind](config, verbose=False)
        except Exception as error:  # Ultralytics reports a bad config with many error types
            raise CamvizError(
                f"Ultralytics cannot build {self.path} ({type(error).__name__}: "
                f"{first_line(error)}); check the file"
            ) from None
        if self.options.weights is not None:
            load_weights(network, self.options.weights, self.name)
        return network

    def _pickled(self) -> nn.Module:
        import_ultralytics()
        if not self.path.is_file():
            raise CamvizError(f"{self.path} does not exist; give the path of an Ultralytics .pt")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                checkpoint = torch.load(self.path, map_location="cpu", weights_only=False)
        except (pickle.UnpicklingError, EOFError, RuntimeError, AttributeError) as error:
            raise CamvizError(
                f"{self.path} is not an Ultralytics model file ({type(error).__name__}: "
                f"{first_line(error)})"
            ) from None
        network = checkpoint
        if isinstance(checkpoint, dict):
            network = checkpoint.get("ema") or checkpoint.get("model")
        if _ultralytics_network(network) is None:
            raise CamvizError(
                f"{self.path} holds {type(network).__name__}, not an Ultralytics model; save "
                "one with YOLO(...).save(PATH), or give a state_dict with --weights"
            )
        assert isinstance(network, nn.Module)
        return network.float()


@dataclass(frozen=True)
class Adapted:
    """An Ultralytics network ready to explain, and what camviz needs to know about it."""

    model: nn.Module
    preprocess: Preprocess
    class_names: list[str]
    task: Task


def adapted(module: object) -> Adapted | None:
    """``module`` made explainable, if it is an Ultralytics model (a ``YOLO(...)`` object or
    the network inside one); ``None`` for anything else. A detector letterboxes to 640
    pixels, a classifier takes a shorter side of 224, as Ultralytics predicts
    (:func:`camviz.models.with_input_size` sets another size).

    Raises:
        CamvizError: An Ultralytics model of a task camviz cannot explain.
    """
    network = _ultralytics_network(module)
    if network is None:
        return None
    from camviz.io.images import Preprocess

    names = _class_names(network)
    kind = type(network).__name__
    if kind == "ClassificationModel":
        return Adapted(
            network,
            Preprocess(size=_CLASSIFY_SIZE, mean=(0.0,), std=(1.0,)),
            names,
            "classification",
        )
    if kind not in _BOX_MODELS:
        raise CamvizError(
            f"camviz cannot explain an Ultralytics {kind}; it explains detect, segment and "
            "pose models (their boxes) and classify models"
        )
    detector = YoloDetector(network, len(names), _DETECT_SIZE)
    return Adapted(
        detector,
        Preprocess(mean=(0.0,), std=(1.0,), resize="none"),
        names,
        "detection",
    )


def _ultralytics_network(module: object) -> nn.Module | None:
    """The ``BaseModel`` network in ``module`` (itself, or a ``YOLO(...)``'s ``.model``)."""
    if "ultralytics" not in sys.modules:  # nothing can be an Ultralytics model
        return None
    tasks = import_ultralytics()
    from ultralytics.engine.model import Model

    if isinstance(module, Model):
        module = module.model
    return module if isinstance(module, tasks.BaseModel) else None


def _class_names(network: nn.Module) -> list[str]:
    """The network's class names, or ``class K`` where it has only numbers (a built .yaml)."""
    names: Any = getattr(network, "names", None)
    count = int(getattr(network, "nc", None) or getattr(_head(network), "nc", 0) or 0)
    if isinstance(names, dict) and names:
        ordered = [str(names[key]) for key in sorted(names)]
        if ordered != [str(index) for index in range(len(ordered))]:
            return ordered
        count = len(ordered)
    return [f"class {index}" for index in range(count)]


def _head(network: nn.Module) -> Any:
    """The network's last layer: the ``Detect`` (``Segment``, ``Pose``, ``Classify``) head."""
    return cast(Any, network).model[-1]


def import_ultralytics() -> ModuleType:
    """``ultralytics.nn.tasks``, imported offline and without its patches of other libraries.

    Ultralytics reads ``YOLO_OFFLINE`` and ``YOLO_AUTOINSTALL`` when it is imported, so they
    are set first: it neither downloads nor installs anything in a camviz run. Its import also
    replaces ``PIL.Image.open`` (with one that installs a HEIF plugin from PyPI when Pillow
    cannot read a file: camviz's message for a file that is no image would become an
    installation attempt) and ``torch.save``; both are put back.

    Raises:
        CamvizError: Ultralytics is not installed (with the ``pip install`` to run).
    """
    os.environ["YOLO_OFFLINE"] = "1"
    os.environ["YOLO_AUTOINSTALL"] = "False"
    saved = Image.open, torch.save
    try:
        tasks = import_extra("ultralytics.nn.tasks", "yolo", "yolo: models")
        importlib.import_module("ultralytics.engine.model")
    finally:
        Image.open, torch.save = saved
    return tasks


class YoloDetector(nn.Module):
    """An Ultralytics box network as a torchvision-style detector (see the module docstring).

    Takes ``(N, 3, H, W)`` photos in ``[0, 1]`` and returns, per photo, a dict of ``boxes``
    (``x0, y0, x1, y1`` in the photo's pixels), ``scores`` and ``labels``.

    Attributes:
        network: The Ultralytics network.
        letterbox: Its input step.
        score_thresh: Detections scored below this are dropped (a job lowers it, as a
            :mod:`camviz.core.modelstate` change, to its ``min_score``).
    """

    def __init__(self, network: nn.Module, num_classes: int, size: int) -> None:
        super().__init__()
        self.letterbox = CentredLetterbox(size)
        self.network = network
        self.num_classes = num_classes
        self.score_thresh = _CONFIDENCE

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        from camviz.core.detection import DenseDetections

        boxed = self.letterbox(images)
        predictions = self._predictions(boxed)[:, : 4 + self.num_classes]
        decode = DenseDetections(
            box_format="cxcywh",
            score_threshold=self.score_thresh,
            iou_threshold=_IOU,
            max_detections=_MAX_DETECTIONS,
            channels_last=False,
        )
        (height, width), (top, left) = self.letterbox.geometry(*images.shape[-2:])
        offset = images.new_tensor([left, top, left, top])
        scale = images.new_tensor([width, height, width, height]) / images.new_tensor(
            [images.shape[-1], images.shape[-2]] * 2
        )
        limit = images.new_tensor([images.shape[-1], images.shape[-2]] * 2)
        detections = decode(predictions)
        for found in detections:
            found["boxes"] = torch.minimum(((found["boxes"] - offset) / scale).clamp(min=0), limit)
        return detections

    def _predictions(self, boxed: torch.Tensor) -> torch.Tensor:
        """The ``(N, 4 + classes + extra, anchors)`` decoded predictions.

        The head caches its anchors for the last input shape; a cache made during a pass
        under ``torch.inference_mode`` (a dry run) would break the next pass's backward, so
        the cache of every call is dropped and the head's own put back.
        """
        head = _head(self.network)
        cached = (head.shape, head.anchors, head.strides)
        head.shape = None
        try:
            output = self.network(boxed)
        finally:
            head.shape, head.anchors, head.strides = cached
        while isinstance(output, (tuple, list)):
            output = output[0]
        return output
