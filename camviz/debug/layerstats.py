"""Per-layer statistics of one forward pass, and the first layer that produced a NaN or Inf.

``camviz.inspect(model, x)`` attaches a forward hook to every layer, reduces each output to
a handful of numbers on the device where it was computed (mean, std, min, max, fraction of
zeros, NaN and Inf counts, and with ``backward=True`` the norm of the output's gradient),
and moves them to the CPU together, at the end. No activation is kept, so inspecting a large
model costs little more memory than running it.

Rows follow *call order*: the order in which layers finished. A container finishes after
its children, so ``layer1.0.conv1`` comes before ``layer1.0`` and ``layer1``; the first row
with a NaN is therefore the innermost layer that produced it.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.hooks import tensors_in
from camviz.core.inputs import call_model
from camviz.core.layers import Layer, resolve_layers
from camviz.core.modelstate import HookSet, eval_mode, no_grad
from camviz.core.precision import Precision, model_precision
from camviz.core.targets import Target, score_fns
from camviz.io.atomic import atomic_write
from camviz.io.csvfiles import write_csv

# The order of the numbers that tensor_stats returns.
STATISTICS = ("mean", "std", "min", "max", "zeros", "nans", "infs")


@dataclass(frozen=True)
class LayerRow:
    """The statistics of one layer's output in one call.

    ``mean``, ``std`` (with Bessel's correction, as ``torch.std``), ``min`` and ``max`` are
    taken over the finite values only, so that one Inf does not hide the range of the rest;
    NaN and Inf are counted separately. ``zeros`` is the fraction of values exactly zero.

    Attributes:
        name: The layer's name; a later call of a layer that runs several times in one pass
            is named ``"name#2"``, ``"name#3"`` and so on.
        type: The module's class name (``"Conv2d"``).
        shape: The output shape (of the first tensor, for outputs that hold several).
        grad_norm: The L2 norm of d(score)/d(output) over the batch, with ``backward=True``;
            ``None`` without a backward pass or when the score does not depend on the layer.
    """

    name: str
    type: str
    shape: tuple[int, ...]
    mean: float
    std: float
    min: float
    max: float
    zeros: float
    nans: int
    infs: int
    grad_norm: float | None = None

    @property
    def finite(self) -> bool:
        """Whether the output holds no NaN and no Inf."""
        return self.nans == 0 and self.infs == 0


def tensor_stats(tensor: torch.Tensor) -> torch.Tensor:
    """The :data:`STATISTICS` of ``tensor`` as one vector, on the tensor's device.

    The numbers stay on the tensor's device so that a whole model's statistics reach the
    CPU in one copy. Only one bit crosses per call: whether the mean is finite. A finite
    mean proves that no value is NaN or Inf, and then plain reductions suffice (mean, std,
    min and max, non-zeros); otherwise the statistics of the finite values are taken with
    masks. Half-precision values are reduced in float32 so that sums do not
    overflow; the vector is float64 (float32 on Apple's MPS, which has no float64) so that
    NaN and Inf counts stay exact.
    """
    values = tensor.detach()
    if values.is_complex():
        values = values.abs()
    if values.dtype != torch.float64:
        values = values.float()
    exact = torch.float32 if values.device.type == "mps" else torch.float64
    size = values.numel()
    if size == 0:
        return torch.full((len(STATISTICS),), math.nan, dtype=exact, device=values.device)
    zeros = (size - torch.count_nonzero(values)) / size
    mean = values.mean()
    if bool(mean.isfinite()):
        # torch.var_mean would fuse these, but on the CPU it is several times slower.
        # One value has no spread to estimate: NaN, as torch.std gives (without its warning).
        std = values.std() if size > 1 else torch.full_like(mean, math.nan)
        low, high = torch.aminmax(values)
        nans = infs = torch.zeros((), device=values.device)
    else:
        mean, std, low, high, nans, infs = _finite_stats(values)
    return torch.stack(
        [statistic.to(exact) for statistic in (mean, std, low, high, zeros, nans, infs)]
    )


def _finite_stats(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mean, std, min and max of the finite values, and the NaN and Inf counts."""
    finite = values.isfinite()
    count = finite.sum()
    nans = values.isnan().sum()
    infs = values.numel() - count - nans
    mean = torch.where(finite, values, 0).sum() / count
    std = (torch.where(finite, values - mean, 0).square().sum() / (count - 1)).sqrt()
    low = torch.where(finite, values, math.inf).amin()
    high = torch.where(finite, values, -math.inf).amax()
    low, high = (torch.where(count > 0, bound, math.nan) for bound in (low, high))
    return mean, std, low, high, nans, infs


class LayerTable:
    """The rows of :func:`inspect`, printable in a terminal and a notebook, exportable.

    ``table["layer1.0.conv1"]`` and ``table[0]`` give a :class:`LayerRow`; ``len``, ``iter``
    and ``.rows`` work as on a list.
    """

    def __init__(self, rows: Sequence[LayerRow]) -> None:
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[LayerRow]:
        return iter(self.rows)

    def __getitem__(self, key: int | str) -> LayerRow:
        if isinstance(key, int):
            return self.rows[key]
        for row in self.rows:
            if row.name == key:
                return row
        raise CamvizError(f"no row for layer {key!r} in the table; names are the layers' own")

    @property
    def has_gradients(self) -> bool:
        """Whether a backward pass filled the ``grad_norm`` column."""
        return any(row.grad_norm is not None for row in self.rows)

    def _columns(self) -> list[str]:
        names = [field.name for field in dataclasses.fields(LayerRow)]
        return names if self.has_gradients else names[:-1]

    def _cells(self, row: LayerRow) -> list[str]:
        cells = [row.name, row.type, "x".join(map(str, row.shape)) or "-"]
        cells += [f"{getattr(row, name):.4g}" for name in ("mean", "std", "min", "max")]
        cells += [f"{row.zeros:.1%}", str(row.nans), str(row.infs)]
        if self.has_gradients:
            cells.append("-" if row.grad_norm is None else f"{row.grad_norm:.4g}")
        return cells

    def __str__(self) -> str:
        header = [name.replace("_", " ") for name in self._columns()]
        lines = [header, *(self._cells(row) for row in self.rows)]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text_columns = 2  # name and type read left-aligned, numbers right-aligned

        def render(line: list[str]) -> str:
            return "  ".join(
                cell.ljust(width) if i < text_columns else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(line, widths, strict=True))
            ).rstrip()

        rule = "  ".join("-" * width for width in widths)
        return "\n".join([render(header), rule, *(render(line) for line in lines[1:])])

    def __repr__(self) -> str:
        return f"LayerTable({len(self.rows)} layers)"

    def _repr_html_(self) -> str:
        header = "".join(f"<th>{html.escape(name)}</th>" for name in self._columns())
        body = []
        for row in self.rows:
            style = "" if row.finite else ' style="background:#fdd"'
            cells = self._cells(row)
            tds = [f"<td style='text-align:left'>{html.escape(cell)}</td>" for cell in cells[:2]]
            tds += [f"<td style='text-align:right'>{html.escape(cell)}</td>" for cell in cells[2:]]
            body.append(f"<tr{style}>{''.join(tds)}</tr>")
        return f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(body)}</tbody></table>"

    def to_csv(self, path: str | Path) -> Path:
        """Write one line per row (shape as ``1x64x32x32``, NaN as ``nan``; cells made safe for
        spreadsheets, :mod:`camviz.io.csvfiles`); return the path."""
        columns = self._columns()
        lines = []
        for row in self.rows:
            values = dataclasses.asdict(row)
            values["shape"] = "x".join(map(str, row.shape))
            lines.append([values[name] for name in columns])
        return write_csv(path, columns, lines)

    def to_json(self, path: str | Path) -> Path:
        """Write a list of row objects; NaN (no finite values) becomes ``null``. Return the path."""
        rows = [
            {
                key: None if isinstance(value, float) and not math.isfinite(value) else value
                for key, value in dataclasses.asdict(row).items()
                if key in self._columns()
            }
            for row in self.rows
        ]
        # One row per line: diffable, and readable without a JSON viewer.
        lines = ",\n ".join(json.dumps(row) for row in rows)
        return _write_text(path, f"[{lines}]\n" if rows else "[]\n")


