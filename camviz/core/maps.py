"""Heatmap arithmetic shared by the CAM engine and the renderer: normalise and resize.

Kept apart from both so that drawing a map does not import the CAM machinery. Maps are
``(M, *spatial)`` with one, two or three spatial axes (signals, images, volumes or clips).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

# The linear interpolation of each spatial rank.
_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def normalize(maps: torch.Tensor) -> torch.Tensor:
    """Min-max normalise each map to ``[0, 1]``; a constant map becomes zeros."""
    flat = maps.flatten(1)
    low = flat.amin(dim=1, keepdim=True)
    span = flat.amax(dim=1, keepdim=True) - low
    scaled = torch.where(span > 0, (flat - low) / span.clamp_min(torch.finfo(flat.dtype).tiny), 0)
    return scaled.view_as(maps)


def normalize_signed(maps: torch.Tensor) -> torch.Tensor:
    """Divide each map by its largest absolute value: ``[-1, 1]``, zero and signs kept."""
    flat = maps.flatten(1)
    peak = flat.abs().amax(dim=1, keepdim=True)
    scaled = torch.where(peak > 0, flat / peak.clamp_min(torch.finfo(flat.dtype).tiny), 0)
    return scaled.view_as(maps)


def upsample(maps: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """(Bi/tri)linear resize of ``(M, *spatial)`` maps to ``size``; stays within their range."""
    size = tuple(size)
    if tuple(maps.shape[1:]) == size:
        return maps
    if maps.dim() - 1 != len(size) or len(size) not in _MODES:
        raise ValueError(f"cannot resize maps of shape {tuple(maps.shape)} to {size}")
    resized = F.interpolate(
        maps.unsqueeze(1), size=size, mode=_MODES[len(size)], align_corners=False
    )
    return resized[:, 0]
