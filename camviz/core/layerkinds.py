"""Where a layer keeps its channels, told from the module that produced its output.

A tensor's shape alone cannot say whether ``(N, A, B)`` is a 1-D convolution's ``(N, C, L)``
map, a transformer's ``(N, T, C)`` tokens or a detection head's ``(N, anchors, classes)``.
The module that produced it can:

* ``"channels_first"`` - convolutions, batch/instance/group norms, pooling (``(N, C, *S)``);
* ``"channels_last"`` - linear layers and attention, which act on the last axis
  (``(N, T, C)`` tokens, or Swin's ``(N, H, W, C)``);
* a layer norm by the axis its statistics run over in the call, whatever its class is
  called: ``nn.LayerNorm``'s own ``forward`` normalises the last axes; a subclass with its
  own ``forward`` (Hugging Face's ``ConvNextLayerNorm``, timm's ``LayerNorm2d``) is read by
  its ``normalized_shape`` against the output's axes: the channel axis (channels first) or
  the last axis (channels last), and when it fits both, by its ``data_format``;
* ``None`` - modules that say nothing about it (activations, dropout, containers, custom
  blocks). Their output is read like that of the last module *with* a kind whose output had
  the same shape and that ran before it (:func:`producer_kind`): a ResNet block's final ReLU
  or the block itself is read like its last batch norm, a ViT block like its MLP's linear.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from camviz.core.lineage import Lineage, TokenGrid
from camviz.core.modelstate import HookSet

Kind = Literal["channels_first", "channels_last", "tokens"]

_CHANNELS_FIRST: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
)
_CHANNELS_LAST: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.Embedding,
)


def module_kind(module: nn.Module, shape: Sequence[int] | None = None) -> Kind | None:
    """The layout a module's output (and input) has by the module's nature, if it has one;
    for a layer norm that is not ``nn.LayerNorm`` itself, told from the output's ``shape``
    (``None`` without it, see the module docstring)."""
    if isinstance(module, nn.LayerNorm):
        return _norm_kind(module, shape)
    if isinstance(module, _CHANNELS_FIRST):
        return "channels_first"
    if isinstance(module, _CHANNELS_LAST) or type(module).__name__.endswith("Attention"):
        return "channels_last"
    return None


def _norm_kind(module: nn.LayerNorm, shape: Sequence[int] | None) -> Kind | None:
    """Which axis a layer norm's statistics run over in a call with this output ``shape``."""
    if type(module).forward is nn.LayerNorm.forward:
        return "channels_last"  # F.layer_norm over the trailing normalized_shape axes
    normalized = tuple(module.normalized_shape)
    if shape is None or len(shape) < 3:
        return None
    last = tuple(shape[-len(normalized) :]) == normalized
    channel = len(normalized) == 1 and shape[1] == normalized[0]
    if last != channel:
        return "channels_last" if last else "channels_first"
    data_format = getattr(module, "data_format", None)
    if channel and data_format in ("channels_first", "channels_last"):
        return data_format
    return None


def needs_shape(module: nn.Module) -> bool:
    """Whether :func:`module_kind` tells the module's kind only from its output's shape."""
    return isinstance(module, nn.LayerNorm) and type(module).forward is not nn.LayerNorm.forward


def spatial_rank_of_model(model: nn.Module) -> int | None:
    """The spatial rank of the model's first convolution (1, 2 or 3), if it has one."""
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            return len(module.kernel_size)
    return None


@dataclass
class Call:
    """One module call seen by :func:`record_calls`: name, kind and output shape; when the
    pass was followed from its map input (:class:`~camviz.core.lineage.Lineage`), whether the
    output depends on it and where its patch tokens are."""

    name: str
    kind: Kind | None
    shape: tuple[int, ...] | None
    depends: bool | None = None
    tokens: TokenGrid | None = None


