"""The command line under faults and hostile input: one test per point of the attack.

Every run goes through the real CLI (``camviz.cli.main``, in this process, so a test costs
the work and not the start of a new Python). Each failure must be one line on stderr, a
non-zero exit, no traceback, and no partial file; each result must be a complete, valid
folder. Runs that must be killed or run at the same time are forked from this process.
"""

from __future__ import annotations

import contextlib
import csv
import faulthandler
import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

import camviz
from camviz.cli import main
from camviz.evaluation.report import image_labels
from camviz.io.csvfiles import spreadsheet_safe
from camviz.io.video import write_video
from camviz.pipeline import lock
from camviz.pipeline.distributed import Context

MODEL = "mobilenet_v3_small"


@pytest.fixture
def run(tiny_mobilenet, capsys):
    """``run(*inputs, out=..., extra=[...])``: ``camviz explain`` with the tiny model;
    returns ``(status, stdout, stderr)``."""

    def explain(*inputs: object, out: Path, extra: tuple[str, ...] = ()) -> tuple:
        capsys.readouterr()
        arguments = [str(path) for path in inputs]
        arguments += ["--model", MODEL, "--weights", tiny_mobilenet, "--out", str(out)]
        arguments += ["--workers", "0", "--quiet", "--no-panel", *extra]
        status = main(["explain", *arguments])
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return explain


@pytest.fixture
def photos(tmp_path, make_photos):
    return make_photos(tmp_path / "photos", {f"{n}.png": (32, 24) for n in range(4)})


