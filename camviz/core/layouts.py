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
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs
from camviz.core.layerkinds import CallLog, Kind, module_kind, record_calls
from camviz.core.modelstate import eval_mode
from camviz.core.taps import edit_spots, parse

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

# The layout kind of each (model, layer spot, input rank), once told from a recorded pass.
_kind_cache: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int], Kind | None]] = (
    weakref.WeakKeyDictionary()
)


def layout_kind(name: str) -> Kind:
    """The kind a ``layout=`` value names."""
    if not isinstance(name, str) or name.lower() not in LAYOUT_NAMES:
        raise CamvizError(
            f"unknown layout {name!r}; use 'channels_first', 'channels_last' or 'tokens'"
        )
    return LAYOUT_NAMES[name.lower()]


@dataclass(frozen=True)
class SpotKinds:
    """The layout kinds of the target spots of one model for inputs of one rank.

    Attributes:
        model: The model the spots are in.
        input_dims: The map input's number of dimensions (``4`` for ``(N, C, H, W)``).
        given: The kinds ``layout=`` gives, by spot key (or element spot of one).
    """

    model: nn.Module
    input_dims: int
    given: Mapping[str, Kind] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        model: nn.Module,
        input_dims: int,
        spots: Sequence[str],
        layout: str | Mapping[str, str] | None,
    ) -> SpotKinds:
        """The kinds of ``spots``, with what ``layout=`` gives (one layout for all spots, or
        ``{spot: layout}``).

        Raises:
            CamvizError: An unknown layout, or a ``{spot: layout}`` for another spot.
        """
        if layout is None:
            return cls(model, input_dims)
        if isinstance(layout, str):
            return cls(model, input_dims, {name: layout_kind(layout) for name in spots})
        unknown = [
            name
            for name in layout
            if not any(name == spot or name.startswith(spot + "[") for spot in spots)
        ]
        if unknown:
            raise CamvizError(f"layout= names {unknown}, which are not target layers ({spots})")
        return cls(model, input_dims, {name: layout_kind(value) for name, value in layout.items()})

    def expanded(self, spots: Sequence[str]) -> SpotKinds:
        """The kinds for the element spots of container spots (an FPN's levels): ``layout=``'s
        entry of the element itself, else of its container."""
        given = {}
        for spot in spots:
            named = [key for key in self.given if spot == key or spot.startswith(key + "[")]
            if named:
                given[spot] = self.given[max(named, key=len)]  # the element's own entry first
        return dataclasses.replace(self, given=given)

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
        prefix = name + "["
        levels = {
            kind
            for (key, dims), kind in cached.items()
            if dims == self.input_dims and key.startswith(prefix)
        }
        return levels.pop() if len(levels) == 1 else None

    def all_known(self, spots: Sequence[str]) -> bool:
        """Whether every spot's kind is known without recording the pass's module calls."""
        return all(self.known(name) is not None for name in spots)

    def told(
        self, name: str, calls: CallLog | None, activations: Mapping[str, torch.Tensor]
    ) -> Kind | None:
        """The kind of a spot's tensor: as :meth:`known`, else told from the pass's module
        ``calls`` and recorded ``activations`` (and remembered for the model)."""
        known = self.known(name)
        if known is not None or calls is None:
            return known
        spot = parse(name)
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


def spot_kind(model: nn.Module, spot: str, inputs: Inputs) -> Kind | None:
    """The layout kind of ``spot``'s tensor for inputs like ``inputs``, for code that reads a
    spot outside the engine's pass (a :class:`~camviz.Unit`'s layer): known without a pass
    (:meth:`SpotKinds.known`), else told from one dry pass on the first sample, which is
    remembered for the model like the engine's; ``None`` when nothing tells."""
    kinds = SpotKinds(model, inputs.main.dim())
    known = kinds.known(spot)
    if known is not None or not inputs.size:
        return known
    seen: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        seen.setdefault(spot, tensor)
        return tensor

    first = torch.zeros(1, dtype=torch.long, device=inputs.main.device)
    with (
        record_calls(model) as log,
        edit_spots(model, {spot: keep}),
        eval_mode(model),
        torch.inference_mode(),
    ):
        inputs.replaced({}, first)(model)
    return kinds.told(spot, log, seen) if spot in seen else None
