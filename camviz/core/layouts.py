"""The layout kind of each target spot of an explanation, and where it comes from.

A spot's kind (:data:`camviz.core.layerkinds.Kind`) is, in this order: what ``layout=``
gives; what the module at the spot says (:func:`camviz.core.layerkinds.module_kind`); what an
earlier pass told for the same model, spot and input rank (cached); or what the pass being
explained tells, from the module that produced the same tensor in its record of module calls
(:class:`camviz.core.layerkinds.CallLog`), which is taken only when one of the first three
does not know. A level of a container spot that no module produced (an FPN's max-pooled
``pool``) is read like its siblings. Why kinds and not shapes: ``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs
from camviz.core.layerkinds import CallLog, Kind, module_kind, needs_shape, record_calls
from camviz.core.lineage import Lineage, TokenGrid
from camviz.core.modelstate import eval_mode, no_grad
from camviz.core.taps import edit_spots, element_key, map_elements, parse

# What layout= accepts: the three kinds, and the usual spellings of the first two.
LAYOUT_NAMES: dict[str, Kind] = {
    "channels_first": "channels_first",
    "ncl": "channels_first",
    "nchw": "channels_first",
    "ncdhw": "channels_first",
    "channels_last": "channels_last",
    "nlc": "channels_last",
    "nhwc": "channels_last",
    "ndhwc": "channels_last",
    "tokens": "tokens",
}


@dataclass(frozen=True)
class Tokens:
    """``layout=`` for token outputs ``(N, T, C)`` whose patches camviz cannot find: the
    tokens ``patches`` (a slice) are the patches in row-major order, on ``grid`` (by default
    the grid of that many patches with the input's proportions).

    camviz finds the patches itself where the pass shows them (a patch embedding's feature
    map flattened into the tokens); this is for models where nothing does. In the CLI:
    ``--layout tokens[1:197]``.

    Example:
        >>> camviz.explain(model, x, layer="blocks.11.norm1",
        ...                layout=camviz.Tokens(patches=slice(1, 197), grid=(14, 14)))
    """

    patches: slice
    grid: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.patches, slice):
            raise CamvizError(
                f"Tokens(patches=) takes a slice of the tokens, e.g. slice(1, 197), not "
                f"{self.patches!r}"
            )
        grid = self.grid
        if grid is not None and (
            not isinstance(grid, (tuple, list))
            or not 1 <= len(grid) <= 3
            or not all(isinstance(extent, int) and extent > 0 for extent in grid)
        ):
            raise CamvizError(
                f"Tokens(grid=) takes one to three positive ints, e.g. (14, 14), not {grid!r}"
            )
        if grid is not None:
            object.__setattr__(self, "grid", tuple(grid))


Layout = str | Tokens
"""What ``layout=`` gives one spot: a kind's name, or where the patch tokens are."""

# The layout kind of each (model, layer spot, input rank), once told from a recorded pass.
_kind_cache: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int], Kind | None]] = (
    weakref.WeakKeyDictionary()
)


_TOKEN_SLICE = re.compile(r"tokens\[\s*(-?\d*)\s*:\s*(-?\d*)\s*\]")


def layout_kind(name: str | Tokens) -> Kind:
    """The kind a ``layout=`` value names."""
    if isinstance(name, Tokens):
        return "tokens"
    if isinstance(name, str) and _TOKEN_SLICE.fullmatch(name.strip().lower()):
        return "tokens"
    if not isinstance(name, str) or name.lower() not in LAYOUT_NAMES:
        raise CamvizError(
            f"unknown layout {name!r}; use 'channels_first', 'channels_last', 'tokens', "
            "'tokens[START:STOP]' or camviz.Tokens(patches=slice(START, STOP))"
        )
    return LAYOUT_NAMES[name.lower()]


def given_tokens(value: str | Tokens) -> Tokens | None:
    """Where a ``layout=`` value puts the patch tokens: a :class:`Tokens`, or its spelling
    ``"tokens[1:197]"`` (the CLI's ``--layout``); ``None`` for a kind's name."""
    if isinstance(value, Tokens):
        return value
    match = _TOKEN_SLICE.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if match is None:
        return None
    start, stop = (int(bound) if bound else None for bound in match.groups())
    return Tokens(slice(start, stop))


