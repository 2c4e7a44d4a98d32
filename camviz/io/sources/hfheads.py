"""Hugging Face detectors and mask-classification segmenters as the models camviz explains.

A DETR-style detector (``...ForObjectDetection``: DETR, Conditional and Deformable DETR,
RT-DETR, YOLOS) becomes a :class:`SetPredictionDetector`: it takes the photo at its own size
(normalised with the processor's mean and std, which commutes with a resize), resizes it inside
as its image processor would (an :class:`~camviz.core.placement.AspectResize`: no padding, so
the layers' grids cover the whole photo), and reads its queries with
:class:`~camviz.core.setpredictions.SetPredictions`. Its boxes are relative to the image, so
they land on the photo's own pixels, and the model answers torchvision's list of per-image
dicts: each detected object gets its own map, as for torchvision's detectors. Whether the
classes are scored by a softmax with a last "no object" column (DETR, YOLOS) or by a sigmoid
each (Conditional and Deformable DETR, RT-DETR) is told from the logits: ``classes + 1`` columns
or ``classes``.

A mask-classification segmenter (``...ForInstanceSegmentation``,
``...ForUniversalSegmentation``: MaskFormer, Mask2Former) answers a class distribution and a
mask per query; :class:`SemanticLogits` turns them into per-class maps, as Hugging Face's
semantic post-processing does: ``sum_q softmax(class_q)[c] * sigmoid(mask_q)``, the "no object"
column dropped and the masks first resized to the input (bilinear). A region of that map is then
explained with :class:`camviz.Region`, as for any segmentation model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.placement import AspectResize
from camviz.core.setpredictions import SetPredictions

__all__ = ["SemanticLogits", "SetPredictionDetector"]

# Hugging Face's object-detection post-processing keeps queries scored this much or more.
_SCORE_THRESHOLD = 0.5


class SetPredictionDetector(nn.Module):
    """A Hugging Face set-prediction detector as a torchvision-style one (see the module
    docstring).

    Takes ``(N, 3, H, W)`` normalised photos at their own size and returns, per photo,
    ``boxes`` (``x0, y0, x1, y1`` in the photo's pixels), ``scores`` and ``labels``, best
    first.

    Attributes:
        model: The Hugging Face detector.
        resize: Its images' resize.
        num_classes: The classes it detects (``config.num_labels``).
        score_thresh: Queries scored below this are dropped (a job lowers it, as a
            :mod:`camviz.core.modelstate` change, to its ``min_score``).
    """

    def __init__(
        self,
        model: nn.Module,
        resize: AspectResize,
        num_classes: int,
    ) -> None:
        super().__init__()
        self.model = model
        self.resize = resize
        self.num_classes = num_classes
        self.score_thresh = _SCORE_THRESHOLD

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        output = self.model(pixel_values=self.resize(images))
        columns = int(output.logits.shape[-1])
        if columns not in (self.num_classes, self.num_classes + 1):
            raise CamvizError(
                f"the detector gives {columns} class logits per query for its "
                f"{self.num_classes} classes; camviz reads classes + 1 (a softmax with a last "
                "'no object' column) or classes (a sigmoid each): explain it in Python with "
                "camviz.Detection(i, adapter=camviz.SetPredictions(...))"
            )
        adapter = SetPredictions(
            activation="softmax" if columns == self.num_classes + 1 else "sigmoid",
            score_threshold=self.score_thresh,
        )
        return adapter.for_input(images.shape)(output)


class SemanticLogits(nn.Module):
    """A mask-classification segmenter's per-class maps at its input's size, ``(N, classes,
    H, W)`` (see the module docstring).

    Attributes:
        model: The Hugging Face segmenter.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        output: Any = self.model(pixel_values=pixel_values)
        classes = output.class_queries_logits.softmax(dim=-1)[..., :-1]
        masks = F.interpolate(
            output.masks_queries_logits,
            size=tuple(pixel_values.shape[-2:]),
            mode="bilinear",
            align_corners=False,
        )
        return torch.einsum("nqc,nqhw->nchw", classes, masks.sigmoid())
