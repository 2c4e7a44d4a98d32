"""Finishing: a method's raw maps made into heatmaps (ReLU, normalisation, placement on the
input, fusion of several layers).

One :class:`Finishing` holds what the caller asked for (``relu``, ``normalize``, ``fuse``),
and every step that changes a map's values goes through it, the maps of ``aug_smooth``'s
variants included. Raw maps (``normalize=False``) stay per layer: their units differ.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from camviz.cams.base import CamMethod
from camviz.core.errors import CamvizError, ZeroMapWarning
from camviz.core.inputs import Inputs, Key, corner
from camviz.core.maps import normalize as normalize_maps
from camviz.core.maps import normalize_signed
from camviz.core.placement import Placement
from camviz.core.taps import parse

Fuse = Literal["mean", "max", "product"]
# Maps on the input: an (M, *spatial) tensor, or one (h_n, w_n) map each for a list of images.
Maps = torch.Tensor | list[torch.Tensor]


@dataclass(frozen=True)
class RawMaps:
    """What a method gave for one pass, before finishing.

    Attributes:
        at_layer: ``{layer: (N * K, *grid)}`` raw maps, sample-major.
        weights: ``{layer: (N * K, C)}`` channel weights, for methods whose map is a
            weighted sum of channels; else ``None``.
        by_input: ``{input: (N * K, *spatial)}`` maps on every spatial input, for methods
            that give them (:class:`~camviz.cams.base.InputMapMethod`); else ``None``.
    """

    at_layer: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor] | None = None
    by_input: dict[Key, torch.Tensor] | None = None


@dataclass(frozen=True)
class Finished:
    """Each layer's finished maps: ``(M, *grid)`` at its own resolution (ReLU and
    normalisation applied) and ``(M, *spatial)`` laid on the map input (not yet fused)."""

    at_layer: dict[str, torch.Tensor]
    on_input: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Finishing:
    """How raw maps become heatmaps (see :func:`camviz.explain`).

    Attributes:
        relu: Apply the ReLU of the CAM formulas (``False``: signed maps).
        normalize: Normalise each map: min-max after ReLU, else by its largest absolute
            value (``False``: the method's own units).
        fuse: How the maps of several layers combine on the input.
    """

    relu: bool = True
    normalize: bool = True
    fuse: Fuse = "mean"

    @classmethod
    def of(cls, cam: CamMethod, fuse: Fuse | None, relu: bool, normalize: bool) -> Finishing:
        """The finishing asked for, with the caller's fusion, else the method's, else the
        mean.

        Raises:
            CamvizError: An unknown fusion, or one the method prescribes otherwise.
        """
        if fuse is not None and fuse not in ("mean", "max", "product"):
            raise CamvizError(f"fuse must be 'mean', 'max' or 'product', not {fuse!r}")
        if cam.fuse is not None and fuse not in (None, cam.fuse):
            raise CamvizError(
                f"{cam.name} combines layers by {cam.fuse!r}; leave fuse= unset (got {fuse!r})"
            )
        return cls(relu, normalize, fuse or cam.fuse or "mean")

    def rescale(self, maps: torch.Tensor) -> torch.Tensor:
        """The normalisation asked for: min-max after ReLU, else by the largest absolute value."""
        if not self.normalize:
            return maps
        return normalize_maps(maps) if self.relu else normalize_signed(maps)

    def finish(self, maps: torch.Tensor) -> torch.Tensor:
        """The ReLU and normalisation asked for."""
        return self.rescale(torch.relu(maps) if self.relu else maps)

    def layers(
        self,
        cam: CamMethod,
        raw: Mapping[str, torch.Tensor],
        placement: Placement,
        samples: torch.Tensor,
    ) -> Finished:
        """Each layer's raw ``(M, *grid)`` maps finished, and laid on the map input (already
        there for methods with ``input_resolution``); row ``m`` belongs to ``samples[m]``."""
        at_layer = {name: self.finish(maps) for name, maps in raw.items()}
        on_input = {
            name: maps if cam.input_resolution else placement.lay(maps, samples)
            for name, maps in at_layer.items()
        }
        return Finished(at_layer, on_input)

    def heatmaps(self, maps: Sequence[torch.Tensor], batch: Inputs, samples: torch.Tensor) -> Maps:
        """The heatmaps: the layers' maps on the input fused; for a list of images one map per
        image, cropped to it and normalised over it."""
        if batch.image_sizes is None:
            return self._fused(maps)
        per_layer = [_crops(values, batch, samples) for values in maps]
        return [
            self._fused([crop[None] for crop in crops])[0] for crops in zip(*per_layer, strict=True)
        ]

    def per_image(self, maps: torch.Tensor, batch: Inputs, samples: torch.Tensor, key: Key) -> Maps:
        """Raw maps on input ``key``, finished; for a list of images, the map input's cropped
        to each image and finished there."""
        if batch.image_sizes is None or key != batch.key:
            return self.finish(maps)
        return [self.finish(crop[None])[0] for crop in _crops(maps, batch, samples)]

    def warn_of_empty_maps(
        self, method: str, heatmaps: Maps, layers: Sequence[str], independent: bool = False
    ) -> None:
        """One line when some maps are all zero (after the ReLU, or at all when the score
        does not depend on the layers: ``independent``, a gradient of exactly zero), which a
        picture would show as nothing."""
        if not (self.relu or independent):
            return
        empty = sum(not bool(maps.any()) for maps in heatmaps)
        if not empty:
            return
        listed = ", ".join(map(repr, layers))
        reason = (
            f"the explained score does not depend on {listed}: its gradient is zero at every "
            f"location{_element_hint(layers)}; pick a layer that the score reads"
            if independent
            else f"the explained score has no positive evidence at {listed}; relu=False shows "
            "the signed map, or pick another layer"
        )
        warnings.warn(
            f"{method}: {empty} of {len(heatmaps)} maps are all zero: {reason}",
            ZeroMapWarning,
            stacklevel=3,
        )

    def _fused(self, maps: Sequence[torch.Tensor]) -> torch.Tensor:
        """The layers' maps at the input size, fused (normalised maps only)."""
        if len(maps) == 1 or not self.normalize:
            return self.rescale(maps[0])
        stacked = torch.stack(list(maps))
        if self.fuse == "product":
            return self.rescale(stacked.prod(0))
        return self.rescale(stacked.amax(0) if self.fuse == "max" else stacked.mean(0))


def _element_hint(layers: Sequence[str]) -> str:
    """For a spot that is one element of a layer's tuple or list output, which one it is and
    another to try (Hugging Face's Swin stages give ``(hidden_states, reshaped_hidden_states,
    ...)``, and the classifier reads only ``[0]``)."""
    spot = parse(layers[0])
    if not spot.path or not isinstance(spot.path[-1], int) or spot.path[-1] == 0:
        return ""
    other = dataclasses.replace(spot, path=(*spot.path[:-1], 0)).key
    return (
        f" ({layers[0]!r} is element [{spot.path[-1]}] of what {spot.name!r} gives, which "
        f"the model may never read; try {other!r})"
    )


def _crops(maps: torch.Tensor, batch: Inputs, samples: torch.Tensor) -> list[torch.Tensor]:
    """Each of the ``(M, *canvas)`` maps of a list of images cropped to its own image."""
    sizes = batch.spatial_sizes()
    return [corner(values, sizes[n]) for values, n in zip(maps, samples.tolist(), strict=True)]