@contextlib.contextmanager
def watchdog(seconds: float = 120):
    """Fail loudly (dump the stacks and exit) instead of hanging the whole suite."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def one_line_error(error: str, *fragments: str) -> None:
    assert error.startswith("camviz: error: ") and error.count("\n") == 1, error
    assert "Traceback" not in error
    for fragment in fragments:
        assert fragment in error, error


def strict_json(text: str) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def assert_complete(out: Path, inputs: int) -> list[dict]:
    """A finished folder: strict-JSON manifests, every listed file whole, nothing else."""
    summary = strict_json((out / "manifest.json").read_text())
    rows = [strict_json(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert summary["complete"] and len(rows) == inputs
    listed = {"manifest.json", "manifest.jsonl", *(video["file"] for video in summary["videos"])}
    for row in rows:
        for name in row["files"]:
            listed.add(name)
            with Image.open(out / name) as image:
                image.load()
    present = {str(path.relative_to(out)) for path in out.rglob("*") if path.is_file()}
    assert present == listed  # no temporary, no lock, no stray file
    return rows


def fork(target) -> int:
    """Run ``target()`` in a forked child that exits with its return value; returns the pid."""
    pid = os.fork()
    if pid == 0:  # the child
        code = 70
        try:
            torch.set_num_threads(1)  # as DataLoader workers do after a fork
            with (
                open(os.devnull, "w") as quiet,
                contextlib.redirect_stdout(quiet),
                contextlib.redirect_stderr(quiet),
            ):
                code = target()
        finally:
            os._exit(code)
    return pid


def exit_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# --- 1. Two runs into one output folder --------------------------------------------------------


def test_a_second_job_into_a_held_folder_stops_and_touches_nothing(run, photos, tmp_path):
    out = tmp_path / "out"
    assert run(*photos, out=out)[0] == 0
    before = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    (out / ".0_overlay.png.0123456789ab.tmp").write_bytes(b"the first job is writing this")
    with lock.locked(out, Context()):  # a live job of this host holds the folder
        status, _, error = run(*photos, out=out, extra=("--alpha", "0.7"))
    one_line_error(error, "is in use by another camviz run", f"process {os.getpid()}")
    assert status == 1
    assert (out / ".0_overlay.png.0123456789ab.tmp").exists()  # not cleaned away
    after = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    assert after == {
        **before,
        ".0_overlay.png.0123456789ab.tmp": after[".0_overlay.png.0123456789ab.tmp"],
    }


def test_two_jobs_started_together_one_runs_the_other_refuses(run, photos, tmp_path):
    out = tmp_path / "out"
    real_save = camviz.pipeline.job._save_png

    def slow_save(image, path):  # both jobs must still be running when the other starts
        time.sleep(0.3)
        real_save(image, path)

    read, write = os.pipe()

    def job() -> int:
        os.read(read, 1)  # start together
        camviz.pipeline.job._save_png = slow_save
        return run(*photos, out=out)[0]

    with watchdog():
        pids = [fork(job), fork(job)]
        os.write(write, b"go")
        statuses = sorted(exit_status(pid) for pid in pids)
    assert statuses == [0, 1]
    assert_complete(out, len(photos))


def test_a_stale_lock_is_taken_over_and_a_live_one_is_not(run, photos, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    held = out / lock.LOCK

    def holder(host: str, pid: int, age: float) -> None:
        held.write_text(json.dumps({"host": host, "pid": pid, "started": "then", "token": "x"}))
        os.utime(held, (time.time() - age, time.time() - age))

    dead = subprocess.Popen(["true"])
    dead.wait()
    holder(lock.socket.gethostname(), dead.pid, age=0)  # killed a moment ago on this host
    assert run(photos[0], out=out)[0] == 0
    holder("elsewhere", 1, age=2)  # another host, heartbeat fresh: its pid means nothing here
    status, _, error = run(photos[0], out=out)
    assert status == 1 and "process 1 on elsewhere" in error
    holder("elsewhere", 1, age=lock.STALE + 1)  # its heartbeat stopped
    assert run(photos[0], out=out)[0] == 0 and not held.exists()


def test_the_lock_heartbeat_keeps_it_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT", 0.05)
    out = tmp_path / "out"
    with lock.locked(out, Context()):
        old = time.time() - 100
        os.utime(out / lock.LOCK, (old, old))
        time.sleep(0.3)
        assert time.time() - (out / lock.LOCK).stat().st_mtime < 5
    assert not out.exists()  # created for the job, empty again: removed


# --- 2. Outputs read back as inputs ------------------------------------------------------------


def test_outputs_are_never_taken_as_inputs(run, make_photos, tmp_path):
    folder = tmp_path / "self"
    make_photos(folder, {"cat.png": (32, 24), "cup.png": (24, 32)})
    for inputs in ([folder], [folder], [f"{folder}/*.png"]):
        assert run(*inputs, out=folder)[0] == 0
    rows = [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]
    assert sorted(Path(row["input"]).name for row in rows) == ["cat.png", "cup.png"]
    assert not list(folder.glob("*_overlay_overlay*"))
    # A run killed after writing an overlay but before its row: the overlay is still no input.
    (folder / "manifest.jsonl").write_text(json.dumps(rows[0]) + "\n")
    make_photos(folder, {"new.png": (32, 24)})  # the user's own file there stays an input
    status, printed, _ = run(folder, out=folder)
    assert status == 0 and "explained 2 of the 2 inputs left (1 were already done)" in printed
    names = sorted(Path(row["input"]).name for row in assert_complete_rows(folder))
    assert names == ["cat.png", "cup.png", "new.png"]


def assert_complete_rows(out: Path) -> list[dict]:
    return [strict_json(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


# --- 3. and 4. Long names, name collisions -----------------------------------------------------


def test_long_names_are_shortened_stably(run, make_photos, tmp_path):
    name = "é" * 123 + "x.png"  # 251 bytes: legal, but NAME_overlay.png is not
    folder = tmp_path / "long"
    make_photos(folder, {name: (32, 24), "é" * 123 + "y.png": (24, 32)})
    out = tmp_path / "out"
    assert run(folder, out=out)[0] == 0
    rows = assert_complete(out, 2)
    files = [row["files"][0] for row in rows]
    assert len(set(files)) == 2 and all(len(file.encode()) <= 255 for file in files)
    status, printed, _ = run(folder, out=out)  # a resumed run finds the same names
    assert status == 0 and printed.startswith("all 2 inputs were already done")


def test_output_names_never_collide(run, make_photos, tmp_path):
    folder = tmp_path / "inputs"
    folder.mkdir()
    frames = make_photos(tmp_path / "frames", {"f0.png": (32, 24), "f1.png": (32, 24)})
    write_video(frames, folder / "clip.mp4", fps=5)
    make_photos(folder, {"clip_frames/000000.png": (32, 24), "A.png": (24, 32), "a.png": (32, 24)})
    out = tmp_path / "out"
    status, _, error = run(folder, out=out)
    assert status == 0, error
    rows = assert_complete(out, 5)  # two frames, three images
    files = [name for row in rows for name in row["files"]]
    assert len({name.casefold() for name in files}) == len(files) == 5
    assert all(row["status"] == "ok" for row in rows)


# --- 5. Tracebacks instead of one line ---------------------------------------------------------


@pytest.mark.parametrize("device", ["meta", "cuda:99", "nowhere"])
def test_a_device_that_cannot_run_the_model_is_one_line(run, photos, tmp_path, device):
    status, _, error = run(photos[0], out=tmp_path / "out", extra=("--device", device))
    assert status == 1
    one_line_error(error, repr(device.split(":")[0]) if device == "meta" else device)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", ["0", "-5", "100000"])
def test_layers_refuses_a_size_out_of_range(size, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["layers", "--size", size])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "must be between 1 and 2048" in error
    assert error.count("\n") == 1 and "`camviz layers --help` lists the options" in error


@contextlib.contextmanager
def small_disk(folder: Path):
    """``folder`` on a disk that is nearly full; yields a function that makes room.

    A 64 KiB tmpfs where this process may mount one (root); otherwise every file that
    grows past 6 KiB fails with EFBIG, as a full disk fails with ENOSPC.
    """
    import resource

    folder.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
            capture_output=True,
        ).returncode
        == 0
    )
    if mounted:
        try:
            yield lambda: subprocess.run(
                ["mount", "-o", "remount,size=16m", str(folder)], check=True
            )
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=False)
        return
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write, not the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (6 * 1024, limits[1]))
    try:
        yield lambda: resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_disk_that_fills_up_gives_one_line_clean_files_and_resumes(run, make_photos, tmp_path):
    sizes = {f"{n}.png": (96, 72) for n in range(12)}
    photos = make_photos(tmp_path / "photos", sizes)
    out = tmp_path / "disk" / "out"
    with small_disk(tmp_path / "disk") as make_room:
        status, _, error = run(*photos, out=out, extra=("--batch-size", "2"))
        assert status == 1
        one_line_error(error, "make room", "run the same command again")
        assert not [path for path in out.rglob("*") if path.name.endswith(".tmp")]
        if (out / "manifest.jsonl").exists():  # every row whole
            done = assert_complete_rows(out)
            for row in done:
                for name in row["files"]:
                    with Image.open(out / name) as image:
                        image.load()
        make_room()
        status, _, error = run(*photos, out=out, extra=("--batch-size", "2"))
        assert status == 0, error
        assert_complete(out, len(photos))


# --- 6. NaN results ----------------------------------------------------------------------------


class NanForBrightImages(torch.nn.Module):
    """Two classes; the output is NaN for images brighter than the middle grey."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        pooled = self.features(inputs).relu().mean((2, 3))
        bright = inputs.mean((1, 2, 3), keepdim=True).squeeze(-1).squeeze(-1) > 0.5
        return torch.where(bright, torch.nan, self.head(pooled))