def inspect(
    model: nn.Module,
    inputs: Any,
    *,
    layers: Layer | Iterable[Layer] | None = None,
    backward: bool = False,
    target: Target = None,
    precision: Precision = "fp32",
    channels_last: bool = False,
) -> LayerTable:
    """Run the model once and tabulate every layer's output statistics, in call order.

    The model runs with every module in eval mode and is handed back as it came: same
    flags, no hooks, no ``.grad`` written (gradients are taken with ``torch.autograd.grad``).

    Args:
        model: Any ``nn.Module``.
        inputs: A tensor, a tuple of positional tensors or a dict of keyword tensors; moved
            to the model's device.
        layers: Names or patterns of the layers to tabulate; all submodules by default.
        backward: Also back-propagate the target score and report, per layer, the norm of
            its gradient with respect to the layer's output.
        target: The score for ``backward``, as in :func:`camviz.explain` (default: each
            sample's top-1 logit, summed over the batch).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the pass runs under
            ``torch.autocast`` to that dtype (statistics are reduced in float32); refused
            on hardware that only emulates it (see :mod:`camviz.core.precision`).
        channels_last: Hand the model a channels-last copy of its input.

    Returns:
        A :class:`LayerTable`.

    Example:
        >>> table = camviz.inspect(model, x, backward=True)
        >>> print(table); table.to_csv("layers.csv")
    """
    recorder = _Recorder(model, layers, gradients=backward)
    with model_precision(model, precision, channels_last), recorder, eval_mode(model):
        if not backward:
            with no_grad():
                call_model(model, inputs)
        else:
            with torch.enable_grad():
                leaves, model_inputs = _differentiable(model, inputs)
                output = call_model(model, model_inputs)
                fns, _ = score_fns(target, output)
                score = torch.stack([fn(output).sum() for fn in fns]).sum()
                if not score.requires_grad:
                    raise CamvizError(
                        "the score does not depend on anything differentiable; give a float "
                        "input or a model with trainable parameters"
                    )
                torch.autograd.grad(score, leaves, allow_unused=True)
    return LayerTable(recorder.rows())


