"""Detection targets: explain one object that a detector found.

A detector's output is not one row of class scores per image but a list of detections per
image. torchvision's detectors (Faster, Mask and Keypoint R-CNN, RetinaNet, FCOS, SSD and
SSDlite) return, in eval mode, one dict per image with ``boxes`` ``(D, 4)`` (``x0, y0, x1,
y1`` in the pixels of the image given), ``scores`` ``(D,)`` and ``labels`` ``(D,)``, best
first. Other detectors join through an *adapter* that turns their output into that list;
:class:`DenseDetections` is the one for raw dense heads (YOLO-style ``(N, anchors, 4 +
classes)``).

:class:`Detection` picks, in each image, the detection to explain, by its index in that list
or as the detection of a class that best overlaps a given box, and scores it with its class
score (plus, on request, the overlap of its box with the reference box). Several objects of
an image are the *ranks* of one call, one map each, like the classes of ``"top3"``.

Methods that run the model again (Score-CAM, Ablation-CAM, ``aug_smooth``) get new outputs
in which the detections are found anew, in another order or not at all. The object found in
the plain pass is therefore followed by class and box: in each re-run output, the detection
of the same class whose box overlaps the plain pass's box most, with an IoU of at least
``iou``; when there is none, the object scores 0. This is the rule of pytorch-grad-cam's
``FasterRCNNBoxScoreTarget`` and of the detection-explanation literature (D-RISE).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torchvision.ops import batched_nms, box_convert, box_iou

from camviz.core.errors import CamvizError
from camviz.core.setpredictions import SetPredictions
from camviz.core.targets.protocol import Change, Context, Resolved, TargetObject

if TYPE_CHECKING:
    from torch import nn

    from camviz.core.inputs import Inputs

#: A model's raw output -> one dict per image with ``boxes``, ``scores`` and ``labels``.
Adapter = Callable[[Any], Sequence[Mapping[str, torch.Tensor]]]

_FIELDS = ("boxes", "scores", "labels")


@dataclass(frozen=True, eq=False)
class Detection(TargetObject):
    """Explain detections: by index, or as the best match of a box and class.

    Pass it as ``target=`` to :func:`camviz.explain` with a detector:

    * ``Detection(0)`` - each image's first detection (the detector's order: best score
      first for torchvision's); ``Detection([0, 1, 2])`` - three objects, one map each.
    * ``Detection(box=(x0, y0, x1, y1), label=c)`` - the detection of class ``c`` whose box
      overlaps that box most (IoU at least ``iou``). ``box`` is ``(4,)``, ``(K, 4)`` for
      ``K`` objects, or ``(N, K, 4)`` per image; ``label`` an int, ``(K,)`` or ``(N, K)``.
      Boxes are in the pixels of the images as given to the model.

    The score explained is the detection's class score; ``with_box=True`` adds the IoU of
    its box with the reference box (the given box, or the detection's own box in the plain
    pass), so the map also shows what places the box - the score of pytorch-grad-cam's
    ``FasterRCNNBoxScoreTarget``. :attr:`camviz.Explanation.boxes` holds the explained
    detections' boxes and :attr:`~camviz.Explanation.targets` their labels.

    Attributes:
        index: Detection index (or indices) in each image's output.
        box: Reference box(es), with ``label``, instead of ``index``.
        label: The class of each reference box.
        iou: The least IoU of a match (with ``box``, and in re-run outputs).
        with_box: Add the IoU of the detection's box to its score.
        adapter: Turns the model's output into one dict per image with ``boxes``,
            ``scores`` and ``labels`` (:class:`DenseDetections` for raw dense heads);
            ``None`` for torchvision's detectors, which return that already.
    """

    index: int | Sequence[int] | None = None
    box: Any = None
    label: Any = None
    iou: float = 0.5
    with_box: bool = False
    adapter: Adapter | None = None

    def __post_init__(self) -> None:
        if (self.index is None) == (self.box is None):
            raise CamvizError(
                "Detection needs an index (Detection(0)) or a box and a label "
                "(Detection(box=(x0, y0, x1, y1), label=3)), not both"
            )
        if (self.box is None) != (self.label is None):
            raise CamvizError("Detection(box=...) needs label= too: the class of the box")
        if isinstance(self.iou, bool) or not isinstance(self.iou, (int, float)):
            raise CamvizError(f"Detection.iou must be a number in [0, 1], not {self.iou!r}")
        if not 0 <= self.iou <= 1:
            raise CamvizError(f"Detection.iou must be in [0, 1], got {self.iou}")

    def prepare(self, model: nn.Module, inputs: Inputs) -> Detection:
        """This target with a :class:`~camviz.core.setpredictions.SetPredictions` adapter told
        the map input's size (its boxes are relative to the image)."""
        if isinstance(self.adapter, SetPredictions):
            return dataclasses.replace(self, adapter=self.adapter.for_input(inputs.main.shape[2:]))
        return self

    def resolve(self, output: Any, context: Context | None = None) -> Resolved:
        """The score function of each object (rank), the explained labels ``(N, K)`` and
        boxes ``(N, K, 4)``, found in the plain pass's ``output``.

        Raises:
            CamvizError: The output is no list of detections, an index does not exist, or
                no detection of a box's class overlaps it enough.
        """
        output_key = None if context is None else context.output_key
        found = self.detections(output, output_key)
        references: list[torch.Tensor] | None = None
        if self.index is not None:
            picked = [_by_index(detections, self.index, n) for n, detections in enumerate(found)]
        else:
            references, labels = self._references(found)
            picked = [
                _by_box(detections, boxes, classes, self.iou, n)
                for n, (detections, boxes, classes) in enumerate(
                    zip(found, references, labels, strict=True)
                )
            ]
        ranks = _rank_count(self.index, self.box)
        return objects(found, picked, self.reader(output_key), self, references, ranks)

    def follow(self, change: Change) -> TargetObject:
        """The objects of the plain pass, followed by class and box in the changed input."""
        scores = [score for score in change.plain.scores if isinstance(score, DetectionScore)]
        assert len(scores) == len(change.plain.scores)  # what resolve gives
        return Followed(tuple(scores)).follow(change)

    def detections(
        self, output: Any, output_key: str | int | None = None
    ) -> list[Mapping[str, torch.Tensor]]:
        """The model output as one dict of ``boxes``, ``scores`` and ``labels`` per image."""
        return self.reader(output_key)(output)

    def reader(self, output_key: str | int | None) -> _Reader:
        """Model outputs -> one dict of detections per image (see :meth:`detections`)."""
        return _Reader(self.adapter, output_key)

    def _references(
        self, found: Sequence[Mapping[str, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The reference boxes ``(K, 4)`` and labels ``(K,)`` of each image."""
        count = len(found)
        box = torch.as_tensor(self.box, dtype=torch.float32)
        label = torch.as_tensor(self.label)
        if box.dim() == 1:
            box = box.unsqueeze(0)
        if box.dim() == 2:
            box = box.expand(count, *box.shape)
        if box.dim() != 3 or box.shape[-1] != 4 or box.shape[0] != count:
            raise CamvizError(
                f"Detection.box must be (4,), (K, 4) or ({count}, K, 4) for {count} images, "
                f"got shape {tuple(torch.as_tensor(self.box).shape)}"
            )
        if label.is_floating_point() or label.dim() > 2:
            raise CamvizError(f"Detection.label must be class ids (ints), not {self.label!r}")
        label = label.long().expand(count, box.shape[1]) if label.dim() < 2 else label.long()
        if label.shape != box.shape[:2]:
            raise CamvizError(
                f"Detection has {box.shape[1]} box(es) per image but labels of shape "
                f"{tuple(label.shape)}; give one label per box"
            )
        device = found[0]["boxes"].device if found else None
        return [b.to(device) for b in box], [lab.to(device) for lab in label]


def objects(
    found: Sequence[Mapping[str, torch.Tensor]],
    picked: Sequence[Sequence[int]],
    read: Callable[[Any], list[Mapping[str, torch.Tensor]]],
    detection: Detection,
    references: list[torch.Tensor] | None = None,
    ranks: int | None = None,
) -> Resolved:
    """The detections ``picked[n]`` (one index per rank) of each image ``n`` of ``found``,
    scored as ``detection`` says against ``references`` (default: their own boxes), in
    ``ranks`` ranks (default: the most an image picks). An image that picks fewer (a folder
    job's batch) is padded: label ``-1``, which no re-run finds, a zero box, score 0."""
    scores = []
    for rank in range(ranks or max((len(chosen) for chosen in picked), default=1)):
        indices = [chosen[rank] if rank < len(chosen) else -1 for chosen in picked]
        pairs = list(zip(found, indices, strict=True))
        boxes = _stacked([_field(one, "boxes", i) for one, i in pairs], (0, 4))
        labels = _stacked([_field(one, "labels", i) for one, i in pairs], (0,))
        reference = boxes
        if references is not None:
            reference = _stacked([per_image[rank] for per_image in references], (0, 4))
        score = DetectionScore(
            boxes=boxes.detach(),
            labels=labels.long(),
            reference=reference.detach().to(boxes.dtype),
            indices=torch.tensor(indices, dtype=torch.long),
            iou=float(detection.iou),
            with_box=detection.with_box,
            read=read,
        )
        scores.append(score)
    return _resolved(scores)


def _field(detections: Mapping[str, torch.Tensor], name: str, index: int) -> torch.Tensor:
    """Detection ``index``'s box or label; for ``-1`` (padding), a zero box or label -1."""
    values = detections[name]
    if index >= 0:
        return values[index]
    return values.new_zeros(4) if name == "boxes" else values.new_tensor(-1)


@dataclass(frozen=True)
class _Reader:
    """A model output -> one dict of detections per image, through the adapter."""

    adapter: Adapter | None
    output_key: str | int | None

    def __call__(self, output: Any) -> list[Mapping[str, torch.Tensor]]:
        if self.output_key is not None:
            output = output[self.output_key]
        adapter = self.adapter
        return _checked(adapter(output) if adapter is not None else output, adapter)

    def rescaled(self, factors: Sequence[float]) -> _Reader:
        """This reader for an input rescaled by ``factors``: a set-prediction adapter's
        relative boxes are scaled to the rescaled input's pixels."""
        adapter = self.adapter
        if not isinstance(adapter, SetPredictions) or adapter.input_size is None:
            return self
        height, width = adapter.input_size
        size = (round(height * factors[-2]), round(width * factors[-1]))
        return _Reader(adapter.for_input(size), self.output_key)


@dataclass(frozen=True, eq=False)
class DetectionScore:
    """The score of one explained object per image (one rank), and how it is found again.

    In the plain pass (``rows is None``) image ``n``'s object is its detection
    ``indices[n]``; in a re-run output, row ``r``'s object is the detection of class
    ``labels[rows[r]]`` with the best IoU (at least ``iou``) with ``boxes[rows[r]]``, and
    scores 0 when there is none.

    Attributes:
        boxes: ``(N, 4)`` the object's box in the plain pass.
        labels: ``(N,)`` its class.
        reference: ``(N, 4)`` the box that ``with_box`` measures the IoU against.
        indices: ``(N,)`` its index in the plain pass's detections (``-1``: none, a padded
            rank, see :func:`objects`); ``None`` when the object is followed in every
            output, the plain one included (see :class:`Followed`).
        iou: The least IoU of a match in a re-run output.
        with_box: Add the IoU with ``reference`` to the class score.
        read: The model output -> one dict of detections per row.
    """

    boxes: torch.Tensor
    labels: torch.Tensor
    reference: torch.Tensor
    indices: torch.Tensor | None
    iou: float
    with_box: bool
    read: Callable[[Any], list[Mapping[str, torch.Tensor]]]

    def __call__(self, output: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        found = self.read(output)
        rows_list = range(len(found)) if rows is None else rows.tolist()
        scores = []
        for row, (image, detections) in enumerate(zip(rows_list, found, strict=True)):
            if rows is None and self.indices is not None:
                picked = int(self.indices[image])
                index: int | None = None if picked < 0 else picked  # -1: a padded rank
            else:
                index = _best_match(detections, self.boxes[image], self.labels[image], self.iou)
            scores.append(self._score(detections, index, image, row))
        return torch.stack(scores) if scores else self.boxes.new_zeros(0)

    def _score(
        self, detections: Mapping[str, torch.Tensor], index: int | None, image: int, row: int
    ) -> torch.Tensor:
        if index is None:  # kept in the graph, so that a gradient of zero can be taken
            return detections["scores"].sum() * 0
        score = detections["scores"][index]
        if self.with_box:
            box = detections["boxes"][index : index + 1]
            reference = self.reference[image : image + 1].to(box)
            score = score + box_iou(box, reference)[0, 0]
        return score

    def moved(self, factors: Sequence[float], flip_width: float | None) -> DetectionScore:
        """This object's boxes in an image rescaled by ``factors`` (height, width) and then,
        if ``flip_width`` is given, flipped left to right in an image that wide (the
        geometry of ``aug_smooth``'s variants)."""

        def move(boxes: torch.Tensor) -> torch.Tensor:
            height, width = factors[-2], factors[-1]
            scaled = boxes * boxes.new_tensor([width, height, width, height])
            if flip_width is None:
                return scaled
            x0, y0, x1, y1 = scaled.unbind(-1)
            return torch.stack([flip_width - x1, y0, flip_width - x0, y1], dim=-1)

        return DetectionScore(
            boxes=move(self.boxes),
            labels=self.labels,
            reference=move(self.reference),
            indices=None,
            iou=self.iou,
            with_box=self.with_box,
            read=self.read.rescaled(factors) if isinstance(self.read, _Reader) else self.read,
        )


@dataclass(frozen=True, eq=False)
class Followed(TargetObject):
    """The objects explained in a plain pass, as the target of passes on variants of the
    input (``aug_smooth``): each found again by class and box in every output."""

    scores: tuple[DetectionScore, ...]

    def resolve(self, output: Any, context: Context | None = None) -> Resolved:
        """The objects' score functions, labels ``(N, K)`` and boxes (``output`` is not
        needed)."""
        return _resolved(list(self.scores))

    def follow(self, change: Change) -> TargetObject:
        """The same objects in the changed input (rescaled and flipped, or as they are)."""
        return self.moved(change.factors or (1.0, 1.0), change.flip_width)

    def moved(self, factors: Sequence[float], flip_width: float | None) -> Followed:
        """The same objects in a rescaled and flipped input (:meth:`DetectionScore.moved`)."""
        return Followed(tuple(score.moved(factors, flip_width) for score in self.scores))


@dataclass(frozen=True)
class DenseDetections:
    """The adapter for dense heads that return raw predictions, one per anchor or cell.

    YOLO-style models output ``(N, A, 4 + C)`` (or ``(N, A, 5 + C)`` with an objectness
    score, YOLOv5's layout): for each of ``A`` anchors a box and ``C`` class scores.
    Ultralytics' YOLOv8 and later output ``(N, 4 + C, A)``, and their ``-seg`` models
    ``(N, 4 + C + K, A)`` with ``K`` mask coefficients, beside the ``K`` mask prototypes.
    Which axis holds the anchors is told from the shape: the one at least 4 times longer
    than the other (an image has thousands of anchors and tens of classes); when neither
    is, ``channels_last`` must say. The mask coefficients are dropped: ``K`` is the number
    of prototypes when the output holds them (Ultralytics' ``Segment`` head), or
    ``mask_coefficients``. This adapter turns them into the detections a detector's
    post-processing gives, so that :class:`Detection` can pick one: per image, the anchors
    whose best class score (times the objectness, if any) reaches ``score_threshold``, then
    class-wise non-maximum suppression at ``iou_threshold``, best first, at most
    ``max_detections``.
    Scores and boxes stay in the autograd graph (only the choice of anchors is not), so
    the explained score is differentiable.

    Example::

        target = camviz.Detection(0, adapter=camviz.DenseDetections(box_format="cxcywh"))
        explanation = camviz.explain(yolo, images, layer="neck.p3", target=target)

    Attributes:
        box_format: ``"cxcywh"`` (centre, width, height) or ``"xyxy"``, in input pixels.
        objectness: Whether a fifth column holds an objectness score.
        score_threshold: The least score of a detection.
        iou_threshold: The IoU above which NMS drops the weaker of two boxes of a class.
        max_detections: The most detections kept per image.
        channels_last: ``True`` for ``(N, A, 4 + C)``, ``False`` for ``(N, 4 + C, A)``,
            ``None`` (the default) to tell it from the shape.
        mask_coefficients: The ``K`` trailing columns that are mask coefficients, not
            classes; ``None``: the number of mask prototypes in the output, if any, else 0.
        activation: ``"sigmoid"`` or ``"softmax"`` if the class (and objectness) columns
            are logits; ``None`` if they are scores already.
    """

    box_format: Literal["cxcywh", "xyxy"] = "cxcywh"
    objectness: bool = False
    score_threshold: float = 0.25
    iou_threshold: float = 0.45
    max_detections: int = 100
    channels_last: bool | None = None
    activation: Literal["sigmoid", "softmax"] | None = None
    mask_coefficients: int | None = None

    def __post_init__(self) -> None:
        masks = self.mask_coefficients
        if masks is not None and (
            isinstance(masks, bool) or not isinstance(masks, int) or masks < 0
        ):
            raise CamvizError(
                f"DenseDetections.mask_coefficients must be an int >= 0 or None, not {masks!r}"
            )
        if self.box_format not in ("cxcywh", "xyxy"):
            raise CamvizError(
                f"DenseDetections.box_format must be 'cxcywh' or 'xyxy', not {self.box_format!r}"
            )
        if self.activation not in (None, "sigmoid", "softmax"):
            raise CamvizError(
                "DenseDetections.activation must be None, 'sigmoid' or 'softmax', not "
                f"{self.activation!r}"
            )

    def __call__(self, output: Any) -> list[dict[str, torch.Tensor]]:
        predictions, prototypes = _dense_predictions(output)
        first = 5 if self.objectness else 4
        if not isinstance(predictions, torch.Tensor) or predictions.dim() != 3:
            raise CamvizError(
                "DenseDetections needs raw predictions of shape (N, anchors, 4 + classes), got "
                + (
                    f"shape {tuple(predictions.shape)}"
                    if isinstance(predictions, torch.Tensor)
                    else type(predictions).__name__
                )
            )
        if not self._anchors_first(predictions.shape):
            predictions = predictions.transpose(1, 2)
        masks = self.mask_coefficients
        if masks is None:
            masks = 0 if prototypes is None else prototypes.shape[1]
        if predictions.shape[-1] <= first + masks:
            raise CamvizError(
                f"DenseDetections expects (N, anchors, {first} + classes"
                + (f" + {masks} mask coefficients" if masks else "")
                + f") predictions, got {tuple(predictions.shape)}; for (N, {first} + classes, "
                "anchors) pass channels_last=False"
            )
        if masks:
            predictions = predictions[..., :-masks]
        return [self._image(rows, first) for rows in predictions]

    def _anchors_first(self, shape: Sequence[int]) -> bool:
        """Whether axis 1 of ``(N, a, b)`` predictions holds the anchors (``channels_last``,
        else the longer axis, when it is at least 4 times the other)."""
        if self.channels_last is not None:
            return self.channels_last
        _, first, second = shape
        if first >= 4 * second or second >= 4 * first:
            return first > second
        raise CamvizError(
            f"DenseDetections cannot tell which axis of the {tuple(shape)} predictions holds "
            "the anchors (neither is 4 times the other); pass channels_last=True for (N, "
            "anchors, 4 + classes) or channels_last=False for (N, 4 + classes, anchors)"
        )

    def _image(self, rows: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
        classes = self._activated(rows[:, first:])
        if self.objectness:
            objectness = rows[:, 4:5]
            objectness = objectness.sigmoid() if self.activation else objectness
            classes = classes * objectness
        best, labels = classes.max(dim=-1)
        keep = (best.detach() >= self.score_threshold).nonzero()[:, 0]
        boxes = rows[keep, :4]
        if self.box_format == "cxcywh":
            boxes = box_convert(boxes, "cxcywh", "xyxy")
        kept = batched_nms(
            boxes.detach().float(), best[keep].detach().float(), labels[keep], self.iou_threshold
        )
        kept = kept[: self.max_detections]
        return {"boxes": boxes[kept], "scores": best[keep][kept], "labels": labels[keep][kept]}

    def _activated(self, scores: torch.Tensor) -> torch.Tensor:
        if self.activation == "sigmoid":
            return scores.sigmoid()
        if self.activation == "softmax":
            return scores.softmax(dim=-1)
        return scores


def _dense_predictions(output: Any) -> tuple[Any, torch.Tensor | None]:
    """A dense head's raw predictions in its output (the first element of a tuple or list),
    and its mask prototypes ``(N, K, h, w)`` if the predictions come with them (Ultralytics'
    ``Segment`` head gives ``[predictions, prototypes]`` first)."""
    predictions = output[0] if isinstance(output, (tuple, list)) else output
    if isinstance(predictions, (tuple, list)) and len(predictions) == 2:
        values, prototypes = predictions
        if (
            isinstance(values, torch.Tensor)
            and isinstance(prototypes, torch.Tensor)
            and values.dim() == 3
            and prototypes.dim() == 4
        ):
            return values, prototypes
    return predictions, None


def _resolved(scores: list[DetectionScore]) -> Resolved:
    """The objects' score functions with their labels ``(N, K)`` and boxes ``(N, K, 4)``."""
    return Resolved(
        tuple(scores),
        torch.stack([score.labels for score in scores], dim=1),
        boxes=torch.stack([score.boxes for score in scores], dim=1),
    )


def _checked(found: Any, adapter: Adapter | None) -> list[Mapping[str, torch.Tensor]]:
    """``found`` if it is a list of per-image dicts with boxes, scores and labels."""
    if isinstance(found, (list, tuple)) and all(
        isinstance(item, Mapping) and all(field in item for field in _FIELDS) for item in found
    ):
        return list(found)
    described = type(found).__name__
    if isinstance(found, torch.Tensor):
        described = f"a tensor of shape {tuple(found.shape)}"
    if adapter is not None:
        raise CamvizError(
            f"the Detection adapter returned {described}; it must return one dict per image "
            "with 'boxes', 'scores' and 'labels'"
        )
    raise CamvizError(
        f"Detection needs a detector's output (one dict per image with 'boxes', 'scores' and "
        f"'labels', as torchvision's detectors return in eval mode), got {described}; for raw "
        "dense predictions pass adapter=camviz.DenseDetections(...)"
    )


def _by_index(
    detections: Mapping[str, torch.Tensor], index: int | Sequence[int], image: int
) -> list[int]:
    """The detection indices of one image, checked to exist."""
    indices = [index] if isinstance(index, int) else list(index)
    if not indices or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise CamvizError(
            f"Detection(index) takes an int or a non-empty list of ints, not {index!r}"
        )
    count = len(detections["scores"])
    if not count:
        raise CamvizError(
            f"image {image} has no detection to explain: no score reaches the threshold of the "
            "detector (box_score_thresh= of torchvision's) or of its adapter (score_threshold= "
            "of DenseDetections and SetPredictions); lower it, or explain another image"
        )
    for i in indices:
        if not 0 <= i < count:
            raise CamvizError(
                f"detection {i} does not exist: image {image} has detections 0..{count - 1}; "
                "pick an index "
                "below that (or lower the detector's score threshold)"
            )
    return indices


def _by_box(
    detections: Mapping[str, torch.Tensor],
    boxes: torch.Tensor,
    labels: torch.Tensor,
    iou: float,
    image: int,
) -> list[int]:
    """For each reference box of one image, the index of its best-matching detection."""
    chosen = []
    for box, label in zip(boxes, labels, strict=True):
        index = _best_match(detections, box, label, iou)
        if index is None:
            overlaps = _same_class_ious(detections, box, label)
            best = f"{float(overlaps.max()):.2f}" if overlaps.numel() else "none of that class"
            corners = [round(float(value), 1) for value in box]
            raise CamvizError(
                f"no detection of class {int(label)} overlaps box {corners} "
                f"in image {image} with IoU >= {iou} (best: {best}); check the box's pixel "
                "coordinates and class, or lower Detection(iou=)"
            )
        chosen.append(index)
    return chosen


def _same_class_ious(
    detections: Mapping[str, torch.Tensor], box: torch.Tensor, label: torch.Tensor
) -> torch.Tensor:
    """The IoU of ``box`` with every detection, ``-1`` for those of another class."""
    found = detections["boxes"].detach()
    if not len(found):
        return found.new_zeros(0)
    ious = box_iou(box.to(found).unsqueeze(0), found)[0]
    same = detections["labels"].to(label.device) == label
    return torch.where(same.to(ious.device), ious, ious.new_tensor(-1.0))


def _best_match(
    detections: Mapping[str, torch.Tensor], box: torch.Tensor, label: torch.Tensor, iou: float
) -> int | None:
    """The detection of class ``label`` that overlaps ``box`` most, if its IoU >= ``iou``."""
    ious = _same_class_ious(detections, box, label)
    if not ious.numel():
        return None
    best = int(ious.argmax())
    return best if float(ious[best]) >= iou and float(ious[best]) >= 0 else None


def _stacked(values: list[torch.Tensor], empty: tuple[int, ...]) -> torch.Tensor:
    return torch.stack(values) if values else torch.zeros(empty)


def _rank_count(index: int | Sequence[int] | None, box: Any) -> int:
    if index is not None:
        return 1 if isinstance(index, int) else len(index)
    shape = torch.as_tensor(box).shape
    return 1 if len(shape) == 1 else shape[-2]
