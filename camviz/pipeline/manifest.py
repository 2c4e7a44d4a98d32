"""The manifests of a folder job: the row log ``manifest.jsonl``, its per-process parts, the
summary ``manifest.json``, and what a resumed run reads back from them.

Each explained (or skipped) input gets one JSON row, appended as soon as its files are
written, so an interrupted run leaves a log of exactly what is finished. A process of a
distributed run appends to its own part, ``manifest.rank<R>.jsonl``; a run alone appends to
``manifest.jsonl`` directly. At the end the main process merges everything into
``manifest.jsonl`` (one row per input, in input order), removes the parts and writes the
complete summary (:func:`summary`). The row log is opened without following a symbolic
link (``O_NOFOLLOW``), and every row checks that the log is still where it was opened: a
log whose folder was removed or moved during the run stops it with one line.

**Whose files these are.** ``manifest.json`` is written before the first row, with the
run's settings, so a row log is camviz's only beside camviz's ``manifest.json``
(:func:`check_folder`): a ``manifest.jsonl`` or ``manifest.json`` that camviz did not write
(a dataset index by that name, a link) is refused and left as it is.

**Resuming.** Every row is read back, from ``manifest.jsonl`` and from any parts an
interrupted run left. An input counts as done when its latest row says ``"ok"`` (with the
explained maps and their files) and every file it lists exists; anything else is done
again. A line that is not a camviz row (cut short by a crash, or edited by hand: not an
object, ``input`` not a string, ``files`` not a list of names inside the folder) is skipped
and counted (:attr:`Rows.skipped`), so a row that names ``../../etc/passwd`` is never
"done" and its files are never taken for camviz's. A row that could not be written whole (a
full disk) is cut off again, so the log never holds half a line that a later row would
follow.

**Names that are not UTF-8.** A row's ``input`` is the path as text, each byte that is not
UTF-8 replaced by U+FFFD; only then the row also holds ``input_bytes``, the path's bytes
(``os.fsencode``) in standard base64, and a resumed run knows the input by those.

Every row is strict JSON: a float that is not finite is written as ``null``, never as the
``NaN`` that Python's ``json`` would write and other readers refuse.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import math
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from camviz.core.errors import CamvizError
from camviz.io.atomic import atomic_write, is_temporary
from camviz.pipeline.rows import Row, explained_ok, is_row, parse_lines, parsed, row_key

#: The merged row log, one JSON object per line.
ROWS = "manifest.jsonl"

#: The run's summary (settings, counts, failures, videos).
SUMMARY = "manifest.json"

_PART = "manifest.rank{rank}.jsonl"
_PARTS = "manifest.rank*.jsonl"


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


def input_fields(path: str) -> dict[str, str]:
    """How a manifest names the input ``path``: ``input`` as text and, for a path that is
    not UTF-8, ``input_bytes`` (see the module docstring)."""
    raw = os.fsencode(path)
    text = raw.decode("utf-8", "replace")
    if text.encode("utf-8") == raw:
        return {"input": text}
    return {"input": text, "input_bytes": base64.b64encode(raw).decode("ascii")}


def log_path(out: Path, rank: int, world_size: int) -> Path:
    """Where the process of rank ``rank`` appends its rows."""
    return out / (ROWS if world_size == 1 else _PART.format(rank=rank))


class RowLog:
    """Appends rows to a JSON-lines file, one whole line per write, from any thread.

    Args:
        path: The file; created if missing, appended to if not; never a symbolic link.

    Raises:
        CamvizError: ``path`` is a symbolic link or not a regular file, or (when appending)
            it was removed or moved since it was opened.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
        try:
            self._descriptor = os.open(path, flags, 0o666)
        except OSError as error:
            if not path.is_symlink():
                raise
            raise CamvizError(_not_a_file(path)) from error
        status = os.fstat(self._descriptor)
        self._identity = (status.st_dev, status.st_ino)
        if not stat.S_ISREG(status.st_mode):
            os.close(self._descriptor)
            raise CamvizError(_not_a_file(path))
        if status.st_size > 0 and os.pread(self._descriptor, 1, status.st_size - 1) != b"\n":
            # A crash cut the last row short: end that line, so the next row stands alone.
            self._write(b"\n")

    def append(self, row: Row) -> None:
        """Write ``row`` as one line, straight to the operating system."""
        line = (dumps(row) + "\n").encode("utf-8")
        with self._lock:
            self._check_in_place()
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

    def _check_in_place(self) -> None:
        """Raise if the file is no longer where it was opened (its folder removed or moved:
        rows appended to it would be lost)."""
        try:
            status = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            status = None
        if status is None or (status.st_dev, status.st_ino) != self._identity:
            raise CamvizError(
                f"the output folder {str(self.path.parent)!r} was removed or moved during the "
                "run, so its rows are lost; run the same command again to start over"
            )

    def close(self, check: bool = True) -> None:
        """Close the file, after checking that it is still in place (see :meth:`append`);
        ``check=False`` when the run already failed, so that its own error is the one told."""
        try:
            if check:
                self._check_in_place()
        finally:
            os.close(self._descriptor)


