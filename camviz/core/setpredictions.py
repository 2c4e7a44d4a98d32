"""The adapter for set-prediction detectors (DETR and its kind): one class distribution and
one box per object query.

DETR, Deformable DETR, RT-DETR and YOLOS (Hugging Face's ``*ForObjectDetection``) return,
per image, ``logits`` ``(Q, classes [+ 1])`` and ``pred_boxes`` ``(Q, 4)`` for ``Q`` object
queries, boxes as centre, width and height relative to the image. Nothing is suppressed: each
query predicts one object or "no object". :class:`SetPredictions` turns that into the list of
per-image dicts that :class:`~camviz.core.detection.Detection` reads, best first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torchvision.ops import box_convert

from camviz.core.errors import CamvizError

__all__ = ["SetPredictions"]


@dataclass(frozen=True)
class SetPredictions:
    """Read a set-prediction detector's output: each query's best class and its box.

    Example::

        target = camviz.Detection(0, adapter=camviz.SetPredictions())
        explanation = camviz.explain(detr, {"pixel_values": images}, target=target)

    Per image, the score of a query is its best class probability: a softmax over the
    classes and the "no object" column, which is then dropped (DETR, YOLOS), or a sigmoid of
    each class logit (Deformable DETR, RT-DETR: ``activation="sigmoid"``). Queries whose
    score reaches ``score_threshold`` are kept, best first. Boxes are converted to ``x0, y0,
    x1, y1`` and scaled to the pixels of the map input (``Detection`` tells the adapter its
    size before the first pass; see :meth:`for_input`). Scores and boxes stay in the autograd
    graph, so the explained score is differentiable.

    Attributes:
        logits: The output's key (or attribute) of the ``(N, Q, classes [+ 1])`` logits.
        boxes: The key of the ``(N, Q, 4)`` boxes.
        box_format: ``"cxcywh"`` or ``"xyxy"``.
        activation: ``"softmax"`` (the last column is "no object") or ``"sigmoid"``.
        score_threshold: The least score of a detection.
        normalized: Whether boxes are relative to the image (``[0, 1]``), as in DETR, rather
            than in pixels.
    """

    logits: str = "logits"
    boxes: str = "pred_boxes"
    box_format: Literal["cxcywh", "xyxy"] = "cxcywh"
    activation: Literal["softmax", "sigmoid"] = "softmax"
    score_threshold: float = 0.0
    normalized: bool = True
    input_size: tuple[int, int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.box_format not in ("cxcywh", "xyxy"):
            raise CamvizError(
                f"SetPredictions.box_format must be 'cxcywh' or 'xyxy', not {self.box_format!r}"
            )
        if self.activation not in ("softmax", "sigmoid"):
            raise CamvizError(
                "SetPredictions.activation must be 'softmax' (with a 'no object' column) or "
                f"'sigmoid', not {self.activation!r}"
            )

    def for_input(self, size: Sequence[int]) -> SetPredictions:
        """This adapter with boxes scaled to an input of spatial ``size`` ``(H, W)``."""
        sized = dataclasses.replace(self)
        object.__setattr__(sized, "input_size", (int(size[-2]), int(size[-1])))
        return sized

    def __call__(self, output: Any) -> list[dict[str, torch.Tensor]]:
        logits, boxes = self._field(output, self.logits), self._field(output, self.boxes)
        if logits.dim() != 3 or boxes.shape != (*logits.shape[:2], 4):
            raise CamvizError(
                f"SetPredictions needs logits (N, queries, classes) and boxes (N, queries, 4), "
                f"got {tuple(logits.shape)} and {tuple(boxes.shape)}"
            )
        if self.activation == "softmax":
            if logits.shape[-1] < 2:
                raise CamvizError(
                    "SetPredictions(activation='softmax') needs the classes and a last "
                    f"'no object' column, got {logits.shape[-1]} column; for one logit per "
                    "class pass activation='sigmoid'"
                )
            probabilities = logits.softmax(dim=-1)[..., :-1]
        else:
            probabilities = logits.sigmoid()
        return [
            self._image(scores, image_boxes)
            for scores, image_boxes in zip(probabilities, boxes, strict=True)
        ]

    def _image(self, probabilities: torch.Tensor, boxes: torch.Tensor) -> dict[str, torch.Tensor]:
        best, labels = probabilities.max(dim=-1)
        kept = (best.detach() >= self.score_threshold).nonzero()[:, 0]
        kept = kept[best.detach()[kept].argsort(descending=True, stable=True)]
        boxes = boxes[kept]
        if self.box_format == "cxcywh":
            boxes = box_convert(boxes, "cxcywh", "xyxy")
        if self.normalized and self.input_size is not None:
            height, width = self.input_size
            boxes = boxes * boxes.new_tensor([width, height, width, height])
        return {"boxes": boxes, "scores": best[kept], "labels": labels[kept]}

    @staticmethod
    def _field(output: Any, key: str) -> torch.Tensor:
        """``output[key]`` of a dict, or ``output.key`` (Hugging Face's output classes)."""
        value = output.get(key) if isinstance(output, Mapping) else getattr(output, key, None)
        if not isinstance(value, torch.Tensor):
            keys = list(output) if isinstance(output, Mapping) else []
            raise CamvizError(
                f"SetPredictions found no tensor {key!r} in the model output "
                f"({type(output).__name__}{f' with keys {keys}' if keys else ''}); pass "
                "logits= and boxes= to name where the class logits and the boxes are"
            )
        return value
