"""Capture what named layers see, and edit what they emit, with hooks that always come off.

Two context managers cover what people use PyTorch hooks for day to day:

* :func:`capture` records, per layer name, the output (``activations``), the positional
  input (``inputs``) and the gradient of whatever is back-propagated with respect to the
  output (``gradients``).
* :func:`edit` replaces a layer's output by ``fn(output)`` (a mask, an ablated channel).

Both take names as in ``model.named_modules()`` (wildcards allowed) and remove every hook
when the block ends, also when it ends with an exception.

The hard parts, and how they are handled:

* **In-place operations after the layer.** torchvision's ResNet does ``out = bn2(...);
  out += identity``: the tensor that ``bn2`` returned is overwritten. Stored activations are
  therefore copies, and output gradients come from a tensor hook registered on the output
  when it is produced, which PyTorch fires with the gradient of the value *before* any later
  in-place change.
* **Full backward hooks** (``backward="full"``, ``Module.register_full_backward_hook``) wrap
  the output in a ``BackwardHookFunction`` view, and PyTorch refuses in-place changes to it
  ("Output 0 of BackwardHookFunctionBackward is a view and is being modified inplace",
  pytorch/pytorch#61519). That error is re-raised as a :class:`CamvizError` that says what
  to do instead.
* **Late binding.** Each hook is bound to its own layer name with :func:`functools.partial`,
  never a closure over a loop variable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.layers import Layer, resolve_layers
from camviz.core.modelstate import HookSet

Keep = Literal["last", "all"]
Backward = Literal["tensor", "full"]


def detach_to(value: Any, device: torch.device | str | None) -> Any:
    """A detached copy of ``value`` (a tensor, or tuples, lists and dicts of tensors).

    A copy, not a view, because the model may later change the original in place.
    Anything that is not a tensor is returned as it is.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to(device or value.device, copy=True)
    if isinstance(value, (tuple, list)):
        return type(value)(detach_to(item, device) for item in value)
    if isinstance(value, Mapping):
        return {key: detach_to(item, device) for key, item in value.items()}
    return value


class Record(dict):
    """Per-layer values seen by hooks: ``record[name]`` is the last value, or the list of all.

    Args:
        keep: ``"last"`` keeps one value per layer (memory stays flat over any number of
            calls); ``"all"`` keeps every call's value in a list.
        max_calls: In ``"all"`` mode, the most values kept per layer. One more is an error,
            because an unbounded list is how a training loop runs out of memory.
    """

    def __init__(self, kind: str, keep: Keep, max_calls: int) -> None:
        super().__init__()
        self.kind = kind
        self.keep = keep
        self.max_calls = max_calls

    def put(self, name: str, value: Any) -> None:
        """Store ``value`` for layer ``name`` according to the keep mode."""
        if self.keep == "last":
            self[name] = value
            return
        values = self.setdefault(name, [])
        if len(values) >= self.max_calls:
            raise CamvizError(
                f"capture of {self.kind} for layer {name!r} reached max_calls={self.max_calls} "
                "in keep='all' mode; raise max_calls, clear the capture, or use keep='last'"
            )
        values.append(value)

    def __missing__(self, name: str) -> Any:
        raise CamvizError(
            f"no {self.kind} recorded for layer {name!r}"
            + (f" (recorded: {', '.join(self)})" if self else "")
            + "; check that the layer ran"
            + (" and that backward reached it" if self.kind == "gradients" else "")
        )


class Capture:
    """What the hooks of one :func:`capture` block saw.

    Attributes:
        activations: ``{layer name: output}``, detached copies.
        inputs: ``{layer name: first positional input}`` (the whole tuple when the layer
            takes several positional inputs).
        gradients: ``{layer name: d(backpropagated quantity)/d(output)}``; filled only when
            ``gradients=True`` and a backward pass reaches the layer. A layer that returns
            several tensors (a tuple) gets a list with one gradient per output tensor, in
            order, ``None`` for an output that backward did not reach; the same in both
            ``backward`` modes.
        layers: The resolved layer names, in the order given.
    """

    def __init__(self, layers: list[str], keep: Keep, max_calls: int) -> None:
        self.layers = layers
        self.activations = Record("activations", keep, max_calls)
        self.inputs = Record("inputs", keep, max_calls)
        self.gradients = Record("gradients", keep, max_calls)

    def clear(self) -> None:
        """Forget everything recorded so far (the hooks stay attached)."""
        for record in (self.activations, self.inputs, self.gradients):
            record.clear()

    def __repr__(self) -> str:
        return f"Capture(layers={self.layers}, recorded={sorted(self.activations)})"


