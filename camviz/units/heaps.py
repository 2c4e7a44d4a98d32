"""The k best images of many units, kept in bounded memory: one heap per unit.

A scan hands :meth:`TopHeaps.add` each batch's ``(B, U)`` values (one per image and unit)
and the grid locations where they were reached; only values above a unit's current k-th
best leave the device, so a batch costs one comparison and a few pushes. Ties go to the
image scanned first (the lower position, when merging shards), as a stable sort of
everything would give them, and
an image enters a unit's heap at most once, so a batch scanned again after a crash changes
nothing. Heaps of the shards of a distributed run merge into the heaps of the whole run.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Example", "TopHeaps"]


@dataclass(frozen=True)
class Example:
    """One of a unit's top images.

    Attributes:
        index: The image's position in the scanned source (a folder's sorted files, a
            ``Dataset``'s items).
        value: The unit's statistic on the image (its maximum or mean over the grid, or the
            neuron's value).
        location: The grid index where the unit is highest in that image (the neuron's own
            index for a neuron).
        path: The image file, when the source was files.
    """

    index: int
    value: float
    location: tuple[int, ...]
    path: str | None = None


# A heap entry: (value, -index, location). The smallest is the k-th best: lowest value,
# and among equal values the latest image.
_Entry = tuple[float, int, tuple[int, ...]]


class TopHeaps:
    """The ``k`` highest values (and where) of each of ``units`` units over the images seen.

    Args:
        units: How many units are ranked.
        k: How many images each keeps.
    """

    def __init__(self, units: int, k: int) -> None:
        self.k = k
        self.heaps: list[list[_Entry]] = [[] for _ in range(units)]
        self.members: list[set[int]] = [set() for _ in range(units)]
        self._floor = torch.full((units,), -torch.inf, dtype=torch.float64)

    def add(self, values: torch.Tensor, locations: torch.Tensor, indices: Sequence[int]) -> None:
        """Offer a batch: ``values`` ``(B, U)``, ``locations`` ``(B, U, D)`` grid indices,
        ``indices`` the images' positions in the source."""
        above = values.double() > self._floor.to(values.device)
        rows, units = torch.nonzero(above, as_tuple=True)
        if not len(rows):
            return
        offered = values[rows, units].double().cpu().tolist()
        places = locations[rows, units].cpu().tolist()
        touched = set()
        for row, unit, value, place in zip(
            rows.tolist(), units.tolist(), offered, places, strict=True
        ):
            self._push(unit, (value, -indices[row], tuple(place)))
            touched.add(unit)
        for unit in touched:
            self._settle(unit)

    def _settle(self, unit: int) -> None:
        """Raise the unit's floor to its k-th best, once it holds k images."""
        if len(self.heaps[unit]) == self.k:
            self._floor[unit] = self.heaps[unit][0][0]

    def _push(self, unit: int, entry: _Entry) -> None:
        index = -entry[1]
        heap, members = self.heaps[unit], self.members[unit]
        if index in members:
            return
        if len(heap) < self.k:
            heapq.heappush(heap, entry)
            members.add(index)
        elif entry[:2] > heap[0][:2]:
            members.discard(-heapq.heapreplace(heap, entry)[1])
            members.add(index)

    def merge(self, other: TopHeaps) -> None:
        """Add the kept images of ``other`` (another shard's heaps for the same units)."""
        for unit, heap in enumerate(other.heaps):
            for entry in heap:
                self._push(unit, entry)
            self._settle(unit)

    def best(self, paths: Sequence[str] | None = None) -> list[list[Example]]:
        """Each unit's kept images, best first (``paths[index]`` names their files)."""
        return [
            [
                Example(-negated, value, location, None if paths is None else paths[-negated])
                for value, negated, location in sorted(heap, reverse=True)
            ]
            for heap in self.heaps
        ]

    def state(self) -> dict[str, Any]:
        """The heaps as JSON-ready data (for a resumed or distributed run)."""
        heaps = [
            [[value, negated, list(place)] for value, negated, place in heap] for heap in self.heaps
        ]
        return {"k": self.k, "heaps": heaps}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TopHeaps:
        """Heaps written by :meth:`state`."""
        heaps = cls(len(state["heaps"]), int(state["k"]))
        for unit, entries in enumerate(state["heaps"]):
            for value, negated, location in entries:
                heaps._push(unit, (float(value), int(negated), tuple(location)))
            heaps._settle(unit)
        return heaps
