"""Merge the row log and the per-process parts of a folder job into one ``manifest.jsonl``,
in input order, one row per input, in memory that does not grow with the rows.

Each process appends its rows in nearly its shard's order (the writer threads finish a few
images out of turn, and a resumed run appends a second pass to the same part), and the log
of an earlier run may follow another order. So the merge is an external merge sort: the
lines are read one at a time, in the order written, in runs of :data:`RUN_ROWS`; each run
is sorted by input position (stably, so that of two rows of one input the later stays
later) and, except the last, spilled to an anonymous temporary file; then the runs are
merged k-way (``heapq.merge``, which keeps the runs' order among equal positions) and, of
the rows of one input, the last written is kept. When the parts are in their shards'
order, this is the k-way merge of the parts; memory holds one run, not the rows.
"""

from __future__ import annotations

import heapq
import json
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from camviz.io.atomic import atomic_write
from camviz.pipeline import manifest

#: Rows sorted in memory at a time (about 20 MB of rows of a few hundred bytes).
RUN_ROWS = 100_000

# (input position, order written, whether the row is plain, the row as JSON). A plain row is
# an explained still image with no empty map: counting it needs no second parse.
_Line = tuple[int, int, bool, str]


def merge(out: Path, keys: Sequence[str], earlier: Iterable[str]) -> manifest.Merged:
    """Write ``manifest.jsonl`` with the latest row of each of ``keys``, in that order.

    The file is replaced atomically, then the per-process parts are removed; a crash in
    between leaves parts whose rows the merged file already holds, which is harmless.

    Args:
        out: The output folder.
        keys: The input keys of this run, in input order.
        earlier: Files the previous summary lists (videos, other files); the files of rows
            of inputs not in ``keys`` join them, and those of this run's rows leave them.

    Returns:
        The counts of the merged rows, for :func:`camviz.pipeline.manifest.summary`.
    """
    position = {key: number for number, key in enumerate(keys)}
    merged = manifest.Merged(earlier=set(earlier))
    with ExitStack() as stack, manifest.bulk_reading():
        runs = _runs(out, position, merged, stack)
        with atomic_write(out / manifest.ROWS, "w") as file:
            for _, _, plain, text in _latest(heapq.merge(*runs)):
                file.write(text + "\n")
                if plain and merged.ok and not merged.earlier:  # the first sets the layers
                    merged.ok += 1
                else:
                    merged.count(json.loads(text))
    for part in out.glob("manifest.rank*.jsonl"):
        part.unlink()
    return merged


def _runs(
    out: Path, position: dict[str, int], merged: manifest.Merged, stack: ExitStack
) -> list[Iterator[_Line]]:
    """The rows of ``out``'s logs in sorted runs; rows of other inputs go to
    ``merged.earlier`` (their latest files), lines that are not rows to ``merged.skipped``."""
    others: dict[str, list[str]] = {}
    runs: list[Iterator[_Line]] = []
    run: list[_Line] = []
    for order, (row, text) in enumerate(manifest.scan_lines(out)):
        if row is None:
            merged.skipped += 1
            continue
        key = manifest.row_key(row)
        number = position.get(key)
        if number is None:
            others[key] = row["files"]
            continue
        run.append((number, order, _plain(row), text))
        if len(run) == RUN_ROWS:
            run.sort()
            runs.append(_spilled(run, stack))
            run = []
    run.sort()
    runs.append(iter(run))
    merged.earlier.update(name for files in others.values() for name in files)
    return runs


def _plain(row: manifest.Row) -> bool:
    """Whether :meth:`~camviz.pipeline.manifest.Merged.count` would only count ``row`` as
    explained (besides removing its files from the earlier ones)."""
    explained = row.get("explained")
    return (
        row.get("status") == "ok"
        and row.get("frame") is None
        and isinstance(explained, list)
        and not any(isinstance(entry, dict) and entry.get("empty") for entry in explained)
    )


def _spilled(run: list[_Line], stack: ExitStack) -> Iterator[_Line]:
    """A sorted run written to an anonymous temporary file, read back one line at a time."""
    file: IO[str] = stack.enter_context(
        tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115  # the stack closes it
    )
    file.writelines(
        f"{number}\t{order}\t{int(plain)}\t{text}\n" for number, order, plain, text in run
    )
    file.seek(0)
    return (_line(text) for text in file)


def _line(text: str) -> _Line:
    number, order, plain, row = text.rstrip("\n").split("\t", 3)
    return int(number), int(order), plain == "1", row


def _latest(lines: Iterator[_Line]) -> Iterator[_Line]:
    """Of consecutive lines of one input position, the last written (the runs are merged
    by position, then by the order written)."""
    previous: _Line | None = None
    for line in lines:
        if previous is not None and previous[0] != line[0]:
            yield previous
        previous = line
    if previous is not None:
        yield previous
