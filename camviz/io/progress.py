"""The progress bars of camviz's long loops: tqdm on stderr, without tqdm's monitor thread.

tqdm starts a monitor thread with its first bar, shown or not, and that thread outlives the
bar: it wakes every ten seconds for the rest of the process and takes tqdm's lock. A process
that forks later (a DataLoader's workers, ``multiprocessing`` with fork) copies that lock
held when the fork falls inside its turn, and the child's first bar then waits for it
forever. The monitor only re-draws a bar whose updates stopped coming; camviz's bars are
updated once per image, so they do without it and camviz leaves no thread behind.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

__all__ = ["progress_bar"]


def progress_bar(total: int, unit: str, shown: bool | None, leave: bool = True) -> Any:
    """A tqdm bar of ``total`` ``unit`` on stderr: shown if ``shown``, hidden if ``False``,
    and with ``None`` shown only when stderr is a terminal (tqdm's rule)."""
    return _unmonitored_tqdm()(
        total=total,
        unit=unit,
        file=sys.stderr,
        disable=None if shown is None else not shown,
        leave=leave,
        smoothing=0.1,
    )


@functools.cache
def _unmonitored_tqdm() -> type:
    """tqdm's bar class without the monitor; tqdm is imported on the first bar."""
    from tqdm import tqdm

    class Unmonitored(tqdm):
        monitor_interval = 0  # read by tqdm.__new__: no monitor thread is started

    return Unmonitored
