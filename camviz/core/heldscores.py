"""The explained objects' scores in an R-CNN's held passes, for all copies at once.

In a held pass (:mod:`camviz.core.heldpasses`) on ``R`` copies of one image, the RoI heads
score the same ``P`` proposals in every copy. torchvision's post-processing would then loop
over the copies as images (a dozen operators each, NMS among them), the transform would
rescale each copy's boxes, and the target would find its object again in each copy's
detections. What one object's score needs from a copy is less: the detection it follows is of
its own class, so it is one of the ``P`` proposals' boxes of that class that survives the
post-processing. :func:`copy_scores` computes that for all copies with the operators
torchvision applies per image, applied to ``(R, P)`` at once: the same softmax and box
decoding of the predictor's rows, the same clipping, score threshold and small-box filter,
NMS among the class's boxes with the offsets and the arithmetic of torchvision's batched NMS,
the same rescaling and IoU. So each score is the one the whole post-processing gives.

What it does not decide is handed back: a copy with more candidates than the detector keeps
(``detections_per_img``) where the class's box might be cut, or one where torchvision's NMS
takes its per-class path (over 1,000 candidates). :meth:`HeldRows.torchvision_scores`
scores those copies through torchvision's own post-processing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn
from torchvision.ops import box_iou
from torchvision.ops.boxes import clip_boxes_to_image

from camviz.core.detection import Detection, DetectionScore

# torchvision's post-processing: the least side of a kept box, and the number of coordinates
# above which its batched NMS runs per class on CPU (without the coordinate offsets).
_MIN_SIDE = 1e-2
_PER_CLASS_NMS = 4000


@dataclass
class HeldRows:
    """The box predictor's rows of one held pass: ``R`` copies of ``P`` proposals.

    Attributes:
        heads: The detector's ``RoIHeads`` (its thresholds and box coder).
        transform: Its ``GeneralizedRCNNTransform`` (its rescaling of boxes).
        logits: ``(R * P, C)`` class logits, copy by copy.
        regression: ``(R * P, C * 4)`` box regression.
        proposals: ``(P, 4)`` the held proposals (the same in every copy).
        size: The image's size after the transform; ``original``: before it.
    """

    heads: nn.Module
    transform: nn.Module
    logits: torch.Tensor
    regression: torch.Tensor
    proposals: torch.Tensor
    size: tuple[int, int]
    original: tuple[int, int]

    @property
    def copies(self) -> int:
        return len(self.logits) // max(1, len(self.proposals))

    def torchvision_scores(
        self, score: DetectionScore, sample: int, copies: torch.Tensor
    ) -> torch.Tensor:
        """``score`` of copies ``copies`` through torchvision's post-processing, one by one."""
        found = []
        rows = len(self.proposals)
        for copy in copies.tolist():
            part = slice(copy * rows, (copy + 1) * rows)
            boxes, scores, labels = self.heads.postprocess_detections(  # type: ignore[operator]
                self.logits[part], self.regression[part], [self.proposals], [self.size]
            )
            detections = [{"boxes": boxes[0], "scores": scores[0], "labels": labels[0]}]
            found += self.transform.postprocess(detections, [self.size], [self.original])  # type: ignore[operator]
        return score(found, torch.full((len(found),), sample, dtype=torch.long))


def reads_output(score: object) -> bool:
    """Whether the score function ``score`` is a :class:`~camviz.Detection`'s that reads the
    model's output as it is (no adapter, no output key): a torchvision detector's own list of
    detections. Asked of its reader, which only such a score has."""
    return getattr(score, "read", None) == Detection(0).reader(None)


