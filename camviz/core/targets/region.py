"""Region targets: a class's logits summed over a region of a segmentation output."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from camviz.core.errors import CamvizError
from camviz.core.targets.classes import ClassScore
from camviz.core.targets.outputs import as_logits
from camviz.core.targets.protocol import Change, Context, Resolved, TargetObject

if TYPE_CHECKING:
    from torch import nn

    from camviz.core.inputs import Inputs

_INTERPOLATION = {1: "linear", 2: "bilinear", 3: "trilinear"}


@dataclass(frozen=True, eq=False)
class Region(TargetObject):
    """A region of a segmentation output: ``y = sum_ij mask_ij * logits[class_id, i, j]``.

    For models whose output is ``(N, classes, H, W)`` (torchvision's segmentation models
    return it under ``"out"``, which :func:`~camviz.core.targets.as_logits` finds), or
    ``(N, classes, L)`` and ``(N, classes, D, H, W)`` for signals and volumes (MONAI's
    UNet). The map then shows what makes the model label that region as ``class_id``.

    Attributes:
        class_id: The class whose logits are summed.
        mask: ``(*grid)`` for every sample or ``(N, *grid)`` per sample, at the output's
            resolution or at the map input's (then resized to the output's: nearest for a
            boolean mask, linear for weights); boolean, or float weights for a weighted sum.
    """

    class_id: int
    mask: torch.Tensor
    input_size: tuple[int, ...] | None = field(default=None, init=False)
    cannot_move = (
        "aug_smooth cannot explain a Region target (the mask would have to move with the "
        "augmented output); explain it without aug_smooth"
    )

    def prepare(self, model: nn.Module, inputs: Inputs) -> Region:
        """This region, told the map input's size (a mask may be given at it)."""
        prepared = dataclasses.replace(self)
        object.__setattr__(prepared, "input_size", tuple(inputs.main.shape[2:]))
        return prepared

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
        """The mask on the logits' device at their grid, checked against a segmentation
        output."""
        if not 3 <= logits.dim() <= 5:
            raise CamvizError(
                f"a Region target needs a segmentation output (N, classes, *grid) with one to "
                f"three grid axes, but the model output has shape {tuple(logits.shape)}"
            )
        batch, num_classes, *grid = logits.shape
        class_id = self.class_id
        if isinstance(class_id, bool) or not isinstance(class_id, int):
            raise CamvizError(f"Region.class_id must be an int, not {class_id!r}")
        if not 0 <= class_id < num_classes:
            raise CamvizError(
                f"class id {class_id} is out of range: the model has {num_classes} classes "
                f"(0..{num_classes - 1})"
            )
        mask = torch.as_tensor(self.mask, device=logits.device)
        rank = len(grid)
        sizes = [tuple(grid)] + ([self.input_size] if self.input_size else [])
        if (
            mask.dim() not in (rank, rank + 1)
            or (mask.dim() == rank + 1 and mask.shape[0] != batch)
            or tuple(mask.shape[-rank:]) not in sizes
        ):
            wanted = " or ".join(
                f"{size} or ({batch}, {', '.join(map(str, size))})" for size in sizes
            )
            raise CamvizError(
                f"Region.mask has shape {tuple(mask.shape)}; it must be {wanted}, at the "
                "output's grid or the input's size"
            )
        if tuple(mask.shape[-rank:]) != tuple(grid):
            mask = _resized(mask, tuple(grid))
        if not bool(mask.flatten(-rank).ne(0).any(-1).all()):
            raise CamvizError(
                "Region.mask selects no pixel (for some sample); give a non-empty region"
            )
        return mask


def _resized(mask: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
    """A mask at the input's size resized to the output's grid: nearest for a boolean mask
    (still boolean), linear for weights."""
    rank = len(grid)
    batched = mask.reshape(-1, 1, *mask.shape[-rank:])
    if mask.dtype == torch.bool:
        resized = F.interpolate(batched.float(), size=grid, mode="nearest").bool()
    else:
        resized = F.interpolate(
            batched.float(), size=grid, mode=_INTERPOLATION[rank], align_corners=False
        ).to(mask.dtype)
    return resized.reshape(*mask.shape[:-rank], *grid)


@dataclass(frozen=True, eq=False)
class RegionSums:
    """A class's score is its logits summed over the mask of each row's sample."""

    mask: torch.Tensor
    output_key: str | int | None

    def _weights(self, samples: torch.Tensor | None, rank: int) -> torch.Tensor:
        """``(*grid)`` or ``(R, 1, *grid)``: the mask of each row, against ``(R, T, *grid)``."""
        if self.mask.dim() == rank:
            return self.mask
        return (self.mask if samples is None else self.mask[samples]).unsqueeze(1)

    def every_class(self, output: Any, samples: torch.Tensor | None) -> torch.Tensor:
        logits = as_logits(output, self.output_key)
        grid = tuple(range(2, logits.dim()))
        return (logits * self._weights(samples, len(grid))).sum(dim=grid)

    def of(self, output: Any, samples: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        logits = as_logits(output, self.output_key)
        rows = torch.arange(len(logits), device=logits.device).unsqueeze(-1)
        picked = logits[rows, ids.to(logits.device)]  # (R, T, *grid)
        grid = tuple(range(2, picked.dim()))
        return (picked * self._weights(samples, len(grid))).sum(dim=grid)
