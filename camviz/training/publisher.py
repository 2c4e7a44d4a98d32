"""Logging off the training thread: pictures are drawn and sinks written on one background
thread, so the training step waits only for the maps.

It is the folder job's :class:`~camviz.pipeline.writer.Writer` with one thread (the sinks
see the records in order) and a short bounded queue: when logging falls behind, the next
logged step waits rather than records piling up. An error in a sink is raised again by the
next :meth:`Publisher.submit` or by :meth:`Publisher.close`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from PIL import Image

from camviz.pipeline.writer import Writer
from camviz.training.pictures import STEP_CELL, StripCells, overlays, probe_pictures, strip
from camviz.training.record import Record
from camviz.training.sinks import Sink

__all__ = ["Publisher"]

# Records that may wait for the writer before the next logged step blocks.
_QUEUE = 4


class Publisher:
    """Draws each record's pictures and hands them to the sinks, in the background.

    Args:
        sinks: Where records go (:func:`camviz.training.sinks.sinks_for`).
        images: The ``(N, C, H, W)`` probe batch, for the overlays.
    """

    def __init__(self, sinks: Sequence[Sink], images: torch.Tensor) -> None:
        self.sinks = list(sinks)
        self._images = images
        # The probe pictures and the strip's cells on them, made on the writer's thread.
        self._drawing: tuple[list[Image.Image], StripCells] | None = None
        self._writer = Writer(threads=1, queue_size=_QUEUE)

    def submit(self, record: Record, history: Sequence[Record]) -> None:
        """Queue ``record``; ``history`` (up to and with it) makes the strip."""
        if self.sinks:
            self._writer.submit(self._publish, record, tuple(history))

    def close(self) -> None:
        """Wait until every queued record is written, then flush the sinks."""
        try:
            self._writer.close()
        finally:
            for sink in self.sinks:
                sink.close()

    def _publish(self, record: Record, history: Sequence[Record]) -> None:
        if self._drawing is None:
            pictures = probe_pictures(self._images)
            self._drawing = pictures, StripCells(pictures, STEP_CELL)
        pictures, cells = self._drawing
        drawn = overlays(record, pictures)
        shown = strip(history, cells)
        for sink in self.sinks:
            sink.write(record, drawn, shown)
