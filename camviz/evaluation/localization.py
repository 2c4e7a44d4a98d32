"""Localisation: does the map point at the object?

* :func:`pointing_game` (Zhang, Bargal, Lin, Brandt, Shen and Sclaroff, "Top-down Neural
  Attention by Excitation Backprop", ECCV 2016): a map *hits* when its maximum lies inside
  the object's region, or less than ``tolerance`` pixels from it. The paper (and TorchRay,
  its authors' benchmark code) forgives 15 pixels at ImageNet size, 224 x 224, for
  annotations that are a little tight; camviz defaults to that, scaled with the map's short
  side. ``tolerance=0`` asks for the maximum inside the region.
* :func:`energy_pointing_game` (Wang et al., "Score-CAM: Score-Weighted Visual Explanations
  for Convolutional Neural Networks", CVPR Workshops 2020): the share of the map's total
  mass that falls inside the region; it rewards a map that is both on the object and
  confined to it.

A region is a box or a mask. Boxes are ``(x0, y0, x1, y1)`` in pixels of the map, half-open
like a slice: pixel ``(row, col)`` is inside when ``y0 <= row < y1`` and ``x0 <= col < x1``.
Masks are ``(N, H, W)`` booleans at the map's size, for objects that are not boxes or for
several objects of the class in one image. A uniformly random map scores, on average, the
region's share of the image in both games.
"""

from __future__ import annotations

import torch

from camviz.core.errors import CamvizError

__all__ = [
    "box_masks",
    "energy_pointing_game",
    "pointing_game",
]

#: The pointing game's tolerance in the paper: 15 pixels on 224 x 224 images.
PAPER_TOLERANCE, PAPER_SIZE = 15.0, 224


def box_masks(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(N, height, width)`` boolean masks of ``(N, 4)`` boxes ``(x0, y0, x1, y1)``."""
    boxes = torch.as_tensor(boxes)
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise CamvizError(f"boxes must be (N, 4) as (x0, y0, x1, y1), got {tuple(boxes.shape)}")
    x0, y0, x1, y1 = boxes.unbind(dim=1)
    rows = torch.arange(height, device=boxes.device).view(1, -1, 1)
    cols = torch.arange(width, device=boxes.device).view(1, 1, -1)
    inside_rows = (rows >= y0.view(-1, 1, 1)) & (rows < y1.view(-1, 1, 1))
    inside_cols = (cols >= x0.view(-1, 1, 1)) & (cols < x1.view(-1, 1, 1))
    return inside_rows & inside_cols


def pointing_game(
    heatmaps: torch.Tensor, regions: torch.Tensor, *, tolerance: float | None = None
) -> torch.Tensor:
    """Whether each map's maximum points at its region.

    The maximum is the first one in raster order when several pixels share it; a constant
    map points nowhere and misses. Give the maps at the image's resolution (as
    :attr:`camviz.Explanation.heatmaps` are), so that the tolerance is in image pixels.

    Args:
        heatmaps: ``(N, H, W)`` maps.
        regions: ``(N, 4)`` boxes ``(x0, y0, x1, y1)`` or ``(N, H, W)`` boolean masks.
        tolerance: A maximum less than this many pixels (Euclidean distance between pixel
            centres) from the region still hits; one inside it always hits. ``None``: the
            paper's 15 pixels at 224 x 224, scaled with the short side,
            ``15 * min(H, W) / 224`` (about 4.3 at 64 x 64). ``0``: inside only.

    Returns:
        ``(N,)`` booleans; their mean is the pointing-game accuracy.
    """
    maps, masks = _checked(heatmaps, regions)
    height, width = maps.shape[-2:]
    if tolerance is None:
        tolerance = PAPER_TOLERANCE * min(height, width) / PAPER_SIZE
    if not tolerance >= 0:
        raise CamvizError(f"tolerance must be >= 0 pixels, got {tolerance}")
    flat = maps.flatten(1)
    peak = flat.argmax(dim=1)
    peak_row, peak_col = peak // width, peak % width
    rows = torch.arange(height, device=maps.device).view(1, -1, 1)
    cols = torch.arange(width, device=maps.device).view(1, 1, -1)
    distance_squared = (rows - peak_row.view(-1, 1, 1)) ** 2 + (cols - peak_col.view(-1, 1, 1)) ** 2
    unreachable = height**2 + width**2 + 1
    nearest = torch.where(masks, distance_squared, unreachable).flatten(1).amin(dim=1)
    has_peak = flat.amax(dim=1) > flat.amin(dim=1)
    return has_peak & ((nearest == 0) | (nearest < tolerance**2))


def energy_pointing_game(heatmaps: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """The share of each map's mass inside its region: ``sum_inside L / sum_all L``.

    Args:
        heatmaps: ``(N, H, W)`` non-negative maps.
        regions: ``(N, 4)`` boxes ``(x0, y0, x1, y1)`` or ``(N, H, W)`` boolean masks.

    Returns:
        ``(N,)`` shares in ``[0, 1]``; an all-zero map has no mass anywhere and scores 0.
    """
    maps, masks = _checked(heatmaps, regions)
    if bool((maps < 0).any()):
        raise CamvizError("the energy-based pointing game needs non-negative maps (after ReLU)")
    total = maps.sum(dim=(1, 2))
    inside = (maps * masks).sum(dim=(1, 2))
    return torch.where(total > 0, inside / total.clamp_min(torch.finfo(maps.dtype).tiny), 0.0)


def _checked(heatmaps: torch.Tensor, regions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Maps as a float ``(N, H, W)`` tensor and regions as boolean masks beside them."""
    if not isinstance(heatmaps, torch.Tensor) or heatmaps.dim() != 3:
        shape = tuple(heatmaps.shape) if isinstance(heatmaps, torch.Tensor) else heatmaps
        raise CamvizError(f"heatmaps must be an (N, H, W) tensor, got {shape}")
    maps = heatmaps.detach().float()
    regions = torch.as_tensor(regions, device=maps.device)
    if regions.dim() == 2:
        masks = box_masks(regions, *maps.shape[-2:])
    elif regions.dim() == 3 and regions.dtype == torch.bool:
        masks = regions
    else:
        raise CamvizError(
            f"regions must be (N, 4) boxes or (N, H, W) boolean masks, got {regions.dtype} of "
            f"shape {tuple(regions.shape)}"
        )
    if masks.shape != maps.shape:
        raise CamvizError(
            f"got {masks.shape[0]} regions of size {tuple(masks.shape[1:])} for "
            f"{maps.shape[0]} maps of size {tuple(maps.shape[1:])}; give one region per map, "
            "at the map's size"
        )
    return maps, masks
