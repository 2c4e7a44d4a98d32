"""Several methods on several images, measured side by side: the job behind ``camviz compare``.

:func:`compare` explains every image with every method for the model's top-1 class, times
each explanation, and measures each map with :mod:`camviz.metrics`: deletion and insertion
curves (and their AUC) and the confidence of the image multiplied by its map (average drop,
increase in confidence, win rate). :func:`write_report` writes the numbers to a folder:

* ``report.html`` - one self-contained page: a sortable summary table, then a grid of
  images x methods, each cell with the overlay, the two curves as a small inline SVG plot,
  the numbers and the time. Images are inline (base64 PNG), the script is a few lines of
  plain JavaScript, and a Content-Security-Policy forbids anything else, so the page opens
  from disk, with no server, and loads nothing from the network.
* ``metrics.csv`` - one row per image and method; ``summary.csv`` - one row per method.
  A text cell that a spreadsheet would run as a formula (one with a line starting with
  ``=``, ``+``, ``-``, ``@``, a tab or a carriage return: an image named ``=cmd|...``) is
  written with a ``'`` in front, as OWASP's advice on CSV injection says
  (:mod:`camviz.io.csvfiles`).

Images are named by their path relative to the folder they share (``a/x.png`` and
``b/x.png``, not twice ``x.png``). Each method is run once on the first image before
anything is timed, so that no method's time holds the first call's warm-up (lazy
initialisation of the backend, the allocator, the thread pool).

Every file is written atomically.
"""

from __future__ import annotations

import base64
import html
import io
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from camviz.cams.engine import Explanation, explain
from camviz.cams.registry import get
from camviz.cams.settings import ExplainSettings, settings_or_keywords
from camviz.core.errors import CamvizError
from camviz.core.inputs import as_batch, run_model
from camviz.core.layers import Layer
from camviz.core.modelstate import no_grad
from camviz.core.precision import Precision
from camviz.core.targets import as_logits, class_name
from camviz.evaluation.metrics import (
    Confidence,
    Curve,
    confidence,
    deletion,
    insertion,
    win_rate,
)
from camviz.io.atomic import atomic_write
from camviz.io.csvfiles import write_csv
from camviz.io.images import load_image
from camviz.io.models import LoadedModel
from camviz.io.progress import progress_bar
from camviz.io.render import overlay

REPORT = "report.html"
METRICS = "metrics.csv"
SUMMARY = "summary.csv"


@dataclass
class Cell:
    """One method on one image.

    Attributes:
        image: The image's file name.
        method: The method's registry name.
        class_id: The explained (top-1) class.
        class_name: Its name.
        probability: The model's probability for it on the whole image.
        seconds: Wall time of the explanation.
        fractions: Curve x positions, share of pixels changed.
        deletion: Probability after each deletion step.
        insertion: Probability after each insertion step.
        deletion_auc: Area under the deletion curve (lower is better).
        insertion_auc: Area under the insertion curve (higher is better).
        drop: Relative fall of the probability on ``map * image``, in percent.
        increase: Whether the probability rose on ``map * image``.
        overlay: The heatmap over the image, as a thumbnail.
    """

    image: str
    method: str
    class_id: int
    class_name: str
    probability: float
    seconds: float
    fractions: list[float]
    deletion: list[float]
    insertion: list[float]
    deletion_auc: float
    insertion_auc: float
    drop: float
    increase: bool
    overlay: Image.Image = field(repr=False)


