"""Where tensors come from, followed through every torch call of one pass.

Two things cannot be told from a module or a shape, only from how a tensor was computed:

* whether it depends on the map input at all (a two-tower model's text tower does not), and
* where the patch tokens of a token sequence are: a vision transformer flattens a feature
  map (its patch embedding's output) into tokens, puts class, distillation or register tokens
  before them and, as YOLOS does, detection tokens after them; a DETR decoder's object
  queries come from no feature map at all and have no grid.

:class:`Lineage`, a :class:`~camviz.core.calls.CallMode`, follows both through the calls of
a pass. A convolution's output computed from the map input carries a *grid* tag (its
spatial axes); flattening its grid axes makes a *tokens* tag (the patches in row-major order, at
offset 0), which a concatenation along the token axis shifts (tokens put before them), a
transpose or permute moves, and every call that keeps the token axis (norms, linear layers,
attention, residual sums) hands on. Unflattening the tokens again, or taking every other row
and column of the grid (Swin's patch merging), gives a grid tag again. A call the rules do
not know drops the tag: camviz then says it cannot tell where the patches are, rather than
guessing from the token count.

Attention is recognised by what it computes, not by a class name: a softmax over a q/k/v
projection (a linear layer's output, reshaped; CoaT's factorised attention takes the
softmax of its keys) or over the product of two activations (``q @ k.T``, also with
convolution projections), ``scaled_dot_product_attention`` or torch's
``multi_head_attention_forward``; :attr:`Lineage.on_attention` is told of each. (A softmax
over an ``(N, K)`` classifier output, or over a convolution's box bins, is none.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from camviz.core.calls import CallMode

__all__ = ["Lineage", "TokenGrid"]


@dataclass(frozen=True)
class TokenGrid:
    """Where the patch tokens of an ``(N, T, C)`` sequence are: ``prod(grid)`` tokens in
    row-major order from token ``start`` on (tokens before are class, distillation or register
    tokens; tokens after them, detection tokens)."""

    start: int
    grid: tuple[int, ...]

    @property
    def count(self) -> int:
        """The number of patch tokens."""
        return math.prod(self.grid)

    @property
    def end(self) -> int:
        """The index after the last patch token."""
        return self.start + self.count


@dataclass(frozen=True)
class _Tokens:
    """Tag: axis ``axis`` holds tokens whose ``grid`` patches start at ``start``."""

    axis: int
    start: int
    grid: tuple[int, ...]


@dataclass(frozen=True)
class _Grid:
    """Tag: axes ``axis .. axis + len(grid) - 1`` are a grid of patches."""

    axis: int
    grid: tuple[int, ...]


_Tag = _Tokens | _Grid

# Calls whose operands meet element by element: the tag of any operand of the output's shape.
_ELEMENTWISE = frozenset(
    {"add", "sub", "mul", "div", "true_divide", "where", "maximum", "minimum", "lerp"}
    | {"addcmul", "addcdiv", "masked_fill", "add_", "sub_", "mul_", "div_", "masked_fill_"}
    | {"__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__"}
    | {"__mul__", "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__"}
)
_PRODUCTS = frozenset({"matmul", "bmm", "einsum", "__matmul__", "__rmatmul__", "baddbmm"})
_ATTENTION = frozenset(("scaled_dot_product_attention", "multi_head_attention_forward"))
_CONCATENATIONS = frozenset(("cat", "concat", "concatenate"))
_CONVOLUTIONS = frozenset(("conv1d", "conv2d", "conv3d"))
# Calls that only rearrange a projection's values (into heads, q/k/v parts) or scale them.
_REARRANGEMENTS = frozenset(
    {"reshape", "view", "permute", "transpose", "unbind", "chunk", "split", "__getitem__"}
    | {"contiguous", "flatten", "unflatten", "mul", "__mul__", "__rmul__", "div", "__truediv__"}
)
_TRANSPOSES = frozenset(("transpose", "swapaxes", "swapdims", "transpose_"))


class Lineage(CallMode):
    """Follow, through a pass, which tensors depend on the map input and where patch tokens
    are (see the module docstring).

    Attributes:
        on_attention: Called at each attention computation (none: nothing is told).
    """

    def __init__(self, source: torch.Tensor) -> None:
        super().__init__()
        self._derived: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._tags: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._scores: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._projections: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._derived[source] = True
        self.on_attention: Callable[[], None] | None = None

    def depends(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was computed from the map input."""
        return tensor in self._derived

    def token_grid(self, tensor: torch.Tensor) -> TokenGrid | None:
        """Where the patch tokens of an ``(N, T, C)`` tensor are, if it holds patch tokens."""
        tag = self._tags.get(tensor)
        if tensor.dim() != 3 or not isinstance(tag, _Tokens) or tag.axis != 1:
            return None
        return TokenGrid(tag.start, tag.grid)

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inputs = list(_tensors((args, kwargs)))
        outputs = list(_tensors(output))
        if not inputs or not outputs:
            return output
        if any(self.depends(tensor) for tensor in inputs):
            for tensor in outputs:
                self._derived[tensor] = True
        self._watch_attention(name, inputs, outputs)
        if name in _CONVOLUTIONS and self.depends(outputs[0]) and outputs[0].dim() > 2:
            self._tags[outputs[0]] = _Grid(2, tuple(outputs[0].shape[2:]))
            return output
        for index, tensor in enumerate(outputs):
            tag = self._followed(name, args, kwargs, inputs, tensor, index)
            if tag is not None:
                self._tags[tensor] = tag
        return output

    def _watch_attention(
        self, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
    ) -> None:
        """Tell :attr:`on_attention` of an attention computation; mark ``q @ k.T`` products
        (of two activations, not a weight) and what is computed from them element-wise."""
        activations = [tensor for tensor in inputs if not isinstance(tensor, nn.Parameter)]
        product = name in _PRODUCTS and len(activations) >= 2
        if product or (name in _ELEMENTWISE and any(tensor in self._scores for tensor in inputs)):
            self._scores[outputs[0]] = True
        if (name == "linear" and self.depends(inputs[0])) or (
            name in _REARRANGEMENTS and inputs[0] in self._projections
        ):
            for tensor in outputs:
                self._projections[tensor] = True
        first = inputs[0]
        attention = name in _ATTENTION or (
            name == "softmax"
            and first.dim() >= 3
            and (first in self._scores or first in self._projections)
        )
        if attention and self.on_attention is not None:
            self.on_attention()

    def _followed(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
        output: torch.Tensor,
        index: int,
    ) -> _Tag | None:
        """The tag of output ``index`` of a call (see the module docstring)."""
        if name in _CONCATENATIONS and index == 0:
            return self._concatenated(args, kwargs, output)
        if name in _ELEMENTWISE:
            for tensor in inputs:
                tag = self._tags.get(tensor)
                if tag is not None and tensor.shape == output.shape:
                    return tag
        first = inputs[0]
        tag = self._tags.get(first)
        if tag is None:
            return None
        if name in _TRANSPOSES and len(args) >= 3 and index == 0:
            order = list(range(first.dim()))
            one, two = (_axis(args[1], first.dim()), _axis(args[2], first.dim()))
            order[one], order[two] = order[two], order[one]
            return _permuted(tag, order)
        if name == "permute" and index == 0:
            dims = args[1] if len(args) == 2 and isinstance(args[1], Sequence) else args[1:]
            return _permuted(tag, [_axis(dim, first.dim()) for dim in dims])
        if name == "__getitem__" and index == 0:
            return _indexed(tag, first, args[1], output)
        return _reshaped(tag, tuple(first.shape), tuple(output.shape))

    def _concatenated(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor
    ) -> _Tag | None:
        pieces = args[0] if args else kwargs.get("tensors", ())
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        if not isinstance(pieces, Sequence) or not isinstance(dim, int):
            return None
        dim = _axis(dim, output.dim())
        offset = 0
        for piece in pieces:
            if not isinstance(piece, torch.Tensor):
                return None
            tag = self._tags.get(piece)
            if isinstance(tag, _Tokens) and tag.axis == dim:
                return _Tokens(dim, offset + tag.start, tag.grid)
            if tag is not None and _axes(tag).isdisjoint({dim}):
                return tag  # joined along another axis (channels): the tokens stay in place
            offset += piece.shape[dim] if piece.dim() > dim else 0
        return None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a call's arguments or result, one level into tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            if isinstance(item, torch.Tensor):
                yield item


