"""Where the engine finds :class:`~camviz.core.grids.NoPatchGridError`: layer layouts and
token grids live in :mod:`camviz.core.grids` (moved to ``core`` so that a
:class:`~camviz.Unit` target reads token grids as the methods do)."""

from __future__ import annotations

from camviz.core.grids import NoPatchGridError

__all__ = ["NoPatchGridError"]
