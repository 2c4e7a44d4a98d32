"""Augmentation (``aug_smooth``): the maps of flipped and rescaled copies of the map input,
brought back to the plain pass's geometry and averaged with its maps.

The target of each variant's pass is the plain target followed into the variant
(:meth:`camviz.core.targets.TargetObject.follow`): the classes the plain pass chose, a
detection's box moved with the image. Each augmented map is brought back (resized, then
flipped back) at the layer's resolution and at the input's, with one interpolation each (a
detector's maps are first laid on the rescaled input it saw, see :mod:`camviz.core.placement`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from camviz.cams.finishing import Finished, Finishing, RawMaps
from camviz.cams.recording import LayerPass
from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs
from camviz.core.maps import upsample
from camviz.core.targets import Change, Resolved, TargetObject

DEFAULT_AUG_SCALES = (1.0, 0.9, 1.1)

_INTERPOLATION = {3: "linear", 4: "bilinear", 5: "trilinear"}


class Passes(Protocol):
    """How the explanation records a pass and makes its raw maps (the engine's)."""

    def record(self, batch: Inputs, target: TargetObject) -> LayerPass: ...

    def raw_maps(self, batch: Inputs, recorded: LayerPass) -> RawMaps: ...


def aug_scales(aug_smooth: bool | Sequence[float], target: TargetObject) -> tuple[float, ...]:
    """The scales that ``aug_smooth`` asks for (none when it is off), checked.

    Raises:
        CamvizError: Bad scales, or a target that cannot follow a moved input.
    """
    if aug_smooth is False:
        return ()
    scales = DEFAULT_AUG_SCALES if aug_smooth is True else tuple(aug_smooth)
    if not scales or not all(isinstance(s, (int, float)) and 0.1 <= s <= 10 for s in scales):
        raise CamvizError(
            f"aug_smooth must be True or a sequence of scales between 0.1 and 10, "
            f"not {aug_smooth!r}"
        )
    if target.cannot_move is not None:
        raise CamvizError(target.cannot_move)
    return scales


@dataclass(frozen=True)
class Augmentation:
    """The variants of one explanation's map input and how their maps are averaged.

    Attributes:
        scales: The scales, each with and without the flip along the last axis.
        finishing: How each variant's raw maps are finished.
        input_resolution: Whether the method's maps are at the input's resolution already.
    """

    scales: tuple[float, ...]
    finishing: Finishing
    input_resolution: bool

    def smoothed(
        self,
        passes: Passes,
        batch: Inputs,
        target: TargetObject,
        plain: Resolved,
        finished: Finished,
    ) -> Finished:
        """The plain pass's ``finished`` maps averaged with those of the variants.

        Returns:
            The averaged maps at each layer's resolution (normalised if asked) and at the
            input's (not yet normalised).
        """
        size = batch.main.shape[2:]
        sums = {name: maps.clone() for name, maps in finished.at_layer.items()}
        full_sums = {name: maps.clone() for name, maps in finished.on_input.items()}
        variants = [(scale, flip) for scale in dict.fromkeys(self.scales) for flip in (False, True)]
        samples = torch.arange(batch.size).repeat_interleave(len(plain.scores))
        for scale, flip in variants:
            if (scale, flip) == (1, False):
                continue  # the plain pass, already in the sums
            augmented = _augmented(batch.main, scale, flip)
            factors = tuple(new / old for new, old in zip(augmented.shape[2:], size, strict=True))
            followed = target.follow(Change(plain, factors, augmented.shape[-1] if flip else None))
            variant = batch.with_main(augmented)
            try:
                recorded = passes.record(variant, followed)
            except (RuntimeError, AssertionError, ValueError) as error:
                if scale == 1:
                    raise
                raise CamvizError(
                    f"the model rejected the input rescaled by {scale} for aug_smooth ({error}); "
                    "pass aug_smooth=(1.0,) to average over flips only"
                ) from error
            for name, maps in passes.raw_maps(variant, recorded).at_layer.items():
                maps = self.finishing.finish(maps)
                at_layer = upsample(maps, finished.at_layer[name].shape[1:])
                at_input = (
                    upsample(maps, size)
                    if self.input_resolution
                    else recorded.placement.lay(maps, samples, size)
                )
                sums[name] += at_layer.flip(-1) if flip else at_layer
                full_sums[name] += at_input.flip(-1) if flip else at_input
        count = len(variants) if 1 in self.scales else len(variants) + 1
        return Finished(
            {name: self.finishing.rescale(total / count) for name, total in sums.items()},
            {name: total / count for name, total in full_sums.items()},
        )


def _augmented(inputs: torch.Tensor, scale: float, flip: bool) -> torch.Tensor:
    """The map input rescaled by ``scale`` and, if ``flip``, flipped along its last axis."""
    augmented = inputs
    if scale != 1:
        size = inputs.shape[2:]
        scaled = tuple(max(1, round(extent * scale)) for extent in size)
        augmented = F.interpolate(
            inputs,
            size=scaled,
            mode=_INTERPOLATION[inputs.dim()],
            align_corners=False,
            antialias=scale < 1 and inputs.dim() == 4,
        )
    return augmented.flip(-1) if flip else augmented