def test_a_non_finite_result_is_an_error_row_and_manifests_are_strict_json(tmp_path):
    from camviz.io.images import Preprocess
    from camviz.io.models import LoadedModel
    from camviz.pipeline.job import Outputs, explain_files

    torch.manual_seed(0)
    loaded = LoadedModel(
        model=NanForBrightImages().eval(),
        preprocess=Preprocess(size=16, mean=(0, 0, 0), std=(1, 1, 1)),
        categories=["dark", "bright"],
        name="nan-for-bright",
        default_layer="features",
    )
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (16, 16), (30, 60, 20)).save(images / "dark.png")
    Image.new("RGB", (16, 16), (250, 240, 230)).save(images / "bright.png")
    out = tmp_path / "out"
    summary = explain_files(images, out, loaded, outputs=Outputs(panel=False))
    rows = assert_complete(out, 2)
    bright, dark = rows
    assert dark["status"] == "ok" and bright["status"] == "error"
    assert "NaN or Inf" in bright["reason"] and bright["files"] == []
    assert summary["counts"] == {"ok": 1, "error": 1, "already_done": 0, "empty_maps": 0}
    assert summary["failures"] == [bright]


def test_a_checkpoint_of_nan_weights_is_refused_in_one_line(run, photos, tmp_path, tiny_mobilenet):
    weights = tmp_path / "nan.pt"
    state = torch.load(tiny_mobilenet, weights_only=True)
    torch.save(
        {
            key: value * torch.nan if value.is_floating_point() else value
            for key, value in state.items()
        },
        weights,
    )
    status, _, error = run(photos[0], out=tmp_path / "out", extra=("--weights", str(weights)))
    assert status == 1
    one_line_error(error, "NaN or Inf")
    assert not (tmp_path / "out").exists()


