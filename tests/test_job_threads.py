"""How the folder job shares a CPU's cores with its helpers (:mod:`camviz.pipeline.threads`).

Without DataLoader workers (the default on a CPU) the writer threads take turns with the
model: they read the image files and write the pictures between its passes, never during
one, and the model runs on torch's setting. With workers, in a process that keeps its freed
memory (as the ``camviz`` command's does), the model runs on one torch thread fewer than
torch's setting (at least one), leaving a core to the workers and writers; elsewhere on
torch's setting. ``threads=`` sets the number; torch's setting comes back afterwards, also
when the job fails. The helpers run at a lower priority than the model's thread, which
keeps its own."""

from __future__ import annotations

import os
import platform
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from camviz.core.errors import CamvizError
from camviz.pipeline import dataset, job, threads
from camviz.pipeline.dataset import explain_dataset
from camviz.pipeline.writer import Writer


@pytest.fixture(params=[True, False], ids=["freed memory kept", "glibc's defaults"])
def retained(request, monkeypatch) -> bool:
    """Whether this process keeps its freed memory, as the job is told (CLI tests in the
    same process may have made the setting for real)."""
    monkeypatch.setattr(threads, "freed_memory_retained", lambda: request.param)
    return request.param


def threads_seen(loaded, photos, out, setting: int, **keywords) -> tuple[set[int], int]:
    """The torch threads of the model's passes in a job started under ``setting`` threads,
    and torch's setting after it."""
    seen: set[int] = set()
    handle = loaded.model.register_forward_pre_hook(
        lambda module, args: seen.add(torch.get_num_threads())
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(setting)
    try:
        job.explain_files(photos, out, loaded, **keywords)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
        handle.remove()
    return seen, after


def test_the_model_leaves_a_core_to_the_workers_and_writers(
    synthetic_classifier, make_photos, tmp_path, retained
):
    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24), "b.png": (24, 32)})
    seen, after = threads_seen(synthetic_classifier, photos, tmp_path / "turns", 3)
    assert seen == {3} and after == 3  # the helpers wait for the pass: every core
    seen, after = threads_seen(synthetic_classifier, photos, tmp_path / "beside", 3, workers=1)
    assert seen == ({2} if retained else {3}) and after == 3
    seen, after = threads_seen(synthetic_classifier, photos, tmp_path / "one", 1, workers=1)
    assert seen == {1} and after == 1  # at least one
    seen, after = threads_seen(synthetic_classifier, photos, tmp_path / "asked", 2, threads=3)
    assert seen == {3} and after == 2


def test_the_setting_comes_back_when_the_job_fails_and_bad_counts_are_refused(
    synthetic_classifier, make_photos, tmp_path, retained
):
    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24)})

    def fail(module, args):
        raise KeyboardInterrupt  # what Ctrl-C raises in the middle of a pass

    handle = synthetic_classifier.model.register_forward_pre_hook(fail)
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with pytest.raises(KeyboardInterrupt):
            job.explain_files(photos, tmp_path / "stopped", synthetic_classifier)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(previous)
        handle.remove()
    with pytest.raises(CamvizError, match="threads must be at least 1, not 0"):
        job.explain_files(photos, tmp_path / "none", synthetic_classifier, threads=0)


def niceness() -> int:
    """The calling thread's niceness (Linux keeps one per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class NicenessRecorded(Dataset):
    """Grey photos; each read writes the niceness of the thread that reads it to ``log``."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Image.Image:
        with self.log.open("a") as file:
            file.write(f"{niceness()}\n")
        return Image.new("RGB", (32, 24), (index * 90, 128, 64))


@pytest.mark.skipif(platform.system() != "Linux", reason="niceness is per thread on Linux only")
def test_the_workers_and_writers_yield_to_the_models_thread(synthetic_classifier, tmp_path):
    mine = niceness()
    lower = min(19, mine + threads.HELPER_NICENESS)
    log = tmp_path / "niceness.txt"
    results = list(explain_dataset(synthetic_classifier, NicenessRecorded(log), workers=1))
    assert [result.ok for result in results] == [True, True]
    assert log.read_text().split() == [str(lower)] * 2  # read in the worker
    list(explain_dataset(synthetic_classifier, NicenessRecorded(log), workers=0))
    assert log.read_text().split()[2:] == [str(mine)] * 2  # read in this thread: unchanged
    seen: list[int] = []
    with Writer(threads=2) as writer:
        for _ in range(4):
            writer.submit(lambda: seen.append(niceness()))
    assert seen == [lower] * 4 and niceness() == mine


