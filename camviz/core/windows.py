"""Sliding windows over a volume too large for one pass, as a model camviz explains.

MONAI's ``sliding_window_inference`` is the convention: windows of ``roi_size`` start every
``int(roi_size * (1 - overlap))`` voxels along each axis (the last one flush with the
volume's end), and the outputs are stitched as ``sum_w m_w * y_w / sum_w m_w`` with the
importance map ``m`` constant or a Gaussian of ``sigma = 0.125 * roi_size``
(:func:`window_starts`, :func:`importance_map`; the same numbers as MONAI's).

:class:`SlidingWindowModel` is that inference as one model: its output is the stitched
output, so the explained score (a region of it) is the score of the whole volume. Its
``stitched`` module holds the target layer's activations of every window on one grid of
the volume's size (each location the mean of the windows that cover it), and that is the
layer camviz explains: in the pass that explains it, each window's layer output becomes its
own activations plus that window's part of the grid's ``delta``, so that the gradient the
engine reads at the grid is, at each location, the sum over the windows that cover it of
``dy/dA_w``: the chain rule of the stitched score for activations the windows share. On
windows that do not overlap both are each window's own, and the map equals the one from
autograd through MONAI's ``sliding_window_inference``.

A window's grid at the layer must sit at whole grid steps of the volume's grid: each
window start a multiple of the layer's stride (a layer at the input's resolution always
fits).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.modelstate import HookSet, no_grad

__all__ = ["SlidingWindowModel", "Windows", "importance_map", "window_starts"]

Blend = Literal["constant", "gaussian"]

# MONAI's Gaussian importance: sigma = 0.125 * roi_size, and no weight below 1e-3.
_SIGMA_SCALE = 0.125
_LEAST_WEIGHT = 1e-3


@dataclass(frozen=True)
class Windows:
    """How a volume is cut into windows.

    Attributes:
        roi_size: The ``(D, H, W)`` of one window (cut to the volume where it is larger).
        overlap: The share of a window that the next one overlaps, ``0 <= overlap < 1``.
        blend: How the windows' outputs are weighted where they overlap.
    """

    roi_size: tuple[int, ...]
    overlap: float = 0.25
    blend: Blend = "constant"

    def __post_init__(self) -> None:
        if not self.roi_size or any(int(side) < 1 for side in self.roi_size):
            raise CamvizError(f"the window size must be positive voxels, not {self.roi_size}")
        if not 0 <= self.overlap < 1:
            raise CamvizError(f"overlap must be at least 0 and below 1, not {self.overlap}")
        if self.blend not in ("constant", "gaussian"):
            raise CamvizError(f"blend must be 'constant' or 'gaussian', not {self.blend!r}")


def window_starts(
    size: Sequence[int], roi_size: Sequence[int], overlap: float
) -> list[tuple[int, ...]]:
    """The first voxel of each window, in MONAI's order (the last axis fastest)."""
    per_axis = []
    for extent, roi in zip(size, roi_size, strict=True):
        step = roi if roi == extent else max(1, int(roi * (1 - overlap)))
        count = next(
            n for n in range(1, math.ceil(extent / step) + 2) if (n - 1) * step + roi >= extent
        )
        per_axis.append([min(n * step, extent - roi) for n in range(count)])
    starts: list[tuple[int, ...]] = [()]
    for axis in per_axis:
        starts = [(*start, position) for start in starts for position in axis]
    return starts


def importance_map(roi_size: Sequence[int], blend: Blend) -> torch.Tensor:
    """The weight of each voxel of a window's output, as MONAI's ``compute_importance_map``."""
    if blend == "constant":
        return torch.ones(tuple(roi_size))
    weights = torch.ones(())
    for roi in roi_size:
        offsets = torch.arange(-(roi - 1) / 2.0, (roi - 1) / 2.0 + 1)
        weights = weights.unsqueeze(-1) * torch.exp(offsets**2 / (-2 * (roi * _SIGMA_SCALE) ** 2))
    return weights.clamp(min=max(float(weights.min()), _LEAST_WEIGHT))


def _index(crop: tuple[slice, ...]) -> Any:
    """The index of a window's voxels in a ``(N, C, *spatial)`` tensor."""
    return (Ellipsis, *crop)


class _StopError(Exception):
    """Ends a window's pass once the layer has run: the rest is not needed."""