@dataclass(frozen=True)
class NonFiniteReport:
    """Where NaN or Inf values first appeared in a forward pass, and what went in there.

    Attributes:
        layer: The statistics row of the first layer (in call order) whose output has NaN
            or Inf values.
        input: The statistics of that layer's (first tensor) input, or ``None`` when it took
            no tensor.
        parameters_finite: Whether the layer's own parameters are all finite.
        is_container: Whether the layer has submodules (whose outputs were all finite).
        previous: The layer that finished just before it, or ``None`` if it was the first.
    """

    layer: LayerRow
    input: LayerRow | None
    parameters_finite: bool
    is_container: bool
    previous: str | None

    @property
    def input_was_finite(self) -> bool:
        """Whether the layer's input was free of NaN and Inf (so the layer made them)."""
        return self.input is None or self.input.finite

    def __str__(self) -> str:
        row = self.layer
        found = (
            f"layer {row.name!r} ({row.type}) is the first to output NaN/Inf "
            f"({row.nans} NaN, {row.infs} Inf of {math.prod(row.shape)} values)"
        )
        if not self.input_was_finite:
            assert self.input is not None  # an input that is not finite was recorded
            source = (
                f"code that runs between {self.previous!r} and it (a functional call in a "
                "parent's forward, such as torch.log or a division)"
                if self.previous
                else "the model's input"
            )
            return (
                f"{found}, but its input already had {self.input.nans} NaN and "
                f"{self.input.infs} Inf: they came from {source}"
            )
        if not self.parameters_finite:
            return f"{found}; its input was finite, but its own parameters hold NaN/Inf"
        made_by = (
            "its own forward code (its submodules' outputs were finite)"
            if self.is_container
            else "the layer's own computation"
        )
        inputs = (
            f" (input min {self.input.min:.4g}, max {self.input.max:.4g})" if self.input else ""
        )
        return (
            f"{found}; its input was finite{inputs}, so {made_by} overflowed or was undefined "
            "(a large exp, a log or sqrt of a negative, a division by zero)"
        )


def find_first_nonfinite(
    model: nn.Module, inputs: Any, *, precision: Precision = "fp32", channels_last: bool = False
) -> NonFiniteReport | None:
    """Name the first layer, in call order, whose output holds a NaN or an Inf.

    One forward pass under ``torch.no_grad()``, every module in eval mode; the model comes
    back as it was. Because containers finish after their children, the layer named is the
    innermost one where the values went bad.

    Args:
        model: Any ``nn.Module``.
        inputs: A tensor, a tuple of positional tensors or a dict of keyword tensors.
        precision, channels_last: As in :func:`inspect` (fp16 overflows where fp32 does not:
            pass the precision under which the NaN appeared).

    Returns:
        A :class:`NonFiniteReport` (``print`` it for a one-paragraph diagnosis), or ``None``
        when every output is finite.

    Example:
        >>> report = camviz.find_first_nonfinite(model, x)
        >>> print(report or "all finite")
    """
    recorder = _Recorder(model, None, gradients=False, inputs=True)
    with (
        model_precision(model, precision, channels_last),
        recorder,
        eval_mode(model),
        no_grad(),
    ):
        call_model(model, inputs)
    rows = recorder.rows()
    for index, row in enumerate(rows):
        if row.finite:
            continue
        module = recorder.calls[index].module
        return NonFiniteReport(
            layer=row,
            input=recorder.input_rows()[index],
            parameters_finite=all(
                bool(torch.isfinite(parameter).all())
                for parameter in module.parameters(recurse=False)
            ),
            is_container=next(module.children(), None) is not None,
            previous=rows[index - 1].name if index else None,
        )
    return None


@dataclass
class _Call:
    """What the hooks saw in one call of one layer; the numbers stay on the device."""

    name: str
    module: nn.Module
    shape: tuple[int, ...] = ()
    stats: torch.Tensor | None = None
    input_shape: tuple[int, ...] = ()
    input_stats: torch.Tensor | None = None
    grad_norm: torch.Tensor | None = None


