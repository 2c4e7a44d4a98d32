"""The folder job on a CPU, in a process that keeps its freed memory (as the ``camviz``
command's does), runs the model on one torch thread fewer than torch's setting (at least one),
leaving a core to its DataLoader workers and writer threads; elsewhere on torch's setting;
``threads=`` sets the number; torch's setting comes back afterwards, also when the job fails.
Its helpers (DataLoader workers, writer threads) run at a lower priority than the model's
thread, which keeps its own."""

from __future__ import annotations

import os
import platform
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from camviz.core.errors import CamvizError
from camviz.pipeline import job, threads
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
    seen, after = threads_seen(synthetic_classifier, photos, tmp_path / "default", 3)
    assert seen == ({2} if retained else {3}) and after == 3
    seen, after = threads_seen(synthetic_classifier, photos, tmp_path / "one", 1)
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
