"""Heatmap arithmetic shared by the CAM engine and the renderer: normalise and resize.

Kept apart from both so that drawing a map does not import the CAM machinery.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name


def normalize(maps: torch.Tensor) -> torch.Tensor:
    """Min-max normalise each ``(h, w)`` map to ``[0, 1]``; a constant map becomes zeros."""
    flat = maps.flatten(1)
    low = flat.amin(dim=1, keepdim=True)
    span = flat.amax(dim=1, keepdim=True) - low
    scaled = torch.where(span > 0, (flat - low) / span.clamp_min(torch.finfo(flat.dtype).tiny), 0)
    return scaled.view_as(maps)


def upsample(maps: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """Bilinear resize of ``(M, h, w)`` maps to ``size``; stays within the input's range."""
    if tuple(maps.shape[-2:]) == tuple(size):
        return maps
    return F.interpolate(maps.unsqueeze(1), size=tuple(size), mode="bilinear", align_corners=False)[
        :, 0
    ]