def _axis(dim: Any, ndim: int) -> int:
    return int(dim) % ndim if ndim else 0


def _axes(tag: _Tag) -> set[int]:
    if isinstance(tag, _Tokens):
        return {tag.axis}
    return set(range(tag.axis, tag.axis + len(tag.grid)))


def _permuted(tag: _Tag, order: Sequence[int]) -> _Tag | None:
    """The tag after the axes are reordered (output axis ``i`` is input axis ``order[i]``)."""
    order = list(order)
    if isinstance(tag, _Tokens):
        return _Tokens(order.index(tag.axis), tag.start, tag.grid) if tag.axis in order else None
    positions = [order.index(axis) for axis in range(tag.axis, tag.axis + len(tag.grid))]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        return None  # grid axes no longer side by side, in order
    return _Grid(positions[0], tag.grid)


def _reshaped(tag: _Tag, before: tuple[int, ...], after: tuple[int, ...]) -> _Tag | None:
    """The tag of a call's output of shape ``after`` made from a tagged input of shape
    ``before``: kept where the tagged axes stay (norms, linear layers, a reshape of the
    other axes); tokens unflattened into their grid; a grid flattened into tokens."""
    if isinstance(tag, _Tokens):
        axis = tag.axis
        if len(after) > axis and after[: axis + 1] == before[: axis + 1]:
            return tag
        complete = tag.start == 0 and before[axis] == math.prod(tag.grid)
        span = len(tag.grid)
        if (
            complete
            and after[:axis] == before[:axis]
            and after[axis : axis + span] == tag.grid
            and after[axis + span :] == before[axis + 1 :]
        ):
            return _Grid(axis, tag.grid)
        return None
    axis, span = tag.axis, len(tag.grid)
    if len(after) <= axis or after[:axis] != before[:axis]:
        return None
    if after[axis : axis + span] == tag.grid:
        return tag
    if after[axis] == math.prod(tag.grid) and after[axis + 1 :] == before[axis + span :]:
        return _Tokens(axis, 0, tag.grid)
    return None


