"""CSV files that a spreadsheet opens without running anything a cell holds.

A text cell that starts with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return is read
by spreadsheets as a formula (OWASP's "CSV injection"); file and layer names are text that
the user does not control, so such a cell gets a leading ``'``. A line break inside a cell
starts a new line for a reader that splits on it without honouring quotes, so every line of
a cell is checked, not only the first; and the file ends its rows with ``\\r\\n`` (RFC 4180),
which makes the csv module quote every cell holding a CR or LF, so a proper reader keeps the
cell whole. (With ``\\n`` line ends a lone CR is left unquoted and splits the row.)
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from camviz.io.atomic import atomic_write

Cell = float | int | str | bool | None

# First characters that make a spreadsheet read a cell as a formula (OWASP, CSV injection).
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")

# Splits a text after each CR or LF, keeping them: the lines of a cell as a reader sees them.
_LINES = re.compile(r"(?<=[\r\n])")


def spreadsheet_safe(value: Cell) -> Cell:
    """A text cell with ``'`` in front of each of its lines that would start a formula;
    other values as they are.

    Numbers are written by the csv module as numbers (a negative one stays ``-0.5``).
    """
    if not isinstance(value, str):
        return value
    return "".join(
        "'" + line if line.startswith(_FORMULA_STARTS) else line for line in _LINES.split(value)
    )


def write_csv(
    path: str | os.PathLike[str], header: Sequence[str], rows: Iterable[Sequence[Cell]]
) -> Path:
    """Write ``header`` and ``rows`` as UTF-8 CSV with ``\\r\\n`` line ends, every cell made
    :func:`spreadsheet_safe`, atomically (:func:`~camviz.io.atomic.atomic_write`).

    Returns:
        The path written.
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\r\n")
    writer.writerow([spreadsheet_safe(name) for name in header])
    writer.writerows([spreadsheet_safe(value) for value in row] for row in rows)
    with atomic_write(path, "wb") as file:
        file.write(buffer.getvalue().encode("utf-8"))
    return Path(path)
