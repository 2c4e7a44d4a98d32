"""Units inside a model as targets: a channel, a neuron or a direction of one layer spot.

A :class:`Unit` asks the pass to record its layer spot (:attr:`TargetObject.spots`) and
scores what the unit does there, on the tensor the rest of the network got:

* ``channel=c`` (or a list: one score, and one map, per channel, in the order given, like
  the ranks of ``"top3"``): the channel's mean over the layer's grid,
  ``y = mean_ij A[c, i, j]``;
* ``neuron=(c, i, j)``: one location of the grid, ``y = A[c, i, j]``;
* ``direction=v``: a vector in channel space (a concept of :func:`camviz.factorize`, a
  probe's weights), ``y = mean_ij sum_c v_c A[c, i, j]``.

A token layer (a vision transformer's ``(N, T, C)``) is read on its patch tokens only: the
class, distillation and register tokens are left out, and a neuron's ``(c, row, col)`` is a
patch of the grid (:mod:`camviz.core.grids` lays the tokens out). A method explains a unit
at any layer before the unit's (without ``layer=`` at the last layer before its own, see
:mod:`camviz.core.defaults`): the explaining pass records the unit's spot, and so do the
passes a method makes of its own (Score-CAM's and Ablation-CAM's re-runs on perturbed
copies, input gradients, noisy or windowed passes: :func:`camviz.cams.base.with_spots`),
whose outputs come as a :class:`~camviz.core.targets.SpotOutput` with that pass's own
tensor at the spot. Any other output (CAM's projection through the classifier) is refused
in one line rather than scored with the explaining pass's values.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.grids import layout_of, patch_size
from camviz.core.layerkinds import Kind
from camviz.core.layouts import spot_reading
from camviz.core.lineage import TokenGrid
from camviz.core.taps import parse
from camviz.core.targets.outputs import SpotOutput
from camviz.core.targets.protocol import Change, Context, Resolved, TargetObject

if TYPE_CHECKING:
    from camviz.core.inputs import Inputs

__all__ = ["Unit", "as_units", "parse_channels", "parse_unit"]


@dataclass(frozen=True)
class _Reading:
    """How a unit's layer lays out its output for one model and input size."""

    kind: Kind | None
    tokens: TokenGrid | None
    input_size: tuple[int, ...]
    patch: tuple[int, ...] | None


