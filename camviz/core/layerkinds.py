"""Where a layer keeps its channels, told from the module that produced its output.

A tensor's shape alone cannot say whether ``(N, A, B)`` is a 1-D convolution's ``(N, C, L)``
map, a transformer's ``(N, T, C)`` tokens or a detection head's ``(N, anchors, classes)``.
The module that produced it can:

* ``"channels_first"`` - convolutions, batch/instance/group norms, pooling (``(N, C, *S)``);
* ``"channels_last"`` - linear layers, layer norms and attention, which act on the last axis
  (``(N, T, C)`` tokens, or Swin's ``(N, H, W, C)``);
* ``None`` - modules that say nothing about it (activations, dropout, containers, custom
  blocks). Their output is read like that of the last module *with* a kind whose output had
  the same shape and that ran before it (:func:`producer_kind`): a ResNet block's final ReLU
  or the block itself is read like its last batch norm, a ViT block like its MLP's linear.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

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
    nn.LayerNorm,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.Embedding,
)


def module_kind(module: nn.Module) -> Kind | None:
    """The layout a module's output (and input) has by the module's nature, if it has one."""
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm) and name[-2:] in ("1d", "2d", "3d"):
        return "channels_first"  # timm's LayerNorm2d normalises dim 1 (ConvNeXt)
    if isinstance(module, _CHANNELS_FIRST):
        return "channels_first"
    if isinstance(module, _CHANNELS_LAST) or name.endswith("Attention"):
        return "channels_last"
    return None


def spatial_rank_of_model(model: nn.Module) -> int | None:
    """The spatial rank of the model's first convolution (1, 2 or 3), if it has one."""
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            return len(module.kernel_size)
    return None


@dataclass
class Call:
    """One module call seen by :func:`record_calls`: name, kind and output shape."""

    name: str
    kind: Kind | None
    shape: tuple[int, ...] | None


@dataclass
class CallLog:
    """The module calls of one forward pass, in the order their outputs were produced."""

    calls: list[Call] = field(default_factory=list)
    starts: dict[str, int] = field(default_factory=dict)

    def index(self, name: str) -> int | None:
        """Where the (first) call of ``name`` ended, or ``None`` if it did not run."""
        return next((i for i, call in enumerate(self.calls) if call.name == name), None)

    def producer_kind(self, shape: tuple[int, ...], before: int) -> Kind | None:
        """The kind of the last call before position ``before`` with an output of ``shape``."""
        for call in reversed(self.calls[:before]):
            if call.kind is not None and call.shape == shape:
                return call.kind
        return None


@contextlib.contextmanager
def record_calls(model: nn.Module) -> Iterator[CallLog]:
    """Record every named module's call (kind, output shape) while the block runs, and
    where each module's first call began (:attr:`CallLog.starts`, for its input). The
    model's own tensor inputs come first, as channels first ``(N, C, *spatial)``: a layer
    that passes one on unchanged (an ``Identity``) is read like it."""
    log = CallLog()

    def on_model_input(module: nn.Module, args: Any) -> None:
        if not log.calls:
            for value in args:
                if isinstance(value, torch.Tensor) and value.dim() >= 3:
                    log.calls.append(Call("", "channels_first", tuple(value.shape)))

    def on_input(name: str, module: nn.Module, args: Any) -> None:
        log.starts.setdefault(name, len(log.calls))

    def on_output(name: str, kind: Kind | None, module: nn.Module, args: Any, output: Any) -> None:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else None
        log.calls.append(Call(name, kind, shape))

    with HookSet() as hooks:
        hooks.add(model.register_forward_pre_hook(on_model_input))
        for name, module in model.named_modules():
            if name:
                hooks.add(module.register_forward_pre_hook(partial(on_input, name)))
                hooks.add(
                    module.register_forward_hook(partial(on_output, name, module_kind(module)))
                )
        yield log