def _not_a_file(path: Path) -> str:
    return (
        f"{str(path)!r} is a link or not a regular file; camviz writes its manifests only as "
        "files of the output folder: remove it, or pass another --out"
    )


def scan(out: Path) -> Iterator[Row | None]:
    """Every line of ``out``'s log and parts, in the order written: the row, or ``None`` for
    a line that is not a camviz row (see the module docstring). A chunk of lines at a time
    (:func:`batches`), so a million rows cost no more memory than a few hundred."""
    for batch in batches(out):
        yield from batch.rows


class Batch(NamedTuple):
    """The lines of a chunk of a row log, in the order written, and what they hold.

    Attributes:
        rows: Each line's row, ``None`` for a line that is not a camviz row.
        keys: Each row's key (:func:`row_key`), ``None`` beside ``None`` in ``rows``.
        lines: Each line as strict JSON (a line that may hold ``NaN`` or ``Infinity``, only
            by a hand's edit, written again), without its line end.
    """

    rows: list[Row | None]
    keys: list[str | None]
    lines: list[str]


def batches(out: Path) -> Iterator[Batch]:
    """The lines of ``out``'s log and parts, in the order written, a chunk (about 32 KiB) at
    a time: readers of a million rows loop over parallel lists, with a few operations a row."""
    for path in _logs(out):
        for text in _chunks(path):
            lines = text.split("\n")
            if text.endswith("\n"):
                lines.pop()  # the empty "line" after the last line end
            if "\r" in text:
                lines = [line.rstrip("\r") for line in lines]
            rows, keys = parse_lines(lines)
            if "NaN" in text or "Infinity" in text:
                lines = [_strict(row, line) for row, line in zip(rows, lines, strict=True)]
            yield Batch(rows, keys, lines)


def _strict(row: Row | None, line: str) -> str:
    """``line`` as strict JSON (see :class:`Batch`)."""
    return dumps(row) if row is not None and ("NaN" in line or "Infinity" in line) else line


def done_keys(out: Path) -> set[str]:
    """The keys (:func:`row_key`) of the inputs whose latest row says ``"ok"`` and whose
    files all exist in ``out``: what a resumed run need not do again.

    Only the keys of done inputs are kept, never their rows: a row that is done adds its
    key, a later row of the same input that is not removes it again.
    """
    done: set[str] = set()
    with bulk_reading():
        for batch in batches(out):
            for row, key in zip(batch.rows, batch.keys, strict=True):
                if row is None:
                    continue
                files = row["files"]
                if (
                    row.get("status") == "ok"
                    and (row.get("explained") == [] or explained_ok(row))
                    and (not files or all((out / name).is_file() for name in files))
                ):
                    done.add(key)  # type: ignore[arg-type]  # a row has a key
                else:
                    done.discard(key)
    return done