def copy_scores(rows: HeldRows, score: DetectionScore, sample: int) -> torch.Tensor:
    """``(R,)``: ``score`` (an object of image ``sample``) in each copy of ``rows``."""
    heads: Any = rows.heads  # torchvision's RoIHeads: its thresholds and box coder
    count = rows.copies
    per_copy = len(rows.proposals)
    boxes = heads.box_coder.decode(rows.regression, [rows.proposals] * count)
    scores = F.softmax(rows.logits, -1)
    boxes = clip_boxes_to_image(boxes, rows.size)
    classes = scores.shape[-1]
    boxes = boxes.reshape(count, per_copy, classes, 4)[:, :, 1:]
    scores = scores.reshape(count, per_copy, classes)[:, :, 1:]
    valid = (
        (scores > heads.score_thresh)
        & (boxes[..., 2] - boxes[..., 0] >= _MIN_SIDE)
        & (boxes[..., 3] - boxes[..., 1] >= _MIN_SIDE)
    )
    candidates = valid.flatten(1).sum(1)
    label = int(score.labels[sample])
    found = torch.zeros(count, dtype=scores.dtype, device=scores.device)
    if not 1 <= label < classes:  # a padded rank, or a class this head has not
        return found
    own = scores[:, :, label - 1]
    order = own.sort(dim=1, descending=True, stable=True).indices  # torchvision's NMS order
    own = own.gather(1, order)
    own_boxes = boxes[:, :, label - 1].gather(1, order[..., None].expand(-1, -1, 4))
    own_valid = valid[:, :, label - 1].gather(1, order)
    kept = _kept(own_boxes, own_valid, boxes, valid, label, float(heads.nms_thresh))
    # The detector keeps its best detections_per_img: certain for those with fewer
    # candidates above them than that, counted over every class, suppressed ones included.
    limit = int(heads.detections_per_img)
    above = (scores.flatten(1)[:, None, :] >= own[..., None]).logical_and(
        valid.flatten(1)[:, None, :]
    )
    certain = (candidates[:, None] <= limit) | (above.sum(-1) <= limit)
    undecided = (kept & ~certain).any(1) | (candidates * 4 > _PER_CLASS_NMS)
    resized = _rescaled(rows, own_boxes)
    ious = box_iou(score.boxes[sample].to(resized).unsqueeze(0), resized.reshape(-1, 4))
    ious = torch.where(kept, ious.reshape(count, per_copy), ious.new_tensor(-1.0))
    best = ious.argmax(1, keepdim=True)
    match = ious.gather(1, best)[:, 0]
    matched = (match >= score.iou) & (match >= 0)
    value = own.gather(1, best)[:, 0]
    if score.with_box:
        box = resized.gather(1, best[..., None].expand(-1, -1, 4))[:, 0]
        reference = score.reference[sample : sample + 1].to(box)
        value = value + box_iou(box, reference)[:, 0]
    found = torch.where(matched, value, found)
    if undecided.any():
        copies = undecided.nonzero()[:, 0]
        found[copies] = rows.torchvision_scores(score, sample, copies).to(found)
    return found


def _kept(
    own: torch.Tensor,
    own_valid: torch.Tensor,
    boxes: torch.Tensor,
    valid: torch.Tensor,
    label: int,
    threshold: float,
) -> torch.Tensor:
    """``(R, P)``: which of a class's candidate boxes ``own`` (best first) survive NMS, as
    torchvision's batched NMS decides it on each copy: boxes offset by the label times the
    largest coordinate of the copy's candidates plus one, then greedy suppression of a box
    whose IoU with a kept better one exceeds ``threshold``, in its kernel's arithmetic."""
    largest = torch.where(valid[..., None], boxes, boxes.new_tensor(-torch.inf)).amax((1, 2, 3))
    offset = torch.tensor(label).to(boxes) * (largest + torch.tensor(1).to(boxes))
    shifted = own + offset[:, None, None]
    x0, y0, x1, y1 = shifted.unbind(-1)
    areas = (x1 - x0) * (y1 - y0)
    suppressed = ~own_valid
    kept = torch.zeros_like(own_valid)
    for first in range(own.shape[1]):
        alive = ~suppressed[:, first]
        kept[:, first] = alive
        later = slice(first + 1, None)
        wide = (
            torch.minimum(x1[:, first, None], x1[:, later])
            - torch.maximum(x0[:, first, None], x0[:, later])
        ).clamp(min=0)
        tall = (
            torch.minimum(y1[:, first, None], y1[:, later])
            - torch.maximum(y0[:, first, None], y0[:, later])
        ).clamp(min=0)
        inter = wide * tall
        overlap = inter / (areas[:, first, None] + areas[:, later] - inter)
        suppressed[:, later] |= alive[:, None] & (overlap.double() > threshold)
    return kept


def _rescaled(rows: HeldRows, boxes: torch.Tensor) -> torch.Tensor:
    """``boxes`` (``(..., 4)``, in the transformed image) in the image as given, as the
    transform's post-processing rescales them."""
    from torchvision.models.detection.transform import resize_boxes

    return resize_boxes(boxes.reshape(-1, 4), list(rows.size), list(rows.original)).reshape(
        boxes.shape
    )