@contextlib.contextmanager
def capture(
    model: nn.Module,
    layers: Layer | Iterable[Layer],
    *,
    gradients: bool = False,
    inputs: bool = True,
    backward: Backward = "tensor",
    device: torch.device | str | None = None,
    keep: Keep = "last",
    max_calls: int = 1000,
) -> Iterator[Capture]:
    """Record the inputs, outputs and output gradients of named layers inside a block.

    Args:
        model: The network to observe. It is not changed; every hook comes off at the end.
        layers: Layer names as in ``model.named_modules()``; wildcards like ``"layer*"``.
        gradients: Also record ``d(quantity)/d(output)`` when the block calls ``backward``
            (or ``torch.autograd.grad``) on something that depends on the layer.
        inputs: Also record each layer's positional input (``False`` saves the copies).
        backward: How gradients are caught. ``"tensor"`` (default) registers a hook on each
            output tensor; it is exact when the output is later changed in place.
            ``"full"`` uses ``register_full_backward_hook`` as PyTorch offers it; PyTorch
            forbids in-place changes of such outputs, and camviz explains that error.
        device: Where to keep the copies (``"cpu"`` frees accelerator memory); by default
            where they were produced.
        keep: ``"last"`` keeps the latest call per layer; ``"all"`` a list of every call.
        max_calls: Bound on the list length per layer in ``"all"`` mode.

    Yields:
        A :class:`Capture` whose dicts fill as the model runs.

    Example:
        >>> with camviz.capture(model, ["layer4", "fc"], gradients=True) as cap:
        ...     model(x)[:, 3].sum().backward()
        >>> cap.activations["layer4"].shape, cap.gradients["layer4"].shape, cap.inputs["fc"]
    """
    if keep not in ("last", "all"):
        raise CamvizError(f"keep must be 'last' or 'all', not {keep!r}")
    if backward not in ("tensor", "full"):
        raise CamvizError(f"backward must be 'tensor' or 'full', not {backward!r}")
    modules = resolve_layers(model, layers)
    record = Capture(list(modules), keep, max_calls)

    def on_input(name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        record.inputs.put(name, detach_to(args[0] if len(args) == 1 else args, device))

    def on_output(name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        record.activations.put(name, detach_to(output, device))
        if gradients and backward == "tensor":
            outputs = list(tensors_in(output))
            collect = _OutputGradients(record.gradients, name, len(outputs), device)
            for index, tensor in enumerate(outputs):
                if tensor.requires_grad:
                    tensor.register_hook(partial(collect, index))

    def on_full_backward(name: str, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        collect = _OutputGradients(record.gradients, name, len(grad_output), device)
        for index, gradient in enumerate(grad_output):
            if gradient is not None:
                collect(index, gradient)

    with HookSet() as hooks, _explain_inplace_error():
        for name, module in modules.items():
            if inputs:
                hooks.add(module.register_forward_pre_hook(partial(on_input, name)))
            hooks.add(module.register_forward_hook(partial(on_output, name)))
            if gradients and backward == "full":
                hooks.add_full_backward_hook(module, partial(on_full_backward, name))
        yield record


class _OutputGradients:
    """Records the gradients of one call's outputs: the tensor for a layer with one output,
    else a list with one entry per output tensor (``None`` where backward did not reach it).

    Tensor hooks fire one output at a time, so the list is recorded when the first gradient
    of a backward pass arrives and filled in as the others do; a gradient for a slot that is
    already filled starts the list of the next backward pass.
    """

    def __init__(
        self, record: Record, name: str, count: int, device: torch.device | str | None
    ) -> None:
        self.record, self.name, self.count, self.device = record, name, count, device
        self.current: list[torch.Tensor | None] | None = None

    def __call__(self, index: int, gradient: torch.Tensor) -> None:
        gradient = detach_to(gradient, self.device)
        if self.count == 1:
            self.record.put(self.name, gradient)
            return
        if self.current is None or self.current[index] is not None:
            self.current = [None] * self.count
            self.record.put(self.name, self.current)
        self.current[index] = gradient


EditFn = Callable[[torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def edit(model: nn.Module, edits: Mapping[str, EditFn]) -> Iterator[nn.Module]:
    """Replace named layers' outputs by ``fn(output)`` inside a block.

    Args:
        model: The network to edit. Its weights are untouched; the edits come off at the end.
        edits: ``{layer name or pattern: fn}``; ``fn`` takes the layer's output tensor and
            returns the tensor that the rest of the network sees instead.

    Yields:
        The model, for ``with camviz.edit(model, {...}) as edited: edited(x)``.

    Example:
        >>> mask = torch.zeros(1, 512, 1, 1); mask[:, 17] = 1
        >>> with camviz.edit(model, {"layer4": lambda out: out * mask}):
        ...     logits = model(x)
    """

    def on_output(fn: EditFn, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return fn(output)

    with HookSet() as hooks:
        for pattern, fn in edits.items():
            for module in resolve_layers(model, pattern).values():
                hooks.add(module.register_forward_hook(partial(on_output, fn)))
        yield model


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or nested tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item)


@contextlib.contextmanager
def _explain_inplace_error() -> Iterator[None]:
    try:
        yield
    except RuntimeError as error:
        if "BackwardHookFunction" not in str(error):
            raise
        raise CamvizError(
            "a full backward hook cannot watch a layer whose output is later changed in "
            "place (pytorch/pytorch#61519); use backward='tensor' (the default), or hook a "
            "layer whose output is not modified in place"
        ) from error
