"""The row log of a folder job: ``manifest.jsonl``, its per-process parts, and resuming.

Each explained (or skipped) input gets one JSON row, appended as soon as its files are
written, so an interrupted run leaves a log of exactly what is finished. A process of a
distributed run appends to its own part, ``manifest.rank<R>.jsonl``; a run alone appends to
``manifest.jsonl`` directly. At the end the main process merges everything into
``manifest.jsonl`` (one row per input, in input order) and removes the parts.

On restart every row is read back, from ``manifest.jsonl`` and from any parts an
interrupted run left. An input counts as done when its latest row says ``"ok"`` and every
file it lists exists; anything else is done again. A row cut short by a crash is the last
line of its file and is ignored; a row that could not be written whole (a full disk) is cut
off again, so the log never holds half a line that a later row would follow.

Every row is strict JSON: a float that is not finite is written as ``null``, never as the
``NaN`` that Python's ``json`` would write and other readers refuse.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from camviz.io.atomic import atomic_write, is_temporary
from camviz.pipeline.inputs import item_key

#: The merged row log, one JSON object per line.
ROWS = "manifest.jsonl"

#: The run's summary (settings, counts, failures, videos).
SUMMARY = "manifest.json"

_PART = "manifest.rank{rank}.jsonl"
_PARTS = "manifest.rank*.jsonl"

Row = dict[str, Any]


def dumps(content: Any, **options: Any) -> str:
    """``content`` as strict JSON: floats that are not finite become ``null``."""
    return json.dumps(_finite(content), allow_nan=False, **options)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def row_key(row: Row) -> str:
    """The key of the input a row describes (see :func:`camviz.pipeline.inputs.item_key`)."""
    return item_key(row["input"], row.get("frame"))


def log_path(out: Path, rank: int, world_size: int) -> Path:
    """Where the process of rank ``rank`` appends its rows."""
    return out / (ROWS if world_size == 1 else _PART.format(rank=rank))


class RowLog:
    """Appends rows to a JSON-lines file, one whole line per write, from any thread.

    Args:
        path: The file; created if missing, appended to if not.
    """

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        if os.fstat(self._descriptor).st_size > 0 and not _ends_with_newline(path):
            # A crash cut the last row short: end that line, so the next row stands alone.
            self._write(b"\n")

    def append(self, row: Row) -> None:
        """Write ``row`` as one line, straight to the operating system."""
        line = (dumps(row) + "\n").encode("utf-8")
        with self._lock:
            self._write(line)

    def _write(self, data: bytes) -> None:
        size = os.fstat(self._descriptor).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._descriptor, view) :]
        except OSError:
            os.ftruncate(self._descriptor, size)  # no half line left behind
            raise

    def close(self) -> None:
        """Close the file."""
        os.close(self._descriptor)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1) == b"\n"


def read_rows(out: Path) -> dict[str, Row]:
    """Every row in ``out``'s log and parts, the latest one for each input.

    Rows that are not valid JSON (a line cut short by a crash) are left out.
    """
    rows: dict[str, Row] = {}
    for path in [out / ROWS, *sorted(out.glob(_PARTS))]:
        for row in _rows_in(path):
            rows[row_key(row)] = row
    return rows


def _rows_in(path: Path) -> Iterator[Row]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "input" in row:
            yield row


def finished(out: Path, rows: dict[str, Row]) -> set[str]:
    """The keys of rows that say ``"ok"`` and whose files all exist in ``out``."""
    return {
        key
        for key, row in rows.items()
        if row.get("status") == "ok" and all((out / name).is_file() for name in row["files"])
    }


def merge(out: Path, keys: Sequence[str]) -> tuple[list[Row], list[Row]]:
    """Write ``manifest.jsonl`` with the latest row of each of ``keys``, in that order.

    The file is replaced atomically, then the per-process parts are removed; a crash
    in between leaves parts whose rows the merged file already holds, which is harmless.

    Returns:
        The rows written, and the rows of inputs not in ``keys`` (an earlier run's), which
        the merged file no longer holds.
    """
    latest = read_rows(out)
    rows = [latest.pop(key) for key in keys if key in latest]
    with atomic_write(out / ROWS, "w") as file:
        file.writelines(dumps(row) + "\n" for row in rows)
    for part in out.glob(_PARTS):
        part.unlink()
    return rows, list(latest.values())


def written_files(out: Path) -> set[Path]:
    """Every file that ``out``'s manifests say camviz wrote there (rows, videos, others).

    These are never inputs: explaining them would explain camviz's own overlays.
    """
    names = [name for row in read_rows(out).values() for name in row.get("files") or []]
    try:
        summary = json.loads((out / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    if isinstance(summary, dict):
        videos = summary.get("videos") or []
        names += [video.get("file") for video in videos if isinstance(video, dict)]
        names += summary.get("other_files") or []
    return {out / name for name in names if isinstance(name, str)}


def remove_temporaries(out: Path) -> list[Path]:
    """Delete temporary files that an interrupted run left in ``out`` (and its sub-folders).

    Only files named the way camviz names its temporaries are touched.

    Returns:
        The files removed.
    """
    removed = []
    for folder, _, names in os.walk(out):
        for name in names:
            if is_temporary(name):
                path = Path(folder) / name
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed
