"""Write files on background threads, so that the model never waits for the disk.

Drawing and encoding an image's pictures runs mostly without the GIL (OpenCV, zlib,
libjpeg, numpy), so a few threads overlap it with the next batch; on a CPU they take their
time from the model's threads, which is why the folder job keeps that work small. The
queue is bounded: when the writers fall behind, :meth:`Writer.submit` blocks and the model
waits, instead of results piling up in memory.

Writer threads run torch (the pictures are drawn with it) on one thread each. A torch
operation on a second Python thread would otherwise start a second OpenMP team; with more
OpenMP threads than cores, libgomp stops spinning between parallel regions, and every
parallel region of the model's thread pays for waking its team: a small CNN's training steps
took 1.5x as long while the tracker's idle writer thread lived (``benchmarks/bench_tracker.py``).
``torch.set_num_threads`` sets the calling thread's OpenMP team size and also the default of
threads that start later, so the submitting thread sets that default back once the writers
have taken theirs. They also run at a lower priority than the thread that started them
(:func:`camviz.pipeline.threads.yield_to_model`), so that on a busy CPU the model goes first.

On a CPU the folder job has its writers take turns with the model instead of running beside
it (:mod:`camviz.pipeline.threads`): the same threads also read the next batch's images
(:meth:`Writer.map`), and each pass waits until they are idle (:meth:`Writer.wait`), so the
model's team has every core to itself and the helpers have them all between passes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import torch

from camviz.pipeline.threads import yield_to_model

_STOP = None  # put on the queue once per thread to end it

Item = TypeVar("Item")
Value = TypeVar("Value")


class Writer:
    """A small pool of threads that run write jobs (and, taking turns with the model, the
    reads of :meth:`map`) from a bounded queue.

    Use it as a context manager: leaving the block normally waits for every job; leaving
    it with an exception drops the jobs not yet started (each file is written atomically,
    so nothing is left half-written either way).

    The first exception a job raises is raised again in the submitting thread, by the next
    :meth:`submit` or by :meth:`close`; later jobs are skipped.

    Args:
        threads: Writer threads.
        queue_size: Jobs that may wait before :meth:`submit` blocks.
    """

    def __init__(self, threads: int = 2, queue_size: int = 32) -> None:
        if threads < 1 or queue_size < 1:
            raise ValueError("a Writer needs at least one thread and a queue of one")
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self._count = threads
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None

    def submit(self, job: Callable[..., Any], *args: Any) -> None:
        """Queue ``job(*args)``; blocks while the queue is full.

        Raises:
            Exception: What an earlier job raised.
        """
        self._raise_error()
        self._put(partial(self._unless_failed, job, args))

    def map(self, function: Callable[[Item], Value], items: Iterable[Item]) -> list[Value]:
        """``function`` of each item, run on the threads, in order; blocks until all are
        done. What a call raises is raised here, not held for :meth:`submit`."""
        futures: list[Future[Value]] = []
        for item in items:
            future: Future[Value] = Future()
            self._put(partial(_settle, future, function, item))
            futures.append(future)
        return [future.result() for future in futures]

    def wait(self) -> None:
        """Block until every job queued so far has finished (what one raised stays for
        :meth:`submit` and :meth:`close`)."""
        self._jobs.join()

    def _put(self, job: Callable[[], None]) -> None:
        if not self._threads:
            self._start()
        self._jobs.put(job)

    def _start(self) -> None:
        # Started on first use, so that a DataLoader forks its workers before any thread
        # exists (a fork copies held locks, not the threads that hold them).
        threads_here = torch.get_num_threads()
        started = [threading.Event() for _ in range(self._count)]
        self._threads = [
            threading.Thread(
                target=self._work, args=(event,), name=f"camviz-writer-{number}", daemon=True
            )
            for number, event in enumerate(started)
        ]
        for thread in self._threads:
            thread.start()
        for event in started:
            event.wait()
        torch.set_num_threads(threads_here)

    def close(self) -> None:
        """Wait for every queued job, then raise what a job raised, if anything."""
        self._stop()
        self._raise_error()

    def cancel(self) -> None:
        """Drop the jobs not yet started and wait for the running ones."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
            self._jobs.task_done()
        self._stop()

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.cancel()

    def _stop(self) -> None:
        for _ in self._threads:
            self._jobs.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _work(self, started: threading.Event) -> None:
        torch.get_num_threads()  # torch sets a thread's team size on its first use: first
        torch.set_num_threads(1)  # then this thread's own, which that would overwrite
        yield_to_model()
        started.set()
        while (job := self._jobs.get()) is not _STOP:
            job()
            self._jobs.task_done()
        self._jobs.task_done()

    def _unless_failed(self, job: Callable[..., Any], args: tuple[Any, ...]) -> None:
        """Run a submitted job, unless an earlier one failed; keep what it raises."""
        if self._error is not None:
            return
        try:
            job(*args)
        except BaseException as error:  # handed to the submitting thread
            self._error = self._error or error

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error


def _settle(future: Future[Value], function: Callable[[Item], Value], item: Item) -> None:
    """Give ``future`` what ``function(item)`` returns or raises."""
    try:
        future.set_result(function(item))
    except BaseException as error:  # raised again in the thread that waits for it
        future.set_exception(error)
