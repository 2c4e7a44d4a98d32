"""Spots on a layer that the engine can read and edit: its output, its input, or one
element of either when it is a tuple, list or dict.

A spot is written as a string, which is also its key in :class:`~camviz.cams.engine.Explanation`:

* ``"layer4"`` - the layer's output (it must be a tensor);
* ``"layer4:input"`` - its first positional input (``at="input"`` in :func:`camviz.explain`);
* ``"lstm[0]"``, ``"head[cls_logits]"``, ``"block:input[1]"`` - one element of a tuple,
  list or dict output (or of the positional inputs), by index or key; brackets nest
  (``"rnn[1][0]"``). A dict key written as a number also finds the key's string
  (``"backbone[0]"`` is level ``'0'`` of an FPN's ``OrderedDict``).

A layer whose output is a tuple, list or dict of feature maps (an FPN's levels, a
segmentation backbone's ``{'out', 'aux'}``) stands for its elements that are maps of the
input's spatial rank (:func:`map_elements`): the engine explains each of them as a layer of
its own, keyed by its element spot (``"backbone[0]"``, ``"backbone[pool]"``).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.layers import Layer, resolve_layers
from camviz.core.modelstate import HookSet

At = Literal["output", "input"]
Path = tuple[int | str, ...]

_SPOT = re.compile(r"(?P<name>[^\[\]:]*)(?P<at>:input|:output)?(?P<path>(\[[^\[\]]+\])*)")
_ELEMENT = re.compile(r"\[([^\[\]]+)\]")


@dataclass(frozen=True)
class Spot:
    """A parsed spot: module name, output or input, and the element path inside it."""

    name: str
    at: At
    path: Path

    @property
    def key(self) -> str:
        """The spot's canonical string (see the module docstring)."""
        suffix = ":input" if self.at == "input" else ""
        return self.name + suffix + "".join(f"[{item}]" for item in self.path)


def parse(text: str, at: At = "output") -> Spot:
    """Split ``"name:input[0]"`` into a :class:`Spot` (``at`` applies unless the text says)."""
    match = _SPOT.fullmatch(text.strip())
    if match is None or not match["name"]:
        raise CamvizError(
            f"cannot read the layer {text!r}; write a layer name, optionally followed by "
            "':input' and [index] or [key] for one element of a tuple or dict"
        )
    path = tuple(_element(item) for item in _ELEMENT.findall(match["path"]))
    where = match["at"][1:] if match["at"] else at
    return Spot(match["name"], "input" if where == "input" else "output", path)


def _element(text: str) -> int | str:
    text = text.strip().strip("'\"")
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def spot_keys(model: nn.Module, layer: Layer | Iterable[Layer], at: At) -> list[str]:
    """The spot keys that ``layer`` (names, patterns, submodules, or a list of them) denotes.

    Raises:
        CamvizError: A layer is unknown or not part of the model, or ``at`` is unknown.
    """
    if at not in ("output", "input"):
        raise CamvizError(f"at must be 'output' or 'input', not {at!r}")
    if isinstance(layer, (str, nn.Module)) or not isinstance(layer, Iterable):
        layer = [layer]  # resolve_layers names a wrong type
    keys: list[str] = []
    for item in layer:
        spot = parse(item, at) if isinstance(item, str) else Spot("", at, ())
        for name in resolve_layers(model, spot.name if isinstance(item, str) else [item]):
            key = Spot(name, spot.at, spot.path).key
            if key not in keys:
                keys.append(key)
    if not keys:
        raise CamvizError("no layer was named; give at least one layer name")
    return keys


def _item(value: Any, item: int | str) -> int | str:
    """The index or key that ``item`` names in ``value``: a number names a dict's string key
    when the dict has no such number among its keys (FPN levels are ``'0'``, ``'1'``...)."""
    if isinstance(value, Mapping) and item not in value and str(item) in value:
        return str(item)
    return item


def select(value: Any, path: Path, key: str) -> Any:
    """The element of ``value`` at ``path``."""
    for item in path:
        try:
            value = value[_item(value, item)]
        except (KeyError, IndexError, TypeError):
            raise CamvizError(
                f"the layer spot {key!r} has no element [{item}] in a {type(value).__name__}"
                + (f" with keys {list(value)}" if isinstance(value, Mapping) else "")
            ) from None
    return value


