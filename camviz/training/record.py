"""What the tracker keeps of one step: each method's maps at each layer, and their numbers.

A :class:`Record` holds one :class:`TrackedMaps` per *series*, a method at a layer, keyed
``"{method}/{layer}"`` (the key the loggers put under ``camviz/``). Its numbers, one per probe
image (:data:`STATISTICS`), are NaN where they are not defined: a change from the previous
step at the first step, a correlation with a constant map. Records turn into plain
dictionaries of tensors, numbers and strings (:meth:`Record.state`), which a checkpoint
holds and ``torch.load(..., weights_only=True)`` reads back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LOGGED", "STATISTICS", "Record", "TrackedMaps"]

#: The numbers of each probe at each step: the explained score (logit), the change of the
#: map from the previous logged step and from the first (correlation, top-15 % overlap),
#: and the share of the map inside the probe's mask or box (only with masks or boxes).
STATISTICS = ("score", "corr_prev", "corr_first", "top15_prev", "top15_first", "inside")

#: The numbers logged as scalars to TensorBoard and W&B, ``camviz/{series}/probe{i}/{name}``.
LOGGED = ("score", "corr_prev", "corr_first", "top15_prev", "inside")


@dataclass(frozen=True)
class TrackedMaps:
    """One method's maps of the probe batch at one layer and step.

    Attributes:
        method: The method's registry name.
        layer: The layer as given (a name), or the layer spot(s) ``camviz.explain`` chose.
        heatmaps: ``(N, H, W)`` maps at the probe images' size, as ``camviz.explain`` gives
            them (on the CPU).
        targets: ``(N,)`` the explained class of each probe (``-1`` for a callable).
        numbers: ``{statistic: (N,) float}`` for the names of :data:`STATISTICS` that apply.
    """

    method: str
    layer: str
    heatmaps: torch.Tensor
    targets: torch.Tensor
    numbers: dict[str, torch.Tensor]

    @property
    def series(self) -> str:
        """``"{method}/{layer}"``."""
        return f"{self.method}/{self.layer}"


@dataclass(frozen=True)
class Record:
    """What one step gave: :class:`TrackedMaps` by series (``"{method}/{layer}"``)."""

    step: int
    maps: dict[str, TrackedMaps]

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready row per series and probe, with every number (``None`` for NaN)."""
        rows = []
        for tracked in self.maps.values():
            for probe in range(len(tracked.targets)):
                row: dict[str, Any] = {
                    "step": self.step,
                    "method": tracked.method,
                    "layer": tracked.layer,
                    "probe": probe,
                    "target": int(tracked.targets[probe]),
                }
                for name, values in tracked.numbers.items():
                    value = float(values[probe])
                    row[name] = value if math.isfinite(value) else None
                rows.append(row)
        return rows

    def state(self) -> dict[str, Any]:
        """The record as plain containers of tensors, numbers and strings."""
        return {
            "step": self.step,
            "maps": [
                {
                    "method": tracked.method,
                    "layer": tracked.layer,
                    "heatmaps": tracked.heatmaps,
                    "targets": tracked.targets,
                    "numbers": dict(tracked.numbers),
                }
                for tracked in self.maps.values()
            ],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Record:
        """The record that :meth:`state` describes."""
        maps = [TrackedMaps(**entry) for entry in state["maps"]]
        return cls(step=int(state["step"]), maps={tracked.series: tracked for tracked in maps})
