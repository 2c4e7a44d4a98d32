"""The model the explorer shows: how its output is read, what can be explained on an image.

A :class:`Subject` wraps one :class:`~camviz.io.models.LoadedModel` for the life of a
server; every browser tab shares it (the model is used by one request at a time, through
camviz's per-model lock, :func:`camviz.core.modelstate.exclusive`).

Its task decides what the page offers to explain, as :class:`Candidate` s:

* **classification**: the top-k classes, or any class typed by name;
* **detection**: each detected object scored :data:`MIN_SCORE` or more, picked by a click
  inside its box (:class:`camviz.Detection` by index). torchvision's detectors are read as
  they are; a model whose output is a raw ``(N, anchors, 4 + classes)`` tensor is read
  through :class:`camviz.DenseDetections` (or the ``adapter`` given), and the page says so;
* **segmentation**: the region predicted as each class, picked by a click on one of its
  pixels (:class:`camviz.Region` of that class's predicted pixels, as ``camviz explain``
  explains a segmentation model).

The task is the model's own (:func:`camviz.models.task_of`, or the ``LoadedModel``'s), else
it is told from the first output: detections, a ``(N, classes, H, W)`` map, or one row of
class scores per image.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from PIL import Image

from camviz.core.detection import Adapter, DenseDetections, Detection
from camviz.core.errors import CamvizError
from camviz.core.inputs import model_device
from camviz.core.layers import default_target_layer, layer_shapes
from camviz.core.modelstate import changed, eval_mode, exclusive
from camviz.core.precision import Precision, check_precision, model_precision
from camviz.core.targets import Region, Target, as_logits, class_name
from camviz.io.models import LoadedModel, task_of

__all__ = ["MIN_SCORE", "TOP_CLASSES", "Candidate", "LayerEntry", "Subject", "as_loaded"]

#: Classes offered for a classifier, best first.
TOP_CLASSES = 5

#: The least score of a detected object that the page offers (as ``camviz explain``).
MIN_SCORE = 0.5

# The most objects of one image that the page lists, best first.
_MAX_OBJECTS = 20

Task = Literal["classification", "detection", "segmentation"]
Box = tuple[float, float, float, float]


@dataclass(frozen=True, eq=False)
class Candidate:
    """One thing the page offers to explain on the current image.

    Attributes:
        label: What the page shows (``"tabby cat (0.42)"``).
        target: What :func:`camviz.explain` is given as ``target``.
        class_id: The class explained.
        score: The class probability, the object's score, or the region's share of pixels.
        box: For a detected object, its box ``(x0, y0, x1, y1)`` in the input's pixels.
    """

    label: str
    target: Target
    class_id: int
    score: float
    box: Box | None = None


@dataclass(frozen=True)
class LayerEntry:
    """One layer of the model as the layer tree shows it (``camviz layers``' columns)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    default: bool

    @property
    def label(self) -> str:
        """The tree line: indented by depth, with type, output shape and the default mark."""
        indent = "\u2003" * self.name.count(".")
        mark = "  \u2190 default" if self.default else ""
        shape = self.shape if self.shape else "(several outputs)"
        return f"{indent}{self.name}  {self.kind} {shape}{mark}"

    @property
    def channels(self) -> int | None:
        """Channels of the output: dim 1 of a feature map, the last dim of tokens (``None``
        for several outputs)."""
        if not self.shape:
            return None
        return self.shape[1] if len(self.shape) == 4 else self.shape[-1]


class Subject:
    """A model being explored, shared by every tab of one server.

    Args:
        loaded: The model with its preprocessing, class names and task.
        adapter: For a detector whose output is not torchvision's list of dicts, what reads
            it (``None``: :class:`camviz.DenseDetections` for a raw 3-D output).
        precision, channels_last: How the model's passes run (see :func:`camviz.explain`),
            checked here, before anything is served.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        adapter: Adapter | None = None,
        precision: Precision = "fp32",
        channels_last: bool = False,
    ) -> None:
        if loaded.task in ("video", "volume"):
            raise CamvizError(
                f"the explorer shows still images; explain a {loaded.task} model with "
                "`camviz explain`"
            )
        if loaded.task == "embedding":
            raise CamvizError(
                "the explorer explains class scores; explain an embedding model with "
                "`camviz explain` and camviz.Similarity"
            )
        self.device = model_device(loaded.model) or torch.device("cpu")
        check_precision(precision, self.device)
        self.loaded = loaded
        self.adapter = adapter
        self.precision: Precision = precision
        self.channels_last = channels_last
        self.task: Task | None = (
            "detection"
            if loaded.task == "detection"
            else "segmentation"
            if loaded.task == "segmentation"
            else None
        )
        self.reading = ""  # how the output is read, once known
        self._layers: dict[tuple[int, ...], list[LayerEntry]] = {}
        self._guard = threading.Lock()

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def name(self) -> str:
        return self.loaded.name

    @contextlib.contextmanager
    def using(self) -> Iterator[torch.nn.Module]:
        """The model held for the block by this request (camviz's per-model lock), with the
        loaded model's temporary changes made (a detector's input size,
        :attr:`~camviz.models.LoadedModel.changes`)."""
        with exclusive(self.model), changed(self.model, *self.loaded.changes):
            yield self.model

    def prepare(self, image: Image.Image) -> torch.Tensor:
        """The ``(1, 3, H, W)`` batch the model takes for ``image``."""
        return self.loaded.preprocess(image).unsqueeze(0).to(self.device)

    def forward(self, inputs: torch.Tensor) -> Any:
        """The model's output for ``inputs``, read once its task is known."""
        with (
            self.using(),
            model_precision(self.model, self.precision, self.channels_last),
            eval_mode(self.model),
            torch.inference_mode(),
        ):
            output = self.model(inputs)
        with self._guard:
            if self.task is None or not self.reading:
                self._read(output)
        return output

    def _read(self, output: Any) -> None:
        """Tell the task from an output, when the model did not say it."""
        if self.task is None:
            if _is_detections(output) or (isinstance(output, torch.Tensor) and output.dim() == 3):
                self.task = "detection"
            else:
                logits = as_logits(output)
                self.task = "segmentation" if logits.dim() == 4 else "classification"
        if self.task == "detection" and not _is_detections(output) and self.adapter is None:
            self.adapter = DenseDetections()
            self.reading = (
                "raw dense predictions (N, anchors, 4 + classes), read with "
                "camviz.DenseDetections(); pass adapter= to camviz.app for another layout"
            )
        else:
            self.reading = {
                "classification": "class scores",
                "detection": "detections",
                "segmentation": "a class map (N, classes, H, W)",
            }[self.task]

    def category(self, class_id: int) -> str:
        return class_name(self.loaded.categories, class_id)

    def candidates(self, output: Any) -> list[Candidate]:
        """What the page offers on an image, best first."""
        if self.task == "detection":
            return self._objects(output)
        if self.task == "segmentation":
            return self._regions(output)
        probabilities = as_logits(output).float().softmax(dim=-1)[0]
        top = probabilities.topk(min(TOP_CLASSES, len(probabilities)))
        return [
            self._class(int(index), float(value))
            for value, index in zip(top.values, top.indices, strict=True)
        ]

    def _class(self, class_id: int, probability: float) -> Candidate:
        name = self.category(class_id)
        return Candidate(f"{name} ({probability:.2f})", class_id, class_id, probability)

    def _objects(self, output: Any) -> list[Candidate]:
        found = (self.adapter(output) if self.adapter is not None else output)[0]
        scores, labels = found["scores"].tolist(), found["labels"].tolist()
        boxes = found["boxes"].detach().float().cpu().tolist()
        objects: list[Candidate] = []
        for index, (score, label, box) in enumerate(zip(scores, labels, boxes, strict=True)):
            if score >= MIN_SCORE and len(objects) < _MAX_OBJECTS:
                objects.append(
                    Candidate(
                        f"{self.category(int(label))} ({score:.2f})",
                        Detection(index, adapter=self.adapter),
                        int(label),
                        float(score),
                        box=(box[0], box[1], box[2], box[3]),
                    )
                )
        return objects

    def _regions(self, output: Any) -> list[Candidate]:
        predicted = as_logits(output).argmax(dim=1)[0]
        counts = torch.bincount(predicted.flatten())
        classes = [int(k) for k in counts.argsort(descending=True, stable=True) if counts[k] > 0]
        return [self._region(predicted, k) for k in classes]

    def _region(self, predicted: torch.Tensor, class_id: int) -> Candidate:
        mask = predicted == class_id
        share = float(mask.float().mean())
        label = f"{self.category(class_id)} ({share:.0%} of the pixels)"
        return Candidate(label, Region(class_id, mask), class_id, share)

    def named(self, name: str, output: Any, candidates: Sequence[Candidate]) -> Candidate:
        """The candidate for a class typed by name: that class (a classifier), its best
        object (a detector) or its region (a segmentation model)."""
        categories = self.loaded.categories
        if name not in categories:
            raise CamvizError(f"{name!r} is not a class of {self.name}; pick one from the list")
        class_id = categories.index(name)
        if self.task == "classification":
            probabilities = as_logits(output).float().softmax(dim=-1)[0]
            return self._class(class_id, float(probabilities[class_id]))
        matching = [candidate for candidate in candidates if candidate.class_id == class_id]
        if not matching:
            found = "no object of" if self.task == "detection" else "no pixel predicted as"
            raise CamvizError(f"{found} class {name!r} in this image; pick another class")
        return matching[0]

    def at_point(
        self,
        x: float,
        y: float,
        size: tuple[int, int],
        output: Any,
        candidates: Sequence[Candidate],
    ) -> Candidate:
        """What a click on input pixel ``(x, y)`` of an ``(H, W)`` input picks: the object
        whose box holds it (the smallest such box), or the region of the class predicted
        there."""
        if self.task == "detection":
            inside = [
                (_area(candidate.box), index)
                for index, candidate in enumerate(candidates)
                if candidate.box is not None and _holds(candidate.box, x, y)
            ]
            if not inside:
                raise CamvizError(
                    f"no detected object at ({x:.0f}, {y:.0f}); click inside one of the boxes"
                )
            return candidates[min(inside)[1]]
        if self.task == "segmentation":
            predicted = as_logits(output).argmax(dim=1)[0]
            row = min(int(y * predicted.shape[0] / size[0]), predicted.shape[0] - 1)
            col = min(int(x * predicted.shape[1] / size[1]), predicted.shape[1] - 1)
            return self._region(predicted, int(predicted[row, col]))
        raise CamvizError("a classifier has no regions to click; pick a class from the list")

    def layers(self, inputs: torch.Tensor) -> list[LayerEntry]:
        """The layer tree for inputs of this shape: every layer with a map or token output,
        in call order, the default marked."""
        key = tuple(inputs.shape)
        if key not in self._layers:
            with self.using():
                rows = layer_shapes(
                    self.model, inputs, precision=self.precision, channels_last=self.channels_last
                )
                default = self.loaded.default_layer or default_target_layer(self.model, inputs)
            entries: dict[str, LayerEntry] = {}
            for name, kind, shape in rows:
                # Maps and tokens; and outputs that are not one tensor (an FPN's dict of
                # levels, a detector's default layer), shown with the shape ().
                if (len(shape) >= 3 or not shape) and name not in entries:
                    entries[name] = LayerEntry(name, kind, shape, name == default)
            if default not in entries:
                raise CamvizError(
                    f"the default layer {default!r} has no feature map output; load the model "
                    "with another default_layer"
                )
            self._layers[key] = list(entries.values())
        return self._layers[key]

    def default_layer(self, inputs: torch.Tensor) -> str:
        return next(entry.name for entry in self.layers(inputs) if entry.default)


def _is_detections(output: Any) -> bool:
    """Whether ``output`` is torchvision's detections: one dict with ``boxes`` per image."""
    return (
        isinstance(output, (list, tuple))
        and len(output) > 0
        and all(isinstance(item, Mapping) and "boxes" in item for item in output)
    )


def _holds(box: Box, x: float, y: float) -> bool:
    return box[0] <= x <= box[2] and box[1] <= y <= box[3]


def _area(box: Box) -> float:
    return (box[2] - box[0]) * (box[3] - box[1])


def as_loaded(model: Any) -> LoadedModel:
    """What :func:`camviz.app` accepts as its model, as a :class:`LoadedModel`: one already,
    a name for :func:`camviz.load_model` (``None``: the offline default), or a module, taken
    with ImageNet preprocessing at 224 pixels and classes named by number."""
    from camviz.io.images import Preprocess
    from camviz.io.models import load

    if isinstance(model, LoadedModel):
        return model
    if model is None or isinstance(model, str):
        return load(model)
    if isinstance(model, torch.nn.Module):
        return LoadedModel(
            model=model,
            preprocess=Preprocess(),
            categories=[],
            name=type(model).__name__,
            task=task_of(model),
        )
    raise CamvizError(
        f"camviz.app takes a model (nn.Module, camviz.models.LoadedModel or a model name), "
        f"not {type(model).__name__}"
    )
