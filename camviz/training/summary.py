"""The tracker's summary: every number over the steps, each step's change to the final map,
and the summary picture (the strip of overlays above the curves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from PIL import Image

from camviz.core.errors import CamvizError
from camviz.io.render import save
from camviz.training.change import correlation, top_overlap
from camviz.training.pictures import (
    StripCells,
    curves,
    figure_picture,
    probe_pictures,
    stacked,
    strip,
)
from camviz.training.record import Record

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["TrainingSummary", "summarize", "write_summary"]


@dataclass
class TrainingSummary:
    """What :meth:`camviz.Tracker.summary` gives.

    Attributes:
        steps: The ``S`` logged steps.
        numbers: ``{series: {name: (S, N) values}}``: the recorded numbers
            (:data:`~camviz.training.record.STATISTICS`) and the change of each step's map to
            the final one, ``corr_final`` and ``top15_final``; NaN where not defined.
        strip: The overlays over steps (Pillow).
        curves: The numbers over steps (a matplotlib ``Figure``).
        picture: The strip above the curves, as written to the summary's PNG.
    """

    steps: list[int]
    numbers: dict[str, dict[str, torch.Tensor]]
    strip: Image.Image
    curves: Figure
    picture: Image.Image

    def _repr_png_(self) -> bytes:
        """Shown inline in a notebook as its picture."""
        from io import BytesIO

        buffer = BytesIO()
        self.picture.save(buffer, format="PNG")
        return buffer.getvalue()


def summarize(history: Sequence[Record], images: torch.Tensor) -> TrainingSummary:
    """The summary of ``history`` on the probe batch ``images``.

    Raises:
        CamvizError: Nothing was recorded yet.
    """
    if not history:
        raise CamvizError(
            "the tracker has recorded no step yet; call tracker.step(model, step) during "
            "training (it explains the probes when step % every == 0)"
        )
    final = history[-1]
    numbers: dict[str, dict[str, torch.Tensor]] = {}
    for series, last in final.maps.items():
        tracked = [record.maps[series] for record in history]
        table = {
            name: torch.stack([entry.numbers[name] for entry in tracked]) for name in last.numbers
        }
        table["corr_final"] = torch.stack(
            [correlation(entry.heatmaps, last.heatmaps) for entry in tracked]
        )
        table["top15_final"] = torch.stack(
            [top_overlap(entry.heatmaps, last.heatmaps) for entry in tracked]
        )
        numbers[series] = table
    steps = [record.step for record in history]
    shown = strip(history, StripCells(probe_pictures(images)))
    figure = curves(steps, numbers)
    return TrainingSummary(
        steps=steps,
        numbers=numbers,
        strip=shown,
        curves=figure,
        picture=stacked(shown, figure_picture(figure)),
    )


def write_summary(summary: TrainingSummary, path: str | Path) -> Path:
    """Write the summary's picture to ``path`` (a ``.png``), atomically.

    Raises:
        CamvizError: ``path`` does not end in ``.png``, or cannot be written.
    """
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise CamvizError(f"the summary is written as PNG; give a path ending in .png, not {path}")
    return save(summary.picture, path)
