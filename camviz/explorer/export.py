"""The numbers and files of the current view: faithfulness, the HTML report, the maps.

:func:`faithfulness` measures the current map with the report's metrics (deletion and
insertion curves and their AUC, average drop; :mod:`camviz.metrics`), as
``camviz compare`` does: class probabilities for a classifier, the raw score for an object
or a region (which have no softmax over classes).

:func:`export` writes the current view into a new folder: ``report.html`` (and its CSV
files) by :func:`camviz.write_report`, one column per panel (the current view, then the
pinned ones), and ``maps.npz`` with the current view's
:class:`~camviz.Explanation` (``heatmaps``, ``layer_maps``, ``targets``, ``scores``,
``samples``, the method and the layers), through :func:`camviz.io.atomic.atomic_write`.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from camviz.cams.engine import Explanation
from camviz.core.errors import CamvizError
from camviz.core.targets import as_logits
from camviz.evaluation.metrics import Score, confidence, deletion, insertion
from camviz.evaluation.report import Cell, Comparison, write_report
from camviz.explorer.session import Panel, Session
from camviz.explorer.views import view_overlay
from camviz.io.atomic import atomic_write

__all__ = ["MAPS", "REPORT_STEPS", "Measured", "export", "faithfulness"]

#: The file of the current view's maps in an export.
MAPS = "maps.npz"

#: Steps of the deletion and insertion curves in the report and the page.
REPORT_STEPS = 20

# Width of the report's thumbnails, in pixels.
_THUMBNAIL = 160


@dataclass
class Measured:
    """The report's metrics of some maps of the current image, one row per map."""

    fractions: list[float]
    deletion: torch.Tensor
    insertion: torch.Tensor
    deletion_auc: torch.Tensor
    insertion_auc: torch.Tensor
    drop: torch.Tensor
    increase: torch.Tensor
    score: str  # "probability" or "score"


def measure(session: Session, maps: torch.Tensor, steps: int = REPORT_STEPS) -> Measured:
    """Deletion, insertion and confidence of ``(M, H, W)`` maps of the current image."""
    if session.inputs is None or session.chosen is None:
        raise CamvizError("nothing explained yet; pick a class, an object or a region")
    model, target = session.subject.model, session.chosen.target
    batch = session.inputs.expand(len(maps), -1, -1, -1)
    score: Score = "probability" if session.subject.task == "classification" else "logit"
    with session.subject.using():
        deleted = deletion(model, batch, maps, target, steps=steps, score=score)
        inserted = insertion(model, batch, maps, target, steps=steps, score=score)
        confidences = confidence(model, batch, maps, target, score=score)
    return Measured(
        fractions=deleted.fractions.tolist(),
        deletion=deleted.scores,
        insertion=inserted.scores,
        deletion_auc=deleted.auc,
        insertion_auc=inserted.auc,
        drop=100 * confidences.drop,
        increase=confidences.explained > confidences.original,
        score="probability" if score == "probability" else "score",
    )


def faithfulness(session: Session) -> str:
    """The current map's numbers, as a line of HTML for the page."""
    measured = measure(session, session.heatmap()[None])
    return (
        f"deletion AUC <b>{float(measured.deletion_auc[0]):.3f}</b> (lower is better), "
        f"insertion AUC <b>{float(measured.insertion_auc[0]):.3f}</b> (higher is better), "
        f"average drop <b>{float(measured.drop[0]):.1f} %</b>, over {REPORT_STEPS} steps of "
        f"the {measured.score} of {html.escape(_explained(session))}"
    )


def export(session: Session, out_dir: Path, panels: list[Panel]) -> dict[str, Path]:
    """Write the report of the current view and the pinned ``panels``, and the current
    view's maps, into ``out_dir``."""
    current = session.current()
    if session.image is None:
        raise CamvizError("no image yet; upload one or pick one from the list")
    views = [current, *panels]
    maps = torch.stack([session.heatmap(view.explained) for view in views])
    measured = measure(session, maps)
    thumbnail = _thumbnail(session.image)
    cells = []
    for index, view in enumerate(views):
        shown = view_overlay(session, view.explained, view.settings)
        cells.append(
            Cell(
                image=session.image_name,
                method=view.settings.label,
                class_id=session.chosen.class_id if session.chosen else -1,
                class_name=session.subject.category(session.chosen.class_id)
                if session.chosen
                else "",
                probability=_probability(session),
                seconds=view.seconds,
                fractions=measured.fractions,
                deletion=measured.deletion[index].tolist(),
                insertion=measured.insertion[index].tolist(),
                deletion_auc=float(measured.deletion_auc[index]),
                insertion_auc=float(measured.insertion_auc[index]),
                drop=float(measured.drop[index]),
                increase=bool(measured.increase[index]),
                overlay=shown.resize(thumbnail.size, Image.Resampling.BILINEAR),
            )
        )
    comparison = Comparison(
        model=session.subject.name,
        methods=[view.settings.label for view in views],
        images=[session.image_name],
        thumbnails=[thumbnail],
        cells=cells,
        explained=_explained(session),
        curve_score=measured.score,
    )
    written = write_report(comparison, out_dir)
    written["maps"] = out_dir / MAPS
    _write_maps(written["maps"], current.explained)
    return written


def _write_maps(path: Path, explained: Explanation) -> None:
    heatmaps = explained.heatmaps
    if not isinstance(heatmaps, torch.Tensor):
        heatmaps = torch.stack(list(heatmaps))
    with atomic_write(path, "wb") as file:
        np.savez(
            file,
            heatmaps=heatmaps.float().cpu().numpy(),
            layer_maps=explained.layer_maps.float().cpu().numpy(),
            targets=explained.targets.cpu().numpy(),
            scores=explained.scores.float().cpu().numpy(),
            samples=explained.samples.cpu().numpy(),
            method=np.array(explained.method),
            layers=np.array(explained.layers),
        )


def _explained(session: Session) -> str:
    return session.chosen.label if session.chosen is not None else "nothing"


def _probability(session: Session) -> float:
    """The explained class's probability: the class's (a classifier), the object's score
    (a detector), the mean probability of the class over its region (a segmenter)."""
    chosen = session.chosen
    if chosen is None:
        return float("nan")
    if session.subject.task != "segmentation":
        return chosen.score
    probabilities = as_logits(session.output).float().softmax(dim=1)[0, chosen.class_id]
    mask = getattr(chosen.target, "mask", None)
    return float(probabilities[mask].mean()) if mask is not None else float("nan")


def _thumbnail(image: Image.Image) -> Image.Image:
    width = min(_THUMBNAIL, image.width)
    height = max(1, round(image.height * width / image.width))
    return image.resize((width, height), Image.Resampling.BILINEAR)