class _Recorder(HookSet):
    """Forward (and forward-pre) hooks that reduce every call of the chosen layers to stats."""

    def __init__(
        self,
        model: nn.Module,
        layers: Layer | Iterable[Layer] | None,
        *,
        gradients: bool,
        inputs: bool = False,
    ) -> None:
        super().__init__()
        if layers is None:
            modules = {name: module for name, module in model.named_modules() if name}
        else:
            modules = resolve_layers(model, layers)
        self.modules = modules
        self.gradients = gradients
        self.inputs = inputs
        self.calls: list[_Call] = []
        self._running: dict[int, list[_Call]] = {}
        self._call_counts: dict[str, int] = {}

    def __enter__(self) -> _Recorder:
        for name, module in self.modules.items():
            self.add(module.register_forward_pre_hook(partial(self._on_input, name)))
            self.add(module.register_forward_hook(partial(self._on_output, name)))
        return self

    def _on_input(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        count = self._call_counts[name] = self._call_counts.get(name, 0) + 1
        call = _Call(name if count == 1 else f"{name}#{count}", module)
        if self.inputs:
            tensor = next(tensors_in(args), None)
            if tensor is not None:
                # Taken now: an in-place layer (ReLU(inplace=True)) overwrites its input.
                call.input_shape, call.input_stats = tuple(tensor.shape), tensor_stats(tensor)
        self._running.setdefault(id(module), []).append(call)

    def _on_output(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        call = self._running[id(module)].pop()
        tensor = next(tensors_in(output), None)
        if tensor is not None:
            call.shape, call.stats = tuple(tensor.shape), tensor_stats(tensor)
            if self.gradients and tensor.requires_grad:
                tensor.register_hook(partial(self._on_gradient, call))
        self.calls.append(call)

    @staticmethod
    def _on_gradient(call: _Call, gradient: torch.Tensor) -> None:
        call.grad_norm = torch.linalg.vector_norm(gradient.detach(), dtype=torch.float32)

    def rows(self) -> list[LayerRow]:
        """One row per finished call, after one transfer of all numbers to the CPU."""
        stats = _to_cpu([call.stats for call in self.calls], len(STATISTICS))
        norms = _to_cpu([call.grad_norm for call in self.calls], 0)
        return [
            _row(call.name, type(call.module).__name__, call.shape, values, norm)
            for call, values, norm in zip(self.calls, stats, norms, strict=True)
        ]

    def input_rows(self) -> list[LayerRow | None]:
        """The statistics of each call's input (``None`` where it took no tensor)."""
        stats = _to_cpu([call.input_stats for call in self.calls], len(STATISTICS))
        return [
            None
            if call.input_stats is None
            else _row(f"{call.name} (input)", "input", call.input_shape, values, None)
            for call, values in zip(self.calls, stats, strict=True)
        ]


def _to_cpu(tensors: Sequence[torch.Tensor | None], size: int) -> list[Any]:
    """Stack device tensors and copy them to the CPU in one transfer; ``None`` stays ``None``."""
    present = [tensor for tensor in tensors if tensor is not None]
    if not present:
        return [None] * len(tensors)
    device = present[0].device
    values = iter(torch.stack([tensor.to(device) for tensor in present]).cpu().tolist())
    return [None if tensor is None else next(values) for tensor in tensors]


def _row(
    name: str, kind: str, shape: tuple[int, ...], stats: list[float] | None, norm: float | None
) -> LayerRow:
    mean, std, low, high, zeros, nans, infs = stats or [math.nan] * 5 + [0, 0]
    return LayerRow(
        name, kind, shape, mean, std, low, high, zeros, int(nans), int(infs), grad_norm=norm
    )


def _differentiable(model: nn.Module, inputs: Any) -> tuple[list[torch.Tensor], Any]:
    """Leaves for ``autograd.grad``: float inputs made to require grad, else the parameters.

    Differentiating with respect to the input walks the whole graph, so every output's
    gradient hook fires, without computing any parameter gradient.
    """

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().requires_grad_(True)
        return value

    if isinstance(inputs, dict):
        model_inputs: Any = {key: leaf(value) for key, value in inputs.items()}
        candidates = list(model_inputs.values())
    elif isinstance(inputs, (tuple, list)):
        model_inputs = type(inputs)(leaf(value) for value in inputs)
        candidates = list(model_inputs)
    else:
        model_inputs = leaf(inputs)
        candidates = [model_inputs]
    leaves = [value for value in candidates if isinstance(value, torch.Tensor)]
    leaves = [value for value in leaves if value.requires_grad]
    if not leaves:
        leaves = [parameter for parameter in model.parameters() if parameter.requires_grad]
    return leaves, model_inputs


def _write_text(path: str | Path, text: str) -> Path:
    with atomic_write(path, "w") as file:
        file.write(text)
    return Path(path)