@dataclass(frozen=True, eq=False)
class Unit(TargetObject):
    """One unit (or several channels) of a layer spot: a target (see the module docstring),
    and what :func:`camviz.top_examples` ranks and :func:`camviz.visualize_unit` draws.
    Give exactly one of ``channel``, ``neuron`` and ``direction``.

    Example:
        >>> camviz.explain(model, x, layer="layer3", target=camviz.Unit("layer4", channel=7))

    Attributes:
        layer: The layer spot the unit belongs to (``"layer3.1"``, ``"model.22:input[0][0]"``);
            a spot that holds several feature maps (``"model.22:input"``, a detection head's
            levels) is read at its first, with a warning that names the others.
        channel: A channel index, or a list of them (one rank each, in that order).
        neuron: ``(c, *grid_index)``: channel ``c`` at one location of the layer's grid
            (tokens: ``(c, patch_row, patch_col)``).
        direction: A ``(C,)`` vector in the layer's channel space.
    """

    layer: str
    channel: int | Sequence[int] | None = None
    neuron: Sequence[int] | None = None
    direction: torch.Tensor | Sequence[float] | None = None
    channels: tuple[int, ...] = field(init=False, repr=False)
    reading: _Reading | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        given = [self.channel is not None, self.neuron is not None, self.direction is not None]
        if sum(given) != 1:
            raise CamvizError(
                f"a Unit needs exactly one of channel=, neuron= or direction= (got {sum(given)})"
            )
        if not isinstance(self.layer, str) or not self.layer:
            raise CamvizError(f"Unit.layer must be a layer name, not {self.layer!r}")
        parse(self.layer)  # a spot that cannot be read is refused here, in one line
        object.__setattr__(self, "channels", self._checked_channels())
        if self.direction is not None:
            vector = torch.as_tensor(self.direction, dtype=torch.float32).detach()
            if vector.dim() != 1 or not bool(torch.isfinite(vector).all()):
                raise CamvizError(
                    f"Unit.direction must be a finite (C,) vector, not shape {tuple(vector.shape)}"
                )
            object.__setattr__(self, "direction", vector)

    def _checked_channels(self) -> tuple[int, ...]:
        if self.neuron is not None:
            neuron = tuple(self.neuron)
            if len(neuron) < 2 or not all(_is_index(value) for value in neuron):
                raise CamvizError(
                    f"Unit.neuron must be (channel, *grid_index) of whole numbers, not {neuron!r}"
                )
            object.__setattr__(self, "neuron", neuron)
            return (neuron[0],)
        if self.channel is None:
            return ()
        channel = self.channel
        channels = (channel,) if isinstance(channel, int) else tuple(channel)
        if not channels or not all(_is_index(value) for value in channels):
            raise CamvizError(
                f"Unit.channel must be a channel index or a list of them, not {self.channel!r}"
            )
        return channels

    @property
    def spots(self) -> tuple[str, ...]:  # type: ignore[override]
        """The unit's layer spot, recorded in the pass for :meth:`resolve`."""
        return (self.layer,)

    @property
    def cannot_move(self) -> str | None:  # type: ignore[override]
        """A neuron is one place of the grid, which a rescaled or flipped input moves."""
        if self.neuron is None:
            return None
        return (
            "aug_smooth cannot explain a Unit neuron (its grid location would move with the "
            "augmented input); explain the channel, or without aug_smooth"
        )

    def prepare(self, model: nn.Module, inputs: Inputs) -> Unit:
        """This unit, knowing how its layer lays out its output for these inputs."""
        name = parse(self.layer).name
        try:
            model.get_submodule(name)
        except AttributeError:
            raise CamvizError(f"no layer named {name!r} in the model") from None
        told = spot_reading(model, self.layer, inputs)
        size = tuple(inputs.main.shape[2:])
        reading = _Reading(told.kind, told.tokens, size, patch_size(model))
        return dataclasses.replace(self, layer=told.element or self.layer, reading=reading)

    def resolve(self, output: Any, context: Context) -> Resolved:
        """One score function per rank, from the unit's layer in this pass."""
        if self.layer not in context.spots:
            raise CamvizError(
                f"layer {self.layer!r} did not run in the forward pass; pick a layer that the "
                "model uses (`camviz layers` lists them with shapes)"
            )
        scores = self.scores(self.view(context.spots[self.layer]))
        return Resolved(
            tuple(_PassScore(self, rank, scores[:, rank], output) for rank in range(self.ranks))
        )

    def follow(self, change: Change) -> Unit:
        """The unit of an augmented pass: the same unit, read at the new input size."""
        if change.moves and self.cannot_move is not None:
            raise CamvizError(self.cannot_move)
        if self.reading is None or not change.factors:
            return self

        def scaled(sizes: Sequence[int]) -> tuple[int, ...]:
            return tuple(
                max(1, round(extent * factor))
                for extent, factor in zip(sizes, change.factors, strict=True)
            )

        tokens = self.reading.tokens
        if tokens is not None:  # the same leading tokens, the patches on a rescaled grid
            tokens = TokenGrid(tokens.start, scaled(tokens.grid))
        reading = dataclasses.replace(
            self.reading, input_size=scaled(self.reading.input_size), tokens=tokens
        )
        return dataclasses.replace(self, reading=reading)

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ``(N, C, *grid)`` view of the unit layer's output (tokens: the patches)."""
        reading = self.reading
        if reading is None:
            return layout_of(tensor.shape, self.layer).to_spatial(tensor)
        layout = layout_of(
            tensor.shape,
            self.layer,
            reading.input_size,
            reading.patch,
            reading.kind,
            reading.tokens,
        )
        return layout.to_spatial(tensor)

    @property
    def ranks(self) -> int:
        """How many scores (and maps) the unit gives per image: one per channel."""
        return len(self.channels) if self.neuron is None and self.channel is not None else 1

    @property
    def label(self) -> str:
        """A short text for the unit, as the CLI writes it (``layer3.1@42``)."""
        if self.neuron is not None:
            return f"{self.layer}@{','.join(str(value) for value in self.neuron)}"
        if self.direction is not None:
            return f"{self.layer}@direction"
        return f"{self.layer}@{_ranges(self.channels)}"

    def ranked(self) -> list[Unit]:
        """One unit per rank: a unit of several channels as single-channel units."""
        if self.ranks == 1:
            return [self]
        return [
            Unit(self.layer, channel=channel, reading=self.reading) for channel in self.channels
        ]

    def maps(self, spatial: torch.Tensor) -> torch.Tensor:
        """``(N, K, *grid)``: what each of the unit's ``K`` ranks is at every location of a
        ``(N, C, *grid)`` layer output (for a neuron, its channel)."""
        count = spatial.shape[1]
        if self.direction is not None:
            vector = torch.as_tensor(self.direction)
            if vector.numel() != count:
                raise CamvizError(
                    f"Unit.direction has {vector.numel()} values, but layer {self.layer!r} has "
                    f"{count} channels"
                )
            weights = vector.to(spatial.device, spatial.dtype)
            return torch.einsum("nc...,c->n...", spatial, weights).unsqueeze(1)
        outside = [channel for channel in self.channels if not 0 <= channel < count]
        if outside:
            raise CamvizError(
                f"channel {outside[0]} is out of range: layer {self.layer!r} has {count} "
                f"channels (0..{count - 1})"
            )
        return spatial[:, list(self.channels)]

    def scores(self, spatial: torch.Tensor) -> torch.Tensor:
        """``(N, K)``: the unit's score for each image and rank (see the module docstring)."""
        maps = self.maps(spatial)
        if self.neuron is None:
            return maps.flatten(2).mean(dim=2)
        index = self.neuron[1:]
        grid = tuple(spatial.shape[2:])
        if len(index) != len(grid) or not all(
            0 <= value < extent for value, extent in zip(index, grid, strict=True)
        ):
            raise CamvizError(
                f"Unit.neuron {tuple(self.neuron)} does not lie on layer {self.layer!r}'s grid "
                f"{grid}; give the channel and one index per grid axis, within it"
            )
        at: tuple[slice | int, ...] = (slice(None), slice(None), *index)
        return maps[at]


