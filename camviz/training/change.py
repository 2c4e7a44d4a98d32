"""How a probe's map moves between two steps, and how much of it lies on the object.

Two numbers compare two maps of one probe image (``(N, H, W)`` batches, pixel by pixel):

* :func:`correlation` - Pearson's correlation of the pixel values: 1 for the same map up to
  scale and offset, about 0 for unrelated maps. Not defined (NaN) when a map is constant,
  such as an all-zero map (no positive evidence): no number would be honest there.
* :func:`top_overlap` - of the ``share`` (15 %) hottest pixels of each map, how many the two
  have in common: ``2 |A & B| / (|A| + |B|)``, which is ``|A & B| / |A|`` when both sets
  hold exactly ``share`` of the pixels. A pixel belongs to a map's set when its value is
  at least the set's smallest value, so ties at the threshold are all in (an all-zero map's
  set is every pixel); nothing depends on the order in which a sort breaks ties.

:func:`inside_share` is the localisation curve's number: the share of the map's mass inside
the probe's mask or box (the energy-based pointing game, :mod:`camviz.localization`).
"""

from __future__ import annotations

import math

import torch

from camviz.evaluation.localization import energy_pointing_game

__all__ = ["TOP_SHARE", "correlation", "inside_share", "top_overlap"]

#: The share of the hottest pixels that :func:`top_overlap` compares.
TOP_SHARE = 0.15


def correlation(maps: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """``(N,)`` Pearson correlations of ``maps[n]`` and ``others[n]`` over their pixels (NaN
    where either map is constant)."""
    first = maps.flatten(1).double()
    second = others.flatten(1).double()
    first = first - first.mean(dim=1, keepdim=True)
    second = second - second.mean(dim=1, keepdim=True)
    spread = first.norm(dim=1) * second.norm(dim=1)
    products = (first * second).sum(dim=1)
    return torch.where(spread > 0, products / spread, math.nan).float()


def top_pixels(maps: torch.Tensor, share: float = TOP_SHARE) -> torch.Tensor:
    """``(N, H * W)`` booleans: each map's ``share`` hottest pixels, ties at the edge included."""
    flat = maps.flatten(1)
    count = max(1, round(share * flat.shape[1]))
    threshold = flat.topk(count, dim=1).values[:, -1:]
    return flat >= threshold


def top_overlap(maps: torch.Tensor, others: torch.Tensor, share: float = TOP_SHARE) -> torch.Tensor:
    """``(N,)`` overlap of the two maps' hottest pixels, in ``[0, 1]`` (see the module doc)."""
    first, second = top_pixels(maps, share), top_pixels(others, share)
    common = (first & second).sum(dim=1).float()
    return 2 * common / (first.sum(dim=1) + second.sum(dim=1)).float()


def inside_share(maps: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
    """``(N,)`` share of each map's mass inside its ``(N, H, W)`` boolean region (0 for an
    all-zero map)."""
    return energy_pointing_game(maps, regions)
