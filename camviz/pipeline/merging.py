"""Merge the row log and the per-process parts of a folder job into one ``manifest.jsonl``,
in input order, one row per input, in memory that does not grow with the rows.

Each process appends its rows in nearly its shard's order (the writer threads finish a few
images out of turn, and a resumed run appends a second pass to the same part), and the log
of an earlier run may follow another order. Every input's position is known before a row is
read (the run's inputs are numbered), so the rows are distributed, not sorted: the positions
are cut into buckets of :data:`BUCKET_INPUTS` consecutive inputs, each row joins its
input's bucket in the order the rows were written, and whenever :data:`HELD_ROWS` rows are
held they are spilled, bucket by bucket, to an anonymous temporary file. Then the buckets
are written in turn: a bucket's rows are read back in the order written into a slot per
input (so of the rows of one input the last written is kept) and its inputs written in
order, counted for ``manifest.json`` on the way. Memory holds one bucket's rows and those
held before a spill, not the rows. No row is compared with another, and a row is parsed
once, while it is read (again, to be counted, only a failure, a video frame or a row with
an empty map). The sort of runs merged k-way that this replaced took twice the time.
"""

from __future__ import annotations

import array
import json
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress
from pathlib import Path
from typing import IO, Any

from camviz.io.atomic import atomic_write
from camviz.pipeline import manifest

#: Consecutive input positions merged in memory at a time (about 15 MB of rows of a few
#: hundred bytes).
BUCKET_INPUTS = 1 << 16

#: Rows held in memory before they are spilled to the temporary file.
HELD_ROWS = 1 << 14


# The state of a kept row in its bucket's slots (0: no row). A plain row is one that
# counting needs nothing more of, once the first row has set the layers and while no
# earlier file is left to remove (see _distribute).
_COUNTED, _PLAIN = 1, 2
_COUNTED_ONLY = bytes(int(state == _COUNTED) for state in range(256))  # for bytes.translate


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
    merged = manifest.Merged(earlier=set(earlier))
    with tempfile.TemporaryFile() as spill, manifest.bulk_reading():
        buckets = _Buckets(len(keys), spill)
        _distribute(out, {key: number for number, key in enumerate(keys)}, merged, buckets)
        with atomic_write(out / manifest.ROWS, "w") as file:
            for bucket in range(len(buckets.codes)):
                lines, states = _latest(buckets.chunks(bucket), bucket)
                _count(lines, states, merged)
                text = "\n".join(compress(lines, states))  # type: ignore[arg-type]
                if text:  # a bucket with rows (a row is never an empty line)
                    file.write(text + "\n")
    for part in out.glob("manifest.rank*.jsonl"):
        part.unlink()
    return merged


class _Buckets:
    """The rows of each bucket in the order written, as two lists: each row's code (its
    input position shifted left by two bits, or'ed with its state) and its line. They are
    held in memory, and spilled to ``spill`` (the codes as 64-bit numbers, the lines as
    UTF-8 text, one a line) whenever :data:`HELD_ROWS` are held."""

    def __init__(self, inputs: int, spill: IO[bytes]) -> None:
        count = inputs // BUCKET_INPUTS + 1
        self.codes: list[list[int]] = [[] for _ in range(count)]
        self.lines: list[list[str]] = [[] for _ in range(count)]
        self._spilled: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
        self._spill = spill
        self._held = 0

    def added(self, rows: int) -> None:
        """Count ``rows`` more held rows (at most); spill them all when there are enough."""
        self._held += rows
        if self._held < HELD_ROWS:
            return
        for codes, lines, spilled in zip(self.codes, self.lines, self._spilled, strict=True):
            if codes:
                numbers = array.array("q", codes).tobytes()
                text = "\n".join(lines).encode("utf-8")
                spilled.append((self._spill.tell(), len(numbers), len(text)))
                self._spill.write(numbers)
                self._spill.write(text)
                codes.clear()
                lines.clear()
        self._held = 0

    def chunks(self, bucket: int) -> Iterator[tuple[Sequence[int], list[str]]]:
        """The codes and lines of ``bucket`` in the order written, a chunk at a time; those
        still held are let go."""
        for offset, numbers, text in self._spilled[bucket]:
            self._spill.seek(offset)
            codes = array.array("q", self._spill.read(numbers))
            yield codes, self._spill.read(text).decode("utf-8").split("\n")
        yield self.codes[bucket], self.lines[bucket]
        self.codes[bucket], self.lines[bucket] = [], []


def _distribute(
    out: Path, position: dict[str, int], merged: manifest.Merged, buckets: _Buckets
) -> None:
    """Put the rows of ``out``'s logs in their buckets; rows of other inputs go to
    ``merged.earlier`` (their latest files), lines that are not rows to ``merged.skipped``."""
    others: dict[str, list[str]] = {}
    codes, lines, span = buckets.codes, buckets.lines, BUCKET_INPUTS
    for batch in manifest.batches(out):
        for row, key, line in zip(*batch, strict=True):
            if row is None:
                merged.skipped += 1
                continue
            number = position.get(key)  # type: ignore[arg-type]  # a row has a key
            if number is None:
                others[key] = row["files"]  # type: ignore[index]
                continue
            explained = row.get("explained")
            plain = (  # an explained still image with no empty map
                row.get("status") == "ok"
                and row.get("frame") is None
                and (explained == [] or _no_empty_map(explained))
            )
            codes[number // span].append(number << 2 | (_PLAIN if plain else _COUNTED))
            # The object alone: the reader takes any white space around it (a form feed in a
            # hand-edited line), JSON only spaces, tabs and line ends, and the merged log is
            # parsed as JSON again (below, and by whoever reads it).
            lines[number // span].append(line.strip())
        buckets.added(len(batch.rows))
    merged.earlier.update(name for files in others.values() for name in files)


def _no_empty_map(explained: Any) -> bool:
    """Whether ``explained`` is a list in which no entry says that its map is empty."""
    return isinstance(explained, list) and not any(
        isinstance(entry, dict) and entry.get("empty") for entry in explained
    )


def _latest(
    chunks: Iterable[tuple[Sequence[int], list[str]]], bucket: int
) -> tuple[list[str | None], bytearray]:
    """Of the rows of ``bucket``, given in the order written, each input's last: a slot
    per input of the bucket, with its line and its state (``0`` where no row is)."""
    first = bucket * BUCKET_INPUTS
    lines: list[str | None] = [None] * BUCKET_INPUTS
    states = bytearray(BUCKET_INPUTS)
    for codes, chunk in chunks:
        for code, line in zip(codes, chunk, strict=True):
            slot = (code >> 2) - first
            lines[slot] = line
            states[slot] = code & 3
    return lines, states


def _count(lines: list[str | None], states: bytearray, merged: manifest.Merged) -> None:
    """Count a bucket's rows in ``merged``: a plain one as one more explained row, any
    other parsed again and counted in full."""
    if merged.ok and not merged.earlier:  # every plain row of the bucket is only counted
        merged.ok += states.count(_PLAIN)
        for line in compress(lines, states.translate(_COUNTED_ONLY)):
            merged.count(json.loads(line))  # type: ignore[arg-type]  # a kept slot
        return
    for line, state in zip(compress(lines, states), compress(states, states), strict=True):
        if state == _PLAIN and merged.ok and not merged.earlier:
            merged.ok += 1
        else:
            merged.count(json.loads(line))  # type: ignore[arg-type]
