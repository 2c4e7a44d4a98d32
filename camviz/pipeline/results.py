"""What :func:`~camviz.pipeline.dataset.explain_dataset` yields for each input, made from an
explanation: the explained classes (or objects) with their scores and probabilities, the
best :data:`TOP_PREDICTIONS` classes, the maps; or the reason an input failed or had nothing
to explain. A sample whose output, explained scores or maps are not finite is a failure;
so is one whose batch raised an error that belongs to its inputs (:func:`belongs_to_input`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from PIL import Image

from camviz.core.errors import CamvizError, ModelError, NonFiniteError, first_line
from camviz.core.memory import is_out_of_memory
from camviz.core.targets import class_name
from camviz.pipeline.inputs import Item

#: How many predictions each result keeps, best first.
TOP_PREDICTIONS = 5


@dataclass(frozen=True)
class Prediction:
    """One class's score for one image.

    Attributes:
        id: The class index (``-1`` for a callable target).
        name: The class name (``"class 7"`` when the model has no names for its classes).
        score: The logit.
        probability: Its softmax probability, or ``None`` when the output is not a
            ``(N, classes)`` score table or the target is a callable.
        box: For a detected object, its ``[x0, y0, x1, y1]`` box in the image's pixels.
    """

    id: int
    name: str
    score: float
    probability: float | None
    box: list[float] | None = None

    def fields(self) -> dict[str, Any]:
        """The prediction as a manifest row shows it (a box rounded to hundredths)."""
        entry: dict[str, Any] = {
            "id": self.id,
            "name": self.name,
            "score": self.score,
            "probability": self.probability,
        }
        if self.box is not None:
            entry["box"] = [round(value, 2) for value in self.box]
        return entry


@dataclass
class ImageResult:
    """What :func:`explain_dataset` yields for one input.

    Attributes:
        index: The input's position in the dataset (or in the expanded list of paths).
        path: The file, for inputs given as paths; ``None`` for a ``Dataset``.
        frame: The video frame index, or ``None``.
        status: ``"ok"``, or ``"error"`` when the input could not be read or explained.
        reason: Why it failed (one line), for an error; for an input explained with
            nothing to explain (no object above the score asked for), what was found.
        image: The original image, upright RGB (``None`` for errors, for tensor inputs and
            with ``keep_images=False``).
        size: The original image's ``(width, height)`` (``None`` for errors and tensors).
        frames: For a clip, its original frames, ``(T, H, W, 3)`` uint8 (``image`` is then
            ``None``).
        heatmaps: ``(K, H, W)`` maps in ``[0, 1]`` at the model's input size, one per
            explained class (``(K, T, H, W)`` for clips); resize one to ``image.size`` to lay
            it on the photo.
        explained: The ``K`` explained classes with their scores, in rank order.
        top: The best :data:`TOP_PREDICTIONS` classes, best first.
        seconds: Time spent on this input: its decoding plus its share of its batch.
        method: The CAM method's name.
        layers: The target layer names.
    """

    index: int
    path: str | None
    frame: int | None
    status: Literal["ok", "error"]
    reason: str | None = None
    image: Image.Image | None = None
    frames: torch.Tensor | None = None
    size: tuple[int, int] | None = None
    heatmaps: torch.Tensor | None = None
    explained: list[Prediction] = field(default_factory=list)
    top: list[Prediction] = field(default_factory=list)
    seconds: float = 0.0
    method: str | None = None
    layers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the input was explained."""
        return self.status == "ok"


class Sample(Protocol):
    """What a result is made from: one decoded input (see :mod:`camviz.pipeline.dataset`)."""

    index: int
    original: torch.Tensor | None  # (H, W, 3) uint8; (T, H, W, 3) for a clip
    size: tuple[int, int] | None
    seconds: float