@dataclass(frozen=True)
class SpotKinds:
    """The layout kinds of the target spots of one model for inputs of one rank.

    Attributes:
        model: The model the spots are in.
        input_dims: The map input's number of dimensions (``4`` for ``(N, C, H, W)``).
        given: The kinds ``layout=`` gives, by spot key (or element spot of one).
        tokens: Where ``layout=`` puts the patch tokens, by spot key (:class:`Tokens`).
    """

    model: nn.Module
    input_dims: int
    given: Mapping[str, Kind] = dataclasses.field(default_factory=dict)
    tokens: Mapping[str, Tokens] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        model: nn.Module,
        input_dims: int,
        spots: Sequence[str],
        layout: Layout | Mapping[str, Layout] | None,
    ) -> SpotKinds:
        """The kinds of ``spots``, with what ``layout=`` gives (one layout for all spots, or
        ``{spot: layout}``).

        Raises:
            CamvizError: An unknown layout, or a ``{spot: layout}`` for another spot.
        """
        if layout is None:
            return cls(model, input_dims)
        if isinstance(layout, (str, Tokens)):
            layout = dict.fromkeys(spots, layout)
        unknown = [
            name
            for name in layout
            if not any(name == spot or name.startswith(spot + "[") for spot in spots)
        ]
        if unknown:
            raise CamvizError(f"layout= names {unknown}, which are not target layers ({spots})")
        tokens = {name: given_tokens(value) for name, value in layout.items()}
        return cls(
            model,
            input_dims,
            {name: layout_kind(value) for name, value in layout.items()},
            {name: value for name, value in tokens.items() if value is not None},
        )

    def expanded(self, spots: Sequence[str]) -> SpotKinds:
        """The kinds for the element spots of container spots (an FPN's levels): ``layout=``'s
        entry of the element itself, else of its container."""
        given, tokens = {}, {}
        for spot in spots:
            named = [key for key in self.given if spot == key or spot.startswith(key + "[")]
            if named:
                key = max(named, key=len)  # the element's own entry first
                given[spot] = self.given[key]
                if key in self.tokens:
                    tokens[spot] = self.tokens[key]
        return dataclasses.replace(self, given=given, tokens=tokens)

    def known(self, name: str) -> Kind | None:
        """The kind of a spot's tensor without a recorded pass: given, by module, or cached."""
        if name in self.given:
            return self.given[name]
        spot = parse(name)
        if not spot.path:
            kind = module_kind(self.model.get_submodule(spot.name))
            if kind is not None:
                return kind
        cached = _kind_cache.get(self.model, {})
        if (name, self.input_dims) in cached:
            return cached[(name, self.input_dims)]
        # A container spot (an FPN's levels): known once a pass told its maps' kind, if they
        # agree.
        levels = self.level_kinds(name)
        return levels.pop() if len(levels) == 1 else None

    def level_kinds(self, name: str) -> set[Kind | None]:
        """The kinds that earlier passes told for elements of the spot ``name`` (empty
        unless it is a container whose maps were explained)."""
        prefix = name + "["
        return {
            kind
            for (key, dims), kind in _kind_cache.get(self.model, {}).items()
            if dims == self.input_dims and key.startswith(prefix)
        }

    def all_known(self, spots: Sequence[str]) -> bool:
        """Whether every spot's kind is known without recording the pass's module calls (a
        layer norm's is told from its output's shape, which the pass records anyway)."""
        return all(
            self.known(name) is not None
            or (not parse(name).path and needs_shape(self.model.get_submodule(parse(name).name)))
            for name in spots
        )

    def told(
        self, name: str, calls: CallLog | None, activations: Mapping[str, torch.Tensor]
    ) -> Kind | None:
        """The kind of a spot's tensor: as :meth:`known`, else told from the pass's module
        ``calls`` and recorded ``activations`` (and remembered for the model)."""
        known = self.known(name)
        spot = parse(name)
        if known is None and not spot.path:
            shape = tuple(activations[name].shape)
            known = module_kind(self.model.get_submodule(spot.name), shape)
        if known is not None or calls is None:
            return known
        end = calls.starts.get(spot.name) if spot.at == "input" else calls.index(spot.name)
        if end is None:
            return None
        kind = calls.producer_kind(tuple(activations[name].shape), end)
        if kind is None and spot.path:
            # A level made by a function (an FPN's max-pooled 'pool'): read like the other
            # maps of its container, when they agree.
            parent = dataclasses.replace(spot, path=spot.path[:-1])
            siblings = {
                calls.producer_kind(tuple(values.shape), end)
                for key, values in activations.items()
                if key != name
                and dataclasses.replace(parse(key), path=parse(key).path[:-1]) == parent
            } - {None}
            kind = siblings.pop() if len(siblings) == 1 else None
        if kind is not None:
            _kind_cache.setdefault(self.model, {})[(name, self.input_dims)] = kind
        return kind


