"""The ``camviz`` command line.

Each subcommand is a module of this package with ``add_parser(subparsers)`` and
``run(args) -> int``; :data:`SUBCOMMANDS` lists them in the order ``--help`` shows them.
Subcommands only parse arguments and call the Python API, and they import torch inside
``run``, so that ``camviz --help`` answers at once.

A :class:`~camviz.core.errors.CamvizError` (a user mistake) is printed as one line on stderr
with exit status 1, and so is an ``OSError`` that no layer below turned into one (a disk
that fails); argument errors exit with 2, as argparse does. An interrupted run (Ctrl-C,
``SIGINT``) stops cleanly with status 130, and so does one that is told to stop
(``SIGTERM``, what batch schedulers and ``torchrun`` send) with status 143 (128 + 15, as a
shell reports it): the folder's lock is released and every file is whole, so the same
command resumes. Every line goes through :func:`camviz.cli.text.echo`, so a file name
cannot write escape sequences to the terminal or break the line, and every warning is one
``camviz: warning:`` line. The process is camviz's own, so it keeps the memory its models
free for their next pass (:func:`camviz.core.allocator.retain_freed_memory`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

from camviz import __version__
from camviz.cli.text import Parser, echo, one_line_warnings
from camviz.core.allocator import retain_freed_memory
from camviz.core.errors import CamvizError, first_line

__all__ = ["main"]

SUBCOMMANDS = (
    "explain",
    "layers",
    "methods",
    "features",
    "inspect",
    "compare",
    "app",
    "units",
    "visualize",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = Parser(
        prog="camviz",
        description="See what a PyTorch vision model looks at.",
    )
    parser.add_argument("--version", action="version", version=f"camviz {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=Parser
    )
    for name in SUBCOMMANDS:
        importlib.import_module(f"camviz.cli.{name}").add_parser(subparsers)
    return parser


class Terminated(KeyboardInterrupt):
    """``SIGTERM``, raised in the main thread: the run stops as after Ctrl-C."""


def _terminate(number: int, frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def _terminated_as_interrupted() -> Iterator[None]:
    """``SIGTERM`` raises :class:`Terminated` while the block runs (in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    retain_freed_memory()  # this process is camviz's: its models reuse what they free
    with one_line_warnings():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The subcommand's status, or a one-line error's."""
    try:
        with _terminated_as_interrupted():
            return args.run(args)
    except CamvizError as error:
        echo(f"camviz: error: {error}", stream=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`camviz methods | head`): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as error:
        where = f": {error.filename}" if error.filename else ""
        echo(f"camviz: error: {error.strerror or first_line(error)}{where}", stream=sys.stderr)
        return 1
    except Terminated:
        print("camviz: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        echo("camviz: interrupted", stream=sys.stderr)
        return 130