@dataclass
class CallLog:
    """The module calls of one forward pass, in the order their outputs were produced.

    Attributes:
        calls: Every call, when it ended.
        starts: How many calls had ended when each module's first call began.
        inputs: ``(position, input shape, kind)`` of every call whose first positional input
            is a tensor and whose module has a kind (a convolution's input is channels first).
        attention: The modules that computed an attention (followed passes only).
        levels: The modules whose first input is a list, tuple or dict of at least two feature
            maps of the map input's rank (a detection head's or an FPN's levels; followed
            passes only), with their start.
    """

    calls: list[Call] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)
    inputs: list[tuple[int, tuple[int, ...], Kind]] = field(default_factory=list)
    attention: set[str] = field(default_factory=set)
    levels: dict[str, int] = field(default_factory=dict)

    def index(self, name: str) -> int | None:
        """Where the (first) call of ``name`` ended, or ``None`` if it did not run."""
        return next((i for i, call in enumerate(self.calls) if call.name == name), None)

    def producer_kind(self, shape: tuple[int, ...], before: int) -> Kind | None:
        """The kind of the last call before position ``before`` with an output of ``shape``,
        else of the first module after it that takes an input of ``shape`` (a functional
        concatenation read by the convolution it feeds)."""
        for call in reversed(self.calls[:before]):
            if call.kind is not None and call.shape == shape:
                return call.kind
        return next(
            (kind for at, taken, kind in self.inputs if at >= before and taken == shape), None
        )

    def tokens_at(self, name: str, at_input: bool = False) -> TokenGrid | None:
        """Where the patch tokens of a module's (first) output are, if the pass told."""
        if at_input:
            return None
        index = self.index(name)
        return None if index is None else self.calls[index].tokens


@contextlib.contextmanager
def record_calls(model: nn.Module, source: torch.Tensor | None = None) -> Iterator[CallLog]:
    """Record every named module's call (kind, output shape) while the block runs, and
    where each module's first call began (:attr:`CallLog.starts`, for its input). The
    model's own tensor inputs come first, as channels first ``(N, C, *spatial)``: a layer
    that passes one on unchanged (an ``Identity``) is read like it.

    With ``source``, the map input the model is called with, the pass is also followed from
    it (:class:`~camviz.core.lineage.Lineage`): every call tells whether its output depends on
    it and where its patch tokens are, and the log holds the attention modules and the
    modules that take several levels."""
    log = CallLog()
    lineage = Lineage(source) if source is not None else None
    rank = source.dim() - 2 if source is not None else 0
    running: list[str] = []

    def on_model_input(module: nn.Module, args: Any) -> None:
        if not log.calls:
            for value in args:
                if isinstance(value, torch.Tensor) and value.dim() >= 3:
                    log.calls.append(Call("", "channels_first", tuple(value.shape)))

    def on_input(name: str, module: nn.Module, args: Any) -> None:
        log.starts.setdefault(name, len(log.calls))
        running.append(name)
        first = args[0] if args else None
        if isinstance(first, torch.Tensor):
            kind = module_kind(module, tuple(first.shape))
            if kind is not None:
                log.inputs.append((len(log.calls), tuple(first.shape), kind))
        elif lineage is not None and _levels(first, rank, lineage) and name not in log.levels:
            log.levels[name] = len(log.calls)

    def on_output(name: str, module: nn.Module, args: Any, output: Any) -> None:
        if running and running[-1] == name:
            running.pop()
        if not isinstance(output, torch.Tensor):
            log.calls.append(Call(name, module_kind(module), None))
            return
        kind = module_kind(module, tuple(output.shape))
        call = Call(name, kind, tuple(output.shape))
        if lineage is not None:
            call.depends = lineage.depends(output)
            call.tokens = lineage.token_grid(output)
        log.calls.append(call)

    def on_attention() -> None:
        if running:
            log.attention.add(running[-1])

    with HookSet() as hooks, lineage if lineage is not None else contextlib.nullcontext():
        if lineage is not None:
            lineage.on_attention = on_attention
        hooks.add(model.register_forward_pre_hook(on_model_input))
        for name, module in model.named_modules():
            if name:
                hooks.add(module.register_forward_pre_hook(partial(on_input, name)))
                hooks.add(module.register_forward_hook(partial(on_output, name)))
        yield log


def _levels(value: Any, rank: int, lineage: Lineage) -> bool:
    """Whether ``value`` is a list, tuple or dict of at least two feature maps of ``rank``
    grid axes computed from the map input."""
    items = value.values() if isinstance(value, Mapping) else value
    if not isinstance(value, (list, tuple, Mapping)):
        return False
    maps = [
        item
        for item in items
        if isinstance(item, torch.Tensor) and item.dim() == rank + 2 and lineage.depends(item)
    ]
    return len(maps) >= 2