def _indexed(tag: _Tag, tensor: torch.Tensor, index: Any, output: torch.Tensor) -> _Tag | None:
    """The tag of ``tensor[index]`` for basic indexing with slices (``x[:, 1:]``, Swin's
    ``x[:, 0::2, 1::2, :]``); other indexing drops it."""
    items = index if isinstance(index, tuple) else (index,)
    if any(item is Ellipsis for item in items):
        before = items.index(Ellipsis)
        filled = (slice(None),) * (tensor.dim() - len(items) + 1)
        items = items[:before] + filled + items[before + 1 :]
    if not all(isinstance(item, slice) for item in items) or len(items) > tensor.dim():
        return None  # an int, None, a tensor or a list: axes dropped, added or gathered
    slices = list(items) + [slice(None)] * (tensor.dim() - len(items))
    if isinstance(tag, _Tokens):
        start, stop, step = slices[tag.axis].indices(tensor.shape[tag.axis])
        end = tag.start + math.prod(tag.grid)
        if step != 1 or start > tag.start or stop < end:
            return None  # patches cut into
        return _Tokens(tag.axis, tag.start - start, tag.grid)
    grid = tuple(output.shape[tag.axis : tag.axis + len(tag.grid)])
    for axis in range(tag.axis, tag.axis + len(tag.grid)):
        start, stop, step = slices[axis].indices(tensor.shape[axis])
        if start >= step or stop < tensor.shape[axis] - step + 1:
            return None  # a crop, not every step-th patch
    return _Grid(tag.axis, grid)