@dataclass
class Comparison:
    """Every cell of a comparison, and the thumbnails of the images.

    Attributes:
        model: The model's name.
        methods: The methods, in the order asked for.
        images: The images' file names.
        thumbnails: Each image, as a thumbnail.
        cells: One :class:`Cell` per image and method, image-major.
        explained: What every map explains, for the page's introduction.
        curve_score: What the curves follow: ``"probability"`` (of the class) or ``"score"``
            (the raw score of a target that has no probability: a region, an object).
    """

    model: str
    methods: list[str]
    images: list[str]
    thumbnails: list[Image.Image] = field(repr=False)
    cells: list[Cell]
    explained: str = "the model's top-1 class"
    curve_score: str = "probability"

    def cell(self, image: int, method: int) -> Cell:
        """The cell of the ``image``-th image and ``method``-th method."""
        return self.cells[image * len(self.methods) + method]

    def summary(self) -> list[dict[str, float | str]]:
        """One row per method: means over the images, win rate and time per image."""
        wins = win_rate(
            {
                method: torch.tensor([cell.drop for cell in self.cells if cell.method == method])
                for method in self.methods
            }
        )
        rows: list[dict[str, float | str]] = []
        for method in self.methods:
            cells = [cell for cell in self.cells if cell.method == method]
            rows.append(
                {
                    "method": method,
                    "deletion_auc": _mean(cell.deletion_auc for cell in cells),
                    "insertion_auc": _mean(cell.insertion_auc for cell in cells),
                    "average_drop": _mean(cell.drop for cell in cells),
                    "increase_in_confidence": _mean(100.0 * cell.increase for cell in cells),
                    "win_rate": wins[method],
                    "ms_per_image": _mean(1000 * cell.seconds for cell in cells),
                }
            )
        return rows


def compare(
    paths: Sequence[str | Path],
    loaded: LoadedModel,
    methods: Sequence[str],
    *,
    layer: Layer | Sequence[Layer] | None = None,
    steps: int = 20,
    batch_size: int = 16,
    thumbnail: int = 128,
    progress: Callable[[str], None] | None = None,
    precision: Precision = "fp32",
    channels_last: bool = False,
    bar: bool | None = False,
    memory_budget: int | str | None = None,
    settings: ExplainSettings | None = None,
) -> Comparison:
    """Explain every image with every method and measure each map.

    Args:
        paths: Image files.
        loaded: A model from :func:`camviz.models.load` (model, preprocessing, class names).
        methods: CAM method names (:func:`camviz.cams.names`).
        layer: Target layer(s); ``None`` uses the model's known default or finds one.
        steps: Steps of the deletion and insertion curves.
        batch_size: Perturbed images per forward pass.
        thumbnail: Width of the thumbnails, in pixels (smaller images keep their own).
        progress: Called with one line after each image and method, e.g. to print it.
        precision, channels_last: How the maps are computed (see :func:`camviz.explain`);
            the metrics always run in float32.
        bar: A progress bar on stderr over the metric work: ``True``, ``False``, or ``None``
            (when stderr is a terminal).
        memory_budget: The ``memory_budget`` of the perturbation methods among ``methods``
            (bytes, or ``"512MiB"``); ``None``: their default.
        settings: ``layer``, ``precision``, ``channels_last`` and ``memory_budget`` in one
            object, as ``camviz explain`` takes them too (then not as keywords; its
            ``method`` is unused: ``methods`` are compared).

    Returns:
        The :class:`Comparison`; write it with :func:`write_report`.
    """
    if not paths:
        raise CamvizError("no image given; pass one or more image files")
    if not methods:
        raise CamvizError("no method given; pass one or more CAM method names")
    keywords = ExplainSettings(
        layer=layer, precision=precision, channels_last=channels_last, memory_budget=memory_budget
    )
    chosen = settings_or_keywords(settings, keywords)
    method_options = chosen.method_options(loaded.model, methods)  # before any model work
    names = [get(method).name for method in methods]
    images = [load_image(path) for path in paths]
    labels = image_labels(paths)
    layer = chosen.layer if chosen.layer is not None else loaded.default_layer
    model = loaded.model
    cells, thumbnails = [], []
    measuring = _metrics_bar(len(paths), bar)
    for image_index, (label, image) in enumerate(zip(labels, images, strict=True)):
        inputs = as_batch(loaded.preprocess(image), model)
        probabilities, class_id = _top_class(model, inputs, label)
        explained = [
            partial(explain, model, inputs, name, layer, class_id, **method_options[name])
            for name in names
        ]
        if image_index == 0:
            for explain_one in explained:  # warm-up, untimed (module docstring)
                explain_one()
        timed = []  # (heatmap, seconds) per method
        for name, explain_one in zip(names, explained, strict=True):
            timed.append(_timed_heatmap(explain_one, inputs.device))
            if progress is not None:
                with measuring.external_write_mode(file=sys.stderr):  # the line above the bar
                    progress(f"{label}: {name} ({timed[-1][1]:.2f} s)")
        maps = torch.stack([heatmap for heatmap, _ in timed])
        deleted, inserted, confidences = _measured(
            model, inputs, maps, class_id, steps, batch_size, measuring, label
        )
        small = _thumbnail(image, thumbnail)
        thumbnails.append(small)
        for index, name in enumerate(names):
            cells.append(
                Cell(
                    image=label,
                    method=name,
                    class_id=class_id,
                    class_name=class_name(loaded.categories, class_id),
                    probability=float(probabilities[class_id]),
                    seconds=timed[index][1],
                    fractions=deleted.fractions.tolist(),
                    deletion=deleted.scores[index].tolist(),
                    insertion=inserted.scores[index].tolist(),
                    deletion_auc=float(deleted.auc[index]),
                    insertion_auc=float(inserted.auc[index]),
                    drop=100 * float(confidences.drop[index]),
                    increase=bool(confidences.explained[index] > confidences.original[index]),
                    overlay=overlay(small, maps[index]),
                )
            )
    measuring.close()
    return Comparison(loaded.name, names, labels, thumbnails, cells)


