"""Colour maps as look-up tables, applied with torch on any device; matplotlib only on demand.

A matplotlib colour map with ``N`` colours maps a value ``x`` in ``[0, 1]`` to colour
``min(floor(x * N), N - 1)``. The same table and the same rule give the same colours,
exactly, without matplotlib: the tables of the usual maps ship in ``colormaps.npz``
(written once from matplotlib 3.11 by :func:`write_shipped`), so drawing overlays and
panels never imports matplotlib (about 2 s, and a global font cache). Any other matplotlib
name or ``Colormap`` object is turned into a table through matplotlib, once per name.
"""

from __future__ import annotations

import difflib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from camviz.core.errors import CamvizError

if TYPE_CHECKING:
    from matplotlib.colors import Colormap

#: The shipped tables, ``{name: (N, 3) uint8}``.
SHIPPED = Path(__file__).with_name("colormaps.npz")

#: The colour maps whose tables ship with camviz.
SHIPPED_NAMES = (
    "jet",
    "turbo",
    "viridis",
    "plasma",
    "inferno",
    "magma",
    "cividis",
    "gray",
    "hot",
    "coolwarm",
    "RdBu_r",
    "bwr",
)

_TABLES: dict[str, torch.Tensor] = {}
_LOCK = threading.Lock()  # writer threads ask for tables concurrently


def lookup_table(colormap: str | Colormap) -> torch.Tensor:
    """The ``(N, 3)`` uint8 CPU table of a colour map name or matplotlib ``Colormap``.

    Raises:
        CamvizError: An unknown colour map name.
    """
    if not isinstance(colormap, str):
        return _table_of(colormap)
    with _LOCK:
        if not _TABLES:
            with np.load(SHIPPED) as shipped:
                _TABLES.update({name: torch.from_numpy(shipped[name]) for name in shipped.files})
        if colormap not in _TABLES:
            _TABLES[colormap] = _table_of(matplotlib_colormap(colormap))
        return _TABLES[colormap]


def apply(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``(...)`` values in ``[0, 1]`` to ``(..., 3)`` uint8 colours, on ``values``' device."""
    size = table.shape[0]
    index = (values.float() * size).long().clamp_(0, size - 1)
    # index_select on the flat index: several times faster than table[index] on a CPU.
    colours = table.to(values.device).index_select(0, index.flatten())
    return colours.view(*values.shape, 3)


def matplotlib_colormap(colormap: str | Colormap) -> Colormap:
    """The matplotlib ``Colormap`` of a name (or the object itself), imported on demand.

    Raises:
        CamvizError: An unknown name, with the closest known ones.
    """
    import matplotlib
    from matplotlib.colors import Colormap

    if isinstance(colormap, Colormap):
        return colormap
    try:
        return matplotlib.colormaps[colormap]
    except KeyError:
        close = difflib.get_close_matches(str(colormap), list(matplotlib.colormaps), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CamvizError(
            f"unknown colour map {colormap!r}; {hint}any matplotlib name works, e.g. jet, "
            "viridis, inferno, turbo, gray"
        ) from None


def write_shipped(path: Path = SHIPPED) -> None:
    """Write the tables of :data:`SHIPPED_NAMES` from matplotlib (run once, by hand)."""
    tables = {name: _table_of(matplotlib_colormap(name)).numpy() for name in SHIPPED_NAMES}
    np.savez_compressed(path, **tables)  # type: ignore[arg-type]


def _table_of(colormap: Colormap) -> torch.Tensor:
    colours = colormap(np.arange(colormap.N), bytes=True)[:, :3]
    return torch.from_numpy(np.ascontiguousarray(colours))
