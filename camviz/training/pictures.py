"""The tracker's pictures: each probe's overlay, the strip of overlays over steps, the curves.

Overlays and the strip are drawn with Pillow and :func:`camviz.render.overlay` (no
matplotlib: they are drawn at every logged step, on the background writer); the curves are
a :class:`matplotlib.figure.Figure`, built without ``pyplot``, for :meth:`Tracker.summary`.

Probe images are tensors as the model takes them. One whose values lie in ``[0, 1]`` is
shown as it is; any other (normalised with a mean and standard deviation) is stretched to
its own minimum and maximum, so that it can be seen at all. One channel is shown in grey,
three as RGB, any other number as the grey mean of its channels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from camviz.io.render import overlay
from camviz.training.record import Record

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "STEP_CELL",
    "STRIP_COLUMNS",
    "SUMMARY_CELL",
    "StripCells",
    "curves",
    "figure_picture",
    "overlays",
    "probe_pictures",
    "stacked",
    "strip",
]

#: The most steps the strip shows: the first, the last and evenly spaced ones between.
STRIP_COLUMNS = 10

#: The height of the strip's cells, in pixels (tiny probes are enlarged, large ones reduced):
#: for the summary, and for the strip logged at every step (smaller: it is encoded each time).
SUMMARY_CELL, STEP_CELL = 96, 64

# The gap between cells and the caption size, in pixels.
_GAP = 6
_CAPTION = 12
_LABEL_WIDTH = 60

# The panels of the curves and the numbers each shows.
_PANELS = (
    ("score", ("score",)),
    ("map correlation", ("corr_prev", "corr_first", "corr_final")),
    ("top-15 % overlap", ("top15_prev", "top15_first", "top15_final")),
    ("share of the map inside the object", ("inside",)),
)
_REFERENCES = {"prev": "previous", "first": "first", "final": "final"}


def probe_pictures(images: torch.Tensor) -> list[Image.Image]:
    """Each ``(C, H, W)`` probe image of the batch as an RGB picture (see the module doc)."""
    pictures = []
    for image in images.detach().float().cpu():
        if image.shape[0] != 3:
            image = image.mean(dim=0, keepdim=True).expand(3, -1, -1)
        low, high = float(image.min()), float(image.max())
        if low < 0 or high > 1:
            image = (image - low) / (high - low) if high > low else torch.zeros_like(image)
        pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)
        pictures.append(Image.fromarray(pixels.numpy()))
    return pictures


def overlays(record: Record, pictures: Sequence[Image.Image]) -> dict[str, list[Image.Image]]:
    """``{series: [overlay of each probe]}`` at the probe images' size."""
    return {
        series: [
            overlay(picture, heatmap)
            for picture, heatmap in zip(pictures, tracked.heatmaps, strict=True)
        ]
        for series, tracked in record.maps.items()
    }


def strip_steps(history: Sequence[Record], columns: int = STRIP_COLUMNS) -> list[Record]:
    """At most ``columns`` records, evenly spaced, the first and the last always among them."""
    if len(history) <= columns:
        return list(history)
    picked = np.linspace(0, len(history) - 1, columns).round().astype(int)
    return [history[index] for index in sorted(set(picked.tolist()))]


class StripCells:
    """The strip's cells: each probe picture enlarged (or reduced) to ``cell_height``, and each
    record's overlays on them, drawn once per record and series. The strip logged at every
    step shows mostly the records it showed at the previous one; they are not drawn again."""

    def __init__(self, pictures: Sequence[Image.Image], cell_height: int = SUMMARY_CELL) -> None:
        first = pictures[0]
        self.size = (max(1, round(first.width * cell_height / first.height)), cell_height)
        self.pictures = [
            picture.resize(self.size, Image.Resampling.BILINEAR) for picture in pictures
        ]
        # By the record's identity; the record is kept with its cells, so that no other
        # record can take its id while they are here.
        self._drawn: dict[tuple[int, str], tuple[Record, list[Image.Image]]] = {}

    def __call__(self, record: Record, series: str) -> list[Image.Image]:
        """The overlays of ``record``'s maps of ``series`` on the cell-sized pictures."""
        key = (id(record), series)
        if key not in self._drawn:
            heatmaps = record.maps[series].heatmaps
            drawn = [overlay(p, h) for p, h in zip(self.pictures, heatmaps, strict=True)]
            self._drawn[key] = (record, drawn)
        return self._drawn[key][1]

    def keep(self, records: Sequence[Record]) -> None:
        """Forget the cells of every record but ``records``."""
        kept = {id(record) for record in records}
        self._drawn = {key: value for key, value in self._drawn.items() if key[0] in kept}


