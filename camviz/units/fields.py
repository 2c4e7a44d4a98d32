"""Receptive fields: the part of the input that each location of a layer's grid sees.

Two ways, and the result says which one it took (:attr:`ReceptiveField.how`):

* ``"analytic"``, from the kernels, strides, paddings and dilations of the convolutions and
  pools that lead to the layer, when they form a chain (each one reads what the one before
  it wrote, with only shape-keeping modules such as norms and activations in between). For
  layers ``l = 1..L`` with kernel ``k``, stride ``s``, padding ``p`` and dilation ``d``::

      jump_l  = jump_{l-1} * s_l
      size_l  = size_{l-1} + d_l * (k_l - 1) * jump_{l-1}
      start_l = start_{l-1} - p_l * jump_{l-1}            (jump_0 = size_0 = 1, start_0 = 0)

  and grid location ``i`` sees input pixels ``start_L + i * jump_L`` to
  ``start_L + i * jump_L + size_L - 1`` (Araujo, Norris & Sim, Distill 2019). A plain skip
  connection added in place (``out += identity``, ResNet's blocks without a projection)
  keeps the chain: its field lies inside the convolutions' own.
* ``"measured"``, by gradient, for everything else (projection shortcuts, branches,
  attention, squeeze-and-excitation, functional code): the input pixels on which the
  layer's centre location depends, the union over a few random inputs of where
  ``d A[:, centre] / d x`` is not zero, moved by the shift to the next location for the
  others. A field that covers the whole input is measured again on an input twice as
  large, so that a deep CNN on a small input is told from a global one (attention, global
  pooling), which gets stride 0: every location sees everything.

Boxes are clipped to the input: a field that reaches into the padding covers less.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.modelstate import HookSet, eval_mode, exclusive, no_grad
from camviz.core.taps import parse
from camviz.units.spots import outputs_at, spatial_view

__all__ = ["ReceptiveField", "receptive_field"]

How = Literal["auto", "analytic", "measured"]

_GEOMETRIC = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)

# Random inputs whose gradient supports are joined: a ReLU that is off for one input is on
# for another, so the support is the field rather than the part one input lights up.
_MEASURING_INPUTS = 4


@dataclass(frozen=True)
class ReceptiveField:
    """Where each location of a layer's grid looks in the input.

    Attributes:
        size: The field's extent per spatial axis, in input pixels.
        stride: Input pixels between neighbouring grid locations, per axis; ``0`` where
            every location sees the whole axis (after an attention, a global pooling).
        start: Per axis, the first input pixel that grid location 0 sees (negative when it
            reaches into the padding).
        grid: The layer's grid.
        input_size: The input's spatial size the field was computed for.
        how: ``"analytic"`` or ``"measured"`` (see the module docstring).
    """

    size: tuple[int, ...]
    stride: tuple[float, ...]
    start: tuple[float, ...]
    grid: tuple[int, ...]
    input_size: tuple[int, ...]
    how: Literal["analytic", "measured"]

    def box(
        self, location: Sequence[int], input_size: Sequence[int] | None = None
    ) -> tuple[tuple[int, int], ...]:
        """``((first, stop), ...)`` per axis: the input pixels that grid ``location`` sees,
        clipped to the input (``stop`` excluded). ``input_size`` clips to an input of
        another size than the one the field was computed for (a photo of another aspect
        ratio: strides and kernels do not change with the input's size)."""
        size = self.input_size if input_size is None else tuple(input_size)
        box = []
        for axis, index in enumerate(location):
            if not self.stride[axis]:  # every location sees the whole axis
                box.append((0, size[axis]))
                continue
            first = math.floor(self.start[axis] + index * self.stride[axis])
            box.append((max(first, 0), min(first + self.size[axis], size[axis])))
        return tuple(box)

    def as_dict(self) -> dict[str, Any]:
        """The field as JSON-ready data (with :meth:`describe`'s text), read back by
        :meth:`from_dict`."""
        fields = {name: list(getattr(self, name)) for name in ("size", "stride", "start")}
        return {
            **fields,
            "grid": list(self.grid),
            "input_size": list(self.input_size),
            "how": self.how,
            "text": self.describe(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReceptiveField:
        """A field written by :meth:`as_dict`."""
        return cls(
            tuple(int(value) for value in data["size"]),
            tuple(float(value) for value in data["stride"]),
            tuple(float(value) for value in data["start"]),
            tuple(int(value) for value in data["grid"]),
            tuple(int(value) for value in data["input_size"]),
            "analytic" if data["how"] == "analytic" else "measured",
        )

    def describe(self) -> str:
        """One line for figures and indexes: ``"analytic: 35 x 35 px, every 8 x 8 px"``."""
        size = " x ".join(str(value) for value in self.size)
        stride = " x ".join(f"{value:g}" for value in self.stride)
        way = "from the kernels and strides" if self.how == "analytic" else "measured by gradient"
        if not any(self.stride):
            return f"receptive field: the whole {size} px input ({way})"
        return f"receptive field {size} px, every {stride} px ({way})"


def receptive_field(
    model: nn.Module, inputs: torch.Tensor, layer: str, how: How = "auto"
) -> ReceptiveField:
    """The receptive field of the locations of ``layer``'s grid for inputs like ``inputs``.

    Args:
        model: The network (handed back as it came: hooks, modes and gradients).
        inputs: An ``(N, C, *spatial)`` batch of the size to compute it for (its values are
            not used: the field is measured on random inputs of that shape).
        layer: A layer spot (``"layer3.1"``, ``"blocks.4:input"``).
        how: ``"auto"`` (analytic when the layers form a chain, else measured),
            ``"analytic"`` (refused, in one line, when they do not) or ``"measured"``.

    Raises:
        CamvizError: ``how`` is unknown, or ``"analytic"`` cannot be computed.
    """
    if how not in ("auto", "analytic", "measured"):
        raise CamvizError(f"how must be 'auto', 'analytic' or 'measured', not {how!r}")
    generator = torch.Generator().manual_seed(0)
    # Ordinary tensors also in a caller's inference mode: the model may keep what it computes.
    with torch.inference_mode(False), exclusive(model), eval_mode(model):
        probe = torch.randn(_MEASURING_INPUTS, *inputs.shape[1:], generator=generator)
        probe = probe.to(inputs.device)
        chain = None if how == "measured" else _chain(model, probe, layer)
        if chain is not None:
            return chain
        if how == "analytic":
            raise CamvizError(
                f"the layers before {layer!r} are not a chain of convolutions and pools "
                "(a skip connection, an attention or functional code joins them), so its "
                "receptive field has no kernel-and-stride formula; use how='measured'"
            )
        return _measured(model, probe, layer)


@dataclass
class _Step:
    """One module call in the pass that :func:`_chain` follows."""

    module: nn.Module
    reads: torch.Tensor | None
    writes: torch.Tensor | None


def _chain(model: nn.Module, probe: torch.Tensor, layer: str) -> ReceptiveField | None:
    """The analytic field, or ``None`` when the calls before the spot are not a chain."""
    spot = parse(layer)
    modules = dict(model.named_modules())
    if spot.name not in modules or spot.path:
        return None
    steps: list[_Step] = []
    end: list[tuple[int, Any]] = []  # (calls before the spot, the tensor at the spot)

    def on_call(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        steps.append(_Step(module, _tensor(args[0] if args else None), _tensor(output)))

    def on_spot_input(module: nn.Module, args: tuple[Any, ...]) -> None:
        end.append((len(steps), args[0] if args else None))

    def on_spot_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        end.append((len(steps), output))

    target = modules[spot.name]
    with HookSet() as hooks, no_grad():
        for module in model.modules():
            if not list(module.children()):
                hooks.add(module.register_forward_hook(on_call))
        if spot.at == "input":
            hooks.add(target.register_forward_pre_hook(on_spot_input))
        else:
            hooks.add(target.register_forward_hook(on_spot_output))
        model(probe)
    if not end or not isinstance(end[0][1], torch.Tensor):
        return None
    count, tensor = end[0]
    return _chained_field(steps[:count], probe, tensor)


def _tensor(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def _chained_field(
    steps: Sequence[_Step], probe: torch.Tensor, at_spot: torch.Tensor
) -> ReceptiveField | None:
    """The chain rule of the module docstring along ``steps``, or ``None`` if a step does
    not read what the step before it wrote (a branch, functional code between them)."""
    rank = probe.dim() - 2
    jump, size, start = [1] * rank, [1] * rank, [0] * rank
    current = probe
    for step in steps:
        if step.reads is not current or step.writes is None:
            return None
        if isinstance(step.module, _GEOMETRIC):
            kernel, stride, padding, dilation = _geometry(step.module, rank)
            for axis in range(rank):
                size[axis] += dilation[axis] * (kernel[axis] - 1) * jump[axis]
                start[axis] -= padding[axis] * jump[axis]
                jump[axis] *= stride[axis]
        elif step.writes.shape != step.reads.shape:
            return None  # a shape-changing module without a kernel (a linear, a resize)
        current = step.writes
    if at_spot is not current or at_spot.dim() != probe.dim():
        return None
    grid = tuple(at_spot.shape[2:])
    strides = tuple(float(value) for value in jump)
    starts = tuple(float(value) for value in start)
    return ReceptiveField(tuple(size), strides, starts, grid, tuple(probe.shape[2:]), "analytic")


def _geometry(module: nn.Module, rank: int) -> tuple[tuple[int, ...], ...]:
    """``(kernel, stride, padding, dilation)`` of a convolution or pool, one value per axis."""

    def per_axis(value: Any) -> tuple[int, ...]:
        if isinstance(value, str):  # padding="same" or "valid"
            return (-1,) * rank
        return tuple(value) if isinstance(value, (tuple, list)) else (int(value),) * rank

    padding = per_axis(getattr(module, "padding", 0))
    kernel = per_axis(module.kernel_size)
    dilation = per_axis(getattr(module, "dilation", 1))
    if padding[0] == -1:  # "same" pads d (k - 1) / 2 on the left; "valid" pads nothing
        same = module.padding == "same"
        padding = tuple(
            d * (k - 1) // 2 if same else 0 for k, d in zip(kernel, dilation, strict=True)
        )
    stride = per_axis(module.stride if module.stride is not None else module.kernel_size)
    return kernel, stride, padding, dilation


def _measured(model: nn.Module, probe: torch.Tensor, layer: str) -> ReceptiveField:
    """The field of the grid's centre location, found by gradient (module docstring); the
    stride is how far the field moves to the next location.

    A field that covers the whole probe may only be larger than it (a deep CNN on a small
    input): it is measured again on a probe twice as large, and counts as seeing the whole
    input (stride 0: attention, global pooling) only if it covers that one too, or if the
    model takes no other size (a ViT with fixed position embeddings).
    """
    grid, extents, starts, steps = _measure(model, probe, layer)
    if 0.0 in steps:
        larger = probe.new_zeros(probe.shape[:2] + tuple(2 * side for side in probe.shape[2:]))
        try:
            larger.normal_(generator=torch.Generator(probe.device).manual_seed(1))
            _, extents, starts, steps = _measure(model, larger, layer)
        except (RuntimeError, ValueError, AssertionError, CamvizError):
            pass  # the model takes this size only: the field is the whole input
    size = tuple(probe.shape[2:])
    extents = [
        extent if step else whole for extent, step, whole in zip(extents, steps, size, strict=True)
    ]
    return ReceptiveField(tuple(extents), tuple(steps), tuple(starts), grid, size, "measured")


def _measure(
    model: nn.Module, probe: torch.Tensor, layer: str
) -> tuple[tuple[int, ...], list[int], list[float], list[float]]:
    """The grid, and per axis the centre's field size, first pixel of location 0 and stride
    (``0`` where the centre sees the whole axis)."""
    pixels = probe.clone().requires_grad_()
    size = tuple(probe.shape[2:])
    with torch.enable_grad():
        tensors, _ = outputs_at(model, pixels, [layer])
        grid_view = spatial_view(model, layer, tensors[layer], probe)
        grid = tuple(grid_view.shape[2:])
        centre = tuple(extent // 2 for extent in grid)
        bounds = _support(grid_view, pixels, centre, layer)
        extents: list[int] = []
        starts: list[float] = []
        steps: list[float] = []
        for axis, (first, last) in enumerate(bounds):
            if (first, last) == (0, size[axis] - 1):  # the whole axis, from every location
                extents.append(size[axis])
                starts.append(0.0)
                steps.append(0.0)
                continue
            step = 0.0
            if grid[axis] > 1:
                side = 1 if centre[axis] + 1 < grid[axis] else -1
                moved = list(centre)
                moved[axis] += side
                step = side * float(_support(grid_view, pixels, moved, layer)[axis][0] - first)
            extents.append(last - first + 1)
            starts.append(first - centre[axis] * step)
            steps.append(step)
    return grid, extents, starts, steps


def _support(
    grid_view: torch.Tensor, pixels: torch.Tensor, location: Sequence[int], layer: str
) -> list[tuple[int, int]]:
    """Per axis, the first and last input pixel on which ``location`` depends."""
    at: tuple[slice | int, ...] = (slice(None), slice(None), *location)
    value = grid_view[at].sum()
    if not value.requires_grad:
        raise CamvizError(f"layer {layer!r} does not depend on the input")
    (gradient,) = torch.autograd.grad(value, pixels, retain_graph=True)
    support = gradient.detach().abs().sum(dim=(0, 1)) > 0
    if not bool(support.any()):
        raise CamvizError(f"layer {layer!r} at {tuple(location)} does not depend on the input")
    bounds = []
    for axis in range(support.dim()):
        others = tuple(other for other in range(support.dim()) if other != axis)
        where = torch.nonzero(support.any(dim=others) if others else support).flatten()
        bounds.append((int(where[0]), int(where[-1])))
    return bounds
