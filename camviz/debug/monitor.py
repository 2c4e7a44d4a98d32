"""Watch gradient norms over many training steps, with bounded memory and threshold flags.

:class:`GradientMonitor` stays attached while a model trains and records, per step:

* **layer gradients** - the L2 norm of d(loss)/d(output) of each named layer, from a hook on
  each output tensor (registered by a forward hook, so it fires with the gradient of the
  value the layer produced, even if a later in-place operation overwrites it);
* **parameter gradients** - ``p.grad.norm()`` of each trainable parameter, read by a hook
  that fires when backward has accumulated ``p.grad`` (so ``optimizer.zero_grad()`` before
  ``mon.step()`` loses nothing, and the norm is the one before any gradient clipping);
* **watched tensors** - d(loss)/d(t) for any non-leaf tensor ``t`` given to :meth:`watch`.

What counts as a step: everything between two calls of :meth:`GradientMonitor.step`. Pass
``optimizer=`` and every ``optimizer.step()`` ends a step by itself. Gradients of several
backward passes in one step (gradient accumulation) combine: a layer's norms add up as the
norm of all its gradients together, a parameter's is that of its accumulated ``.grad``.

Norms stay on the device until the step ends; then one transfer moves the step's row to a
ring buffer of ``history`` rows on the CPU, so memory does not grow with training time.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.hooks import tensors_in
from camviz.core.layers import Layer, resolve_layers
from camviz.core.modelstate import HookSet

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Source = Literal["layer", "param", "tensor"]
FlagKind = Literal["vanishing", "exploding", "nonfinite"]

_TITLES = {
    "layer": "layer output gradients",
    "param": "parameter gradients",
    "tensor": "watched tensor gradients",
}
# More lines than this make a legend that hides the plot.
_MAX_LEGEND = 12


class GradientWarning(UserWarning):
    """A gradient norm crossed a threshold of a :class:`GradientMonitor`."""


@dataclass(frozen=True)
class GradientFlag:
    """One norm outside the monitor's thresholds.

    Attributes:
        step: The step number (0 for the first recorded step).
        kind: ``"vanishing"`` (below ``vanishing``), ``"exploding"`` (above ``exploding``)
            or ``"nonfinite"`` (NaN or Inf).
        source: ``"layer"``, ``"param"`` or ``"tensor"``.
        name: The layer, parameter or watched tensor.
        norm: The recorded norm.
    """

    step: int
    kind: FlagKind
    source: Source
    name: str
    norm: float


@dataclass(frozen=True)
class GradientHistory:
    """The recorded norms of the last ``history`` steps, oldest first, as CPU tensors.

    A norm is NaN in a step where no gradient reached that layer, parameter or tensor.

    Attributes:
        steps: ``(S,)`` step numbers.
        layers: ``{layer name: (S,) norms of d(loss)/d(output)}``.
        params: ``{parameter name: (S,) norms of p.grad}``.
        tensors: ``{watched name: (S,) norms}``.
    """

    steps: torch.Tensor
    layers: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor]


_NAMED_IN_WARNING = 3


class GradientMonitor:
    """Record per-step gradient norms of layers, parameters and tensors while a model trains.

    Args:
        model: The model being trained. Its hooks come off when the block ends; nothing else
            about it is changed.
        layers: Names or patterns of layers whose output gradients to record; ``None`` for
            none.
        params: Record the gradient norm of every parameter that requires grad.
        optimizer: If given, each ``optimizer.step()`` ends a monitor step; otherwise call
            :meth:`step` once per training step.
        vanishing: A norm below this is flagged as vanishing.
        exploding: A norm above this is flagged as exploding.
        history: How many of the latest steps are kept.

    Example:
        >>> with camviz.GradientMonitor(model, layers="layer*", optimizer=opt) as mon:
        ...     for x, y in loader:
        ...         opt.zero_grad()
        ...         loss_fn(model(x), y).backward()
        ...         opt.step()
        >>> mon.plot(); mon.flags[:3]
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Layer | Iterable[Layer] | None = None,
        params: bool = True,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        vanishing: float = 1e-7,
        exploding: float = 1e3,
        history: int = 1000,
    ) -> None:
        if history < 1:
            raise CamvizError(f"history must be at least 1 step, got {history}")
        if not 0 <= vanishing < exploding:
            raise CamvizError(
                f"thresholds must satisfy 0 <= vanishing < exploding, got vanishing="
                f"{vanishing}, exploding={exploding}"
            )
        self.model = model
        self.optimizer = optimizer
        self.vanishing = vanishing
        self.exploding = exploding
        self.capacity = history
        self._layers = {} if layers is None else resolve_layers(model, layers)
        self._params = (
            {name: p for name, p in model.named_parameters() if p.requires_grad} if params else {}
        )
        series: list[tuple[Source, str]] = [("layer", name) for name in self._layers]
        series += [("param", name) for name in self._params]
        self._columns: dict[tuple[Source, str], int] = {key: i for i, key in enumerate(series)}
        self._norms = torch.full((history, len(self._columns)), math.nan)
        self._present = torch.zeros((history, len(self._columns)), dtype=torch.bool)
        self._steps = torch.full((history,), -1, dtype=torch.long)
        self._count = 0
        self._pending: dict[int, torch.Tensor] = {}
        self._warned: set[tuple[FlagKind, int]] = set()
        self._hooks = HookSet()
        self._watches = HookSet()
        self._active = False
        self.last_gradients: dict[str, torch.Tensor] = {}
        """``{watched name: the latest gradient}``, detached copies."""

    # -- attaching -------------------------------------------------------------------------

    def __enter__(self) -> GradientMonitor:
        if self._active:
            raise CamvizError("this GradientMonitor is already active; use it in one block")
        try:
            for name, module in self._layers.items():
                column = self._columns["layer", name]
                self._hooks.add(module.register_forward_hook(partial(self._on_output, column)))
            for name, parameter in self._params.items():
                column = self._columns["param", name]
                hook = partial(self._on_param_gradient, column)
                self._hooks.add(parameter.register_post_accumulate_grad_hook(hook))
            if self.optimizer is not None:
                self._hooks.add(self.optimizer.register_step_post_hook(self._on_optimizer_step))
        except BaseException:
            self._hooks.remove()
            raise
        self._active = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._active = False
        self._hooks.remove()
        self._watches.remove()
        if self._pending:
            self._record_step()

    def watch(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Record d(loss)/d(tensor) for a non-leaf tensor of this step's graph.

        The gradient's norm goes into the history under ``name`` (``history.tensors``) and
        the gradient itself into ``last_gradients[name]``. The hook holds until the next
        :meth:`step` or the end of the block, so call ``watch`` again on the next step's
        tensor.

        Args:
            tensor: A tensor that requires grad, typically an intermediate result such as
                ``a`` in ``a = x + y; c = a * z``.
            name: The name to record it under.

        Returns:
            ``tensor``, so that ``a = mon.watch(x + y, "a")`` reads naturally.
        """
        if not self._active:
            raise CamvizError("watch() works inside the monitor's with-block only")
        if not isinstance(tensor, torch.Tensor) or not tensor.requires_grad:
            raise CamvizError(
                f"cannot watch {name!r}: it is not a tensor that requires grad (was it made "
                "under torch.no_grad(), or from inputs that need no gradient?)"
            )
        column = self._column("tensor", name)
        self._watches.add(tensor.register_hook(partial(self._on_tensor_gradient, name, column)))
        return tensor

    # -- what the hooks record -------------------------------------------------------------

    def _on_output(self, column: int, module: nn.Module, args: Any, output: Any) -> None:
        if not self._active:
            return
        for tensor in tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(partial(self._on_layer_gradient, column))

    def _on_layer_gradient(self, column: int, gradient: torch.Tensor) -> None:
        # A tensor hook lives as long as its graph; one from inside the block may fire later.
        if self._active:
            self._add(column, _norm(gradient))

    def _on_param_gradient(self, column: int, parameter: torch.Tensor) -> None:
        if parameter.grad is not None:
            self._pending[column] = _norm(parameter.grad)

    def _on_tensor_gradient(self, name: str, column: int, gradient: torch.Tensor) -> None:
        self.last_gradients[name] = gradient.detach().clone()
        self._add(column, _norm(gradient))

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step()

    def _add(self, column: int, norm: torch.Tensor) -> None:
        """Combine with what this step already has: the norm of all the gradients together."""
        previous = self._pending.get(column)
        self._pending[column] = norm if previous is None else torch.hypot(previous, norm)

    # -- steps -----------------------------------------------------------------------------

    def step(self) -> None:
        """End the current step: record its norms, flag and warn, drop this step's watches.

        Call it once per training step, after ``optimizer.step()`` (or pass ``optimizer=``
        to the monitor and never call it).
        """
        if not self._active:
            raise CamvizError("step() works inside the monitor's with-block only")
        self._record_step()
        self._watches.remove()

    def _record_step(self) -> None:
        row = torch.full((len(self._columns),), math.nan)
        present = torch.zeros(len(self._columns), dtype=torch.bool)
        if self._pending:
            columns = list(self._pending)
            device = next(iter(self._pending.values())).device
            values = torch.stack([norm.to(device) for norm in self._pending.values()])
            row[columns] = values.cpu()  # the one transfer per step
            present[columns] = True
        self._pending.clear()
        slot = self._count % self.capacity
        self._norms[slot], self._present[slot], self._steps[slot] = row, present, self._count
        self._warn(self._count, row, present)
        self._count += 1

    def _warn(self, step: int, row: torch.Tensor, present: torch.Tensor) -> None:
        """One warning per kind and step, naming the series flagged for the first time.

        A diverging step flags every parameter at once; one line per parameter would bury
        the message, so the first few are named and the rest counted.
        """
        names = self._names()
        for kind, hits in _classify(row, present, self.vanishing, self.exploding).items():
            new = [c for c in hits.nonzero().flatten().tolist() if (kind, c) not in self._warned]
            if not new:
                continue
            self._warned.update((kind, column) for column in new)
            named = ", ".join(
                f"{names[column][0]} {names[column][1]!r} is {float(row[column]):.4g}"
                for column in new[:_NAMED_IN_WARNING]
            )
            more = len(new) - _NAMED_IN_WARNING
            warnings.warn(
                f"step {step}: gradient norms {_describe(kind, self)}: {named}"
                + (f" and {more} more" if more > 0 else "")
                + " (each series is warned about once per kind; GradientMonitor.flags lists "
                "every step)",
                GradientWarning,
                stacklevel=4,  # the caller of step()
            )

    # -- results ---------------------------------------------------------------------------

    @property
    def steps_recorded(self) -> int:
        """How many steps were recorded in all (the history keeps the last ``history``)."""
        return self._count

    @property
    def history(self) -> GradientHistory:
        """The kept steps' norms, oldest first (copies)."""
        order = self._order()
        norms = self._norms[order]
        by_source: dict[Source, dict[str, torch.Tensor]] = {"layer": {}, "param": {}, "tensor": {}}
        for (source, name), column in self._columns.items():
            by_source[source][name] = norms[:, column].clone()
        return GradientHistory(
            steps=self._steps[order].clone(),
            layers=by_source["layer"],
            params=by_source["param"],
            tensors=by_source["tensor"],
        )

    @property
    def flags(self) -> list[GradientFlag]:
        """Every norm of the kept steps outside the thresholds, by step, then by column."""
        order = self._order()
        norms, present, steps = self._norms[order], self._present[order], self._steps[order]
        names = self._names()
        found = []
        for kind, hits in _classify(norms, present, self.vanishing, self.exploding).items():
            for row, column in hits.nonzero().tolist():
                source, name = names[column]
                norm = float(norms[row, column])
                found.append(GradientFlag(int(steps[row]), kind, source, name, norm))
        return sorted(found, key=lambda flag: (flag.step, self._columns[flag.source, flag.name]))

    def plot(self, sources: Sequence[Source] | None = None) -> Figure:
        """Norms over steps, one line per layer, parameter or tensor, on a log scale.

        Args:
            sources: Which panels to draw, among ``"layer"``, ``"param"`` and ``"tensor"``;
                by default every kind that has something recorded. Thresholds near the
                recorded norms are drawn as dashed lines.

        Returns:
            A matplotlib ``Figure`` (one panel per source), not registered with pyplot.
        """
        # Only plotting needs matplotlib.
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        history = self.history
        series: dict[Source, dict[str, torch.Tensor]] = {
            "layer": history.layers,
            "param": history.params,
            "tensor": history.tensors,
        }
        if sources is None:
            sources = [source for source, named in series.items() if named] or ["layer"]
        unknown = [source for source in sources if source not in series]
        if unknown:
            raise CamvizError(f"sources must be among layer, param, tensor; got {unknown}")
        figure = Figure(figsize=(8, 3 * len(sources)), layout="constrained")
        axes = figure.subplots(len(sources), 1, squeeze=False, sharex=True)[:, 0]
        steps = history.steps.numpy()
        for ax, source in zip(axes, sources, strict=True):
            for name, norms in series[source].items():
                ax.plot(steps, norms.numpy(), label=name, linewidth=1)
            ax.set_yscale("log")
            low, high = ax.get_ylim()
            for threshold in (self.vanishing, self.exploding):
                # A threshold decades away from the data would squash the lines flat.
                if low / 10 <= threshold <= high * 10:
                    ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8)
            ax.set_title(f"{_TITLES[source]} ({len(series[source])})", fontsize=10)
            ax.set_ylabel("L2 norm")
            if 0 < len(series[source]) <= _MAX_LEGEND:
                ax.legend(fontsize=7, loc="best")
        axes[-1].set_xlabel("step")
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
        return figure

    def __repr__(self) -> str:
        return (
            f"GradientMonitor({len(self._layers)} layers, {len(self._params)} params, "
            f"{self._count} steps recorded, {'active' if self._active else 'detached'})"
        )

    # -- storage ---------------------------------------------------------------------------

    def _column(self, source: Source, name: str) -> int:
        """The history column of a series, adding one (NaN so far) for a new name."""
        key = (source, name)
        if key not in self._columns:
            self._columns[key] = len(self._columns)
            self._norms = torch.cat([self._norms, torch.full((self.capacity, 1), math.nan)], 1)
            absent = torch.zeros((self.capacity, 1), dtype=torch.bool)
            self._present = torch.cat([self._present, absent], 1)
        return self._columns[key]

    def _names(self) -> list[tuple[Source, str]]:
        return list(self._columns)  # dicts keep insertion order, which is column order

    def _order(self) -> torch.Tensor:
        """Ring-buffer slots of the kept steps, oldest first."""
        kept = min(self._count, self.capacity)
        return (torch.arange(kept) + self._count - kept) % self.capacity


def _norm(gradient: torch.Tensor) -> torch.Tensor:
    """The L2 norm, in float32 so that half-precision gradients do not overflow."""
    return torch.linalg.vector_norm(gradient.detach(), dtype=torch.float32)


def _classify(
    norms: torch.Tensor, present: torch.Tensor, vanishing: float, exploding: float
) -> dict[FlagKind, torch.Tensor]:
    finite = present & norms.isfinite()
    return {
        "nonfinite": present & ~norms.isfinite(),
        "vanishing": finite & (norms < vanishing),
        "exploding": finite & (norms > exploding),
    }


def _describe(kind: FlagKind, monitor: GradientMonitor) -> str:
    if kind == "vanishing":
        return f"vanishing (below {monitor.vanishing:g})"
    if kind == "exploding":
        return f"exploding (above {monitor.exploding:g})"
    return "not finite"