# --- 7. Special files --------------------------------------------------------------------------


def test_a_link_to_a_fifo_is_skipped_with_a_row(run, photos, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "photos" / "link.png"
    link.symlink_to(fifo)
    out = tmp_path / "out"
    with watchdog(60):
        status, _, error = run(photos[0], link, tmp_path / "photos", out=out)
    assert status == 0
    rows = assert_complete(out, len(photos) + 1)
    (skipped,) = [row for row in rows if row["status"] == "error"]
    assert (
        skipped["input"].endswith("link.png") and "not a regular file (a FIFO)" in skipped["reason"]
    )
    assert error.count("\n") == 1 and "not a regular file" in error


# --- 8. Hostile names in outputs ---------------------------------------------------------------


def test_names_reach_the_terminal_escaped_and_ffmpeg_stays_quiet(
    photos, tmp_path, tiny_mobilenet, capfd
):
    hostile = tmp_path / "photos" / "evil\x1b[2J\nname.png"
    hostile.write_text("not a picture")
    broken = tmp_path / "photos" / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 50)
    model = ["--model", MODEL, "--weights", tiny_mobilenet, "--workers", "0", "--quiet"]
    capfd.readouterr()
    status = main(["explain", str(tmp_path / "photos"), *model, "--out", str(tmp_path / "out")])
    error = capfd.readouterr().err  # FFmpeg writes to the file descriptor itself
    assert status == 0
    assert "\x1b" not in error and "evil\\x1b[2J\\nname.png" in error
    assert all(line.startswith("camviz: skipped ") for line in error.splitlines()), error
    assert "moov atom" not in error and "broken.mp4" in error


def test_compare_neutralises_formulas_names_images_apart_and_checks_out_first(
    tmp_path, make_photos, tiny_mobilenet, capsys
):
    assert [spreadsheet_safe(value) for value in ("=1+2", "+a", "-b", "@c", "\tx", "ok", -0.5)] == [
        "'=1+2",
        "'+a",
        "'-b",
        "'@c",
        "'\tx",
        "ok",
        -0.5,
    ]
    folder = tmp_path / "images"
    paths = make_photos(
        folder, {"a/x.png": (32, 24), "b/x.png": (24, 32), "=HYPERLINK(1).png": (32, 24)}
    )
    assert image_labels(paths) == ["a/x.png", "b/x.png", "=HYPERLINK(1).png"]
    model = ["--model", MODEL, "--weights", tiny_mobilenet, "--methods", "gradcam", "--steps", "2"]
    a_file = tmp_path / "taken.csv"
    a_file.write_text("mine")
    # Checked before anything else: the model (whose weights are missing here) never loads.
    missing = ["--model", MODEL, "--weights", str(tmp_path / "missing.pt")]
    assert main(["compare", *map(str, paths), *missing, "--out", str(a_file)]) == 1
    error = capsys.readouterr().err
    one_line_error(error, "is a file")
    assert "missing.pt" not in error and a_file.read_text() == "mine"

    out = tmp_path / "out"
    assert main(["compare", *map(str, paths), *model, "--out", str(out)]) == 0
    lines = (out / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in lines[1:]] == [
        "a/x.png",
        "b/x.png",
        "'=HYPERLINK(1).png",
    ]


# --- 10. Rerun with fewer inputs ---------------------------------------------------------------


def test_a_rerun_with_fewer_inputs_lists_the_files_of_no_current_input(run, photos, tmp_path):
    out = tmp_path / "out"
    assert run(*photos, out=out)[0] == 0
    status, printed, error = run(*photos[:2], out=out)
    assert status == 0 and printed.startswith("all 2 inputs were already done")
    summary = strict_json((out / "manifest.json").read_text())
    assert summary["other_files"] == ["2_overlay.png", "3_overlay.png"]
    assert "2 file(s) in" in error and "other_files" in error
    status, printed, _ = run(*photos, out=out)  # asked for again: explained again
    assert status == 0 and "explained 2 of the 2 inputs left (2 were already done)" in printed
    assert strict_json((out / "manifest.json").read_text())["other_files"] == []


# --- kill -9 at random points ------------------------------------------------------------------


