"""What a line of a folder job's row log holds: the checks that tell a camviz row from any
other line (see :mod:`camviz.pipeline.manifest`, whose reliability rules they are), and the
key of the input a row describes. Made for a million lines: each is parsed once, and a
still image's row is told by a few lookups.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

Row = dict[str, Any]

_DECODER = json.JSONDecoder()
_SCAN_ONCE = _DECODER.scan_once  # type: ignore[attr-defined]  # raw_decode without its frame


def item_key(path: str, frame: int | None) -> str:
    """What identifies an input across runs: its path, with ``#N`` added for frame ``N`` of
    a video. (Here, not among the inputs, so that reading a manifest needs no PyTorch.)"""
    return path if frame is None else f"{path}#{frame}"


def row_path(row: Row) -> str:
    """The path of the input a row describes, as this process names it."""
    if "input_bytes" in row:
        return os.fsdecode(base64.b64decode(row["input_bytes"], validate=True))
    return str(row["input"])


def row_key(row: Row) -> str:
    """The key of the input a row describes (see :func:`item_key`)."""
    if "input_bytes" not in row and row.get("frame") is None:
        return str(row["input"])  # most rows: the key is the input (a million in a merge)
    return item_key(row_path(row), row.get("frame"))


def parse_lines(lines: list[str]) -> tuple[list[Row | None], list[str | None]]:
    """Each line's row (:func:`is_row`) and key, ``None`` for a line that is not a row. A
    line that holds one JSON value and nothing else, as camviz writes them, is parsed once
    (any other goes through :func:`parsed`), and a still image's row is told by a few
    lookups (the checks of :func:`is_row` for a row without ``frame`` or ``input_bytes``)."""
    rows: list[Row | None] = []
    keys: list[str | None] = []
    for line in lines:
        try:
            value, end = _SCAN_ONCE(line, 0)
        except (StopIteration, json.JSONDecodeError):  # not JSON, or space before it
            value = parsed(line)
        else:
            if end != len(line):  # space or more after the value
                value = parsed(line)
        if (
            type(value) is dict
            and value.get("frame") is None
            and "input_bytes" not in value
            and type(key := value.get("input")) is str
            and type(files := value.get("files")) is list
            and (not files or all(map(_is_inside, files)))
        ):
            pass  # a still image's row: its key is its input
        elif is_row(value):
            key = row_key(value)
        else:
            value = key = None
        rows.append(value)
        keys.append(key)
    return rows, keys


def parsed(line: str) -> Any:
    """The JSON value of one line; ``None`` for a line that is not JSON (cut short)."""
    if line[:1].isspace():
        line = line.strip()
    try:
        value, end = _DECODER.raw_decode(line)
    except json.JSONDecodeError:
        return None
    return value if end == len(line) or line[end:].isspace() else None


def is_row(row: Any) -> bool:
    """Whether ``row`` is shaped as a camviz row: an object with ``input`` a string,
    ``files`` a list of names inside the output folder, ``frame`` (if any) a whole number or
    null and ``input_bytes`` (if any) base64."""
    if not isinstance(row, dict) or not isinstance(row.get("input"), str):
        return False
    frame = row.get("frame")
    if frame is not None and (not isinstance(frame, int) or isinstance(frame, bool)):
        return False
    if not _inside(row.get("files")):
        return False
    if "input_bytes" in row:
        try:
            base64.b64decode(row["input_bytes"], validate=True)
        except (TypeError, ValueError, binascii.Error):
            return False
    return True


def explained_ok(row: Row) -> bool:
    """Whether ``row`` says its input was explained, with every field a later run reads:
    ``status`` ``ok`` and ``explained`` a list of objects whose ``files`` are names inside
    the output folder."""
    explained = row.get("explained")
    return (
        row.get("status") == "ok"
        and isinstance(explained, list)
        and all(
            isinstance(entry, dict)
            and isinstance(entry.get("files"), dict)
            and _inside(list(entry["files"].values()))
            for entry in explained
        )
    )


def _inside(names: Any) -> bool:
    """Whether ``names`` is a list of relative paths that stay inside the output folder."""
    return isinstance(names, list) and (not names or all(map(_is_inside, names)))


def _is_inside(name: Any) -> bool:
    """Whether ``name`` is a relative path that stays inside the output folder. (Without
    ``..`` in it, no part of its normal form can start with ``..``: most names need no
    ``normpath``.)"""
    return (
        isinstance(name, str)
        and name != ""
        and not os.path.isabs(name)
        and "\x00" not in name
        and (".." not in name or not os.path.normpath(name).startswith(os.pardir))
    )
