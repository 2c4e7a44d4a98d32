"""What the command line prints: safe names, aligned tables, help that shows defaults.

Every line a subcommand prints goes through :func:`echo` (and so :func:`printable`), and
every warning raised while it runs is printed as one ``camviz: warning:`` line
(:func:`one_line_warnings`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import unicodedata
import warnings
from collections.abc import Iterator, Sequence
from typing import NoReturn, TextIO

# Characters that change how a terminal shows what follows: bidirectional overrides and
# isolates (a file name could reverse the rest of the line).
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\x1b``, ``\\n``), on one line.

    File names may hold terminal escape sequences and newlines; printed raw they could
    rewrite the terminal or forge lines, so every name and message the command line
    prints goes through here.
    """
    return "".join(
        _escaped(character)
        if unicodedata.category(character) == "Cc" or character in _BIDI_CONTROLS
        else character
        for character in text
    )


def _escaped(character: str) -> str:
    escaped = repr(character)[1:-1]  # '\n', '\x1b', '\u202e'
    return escaped if escaped != character else f"\\x{ord(character):02x}"


def echo(*lines: str, stream: TextIO | None = None) -> None:
    """Print each of ``lines`` as one line, through :func:`printable`, to stdout (or
    ``stream``). A table is several lines: pass ``*text.splitlines()``."""
    for line in lines:
        print(printable(line), file=stream or sys.stdout)


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """While the block runs, a warning that reaches the terminal is printed as one line,
    ``camviz: warning: <its first line>``, escaped.

    Python's own format adds the source file, the line number and the source line, and
    libraries' messages may span lines (Pillow's, the DataLoader's, camviz's own). Only
    the format changes, so filters and ``warnings.catch_warnings(record=True)`` (pytest's
    ``pytest.warns``) work as before.
    """
    original = warnings.formatwarning
    warnings.formatwarning = _one_line_warning
    try:
        yield
    finally:
        warnings.formatwarning = original


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    lines = str(message).strip().splitlines()
    return f"camviz: warning: {printable(lines[0] if lines else category.__name__)}\n"


def aligned(header: Sequence[str], rows: Sequence[Sequence[str]], gap: int = 2) -> str:
    """``rows`` under ``header`` in left-aligned columns (the last column is not padded)."""
    table = [list(header), *[list(row) for row in rows]]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    lines = []
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)]
        lines.append((" " * gap).join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the text already says it.

    Options without a meaningful default (``None``, ``False``, flags) stay as they are.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text.lower()
            or default in (None, False, argparse.SUPPRESS)
            or action.option_strings == []
        ):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """A parser whose help shows defaults (see :class:`DefaultsFormatter`) and whose errors
    are one line.

    argparse prints the whole usage before an error; camviz's rule is one line that says
    what was wrong and what to do, so the usage is replaced by a pointer to ``--help``.
    """

    def __init__(self, **options: object) -> None:
        options.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(**options)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(
            2,
            printable(f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)")
            + "\n",
        )