def test_kill_9_at_random_points_then_a_complete_valid_folder(
    run, make_photos, tmp_path, assert_rows_match
):
    photos = make_photos(tmp_path / "photos", {f"{n}.png": (32, 24) for n in range(8)})
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run(*photos, out=clean, extra=("--batch-size", "2"))[0] == 0
    chance = random.Random(13)
    with watchdog():
        for _ in range(5):
            pid = fork(lambda: run(*photos, out=killed, extra=("--batch-size", "2"))[0])
            time.sleep(chance.uniform(0.0, 0.6))
            os.kill(pid, signal.SIGKILL)
            exit_status(pid)
    status, _, error = run(*photos, out=killed, extra=("--batch-size", "2"))
    assert status == 0, error
    rows = assert_complete(killed, len(photos))
    assert_rows_match(rows, assert_complete_rows(clean))


# --- 11. One model, two threads ----------------------------------------------------------------


class Gate(torch.nn.Module):
    """Identity that, on its first call, says it was entered and waits to be released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        self.hooks_seen: list[int] = []

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(30)
        return inputs


def test_two_threads_explaining_with_one_model_take_turns(resnet18):
    gate = Gate()
    model = torch.nn.Sequential(gate, resnet18).eval()
    torch.manual_seed(3)
    first, second = torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32)
    layer = "1.layer4"
    gate.release.set()
    alone = [camviz.explain(model, x, layer=layer).heatmaps for x in (first, second)]
    gate.entered.clear()
    gate.release.clear()
    results: dict[str, torch.Tensor] = {}

    def explain(name: str, inputs: torch.Tensor) -> None:
        results[name] = camviz.explain(model, inputs, layer=layer).heatmaps

    one = threading.Thread(target=explain, args=("first", first))
    one.start()
    assert gate.entered.wait(30)
    two = threading.Thread(target=explain, args=("second", second))
    two.start()
    time.sleep(0.3)
    # The first call is inside its forward pass; the second has not hooked the model.
    assert len(resnet18.layer4._forward_hooks) == 1 and "second" not in results
    gate.release.set()
    one.join(30)
    two.join(30)
    torch.testing.assert_close(results["first"], alone[0])
    torch.testing.assert_close(results["second"], alone[1])
    assert len(resnet18.layer4._forward_hooks) == 0


# --- 12. Untrusted checkpoints -----------------------------------------------------------------


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this would run",))


def test_a_checkpoint_that_would_run_code_is_refused_in_one_clear_line(run, photos, tmp_path):
    weights = tmp_path / "evil.pt"
    torch.save({"weight": RunsCode()}, weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status, _, error = run(photos[0], out=tmp_path / "out", extra=("--weights", str(weights)))
    assert status == 1 and not caught
    one_line_error(error, "not a plain state_dict", "posix.system", "loads weights only")
    assert "UnpicklingError" not in error


def test_a_checkpoint_with_keys_that_are_not_names_is_refused_in_one_line(run, photos, tmp_path):
    weights = tmp_path / "k.pt"
    torch.save({1: torch.zeros(3)}, weights)
    out = tmp_path / "out"
    status, _, error = run(photos[0], out=out, extra=("--weights", str(weights)))
    assert status == 1
    one_line_error(error, str(weights), "not all parameter names", "int 1", "model.state_dict()")
    assert "startswith" not in error
    assert not out.exists() or not any(out.iterdir())


# --- The CLI as people read it -----------------------------------------------------------------


def test_help_layers_and_methods_read_well(capsys, tiny_mobilenet):
    with pytest.raises(SystemExit):
        main(["explain", "--help"])
    help_text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for default in ("camviz-out", "(default: jet)", "(default: 0.5)", "(default: 16)"):
        assert default in help_text
    assert re.search(r"--workers N .*\(default: \d+\)", help_text)

    assert main(["layers", "--model", MODEL, "--weights", tiny_mobilenet, "--size", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["layer", "type", "output", "shape"]
    marked = [line for line in lines if "<- default target layer" in line]
    assert len(marked) == 1 and marked[0].split()[0] == "features"
    shape_column = {line.index("(1, ") for line in lines[1:]}
    assert len(shape_column) == 1  # aligned

    assert main(["methods"]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].split()[:3] == ["method", "family", "needs"]
    listed = [line.split()[0] for line in table[1:] if line and not line.startswith("Papers")]
    assert sorted(listed) == sorted(camviz.cams.names())
    assert max(map(len, table)) < 145  # the longest name, transformer_attribution, included
    assert main(["methods", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == camviz.cams.table()


def test_an_unknown_layer_points_to_camviz_layers(run, photos, tmp_path):
    status, _, error = run(photos[0], out=tmp_path / "out", extra=("--layer", "layer4"))
    assert status == 1
    one_line_error(error, "no layer named 'layer4'", "camviz layers")


def test_features_tiles_are_readable(tmp_path, tiny_mobilenet, photos, capsys):
    out = tmp_path / "features"
    arguments = ["features", str(photos[0]), "--model", MODEL, "--weights", tiny_mobilenet]
    assert main([*arguments, "--layer", "features.12", "--out", str(out), "--channels", "4"]) == 0
    with Image.open(out / "features.12_grid.png") as grid:
        # 4 channels of 7 x 10 at 224 x 298: each drawn 10 times larger, 2 x 2 tiles.
        assert grid.size == (2 * 100 + 3, 2 * 70 + 3)


# --- 11. One image read by a command, and sizes beyond any machine -----------------------------


def forked_cli(arguments: list[str], tmp_path: Path, seconds: float = 60) -> tuple[int, str]:
    """``main(arguments)`` in a forked child, so that a hang fails this test instead of
    blocking the suite: its exit status and stderr."""
    stderr = tmp_path / "stderr.txt"
    pid = os.fork()
    if pid == 0:  # the child
        code = 70
        try:
            torch.set_num_threads(1)  # as DataLoader workers do after a fork
            with (
                open(os.devnull, "w") as quiet,
                open(stderr, "w") as errors,
                contextlib.redirect_stdout(quiet),
                contextlib.redirect_stderr(errors),
            ):
                code = main(arguments)
        finally:
            os._exit(code)
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), stderr.read_text()
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"camviz {arguments[0]} still runs after {seconds} s: it hangs")
        time.sleep(0.05)


@pytest.mark.parametrize("command", ["inspect", "features", "compare", "explain --similar-to"])
def test_a_fifo_as_a_commands_image_is_one_line_not_a_hang(
    command, tmp_path, photos, tiny_mobilenet
):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    model = ["--model", MODEL, "--weights", tiny_mobilenet]
    out = ["--out", str(tmp_path / "out")]
    arguments = {
        "inspect": ["inspect", str(fifo), *model, "--csv", str(tmp_path / "out" / "t.csv")],
        "features": ["features", str(fifo), *model, "--layer", "features.0", *out],
        "compare": ["compare", str(photos[0]), str(fifo), *model, "--methods", "gradcam", *out],
        "explain --similar-to": [
            "explain",
            str(photos[0]),
            *model,
            "--similar-to",
            str(fifo),
            *out,
        ],
    }[command]
    status, error = forked_cli(arguments, tmp_path)
    assert status == 1
    one_line_error(error, "pipe.png is not a regular file (a FIFO)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("option", "largest", "command"),
    [
        ("--input-size", "4096", ["explain", "x.png"]),
        ("--tile", "1024", ["features", "x.png", "--layer", "features.0"]),
        ("--steps", "1000", ["compare", "x.png"]),
        ("--workers", str(os.cpu_count()), ["explain", "x.png"]),
    ],
)
def test_sizes_and_counts_beyond_what_a_machine_has_are_refused(option, largest, command, capsys):
    from camviz.cli import build_parser

    name = option.lstrip("-").replace("-", "_")
    assert getattr(build_parser().parse_args([*command, option, largest]), name) == int(largest)
    for beyond in (str(int(largest) + 1), "-1"):
        with pytest.raises(SystemExit) as exited:
            main([*command, option, beyond])
        error = capsys.readouterr().err
        assert exited.value.code == 2 and "Traceback" not in error
        low = 0 if option == "--workers" else 1
        assert f"error: argument {option}: must be between {low} and {largest}" in error
        assert error.count("\n") == 1  # one line: no usage block before it


def test_an_image_too_elongated_once_preprocessed_is_a_failed_row(run, photos, tmp_path):
    # 1 x 600 pixels, a few hundred bytes: its shorter side at 224 would be 224 x 134400.
    Image.new("RGB", (1, 600), "white").save(tmp_path / "photos" / "strip.png")
    out = tmp_path / "out"
    status, _, error = run(tmp_path / "photos", out=out)
    assert status == 0
    rows = {Path(row["input"]).name: row for row in assert_complete(out, len(photos) + 1)}
    assert rows.pop("strip.png")["reason"] == (
        "an image of 1x600 pixels would preprocess to 224x134400, more elongated than 16:1; "
        "crop it to a less elongated part, or pad it"
    )
    assert {row["status"] for row in rows.values()} == {"ok"}
    assert "strip.png" in error and error.count("\n") == 1


def test_preprocess_refuses_a_tensor_too_large_or_too_elongated_before_making_it(
    tmp_path, make_photos, tiny_mobilenet, monkeypatch
):
    from camviz.core.errors import CamvizError
    from camviz.io.images import Preprocess
    from camviz.pipeline import dataset

    with pytest.raises(CamvizError, match=r"to 4096x16384 \(67\.1 megapixels\), more than the"):
        Preprocess(size=4096)(Image.new("RGB", (1000, 4000)))
    pixels = torch.zeros(3, 1, 600, dtype=torch.uint8)  # decoded on a GPU, say
    with pytest.raises(CamvizError, match="would preprocess to 134400x224, more elongated"):
        Preprocess()(pixels)
    # The folder job's device-decoding path (JPEGs decoded by torchvision, on the CPU here)
    # makes it a failed row too, and the good image in the same batch is explained.
    decoded, decode = [], dataset.decode

    def counted(encoded, device):
        decoded.extend(encoded)
        return decode(encoded, device)

    monkeypatch.setattr(dataset, "device_decodes", lambda device, preprocess: True)
    monkeypatch.setattr(dataset, "decode", counted)
    good = make_photos(tmp_path, {"good.jpg": (32, 24)})[0]
    Image.new("RGB", (1, 600), "white").save(tmp_path / "strip.jpg")
    loaded = camviz.models.load(MODEL, weights=tiny_mobilenet)
    results = list(camviz.explain_dataset(loaded, [good, tmp_path / "strip.jpg"]))
    assert len(decoded) == 2
    by_name = {Path(str(result.path)).name: result for result in results}
    assert by_name["good.jpg"].ok and by_name["good.jpg"].heatmaps is not None
    assert "more elongated than 16:1" in str(by_name["strip.jpg"].reason)


# --- 12. Spreadsheets, terminals and warnings --------------------------------------------------


def assert_safe_for_spreadsheets(path: Path, rows: int) -> list[list[str]]:
    """The CSV's rows as csv.reader reads them (``rows`` of them after the header), and no
    cell that starts a formula, also for a reader that splits lines at every CR or LF."""
    with open(path, newline="", encoding="utf-8") as file:
        table = list(csv.reader(file))
    assert len(table) == rows + 1 and len({len(row) for row in table}) == 1
    text = path.read_bytes().decode("utf-8")
    naive = [cell.lstrip('"') for line in re.split(r"[\r\n]", text) for cell in line.split(",")]
    formulas = [cell for cell in naive if cell.startswith(("=", "+", "-", "@"))]
    assert all(re.fullmatch(r"-[0-9.e+-]+", cell) for cell in formulas), formulas  # negatives
    return table


def test_a_carriage_return_in_a_name_cannot_start_a_formula_in_a_csv(
    tmp_path, make_photos, tiny_mobilenet
):
    names = ["\r=1+1.png", "a\n@SUM(1).png", "plain.png"]
    paths = make_photos(tmp_path / "images", {name: (32, 24) for name in names})
    model = ["--model", MODEL, "--weights", tiny_mobilenet, "--methods", "gradcam", "--steps", "2"]
    assert main(["compare", *map(str, paths), *model, "--out", str(tmp_path / "out")]) == 0
    table = assert_safe_for_spreadsheets(tmp_path / "out" / "metrics.csv", rows=3)
    assert [row[0] for row in table[1:]] == ["'\r'=1+1.png", "a\n'@SUM(1).png", "plain.png"]
    # The layer table of `camviz inspect --csv` holds the model's own names.
    model = nn.Sequential()
    model.add_module("\r=cmd|calc", nn.Conv2d(3, 2, 1))
    model.add_module("-head", nn.ReLU())
    table = camviz.inspect(model, torch.rand(1, 3, 4, 4))
    rows = assert_safe_for_spreadsheets(table.to_csv(tmp_path / "layers.csv"), rows=2)
    assert [row[0] for row in rows[1:]] == ["'\r'=cmd|calc", "'-head"]


def test_features_and_inspect_print_paths_escaped(tmp_path, photos, tiny_mobilenet, capsys):
    model = ["--model", MODEL, "--weights", tiny_mobilenet]
    out = tmp_path / "red\x1b[31m"
    features = ["features", str(photos[0]), *model, "--layer", "features.0", "--tile", "1"]
    assert main([*features, "--out", str(out)]) == 0
    inspect = ["inspect", str(photos[0]), *model, "--layer", "features.0"]
    assert main([*inspect, "--csv", str(out / "t.csv"), "--json", str(out / "t.json")]) == 0
    printed = capsys.readouterr().out
    assert "\x1b" not in printed
    assert printed.count("red\\x1b[31m") == 4  # the grid, the figure, the CSV and the JSON


def corrupt_exif_jpeg(path: Path) -> Path:
    """A JPEG whose EXIF block says it holds 5 tags and holds one: Pillow decodes the
    pixels and warns "Corrupt EXIF data" (a multi-line warning when printed by Python)."""
    entry = struct.pack(">HHI4s", 0x0112, 3, 1, b"\x00\x01\x00\x00")  # orientation 1
    tiff = b"MM\x00*" + struct.pack(">I", 8) + struct.pack(">H", 5) + entry
    Image.new("RGB", (32, 24), "red").save(path, exif=b"Exif\x00\x00" + tiff)
    return path


def test_warnings_are_one_camviz_line_each(tmp_path, tiny_mobilenet):
    photo = corrupt_exif_jpeg(tmp_path / "photo.jpg")
    with pytest.warns(UserWarning, match=r"photo\.jpg: Corrupt EXIF data"):
        camviz.load_image(photo)  # the warning says which file it is about
    # A real process: its warnings reach stderr as Python prints them (pytest records them).
    command = [sys.executable, "-m", "camviz", "explain", str(photo), "--model", MODEL]
    command += ["--weights", tiny_mobilenet, "--method", "scorecam", "--layer", "features.0"]
    command += ["--memory-budget", "1", "--input-size", "32", "--workers", "0", "--quiet"]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(
        [*command, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines == [
        f"camviz: warning: {photo}: Corrupt EXIF data.  Expecting to read 12 bytes but only got 0.",
        "camviz: warning: scorecam: memory_budget 1 B is less than one perturbed copy needs "
        + lines[1].split("needs ")[-1],
    ]
    assert lines[1].endswith("; running one copy per pass")


class RowsOfItsOwn(nn.Module):
    """A model that takes only the batch it is told: ``forward(image, rows)`` concatenates its
    features with ``rows`` copies of a one-row table it holds. Neither a broadcast batch of
    ablated copies nor a batch of whole-network copies fits it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.table = nn.Parameter(torch.randn(1, 4))
        self.head = nn.Linear(10, 5)

    def forward(self, image: torch.Tensor, rows: int) -> torch.Tensor:
        pooled = self.conv(image).relu().mean(dim=(2, 3))
        return self.head(torch.cat([pooled, self.table.expand(rows, -1)], dim=1))


def test_ablationcam_falls_back_to_the_batch_as_given_with_one_line(untouched):
    model = RowsOfItsOwn().eval()
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with untouched(model), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = camviz.explain(model, (images, 2), "ablationcam", "conv", 1, normalize=False)
    (warning,) = [w for w in caught if "ablationcam" in str(w.message)]
    message = str(warning.message)
    assert "\n" not in message and "RuntimeError: Sizes of tensors must match" in message
    assert message.endswith("re-running it on the batch as given, once per channel, instead")
    # The paper's formula by hand: w_k = (y - y_k) / y, y_k with channel k zeroed.
    with torch.no_grad():
        activations = model.conv(images)
        score = model(images, 2)[:, 1]
        weights = []
        for channel in range(6):
            ablated = activations.clone()
            ablated[:, channel] = 0
            pooled = torch.cat([ablated.relu().mean(dim=(2, 3)), model.table.expand(2, -1)], 1)
            weights.append((score - model.head(pooled)[:, 1]) / score)
        expected = torch.relu((torch.stack(weights, 1)[:, :, None, None] * activations).sum(1))
    assert expected.amax() > 0
    torch.testing.assert_close(result.layer_maps, expected)