@dataclass(frozen=True, eq=False)
class _PassScore:
    """One rank of a unit's score: its values in the pass it was resolved on, and in a
    re-run, read from the unit's spot as that re-run recorded it (a :class:`SpotOutput`).
    Any other output comes from a pass that did not record the spot: scoring it with the
    explaining pass's values would be silently wrong, so it is refused."""

    unit: Unit
    rank: int
    values: torch.Tensor
    output: Any

    def __call__(self, output: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        if output is self.output:
            return self.values if rows is None else self.values[rows.to(self.values.device)]
        if not isinstance(output, SpotOutput):
            raise CamvizError(
                f"this pass of the model did not record the Unit's layer {self.unit.layer!r}, "
                "so it cannot score the unit; explain the unit with a method that runs the "
                "model (gradcam, scorecam, ablationcam, ...), not one that reads the classifier"
            )
        if self.unit.layer not in output.spots:
            raise CamvizError(
                f"layer {self.unit.layer!r} did not run in the re-run of the model; pick a "
                "layer that the model uses (`camviz layers` lists them with shapes)"
            )
        # Row r of a re-run is its own copy: its score is the unit at the spot's row r.
        return self.unit.scores(self.unit.view(output.spots[self.unit.layer]))[:, self.rank]


def as_units(value: object, what: str = "units") -> list[Unit]:
    """One :class:`Unit` or a list of them, as a list; anything else is a one-line error."""
    given = [value] if isinstance(value, Unit) else value
    if isinstance(given, (list, tuple)) and given and all(isinstance(u, Unit) for u in given):
        return list(given)
    raise CamvizError(f"{what} must be a camviz.Unit or a list of them, not {value!r}")


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    parts: list[str] = []
    start = previous = values[0]
    for value in [*values[1:], math.inf]:
        if value != previous + 1:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = value  # type: ignore[assignment]
        previous = value  # type: ignore[assignment]
    return ",".join(parts)


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_channels(text: str) -> list[int]:
    """``"42"``, ``"0-63"`` or ``"0-7,12"`` as the channel indices they name, in order.

    Raises:
        CamvizError: The text is not such a list, or a range runs backwards.
    """
    channels: list[int] = []
    for part in text.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise CamvizError(
                f"cannot read the channels {text!r}; write an index (42), a range (0-63) or "
                "both separated by commas (0-7,12)"
            )
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if last < first:
            raise CamvizError(f"the channel range {part.strip()!r} runs backwards")
        channels += range(first, last + 1)
    return channels


def parse_unit(text: str) -> Unit:
    """A unit from the command line's ``unit:LAYER@CHANNELS`` (``unit:layer3.1@42``,
    ``unit:model.22:input[0][0]@0-15``) or ``unit:LAYER@C,I,J`` (a neuron: channel, grid index).

    Raises:
        CamvizError: The text does not read as a unit.
    """
    body = text[len("unit:") :] if text.startswith("unit:") else text
    layer, at, which = body.rpartition("@")
    if not at or not layer or not which:
        raise CamvizError(
            f"cannot read the unit {text!r}; write unit:LAYER@CHANNELS (unit:layer3.1@42, "
            "unit:layer3.1@0-63) or unit:LAYER@C,I,J for one neuron"
        )
    parts = which.split(",")
    if len(parts) > 1 and all(part.strip().isdigit() for part in parts):
        return Unit(layer, neuron=tuple(int(part) for part in parts))
    channels = parse_channels(which)
    return Unit(layer, channel=channels[0] if len(channels) == 1 else channels)