@contextlib.contextmanager
def bulk_reading() -> Iterator[None]:
    """No cyclic garbage collection while the block runs: reading a million rows makes
    millions of short-lived dicts, each batch of which would start a collection that walks
    everything still alive (a third of the time of a scan). Rows hold no cycles, so nothing
    is left for the collector; it is enabled again (if it was) at the end."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _logs(out: Path) -> list[Path]:
    """The row log and the per-process parts in ``out`` that exist (links included)."""
    paths = [out / ROWS, *sorted(out.glob(_PARTS))] if out.is_dir() else []
    return [path for path in paths if path.exists() or path.is_symlink()]


#: Bytes read at a time: a chunk of lines is decoded, split and parsed together. (Small
#: enough that its rows stay in the processor's cache while they are looked at: a scan of
#: chunks of a MiB took 1.3 times as long.)
_CHUNK_BYTES = 1 << 15


def _chunks(path: Path) -> Iterator[str]:
    """The text of a row log, whole lines (about :data:`_CHUNK_BYTES`) at a time, bytes
    that are not UTF-8 replaced (none if it is missing); never through a link, never from a
    special file. (A chunk that ends at a line end decodes as its lines one by one would:
    no UTF-8 sequence holds the byte of a line end.)"""
    if not _checked(path):
        return
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as file:
        while data := file.read(_CHUNK_BYTES):
            if not data.endswith(b"\n"):
                data += file.readline()  # to the line end, or the end of a cut-short file
            yield data.decode("utf-8", "replace")


def _holds_no_row(paths: Sequence[Path]) -> bool:
    """Whether the logs hold JSON objects and not one camviz row (read up to the first row,
    not through a million of them)."""
    objects = False
    for path in paths:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as file:
            for line in file:
                row = parsed(line.decode("utf-8", "replace"))
                if is_row(row):
                    return False
                objects = objects or isinstance(row, dict)
    return objects


def _checked(path: Path) -> bool:
    """Whether ``path`` exists; raise if it is a link or a special file (a FIFO would
    block)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise CamvizError(_not_a_file(path))
    return True


def written_files(out: Path) -> set[Path]:
    """Every file that ``out``'s manifests say camviz wrote there (rows, videos, others).

    These are never inputs: explaining them would explain camviz's own overlays.
    """
    with bulk_reading():
        names = {name for row in scan(out) if row is not None for name in row["files"]}
    summary = read_summary(out) or {}
    names.update(summary_files(summary))
    return {out / name for name in names if isinstance(name, str)}


def summary_files(summary: dict[str, Any]) -> list[Any]:
    """The files a summary lists besides the rows' (its videos and ``other_files``)."""
    videos = summary.get("videos")
    names = (
        [video.get("file") for video in videos if isinstance(video, dict)]
        if isinstance(videos, list)
        else []
    )
    others = summary.get("other_files")
    return names + (others if isinstance(others, list) else [])


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


# --- The summary, manifest.json ------------------------------------------------------------


def read_summary(out: Path) -> dict[str, Any] | None:
    """``out``'s ``manifest.json``: ``None`` if there is none, ``{}`` if it is no JSON object.

    Raises:
        CamvizError: It is a link or not a regular file.
    """
    path = out / SUMMARY
    if not (path.exists() or path.is_symlink()):
        return None
    _checked(path)
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as file:
        text = file.read().decode("utf-8", "replace")
    try:
        content = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return content if isinstance(content, dict) else {}


def write_summary(out: Path, content: dict[str, Any]) -> None:
    """Write ``manifest.json``, atomically (a link there is replaced, never followed)."""
    with atomic_write(out / SUMMARY, "w") as file:
        file.write(dumps(content, indent=2) + "\n")


def folder_used(out: Path) -> bool:
    """Whether camviz has run in ``out``: its ``manifest.json`` holds camviz's settings."""
    return isinstance((read_summary(out) or {}).get("settings"), dict)


