"""Where the tracker's records go: TensorBoard, Weights & Biases, or plain files.

Every sink gets the same things from the background writer: the :class:`Record`, each
probe's overlay and the strip. The names are fixed (the keys of issue 24):

* images ``camviz/{method}/{layer}/probe{i}`` and ``camviz/strip``;
* scalars ``camviz/{method}/{layer}/probe{i}/{name}`` for the names of
  :data:`~camviz.training.record.LOGGED` that apply and are defined (a change from the
  previous step starts at the second step; a correlation with a constant map is skipped);
* files ``OUT/camviz_tracker.jsonl`` (one JSON row per step, series and probe, with every
  number; ``null`` where one is not defined), ``OUT/steps/{step}_probe{i}_{method}.png``
  (``..._{method}_{layer}.png`` when several layers are tracked, so that names stay apart)
  and ``OUT/strip.png`` (the latest strip).

Sinks are told from the object given (:func:`sinks_for`): anything with ``add_image`` and
``add_scalar`` is a TensorBoard ``SummaryWriter`` (torch's or tensorboardX's), an object of
the ``wandb`` package with ``log`` is a W&B run. The user's writer or run is flushed, never
closed: it is theirs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image

from camviz.core.errors import CamvizError
from camviz.pipeline.encoders import save_png
from camviz.pipeline.manifest import RowLog
from camviz.training.record import LOGGED, Record

__all__ = [
    "LOG_FILE",
    "STRIP_KEY",
    "FileSink",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "image_key",
    "scalars",
    "sinks_for",
]

#: The image key of the strip of overlays over steps.
STRIP_KEY = "camviz/strip"

#: The JSON-lines log in the output folder.
LOG_FILE = "camviz_tracker.jsonl"

Overlays = dict[str, list[Image.Image]]


class Sink(Protocol):
    """Writes what one step gave, from the background writer's thread."""

    def write(self, record: Record, overlays: Overlays, strip: Image.Image) -> None: ...

    def close(self) -> None: ...


def image_key(series: str, probe: int) -> str:
    """``camviz/{method}/{layer}/probe{i}``."""
    return f"camviz/{series}/probe{probe}"


def scalars(record: Record) -> dict[str, float]:
    """The record's logged numbers by key (defined ones only)."""
    logged = {}
    for series, tracked in record.maps.items():
        for name in LOGGED:
            if name not in tracked.numbers:
                continue
            for probe, value in enumerate(tracked.numbers[name].tolist()):
                if math.isfinite(value):
                    logged[f"{image_key(series, probe)}/{name}"] = value
    return logged


class TensorBoardSink:
    """Images and scalars on a ``SummaryWriter``, at the record's step."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def write(self, record: Record, overlays: Overlays, strip: Image.Image) -> None:
        for series, pictures in overlays.items():
            for probe, picture in enumerate(pictures):
                self._image(image_key(series, probe), picture, record.step)
        self._image(STRIP_KEY, strip, record.step)
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record.step)

    def _image(self, key: str, picture: Image.Image, step: int) -> None:
        self.writer.add_image(key, np.asarray(picture), step, dataformats="HWC")

    def close(self) -> None:
        self.writer.flush()


class WandbSink:
    """``wandb.Image`` and scalars in one ``run.log`` per step, against ``camviz/step``.

    The step goes in as a metric of its own rather than as ``step=``: W&B drops a row whose
    ``step=`` is below the run's own counter, which the user's other ``log`` calls advance.
    """

    STEP = "camviz/step"

    def __init__(self, run: Any) -> None:
        import wandb

        self.run = run
        self._image = wandb.Image
        run.define_metric(self.STEP)
        run.define_metric("camviz/*", step_metric=self.STEP)

    def write(self, record: Record, overlays: Overlays, strip: Image.Image) -> None:
        row: dict[str, Any] = {self.STEP: record.step, STRIP_KEY: self._image(strip)}
        for series, pictures in overlays.items():
            for probe, picture in enumerate(pictures):
                row[image_key(series, probe)] = self._image(picture)
        row.update(scalars(record))
        self.run.log(row)

    def close(self) -> None:
        """Nothing to flush: the run sends what it was given (it is the user's to finish)."""


class FileSink:
    """PNG files and a JSON-lines log in a folder (see the module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._log: RowLog | None = None

    def write(self, record: Record, overlays: Overlays, strip: Image.Image) -> None:
        several_layers = len({tracked.layer for tracked in record.maps.values()}) > 1
        for series, pictures in overlays.items():
            tracked = record.maps[series]
            name = tracked.method + (f"_{_file_safe(tracked.layer)}" if several_layers else "")
            for probe, picture in enumerate(pictures):
                save_png(picture, self.folder / "steps" / f"{record.step}_probe{probe}_{name}.png")
        save_png(strip, self.folder / "strip.png")
        if self._log is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._log = RowLog(self.folder / LOG_FILE)
        for row in record.rows():
            self._log.append(row)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _file_safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "_", name)


def sinks_for(logger: Any, out_dir: str | Path | None) -> list[Sink]:
    """The sinks of a ``logger`` (a ``SummaryWriter``, a W&B run, a sequence of them, or
    ``None``) and of ``out_dir`` (files, when given).

    Raises:
        CamvizError: ``logger`` is none of these.
    """
    loggers: Sequence[Any] = (
        () if logger is None else logger if isinstance(logger, (list, tuple)) else (logger,)
    )
    sinks: list[Sink] = [_sink_of(item) for item in loggers]
    if out_dir is not None:
        sinks.append(FileSink(out_dir))
    return sinks


def _sink_of(logger: Any) -> Sink:
    if hasattr(logger, "add_image") and hasattr(logger, "add_scalar"):
        return TensorBoardSink(logger)
    if type(logger).__module__.split(".")[0] == "wandb" and hasattr(logger, "log"):
        return WandbSink(logger)
    raise CamvizError(
        f"the tracker cannot log to a {type(logger).__name__}; give a TensorBoard "
        "SummaryWriter, a W&B run (wandb.init()), a list of them, or out_dir= for plain files"
    )