def test_a_job_leaves_no_thread_behind_its_progress_bar_shown_or_not(
    synthetic_classifier, make_photos, tmp_path, capsys
):
    # tqdm's monitor thread outlives its bars and holds tqdm's lock at times, which a later
    # fork copies held (camviz.io.progress): a job must end with the threads it found.
    photos = make_photos(tmp_path / "photos", {f"{n}.png": (32, 32) for n in range(3)})
    before = set(threading.enumerate())
    for shown in (True, False, None):
        job.explain_files(photos, tmp_path / f"out-{shown}", synthetic_classifier, progress=shown)
        assert set(threading.enumerate()) <= before, f"progress={shown}"
    assert "3/3" in capsys.readouterr().err  # the bar that was shown counted every image


def test_the_writers_read_and_write_between_the_passes_never_during_one(
    synthetic_classifier, make_photos, tmp_path, monkeypatch
):
    # Seven photos in batches of two: four passes, each with the helpers of the one before.
    sizes = {f"{name}.png": (32, 24) for name in "abcdefg"}
    photos = make_photos(tmp_path / "photos", sizes)
    busy = [0]
    lock = threading.Lock()
    busy_at_a_pass: list[int] = []
    readers: set[str] = set()

    def counted(function, seconds):
        def run(*args, **keywords):
            with lock:
                busy[0] += 1
            try:
                time.sleep(seconds)  # a write outlasts the reads queued after it
                return function(*args, **keywords)
            finally:
                with lock:
                    busy[0] -= 1

        return run

    read = counted(dataset._Prepared.read, 0.0)

    def read_and_say_where(self, index):
        readers.add(threading.current_thread().name)
        return read(self, index)

    monkeypatch.setattr(dataset._Prepared, "read", read_and_say_where)
    monkeypatch.setattr(job._Job, "_write", counted(job._Job._write, 0.05))
    handle = synthetic_classifier.model.register_forward_pre_hook(
        lambda module, args: busy_at_a_pass.append(busy[0])
    )
    try:
        summary = job.explain_files(photos, tmp_path / "out", synthetic_classifier, batch_size=2)
    finally:
        handle.remove()
    assert summary["counts"]["ok"] == 7 and len(list((tmp_path / "out").glob("*.png"))) == 7
    assert busy_at_a_pass == [0, 0, 0, 0]
    assert readers and all(name.startswith("camviz-writer-") for name in readers)


def test_a_videos_frames_are_read_in_order_on_the_callers_thread(
    synthetic_classifier, make_photos, tmp_path, monkeypatch
):
    import cv2

    video = tmp_path / "clip.mp4"
    out = cv2.VideoWriter(str(video), cv2.VideoWriter.fourcc(*"mp4v"), 10.0, (32, 24))
    for frame in range(4):
        out.write(np.full((24, 32, 3), 40 * frame, np.uint8))
    out.release()
    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24), "b.png": (24, 32)})
    reads: list[tuple[str, int | None]] = []
    original = dataset.ItemDataset.__getitem__

    def recorded(self, index):
        item = self.items[index]
        reads.append((threading.current_thread().name, item.frame))
        return original(self, index)

    monkeypatch.setattr(dataset.ItemDataset, "__getitem__", recorded)
    with Writer(threads=2) as helpers:
        results = list(
            explain_dataset(synthetic_classifier, [video, *photos], batch_size=3, helpers=helpers)
        )
    assert sorted(result.ok for result in results) == [True] * 6
    here = threading.current_thread().name
    frames = [frame for name, frame in reads if frame is not None]
    assert frames == [0, 1, 2, 3] and {name for name, frame in reads if frame is not None} == {here}
    assert all(name.startswith("camviz-writer-") for name, frame in reads if frame is None)


def test_writer_map_gives_results_in_order_raises_a_calls_error_and_wait_waits():
    finished: list[int] = []

    def slow(value: int) -> None:
        time.sleep(0.02)
        finished.append(value)

    with Writer(threads=3) as writer:
        assert writer.map(lambda value: value * value, range(10)) == [v * v for v in range(10)]
        with pytest.raises(ZeroDivisionError):
            writer.map(lambda value: 1 / value, [2, 1, 0, 4])
        for value in range(6):
            writer.submit(slow, value)
        writer.wait()
        assert sorted(finished) == list(range(6))
        writer.submit(slow, 6)  # a call's error is not held for submit
    assert sorted(finished) == list(range(7))


def test_the_cli_decodes_in_workers_only_beside_a_device():
    assert threads.default_workers(torch.device("cpu")) == 0
    assert threads.default_workers(None) == 0
    expected = min(4, max(0, (os.cpu_count() or 1) - 1))
    assert threads.default_workers(torch.device("cuda")) == expected