def check_folder(out: Path) -> None:
    """Refuse an output folder whose manifests camviz did not write, before any work.

    Raises:
        CamvizError: A manifest is a link or a special file, or a row log lies there without
            camviz's ``manifest.json`` (or holds no camviz row at all).
    """
    logs = _logs(out)
    for path in [*logs, out / SUMMARY]:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise CamvizError(_not_a_file(path))
    if logs and (not folder_used(out) or _holds_no_row(logs)):
        raise CamvizError(
            f"{str(logs[0])!r} was not written by camviz (it is no camviz row log beside "
            f"camviz's {SUMMARY}); move it away or pass another --out, camviz leaves it as it is"
        )


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Refuse to resume into a folder whose results were made with other settings."""
    previous = read_summary(out)
    if previous is None:
        return
    stored = previous.get("settings")
    if stored == settings:
        return
    differences = (
        [
            f"{key} {stored.get(key)!r} there, {value!r} now"
            for key, value in settings.items()
            if stored.get(key) != value
        ]
        if isinstance(stored, dict)
        else ["it has no camviz settings"]
    )
    raise CamvizError(
        f"{out} holds the results of another run ({'; '.join(differences)}); pass another "
        "--out, or delete that folder to start again"
    )


def summary(
    out: Path,
    settings: dict[str, Any],
    merged: Merged,
    videos: list[dict[str, Any]],
    already_done: int,
) -> dict[str, Any]:
    """The complete ``manifest.json`` of a run (see :mod:`camviz.pipeline.job`).

    Args:
        out: The output folder.
        settings: The run's settings.
        merged: What :func:`camviz.pipeline.merging.merge` counted in the rows of this
            run's inputs.
        videos: The overlay videos written.
        already_done: Inputs a previous run had finished.
    """
    current = {video["file"] for video in videos}
    return {
        "model": settings["model"],
        "method": settings["method"],
        "layers": merged.layers,
        "target": settings["target"],
        "complete": True,
        "counts": {
            "ok": merged.ok,
            "error": len(merged.failures),
            "already_done": already_done,
            "empty_maps": merged.empty_maps,
        },
        "skipped_rows": merged.skipped,
        "settings": settings,
        "rows": ROWS,
        "failures": merged.failures,
        "videos": videos,
        "other_files": sorted(
            name for name in merged.earlier if name not in current and (out / name).is_file()
        ),
    }


@dataclass
class Merged:
    """What the merged rows of a run's inputs hold, counted while they are written.

    Attributes:
        ok: Inputs explained (or with nothing to explain).
        empty_maps: Explained maps that are all zero.
        layers: The layers of the first explained input.
        failures: The rows of inputs that failed.
        overlays: For video frames and clips, the first overlay file, by input key.
        earlier: Files earlier runs wrote for other inputs, that no row of this run lists.
        skipped: Lines that were not camviz rows.
    """

    ok: int = 0
    empty_maps: int = 0
    layers: Any = None
    failures: list[Row] = field(default_factory=list)
    overlays: dict[str, str] = field(default_factory=dict)
    earlier: set[str] = field(default_factory=set)
    skipped: int = 0

    def count(self, row: Row) -> None:
        """Count one merged row of this run's inputs."""
        if row.get("status") != "ok":
            self.failures.append(row)
            return
        self.ok += 1
        explained = [entry for entry in row.get("explained") or [] if isinstance(entry, dict)]
        if self.ok == 1:
            self.layers = row.get("layers")
        self.empty_maps += sum(bool(entry.get("empty")) for entry in explained)
        self.earlier.difference_update(row["files"])
        if row.get("frame") is not None and explained:
            files = explained[0].get("files")
            overlay = files.get("overlay") if isinstance(files, dict) else None
            if isinstance(overlay, str):
                self.overlays[row_key(row)] = overlay
