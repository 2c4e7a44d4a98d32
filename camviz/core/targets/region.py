"""Region targets: a class's logits summed over a region of a segmentation output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from camviz.core.errors import CamvizError
from camviz.core.targets.classes import ClassScore
from camviz.core.targets.outputs import as_logits
from camviz.core.targets.protocol import Change, Context, Resolved, TargetObject


@dataclass(frozen=True, eq=False)
class Region(TargetObject):
    """A region of a segmentation output: ``y = sum_ij mask_ij * logits[class_id, i, j]``.

    For models whose output is ``(N, classes, H, W)`` (torchvision's segmentation models
    return it under ``"out"``, which :func:`~camviz.core.targets.as_logits` finds). The map
    then shows what makes the model label that region as ``class_id``.

    Attributes:
        class_id: The class whose logits are summed.
        mask: ``(H, W)`` for every sample or ``(N, H, W)`` per sample, at the output's
            resolution; boolean, or float weights for a weighted sum.
    """

    class_id: int
    mask: torch.Tensor
    cannot_move = (
        "aug_smooth cannot explain a Region target (the mask would have to move with the "
        "augmented output); explain it without aug_smooth"
    )

    def resolve(self, output: Any, context: Context) -> Resolved:
        logits = as_logits(output, context.output_key)
        mask = self._checked_mask(logits)
        ids = torch.full((logits.shape[0],), self.class_id, device=logits.device)
        read = RegionSums(mask.to(logits.dtype), context.output_key)
        return Resolved((ClassScore(read, ids),), ids.unsqueeze(1))

    def follow(self, change: Change) -> TargetObject:
        if change.moves:
            raise CamvizError(self.cannot_move)
        return self

    def _checked_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The mask on the logits' device, checked against a segmentation output."""
        if logits.dim() != 4:
            raise CamvizError(
                f"a Region target needs a segmentation output (N, classes, H, W), but the "
                f"model output has shape {tuple(logits.shape)}"
            )
        batch, num_classes, height, width = logits.shape
        class_id = self.class_id
        if isinstance(class_id, bool) or not isinstance(class_id, int):
            raise CamvizError(f"Region.class_id must be an int, not {class_id!r}")
        if not 0 <= class_id < num_classes:
            raise CamvizError(
                f"class id {class_id} is out of range: the model has {num_classes} classes "
                f"(0..{num_classes - 1})"
            )
        mask = torch.as_tensor(self.mask, device=logits.device)
        if (
            mask.shape[-2:] != (height, width)
            or mask.dim() not in (2, 3)
            or (mask.dim() == 3 and mask.shape[0] != batch)
        ):
            raise CamvizError(
                f"Region.mask has shape {tuple(mask.shape)}; it must be ({height}, {width}) or "
                f"({batch}, {height}, {width}) to match the output's grid"
            )
        if not bool(mask.flatten(-2).ne(0).any(-1).all()):
            raise CamvizError(
                "Region.mask selects no pixel (for some sample); give a non-empty region"
            )
        return mask


@dataclass(frozen=True, eq=False)
class RegionSums:
    """A class's score is its logits summed over the mask of each row's sample."""

    mask: torch.Tensor
    output_key: str | int | None

    def _weights(self, samples: torch.Tensor | None) -> torch.Tensor:
        """``(H, W)`` or ``(R, 1, H, W)``: the mask of each row, against ``(R, T, H, W)``."""
        if self.mask.dim() == 2:
            return self.mask
        return (self.mask if samples is None else self.mask[samples]).unsqueeze(1)

    def every_class(self, output: Any, samples: torch.Tensor | None) -> torch.Tensor:
        return (as_logits(output, self.output_key) * self._weights(samples)).sum(dim=(-2, -1))

    def of(self, output: Any, samples: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        logits = as_logits(output, self.output_key)
        rows = torch.arange(len(logits), device=logits.device).unsqueeze(-1)
        return (logits[rows, ids.to(logits.device)] * self._weights(samples)).sum(dim=(-2, -1))
