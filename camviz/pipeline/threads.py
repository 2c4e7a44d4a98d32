"""How the folder job shares a CPU's cores between the model and its helpers.

The model's passes run on torch's OpenMP team, whose threads wait for one another at the end
of every parallel region; a helper thread (a DataLoader worker, a writer) that takes a core
from a thread of the team stalls the whole team, hundreds of times a pass. So on a CPU the
job has them **take turns** (:func:`takes_turns`): with no DataLoader workers, the writer
threads also read the images, and the model's pass starts only once they are idle
(:meth:`camviz.pipeline.writer.Writer.wait`); the pass has every core, on torch's setting of
threads, and the helpers have them all between passes. Reading and writing an image cost a
fraction of its pass and spread over the cores; on two cores the job ran at 0.96x of plain
inference this way, 0.73x with its helpers beside the model (README, *Many images, issue 26*).

With DataLoader workers, which read beside the model in other processes, the job instead
runs the model on one thread fewer than torch's setting, at least one, in a process that
keeps its freed memory (:mod:`camviz.core.allocator`, as the ``camviz`` command does), and
leaves that core to the workers and writers. Where freed memory goes back to the kernel, the
model's passes spend much of their time in page faults, which its threads take in parallel,
and torch's setting stays. ``JobSettings.threads`` (``camviz explain --threads``) sets the
number; torch's setting comes back when the job ends. Why, with the figures:
``docs/architecture.md``, *Many images*.

The helpers also yield to the model's thread (:func:`yield_to_model`): the DataLoader
workers and the writer threads run at a niceness :data:`HELPER_NICENESS` above the thread
that started them. On two cores the model's thread, a worker and two writers are four
threads, and the scheduler shares the cores evenly between whichever are ready; the model's
thread, on whose pace the whole job waits, was running three quarters of the time. At a
lower priority the helpers take the time that the model leaves them, and they still keep up,
since their work per image is a fraction of the model's.
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
from collections.abc import Iterator

import torch

from camviz.core.allocator import freed_memory_retained

__all__ = [
    "HELPER_NICENESS",
    "default_workers",
    "model_threads",
    "running_on",
    "takes_turns",
    "yield_to_model",
]

#: How much nicer (lower in priority) the helpers run than the model's thread (Linux).
HELPER_NICENESS = 5
# The nicest a thread can be.
_NICEST = 19


def takes_turns(device: torch.device | None, workers: int) -> bool:
    """Whether the job's helpers take turns with the model's passes on ``device`` (``None``:
    no parameters, so the CPU), with ``workers`` DataLoader processes: on a CPU without
    workers (module docstring)."""
    return _on_cpu(device) and workers == 0


def default_workers(device: torch.device | None) -> int:
    """DataLoader processes for the job on ``device`` when not told: none on a CPU, where
    the writers read between the model's passes (module docstring); elsewhere up to four,
    which decode while the device computes, leaving a core to this process."""
    if _on_cpu(device):
        return 0
    return min(4, max(0, (os.cpu_count() or 1) - 1))


def model_threads(threads: int | None, device: torch.device | None, workers: int = 0) -> int:
    """Torch threads for the model's passes on ``device`` (``None``: no parameters, so the
    CPU) beside ``workers`` DataLoader processes: ``threads`` if given, else the rule of
    the module docstring."""
    if threads is not None:
        return threads
    current = torch.get_num_threads()
    if takes_turns(device, workers) or not freed_memory_retained() or not _on_cpu(device):
        return current
    return max(1, current - 1)


def _on_cpu(device: torch.device | None) -> bool:
    """Whether the model runs on the CPU (``None``: it has no parameters, so it does)."""
    return device is None or device.type == "cpu"


@contextlib.contextmanager
def running_on(threads: int) -> Iterator[None]:
    """The block runs torch on ``threads`` threads; the previous number comes back after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def yield_to_model(_worker_id: int | None = None) -> None:
    """Lower the calling thread's priority by :data:`HELPER_NICENESS` (see the module
    docstring); for a DataLoader's ``worker_init_fn`` and the writer threads.

    Only on Linux, whose niceness is per thread; elsewhere it does nothing. A niceness cannot
    be raised back without privileges, so call it only in a thread or process that ends
    with the work (camviz's own helpers do; so may a loop of one's own, as
    ``DataLoader(..., worker_init_fn=yield_to_model)``).
    """
    if platform.system() != "Linux":
        return
    thread = threading.get_native_id()
    niceness = os.getpriority(os.PRIO_PROCESS, thread)
    os.setpriority(os.PRIO_PROCESS, thread, min(_NICEST, niceness + HELPER_NICENESS))