@dataclass(frozen=True)
class SpotReading:
    """How a spot's tensor is read outside the engine's pass (a :class:`~camviz.Unit`'s
    layer): its layout kind and, for patch tokens, where they are."""

    kind: Kind | None
    tokens: TokenGrid | None = None
    #: The spots of the feature maps in it, when the spot holds a container: it is read at
    #: the first.
    elements: tuple[str, ...] = ()

    @property
    def element(self) -> str | None:
        """The spot of the tensor read, when it is not the spot itself."""
        return self.elements[0] if self.elements else None


# Readings told by a dry pass, per model, spot and input shape (tokens depend on the size).
_reading_cache: weakref.WeakKeyDictionary[
    nn.Module, dict[tuple[str, tuple[int, ...]], SpotReading]
] = weakref.WeakKeyDictionary()


def spot_reading(model: nn.Module, spot: str, inputs: Inputs) -> SpotReading:
    """How to read ``spot``'s tensor for inputs like ``inputs``, as the engine would: a
    channels-first kind known without a pass (:meth:`SpotKinds.known`) as it is; anything
    else from one dry pass on the first sample, followed from the map input
    (:class:`~camviz.core.lineage.Lineage`) to find the patch tokens, and remembered.

    A spot that holds a tuple, list or dict of feature maps (a detection head's input, its
    levels) is read at its first map, :attr:`SpotReading.element`, and a one-line warning
    names it and the others.
    """
    kinds = SpotKinds(model, inputs.main.dim())
    known = kinds.known(spot)
    if (known == "channels_first" and not kinds.level_kinds(spot)) or not inputs.size:
        return SpotReading(known)
    key = (spot, tuple(inputs.main.shape[1:]))
    per_model = _reading_cache.setdefault(model, {})
    if key not in per_model:
        first = torch.zeros(1, dtype=torch.long, device=inputs.main.device)
        sample = inputs.replaced({}, first)
        lineage = Lineage(sample.main)
        seen: dict[str, Any] = {}

        def keep(value: Any) -> Any:
            seen.setdefault(spot, value)
            return value

        with (
            record_calls(model) as log,
            edit_spots(model, {spot: keep}, containers=True),
            eval_mode(model),
            no_grad(),
            lineage,
        ):
            sample(model)
        if spot not in seen:
            return SpotReading(known)
        value = seen[spot]
        if isinstance(value, torch.Tensor):
            kind = known or kinds.told(spot, log, seen)
            per_model[key] = SpotReading(kind, lineage.token_grid(value))
        else:
            elements = _maps_in(spot, value, inputs.main.dim() - 2)
            read = spot_reading(model, elements[0], inputs)
            per_model[key] = dataclasses.replace(read, elements=read.elements or elements)
    reading = per_model[key]
    if len(reading.elements) > 1:
        read_at, *others = reading.elements
        warnings.warn(
            f"layer {spot!r} holds {len(reading.elements)} feature maps; the unit reads the "
            f"first, {read_at!r} (name {' or '.join(map(repr, others))} for another)",
            UserWarning,
            stacklevel=3,
        )
    return reading


def tensor_spot(model: nn.Module, spot: str, inputs: Inputs) -> str:
    """``spot``, or the spot of its first feature map when it holds several
    (:func:`spot_reading`)."""
    return spot_reading(model, spot, inputs).element or spot


def _maps_in(spot: str, value: Any, rank: int) -> tuple[str, ...]:
    """The spots of the feature maps in the container ``value`` at ``spot``; a container of
    no feature map is refused."""
    items = map_elements(value, rank) if isinstance(value, (tuple, list, Mapping)) else []
    if not items:
        raise CamvizError(
            f"layer {spot!r} gives a {type(value).__name__} with no feature map in it; pick a "
            "layer that outputs a feature map (`camviz layers` lists them with shapes)"
        )
    return tuple(element_key(spot, item) for item in items)