class SlidingWindowModel(nn.Module):
    """``model`` run on sliding windows of its input, ``layer`` stitched at ``stitched``.

    Takes ``(N, C, *spatial)`` volumes and returns the stitched output (see the module
    docstring). The model comes back as it came: its hooks are removed after each call.

    Attributes:
        model: The network.
        layer: The name of the layer in ``model`` whose activations are stitched.
        windows: The windows.
        stitched: The layer whose output is the stitched activations: explain this one.
    """

    def __init__(self, model: nn.Module, layer: str, windows: Windows) -> None:
        super().__init__()
        modules = dict(model.named_modules())
        if layer not in modules:
            raise CamvizError(f"the model has no layer {layer!r}; `camviz layers` lists them")
        self.model = model
        self.layer = layer
        self.windows = windows
        self.stitched = nn.Identity()

    def forward(self, volume: torch.Tensor) -> torch.Tensor:
        size = tuple(volume.shape[2:])
        if len(size) != len(self.windows.roi_size):
            raise CamvizError(
                f"windows of {len(self.windows.roi_size)} axes do not fit an input of shape "
                f"{tuple(volume.shape)}"
            )
        roi = tuple(
            min(side, extent) for side, extent in zip(self.windows.roi_size, size, strict=True)
        )
        crops = [
            tuple(slice(first, first + side) for first, side in zip(start, roi, strict=True))
            for start in window_starts(size, roi, self.windows.overlap)
        ]
        grid, stride = self._stitched_activations(volume, crops, roi)
        tapped = self.stitched(grid)
        residual = tapped - grid  # the engine's delta (and any edit of the stitched layer)
        return self._stitched_output(volume, crops, roi, stride, residual)

    def _stitched_activations(
        self, volume: torch.Tensor, crops: list[tuple[slice, ...]], roi: tuple[int, ...]
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The layer's activations of every window on one grid (the mean where windows
        overlap), and the layer's stride."""
        total: torch.Tensor | None = None
        count: torch.Tensor | None = None
        stride: tuple[int, ...] = ()
        for crop in crops:
            with no_grad():
                found = self._layer_output(volume[_index(crop)])
            if total is None or count is None:
                stride = self._stride(roi, tuple(found.shape[2:]))
                grid = [
                    extent // step for extent, step in zip(volume.shape[2:], stride, strict=True)
                ]
                total = found.new_zeros(*found.shape[:2], *grid)
                count = found.new_zeros(grid)
            at = self._on_grid(crop, stride)
            total[_index(at)] += found
            count[at] += 1
        assert total is not None and count is not None  # there is always a window
        return total / count, stride

    def _stitched_output(
        self,
        volume: torch.Tensor,
        crops: list[tuple[slice, ...]],
        roi: tuple[int, ...],
        stride: tuple[int, ...],
        residual: torch.Tensor,
    ) -> torch.Tensor:
        weights = importance_map(roi, self.windows.blend).to(volume.device)
        summed: torch.Tensor | None = None
        covered = volume.new_zeros(volume.shape[2:])
        for crop in crops:
            added = residual[_index(self._on_grid(crop, stride))]
            # Only the layers after the target keep a graph, as in any explaining pass.
            with no_grad(), self._adding(added):
                output = self.model(volume[_index(crop)])
            if not isinstance(output, torch.Tensor) or output.shape[2:] != roi:
                raise CamvizError(
                    "sliding windows need a model whose output has the window's shape "
                    f"{roi} (a segmentation model); it gave "
                    + (
                        f"{tuple(output.shape)}"
                        if isinstance(output, torch.Tensor)
                        else type(output).__name__
                    )
                )
            if summed is None:
                summed = output.new_zeros(*output.shape[:2], *volume.shape[2:])
            summed[_index(crop)] = summed[_index(crop)] + weights * output
            covered[crop] += weights
        assert summed is not None
        return summed / covered

    def _layer_output(self, crop: torch.Tensor) -> torch.Tensor:
        found: list[torch.Tensor] = []

        def record(module: nn.Module, args: Any, output: Any) -> None:
            if not isinstance(output, torch.Tensor):
                raise CamvizError(
                    f"layer {self.layer!r} outputs a {type(output).__name__}; stitch a layer "
                    "that outputs one tensor"
                )
            found.append(output)
            raise _StopError

        with HookSet() as hooks:
            hooks.add(dict(self.model.named_modules())[self.layer].register_forward_hook(record))
            with suppress(_StopError):
                self.model(crop)
        if not found:
            raise CamvizError(f"layer {self.layer!r} did not run; pick a layer the model uses")
        return found[0]

    @contextmanager
    def _adding(self, added: torch.Tensor) -> Iterator[None]:
        """The layer's output plus ``added`` during the block, the layers after it with a
        graph (grad mode on from there, as the engine's own tap does)."""

        def add(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            torch.set_grad_enabled(added.requires_grad)  # undone when the block ends
            return output + added

        with HookSet() as hooks:
            hooks.add(dict(self.model.named_modules())[self.layer].register_forward_hook(add))
            yield

    def _stride(self, roi: tuple[int, ...], grid: tuple[int, ...]) -> tuple[int, ...]:
        """How many voxels one step of the layer's grid covers along each axis."""
        if len(grid) != len(roi) or any(
            side % extent for side, extent in zip(roi, grid, strict=True)
        ):
            raise CamvizError(
                f"layer {self.layer!r} gives a grid of {grid} for windows of {roi}, not a whole "
                "fraction of them; stitch a layer at the input's resolution, or windows that "
                "its stride divides"
            )
        return tuple(side // extent for side, extent in zip(roi, grid, strict=True))

    def _on_grid(self, crop: tuple[slice, ...], stride: tuple[int, ...]) -> tuple[slice, ...]:
        """Where a window lies on the layer's grid of the volume."""
        placed = []
        for part, step in zip(crop, stride, strict=True):
            if part.start % step:
                raise CamvizError(
                    f"a window starts at voxel {part.start}, between two steps of layer "
                    f"{self.layer!r}'s grid (every {step}); choose --roi-size and --overlap "
                    "so that every window starts at a multiple of it, or another layer"
                )
            placed.append(slice(part.start // step, part.stop // step))
        return tuple(placed)