def results_of(
    samples: Sequence[Sample],
    explanation: Any,
    logits: torch.Tensor,
    boxes: list[list[float]],
    categories: Sequence[str] | None,
    items: list[Item] | None,
    share: float,
) -> list[ImageResult]:
    """One result per sample of one explained group.

    Args:
        samples: The group's samples, in batch order.
        explanation: Their :class:`~camviz.cams.engine.Explanation`.
        logits: The model's class scores for them, ``(N, classes)``; ``(N, 0)`` when the
            output holds none (a detector's detections).
        boxes: A detector's explained boxes, one per map, in order (else empty); a map of
            class ``-1`` among them is a rank padded for the batch (an image with fewer
            objects than another, :class:`~camviz.pipeline.choosing.DetectedObjects`) and
            is dropped.
        categories: The model's class names.
        items: The dataset's items, when it is made of paths.
        share: Each sample's share of the batch's time, in seconds.
    """
    table = logits.dim() == 2 and logits.shape[1] > 0  # (N, classes): probabilities
    probabilities = logits.softmax(-1).cpu() if table else None
    if probabilities is not None:
        best = probabilities.topk(min(TOP_PREDICTIONS, logits.shape[-1]), dim=-1)
        top_ids, top_probabilities = best.indices.tolist(), best.values.tolist()
        top_scores = logits.cpu().gather(1, best.indices).tolist()
    ranks = len(explanation.targets) // len(samples)
    targets = explanation.targets.tolist()
    scores = explanation.scores.tolist()
    heatmaps = explanation.heatmaps.detach().cpu()
    finite = _finite_per_sample(logits, explanation.scores, heatmaps, len(samples))
    results = []
    reasons = explanation.reasons or [None] * len(samples)
    for position, sample in enumerate(samples):
        if reasons[position] is not None:  # chosen in the pass: nothing to explain
            results.append(nothing(sample, reasons[position], items, share))
            continue
        if not finite[position]:
            results.append(failed(sample, _NOT_FINITE, items))
            continue
        rows = [
            row
            for row in range(position * ranks, (position + 1) * ranks)
            if not (boxes and targets[row] < 0)  # a detection rank padded for the batch
        ]
        explained = [
            Prediction(
                id=targets[row],
                name=class_name(categories, targets[row]),
                score=scores[row],
                probability=(
                    float(probabilities[position, targets[row]])
                    if probabilities is not None and targets[row] >= 0
                    else None
                ),
                box=boxes[row] if boxes else None,
            )
            for row in rows
        ]
        top = (
            [
                Prediction(class_id, class_name(categories, class_id), score, probability)
                for class_id, score, probability in zip(
                    top_ids[position],
                    top_scores[position],
                    top_probabilities[position],
                    strict=True,
                )
            ]
            if table
            else []
        )
        results.append(
            ImageResult(
                index=sample.index,
                path=_path(items, sample.index),
                frame=_frame(items, sample.index),
                status="ok",
                image=_image(sample.original),
                frames=_frames(sample.original),
                size=sample.size,
                heatmaps=heatmaps[rows].clone(),
                explained=explained,
                top=top,
                seconds=sample.seconds + share,
                method=explanation.method,
                layers=list(explanation.layers),
            )
        )
    return results


_NOT_FINITE = (
    "the model's output or the map is not finite (NaN or Inf) for this input; check the "
    "weights (`camviz inspect` names the first layer that makes a NaN)"
)


def _finite_per_sample(
    logits: torch.Tensor, scores: torch.Tensor, heatmaps: torch.Tensor, count: int
) -> list[bool]:
    """Whether each sample's output, explained scores and maps are all finite numbers."""
    finite = torch.ones(count, dtype=torch.bool)
    for values in (logits, scores, heatmaps):
        if values.dim() > 0 and values.shape[0] % count == 0:
            per_sample = values.detach().cpu().reshape(count, -1)
            finite &= torch.isfinite(per_sample).all(dim=1)
    return finite.tolist()


def _image(original: torch.Tensor | None) -> Image.Image | None:
    """The photo of an image sample (``None`` for a clip or without originals)."""
    return None if original is None or original.dim() != 3 else Image.fromarray(original.numpy())


def _frames(original: torch.Tensor | None) -> torch.Tensor | None:
    """The ``(T, H, W, 3)`` frames of a clip sample (``None`` for an image)."""
    return original if original is not None and original.dim() == 4 else None


def nothing(
    sample: Sample, reason: str | None, items: list[Item] | None, share: float
) -> ImageResult:
    """The result of an input that had nothing to explain: ``"ok"``, saying why."""
    return ImageResult(
        index=sample.index,
        path=_path(items, sample.index),
        frame=_frame(items, sample.index),
        status="ok",
        reason=reason,
        image=_image(sample.original),
        frames=_frames(sample.original),
        size=sample.size,
        heatmaps=torch.zeros(0),
        seconds=sample.seconds + share,
    )


def failed(sample: Sample, reason: str, items: list[Item] | None) -> ImageResult:
    """The result of an input that could not be read or explained."""
    return ImageResult(
        index=sample.index,
        path=_path(items, sample.index),
        frame=_frame(items, sample.index),
        status="error",
        reason=reason,
        seconds=sample.seconds,
    )


def _path(items: list[Item] | None, index: int) -> str | None:
    return None if items is None else items[index].path


def _frame(items: list[Item] | None, index: int) -> int | None:
    return None if items is None else items[index].frame


# What explaining a batch raises for its inputs (and, told apart by belongs_to_input, bugs).
FAILURES = (CamvizError, RuntimeError, MemoryError)


def belongs_to_input(error: BaseException) -> bool:
    """Whether ``error`` belongs to the inputs being explained, so that it becomes their
    rows: a :class:`~camviz.core.errors.CamvizError` (the model failed on them,
    :class:`~camviz.core.errors.ModelError`; a NaN; a map that cannot be made) or an
    out-of-memory error. Anything else is a bug of camviz."""
    return isinstance(error, CamvizError) or is_out_of_memory(error)


def about_the_arguments(error: BaseException) -> bool:
    """Whether ``error`` is a mistake in what was asked rather than about the input."""
    return isinstance(error, CamvizError) and not isinstance(error, (ModelError, NonFiniteError))


def failure_reason(error: BaseException) -> str:
    """The reason a failed input's row gives for ``error`` (see :func:`belongs_to_input`)."""
    if isinstance(error, CamvizError):
        return str(error)
    return (
        f"memory ran out on this input ({first_line(error)}); use a smaller batch size, input "
        "size or memory budget"
    )