def strip(
    history: Sequence[Record], cells: StripCells, columns: int = STRIP_COLUMNS
) -> Image.Image:
    """Overlays over steps: for each series a block under its name, with one row per probe
    image and one column per step (at most ``columns``), captioned with the steps."""
    shown = strip_steps(history, columns)
    cells.keep(shown)
    cell, rows = cells.size, len(cells.pictures)
    series = list(shown[0].maps)
    heading = 2 * (_CAPTION + _GAP)  # the series' name, then the steps
    block_height = heading + rows * (cell[1] + _GAP)
    width = _LABEL_WIDTH + len(shown) * (cell[0] + _GAP) + _GAP
    canvas = Image.new("RGB", (width, _GAP + len(series) * (block_height + _GAP)), "white")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(_CAPTION)
    for block, name in enumerate(series):
        top = _GAP + block * (block_height + _GAP)
        draw.text((_GAP, top), name, fill="black", font=font)
        for row in range(rows):
            middle = top + heading + row * (cell[1] + _GAP) + cell[1] / 2
            draw.text((_GAP, middle), f"probe {row}", fill="black", font=font, anchor="lm")
        for column, record in enumerate(shown):
            left = _LABEL_WIDTH + column * (cell[0] + _GAP)
            caption_top = top + _CAPTION + _GAP
            caption = f"step {record.step}"
            draw.text(
                (left + cell[0] / 2, caption_top), caption, fill="black", font=font, anchor="ma"
            )
            for row, drawn in enumerate(cells(record, name)):
                canvas.paste(drawn, (left, top + heading + row * (cell[1] + _GAP)))
    return canvas


def curves(steps: Sequence[int], numbers: dict[str, dict[str, torch.Tensor]]) -> Figure:
    """The numbers over steps, one row of panels per series: the score and the share inside
    the object (when known) with one thin line per probe and their mean in black; the
    correlation and the top-15 % overlap with the previous, the first and the final map,
    averaged over the probes (NaN leaves a gap).

    Args:
        steps: The ``S`` steps.
        numbers: ``{series: {name: (S, N) values}}``.
    """
    from matplotlib.figure import Figure

    panels = [
        (title, names)
        for title, names in _PANELS
        if any(name in table for table in numbers.values() for name in names)
    ]
    height = 2.6 * len(numbers)
    figure = Figure(figsize=(3.3 * len(panels), height))
    # Margins in inches (a constrained layout took seconds): titles above, step labels below.
    figure.subplots_adjust(
        left=0.06, right=0.98, bottom=0.5 / height, top=1 - 0.3 / height, wspace=0.3, hspace=0.6
    )
    axes = figure.subplots(len(numbers), len(panels), squeeze=False)
    for row, (series, table) in enumerate(numbers.items()):
        for ax, (title, names) in zip(axes[row], panels, strict=True):
            if len(names) == 1:
                values = table[names[0]]
                for probe in range(values.shape[1]):
                    ax.plot(steps, values[:, probe].numpy(), linewidth=0.8, alpha=0.6)
                ax.plot(steps, values.nanmean(dim=1).numpy(), color="black", linewidth=2)
            else:
                for name in names:
                    label = "to " + _REFERENCES[name.rsplit("_", 1)[1]]
                    ax.plot(steps, table[name].nanmean(dim=1).numpy(), label=label)
                ax.legend(fontsize=7)
            if len(steps) > 1:
                ax.set_xlim(steps[0], steps[-1])
            ax.set_title(title if len(numbers) == 1 else f"{series}: {title}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
    return figure


def figure_picture(figure: Figure, dpi: int = 100) -> Image.Image:
    """A figure drawn as an RGB picture (Agg, without pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure.set_dpi(dpi)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return Image.fromarray(np.asarray(canvas.buffer_rgba())).convert("RGB")


def stacked(top: Image.Image, bottom: Image.Image) -> Image.Image:
    """Two pictures one above the other, centred, on white."""
    canvas = Image.new("RGB", (max(top.width, bottom.width), top.height + bottom.height), "white")
    canvas.paste(top, ((canvas.width - top.width) // 2, 0))
    canvas.paste(bottom, ((canvas.width - bottom.width) // 2, top.height))
    return canvas