def _top_class(model: nn.Module, inputs: torch.Tensor, label: str) -> tuple[torch.Tensor, int]:
    """The model's class probabilities for one image, and its top class.

    Raises:
        CamvizError: The output is not finite.
    """
    with no_grad():
        probabilities = as_logits(run_model(model, inputs)).softmax(dim=-1)[0]
    if not bool(torch.isfinite(probabilities).all()):
        raise CamvizError(
            f"the model's output for {label} is not finite (NaN or Inf); check the "
            "weights (`camviz inspect` names the first layer that makes a NaN)"
        )
    return probabilities, int(probabilities.argmax())


def _timed_heatmap(
    explain_one: Callable[[], Explanation], device: torch.device
) -> tuple[torch.Tensor, float]:
    """The heatmap of one explanation and its wall time (the GPU's work included)."""
    started = time.perf_counter()
    heatmap = explain_one().heatmaps[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return heatmap, time.perf_counter() - started


def _measured(
    model: nn.Module,
    inputs: torch.Tensor,
    maps: torch.Tensor,
    class_id: int,
    steps: int,
    batch_size: int,
    measuring: Any,
    label: str,
) -> tuple[Curve, Curve, Confidence]:
    """The deletion and insertion curves and the confidence of each method's map of one
    image, each step shown on the ``measuring`` bar."""
    batch = inputs.expand(len(maps), -1, -1, -1)
    measuring.set_description(f"{label}: deletion")
    deleted = deletion(model, batch, maps, class_id, steps=steps, batch_size=batch_size)
    measuring.update(1)
    measuring.set_description(f"{label}: insertion")
    inserted = insertion(model, batch, maps, class_id, steps=steps, batch_size=batch_size)
    measuring.update(1)
    measuring.set_description(f"{label}: confidence")
    confidences = confidence(model, batch, maps, class_id, batch_size=batch_size)
    measuring.update(1)
    return deleted, inserted, confidences


def image_labels(paths: Sequence[str | Path]) -> list[str]:
    """How the report names each image: its path relative to the folder all of them share.

    ``a/x.png`` and ``b/x.png`` stay apart; images in one folder are named by file name.
    """
    absolute = [os.path.abspath(path) for path in paths]
    common = os.path.commonpath([os.path.dirname(path) for path in absolute])
    return [Path(os.path.relpath(path, common)).as_posix() for path in absolute]


def _metrics_bar(images: int, shown: bool | None) -> Any:
    """A tqdm bar over the three metric steps (deletion, insertion, confidence) per image."""
    return progress_bar(3 * images, "step", shown, leave=False)


def write_report(comparison: Comparison, out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.html``, ``metrics.csv`` and ``summary.csv`` into ``out_dir``.

    Returns:
        ``{"report": ..., "metrics": ..., "summary": ...}``, the paths written.
    """
    out = Path(out_dir)
    written = {"report": out / REPORT, "metrics": out / METRICS, "summary": out / SUMMARY}
    _write_csv(written["metrics"], [_cell_row(cell) for cell in comparison.cells])
    _write_csv(written["summary"], comparison.summary())
    with atomic_write(written["report"], "w") as file:
        file.write(report_html(comparison))
    return written


def report_html(comparison: Comparison) -> str:
    """The self-contained HTML page of a comparison."""
    title = f"camviz compare - {comparison.model}"
    return _PAGE.format(
        title=html.escape(title),
        style=_STYLE,
        script=_SCRIPT,
        heading=html.escape(title),
        intro=html.escape(
            f"{len(comparison.images)} image(s) x {len(comparison.methods)} method(s), each "
            f"explained for {comparison.explained}. Curves: {comparison.curve_score} of it as "
            "pixels are deleted (red) or inserted (blue), most important first."
        ),
        summary=_summary_table(comparison),
        grid=_grid(comparison),
    )


# --- HTML pieces ------------------------------------------------------------------------------

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; \
style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<h1>{heading}</h1>
<p>{intro}</p>
<h2>Summary</h2>
<p>Means over the images. Click a column to sort.</p>
{summary}
<h2>Images x methods</h2>
{grid}
<script>{script}</script>
</body>
</html>
"""

_STYLE = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 4px 6px; vertical-align: top; }
.sortable th { cursor: pointer; background: #f3f3f3; }
.sortable th[data-order="asc"]::after { content: " \\25B2"; }
.sortable th[data-order="desc"]::after { content: " \\25BC"; }
.sortable td { text-align: right; }
.sortable td:first-child { text-align: left; }
.grid td { text-align: center; }
.numbers { font-size: 11px; text-align: left; margin-top: 2px; }
img { display: block; margin: 0 auto; }
"""

_SCRIPT = """
document.querySelectorAll("table.sortable th").forEach((header, column) => {
  header.addEventListener("click", () => {
    const body = header.closest("table").tBodies[0];
    const ascending = header.dataset.order !== "asc";
    header.closest("tr").querySelectorAll("th").forEach((th) => delete th.dataset.order);
    header.dataset.order = ascending ? "asc" : "desc";
    const key = (row) => {
      const cell = row.cells[column];
      return cell.dataset.value !== undefined ? Number(cell.dataset.value) : cell.textContent;
    };
    const rows = Array.from(body.rows).sort((a, b) => {
      const order = key(a) < key(b) ? -1 : key(a) > key(b) ? 1 : 0;
      return ascending ? order : -order;
    });
    rows.forEach((row) => body.appendChild(row));
  });
});
window.addEventListener("load", () => {
  const images = Array.from(document.images);
  const shown = images.filter((image) => image.complete && image.naturalWidth > 0);
  document.body.dataset.imagesShown = shown.length;
  document.body.dataset.imagesBroken = images.length - shown.length;
});
"""

# Summary columns: key, header, format, which way is better.
_COLUMNS = (
    ("deletion_auc", "deletion AUC", "{:.3f}", "lower"),
    ("insertion_auc", "insertion AUC", "{:.3f}", "higher"),
    ("average_drop", "average drop %", "{:.1f}", "lower"),
    ("increase_in_confidence", "increase in confidence %", "{:.1f}", "higher"),
    ("win_rate", "win rate %", "{:.1f}", "higher"),
    ("ms_per_image", "ms / image", "{:.1f}", "lower"),
)


def _summary_table(comparison: Comparison) -> str:
    headers = "".join(
        f'<th title="{better} is better">{html.escape(label)}</th>'
        for _, label, _, better in _COLUMNS
    )
    rows = []
    for row in comparison.summary():
        cells = "".join(
            f'<td data-value="{row[key]!r}">{fmt.format(row[key])}</td>'
            for key, _, fmt, _ in _COLUMNS
        )
        rows.append(f"<tr><td>{html.escape(str(row['method']))}</td>{cells}</tr>")
    return (
        f'<table class="sortable"><thead><tr><th>method</th>{headers}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _grid(comparison: Comparison) -> str:
    headers = "".join(f"<th>{html.escape(method)}</th>" for method in comparison.methods)
    rows = []
    for index, (name, thumbnail) in enumerate(
        zip(comparison.images, comparison.thumbnails, strict=True)
    ):
        first = comparison.cell(index, 0)
        caption = f"{first.class_name} (p = {first.probability:.2f})"
        cells = [
            f"<td>{_img(thumbnail, name)}<div>{html.escape(name)}</div>"
            f"<div>{html.escape(caption)}</div></td>"
        ]
        for method_index in range(len(comparison.methods)):
            cell = comparison.cell(index, method_index)
            numbers = (
                f"deletion AUC {cell.deletion_auc:.3f}<br>insertion AUC {cell.insertion_auc:.3f}"
                f"<br>drop {cell.drop:.1f} %{' (increase)' if cell.increase else ''}"
                f"<br>{1000 * cell.seconds:.0f} ms"
            )
            cells.append(
                f"<td>{_img(cell.overlay, f'{cell.method} on {name}')}{_curves_svg(cell)}"
                f'<div class="numbers">{numbers}</div></td>'
            )
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return (
        f'<table class="grid"><thead><tr><th>image</th>{headers}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _img(image: Image.Image, alt: str) -> str:
    buffer = io.BytesIO()
    # A 256-colour palette halves the PNG of a photo thumbnail, with no visible loss.
    image.convert("P", palette=Image.Palette.ADAPTIVE, colors=256).save(
        buffer, format="PNG", optimize=True
    )
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return (
        f'<img src="data:image/png;base64,{data}" width="{image.width}" '
        f'height="{image.height}" alt="{html.escape(alt)}">'
    )


def _curves_svg(cell: Cell, width: int = 150, height: int = 60) -> str:
    """Deletion (red) and insertion (blue) probability curves, on axes from 0 to 1."""
    top = max(1.0, *cell.deletion, *cell.insertion)

    def points(values: list[float]) -> str:
        return " ".join(
            f"{x * width:.1f},{height - y / top * height:.1f}"
            for x, y in zip(cell.fractions, values, strict=True)
        )

    label = f"deletion and insertion curves of {cell.method} on {cell.image}"
    return (
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{html.escape(label)}">'
        f'<rect width="{width}" height="{height}" fill="#fafafa" stroke="#bbb"/>'
        f'<polyline fill="none" stroke="#d62728" stroke-width="1.5" '
        f'points="{points(cell.deletion)}"/>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" '
        f'points="{points(cell.insertion)}"/></svg>'
    )


def _thumbnail(image: Image.Image, width: int) -> Image.Image:
    if width < 16:
        raise CamvizError(f"thumbnail width must be at least 16 pixels, got {width}")
    width = min(width, image.width)  # never enlarge: a bigger thumbnail shows nothing more
    height = max(1, round(image.height * width / image.width))
    return image.resize((width, height), Image.Resampling.BILINEAR)


# --- CSV and helpers ----------------------------------------------------------------------------


def _cell_row(cell: Cell) -> dict[str, float | int | str]:
    return {
        "image": cell.image,
        "method": cell.method,
        "class_id": cell.class_id,
        "class_name": cell.class_name,
        "probability": cell.probability,
        "deletion_auc": cell.deletion_auc,
        "insertion_auc": cell.insertion_auc,
        "drop": cell.drop,
        "increase": int(cell.increase),
        "seconds": cell.seconds,
    }


def _write_csv(path: Path, rows: list[dict[str, float | int | str]]) -> None:
    write_csv(path, list(rows[0]), [list(row.values()) for row in rows])


def _mean(values: Iterable[float]) -> float:
    listed = list(values)
    return sum(listed) / len(listed)