def replace(value: Any, path: Path, new: Any) -> Any:
    """A copy of ``value`` with the element at ``path`` replaced by ``new``."""
    if not path:
        return new
    head, rest = _item(value, path[0]), path[1:]
    inner = replace(value[head], rest, new)
    if isinstance(value, Mapping):
        copied = dict(value)
        copied[head] = inner
        return copied if type(value) is dict else type(value)(copied)  # type: ignore[call-arg]
    items = list(value)
    items[int(head)] = inner
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*items)  # a namedtuple
    return type(value)(items)


def map_elements(value: Any, rank: int) -> list[int | str]:
    """The indices or keys of the elements of a tuple, list or dict that are feature maps for
    an input with ``rank`` spatial axes: tensors of rank ``rank + 2`` with more than one
    location (whether the channels come first or last). Elements are looked at one level
    deep; an FPN's ``OrderedDict`` gives its level names in order."""
    items = value.items() if isinstance(value, Mapping) else enumerate(value)
    return [
        index
        for index, element in items
        if isinstance(element, torch.Tensor)
        and element.dim() == rank + 2
        and math.prod(element.shape[2:]) > 1
        and math.prod(element.shape[1:-1]) > 1
    ]


def element_key(key: str, item: int | str) -> str:
    """The spot key of element ``item`` of the value at spot ``key`` (for a whole input spot,
    of its first positional input: ``"head:input"`` -> ``"head:input[0][item]"``)."""
    spot = parse(key)
    path = spot.path or ((0,) if spot.at == "input" else ())
    return Spot(spot.name, spot.at, (*path, item)).key


SpotFn = Callable[[torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def edit_spots(
    model: nn.Module, edits: Mapping[str, SpotFn], *, containers: bool = False
) -> Iterator[nn.Module]:
    """Replace the tensor at each spot by ``fn(tensor)`` inside a block (hooks come off after).

    With ``containers=True`` a spot that holds a tuple, list or dict hands it to ``fn`` whole,
    and ``fn`` returns its replacement (the engine's taps expand it into its feature maps).

    Raises:
        CamvizError: A spot holds something other than a tensor (or a container, if allowed).
    """
    modules = dict(model.named_modules())

    def value_at(key: str, value: Any, path: Path) -> Any:
        found = select(value, path, key)
        if containers and isinstance(found, (tuple, list, Mapping)):
            return found  # fn takes the container whole
        if not isinstance(found, torch.Tensor):
            # The spelling of its first element (a whole input spot is its first input's).
            first = next(iter(found), 0) if isinstance(found, Mapping) else 0
            example = element_key(key, first) if isinstance(found, (tuple, list, Mapping)) else ""
            raise CamvizError(
                f"layer {key!r} gives a {type(found).__name__}, not a tensor; pick a layer that "
                "outputs a feature map, or one element of it "
                + (f"such as {example!r}" if example else "as 'name[0]' or 'name[key]'")
            )
        return found

    def on_output(
        key: str, spot: Spot, fn: SpotFn, module: nn.Module, args: Any, output: Any
    ) -> Any:
        return replace(output, spot.path, fn(value_at(key, output, spot.path)))

    def on_input(key: str, spot: Spot, fn: SpotFn, module: nn.Module, args: tuple[Any, ...]) -> Any:
        path = spot.path or (0,)
        return replace(args, path, fn(value_at(key, args, path)))

    with HookSet() as hooks:
        for key, fn in edits.items():
            spot = parse(key)
            if spot.name not in modules:
                raise CamvizError(f"no layer named {spot.name!r} in the model")
            module = modules[spot.name]
            if spot.at == "input":
                hooks.add(module.register_forward_pre_hook(partial(on_input, key, spot, fn)))
            else:
                hooks.add(module.register_forward_hook(partial(on_output, key, spot, fn)))
        yield model


class Watch:
    """An edit that changes nothing: it keeps the tensor (or container) at its spot as the
    rest of the network got it, for a target that reads the spot (a ``Unit``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ran = False
        self.handed: Any = None

    def __call__(self, output: Any) -> Any:
        self.ran = True
        self.handed = output
        return output


@contextlib.contextmanager
def watching(model: nn.Module, spots: Iterable[str]) -> Iterator[dict[str, Watch]]:
    """A :class:`Watch` on each of ``spots`` inside a block (the hooks come off after)."""
    watches = {spot: Watch(spot) for spot in spots}
    with edit_spots(model, watches, containers=True):
        yield watches
