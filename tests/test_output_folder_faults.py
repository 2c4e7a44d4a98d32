"""The output folder of ``camviz explain`` under faults: foreign and hand-edited manifests,
the user's files named like outputs, colliding detector outputs, a folder removed mid-run, a
row log that is a link, SIGTERM, file names that are not UTF-8, and a detector's bad layer.

Runs go through the real CLI in this process, with the shipped synthetic CNN (32 px
images) instead of a model loaded by name, so each costs milliseconds per image.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

import camviz.cli.options
from camviz.cli import main
from camviz.core.errors import CamvizError
from camviz.io.images import Preprocess
from camviz.io.models import LoadedModel
from camviz.pipeline import dataset, job, lock, manifest
from camviz.pipeline.settings import Outputs
from camviz.pipeline.tasks import TaskOptions


@pytest.fixture
def cli(synthetic_classifier, monkeypatch, capsys):
    """``cli(*inputs, out=..., extra=[...])``: ``camviz explain`` with the synthetic CNN;
    returns ``(status, stdout, stderr)``."""
    monkeypatch.setattr(camviz.cli.options, "load_model", lambda args: synthetic_classifier)

    def explain(*inputs: object, out: Path, extra: tuple[str, ...] = ()) -> tuple:
        capsys.readouterr()
        arguments = [*map(str, inputs), "--out", str(out), "--workers", "0", "--quiet"]
        status = main(["explain", *arguments, "--no-panel", *extra])
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return explain


def one_line_error(error: str, *fragments: str) -> None:
    assert error.startswith("camviz: error: ") and error.count("\n") == 1, error
    for fragment in fragments:
        assert fragment in error, error


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def files_in(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*")}


# --- 1. A manifest.jsonl that camviz did not write ---------------------------------------------


def test_a_foreign_row_log_is_refused_and_left_byte_identical(cli, make_photos, tmp_path):
    photos = tmp_path / "photos"
    make_photos(photos, {"a.png": (32, 24), "b.png": (24, 32)})
    index = photos / "manifest.jsonl"
    index.write_bytes(b'{"file": "a.png", "label": 3}\n{"file": "b.png", "label": 1}\n')
    before = files_in(photos)
    status, _, error = cli(photos, out=photos)
    assert status == 1
    one_line_error(error, "manifest.jsonl", "was not written by camviz", "another --out")
    assert files_in(photos) == before  # the user's lines, and nothing written

    # Beside camviz's own manifest.json, a log of only foreign objects is refused too.
    out = tmp_path / "out"
    assert cli(photos / "a.png", out=out)[0] == 0
    (out / "manifest.jsonl").write_bytes(b'{"file": "a.png", "label": 3}\n')
    before = files_in(out)
    status, _, error = cli(photos / "a.png", out=out)
    assert status == 1 and "was not written by camviz" in error
    assert files_in(out) == before


# --- 2. The user's own file named like an output -----------------------------------------------


def test_a_users_file_named_like_an_output_stays_an_input_and_is_never_replaced(
    cli, make_photos, tmp_path
):
    photos = tmp_path / "photos"
    make_photos(photos, {"cat.png": (32, 24), "cat_overlay.png": (24, 32)})
    np_bytes = b"the user's own heatmap"
    (photos / "cat_heatmap.npz").write_bytes(np_bytes)
    mine = (photos / "cat_overlay.png").read_bytes()
    status, printed, error = cli(photos, out=photos, extra=("--heatmap", "npz"))
    assert status == 0, error
    assert (photos / "cat_overlay.png").read_bytes() == mine
    assert (photos / "cat_heatmap.npz").read_bytes() == np_bytes
    rows = {Path(row["input"]).name: row for row in rows_of(photos)}
    assert sorted(rows) == ["cat.png", "cat_overlay.png"]  # the user's file was explained
    cat = rows["cat.png"]["files"]
    assert cat[0].startswith("cat-") and cat[0].endswith("_overlay.png")  # another name
    assert rows["cat_overlay.png"]["files"][0] == "cat_overlay_overlay.png"
    with Image.open(photos / cat[0]) as drawn:
        assert drawn.size == (32, 24)  # cat.png's own overlay, at its size

    status, printed, _ = cli(photos, out=photos, extra=("--heatmap", "npz"))
    assert status == 0 and printed.startswith("all 2 inputs were already done")
    assert (photos / "cat_overlay.png").read_bytes() == mine
    assert [row["files"] for row in rows_of(photos)] == [
        rows[name]["files"] for name in ("cat.png", "cat_overlay.png")
    ]


# --- 3. Detector outputs that would collide ----------------------------------------------------


class TwoObjects(nn.Module):
    """A detector of two objects, the left and the right half of the image, of classes 1
    and 2: object 1 scores the mean red of the image, object 2 its mean green."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, 2, 1, bias=False)
        with torch.no_grad():
            self.features.weight.copy_(torch.eye(3)[:2].view(2, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        scores = self.features(images).mean((2, 3))
        height, width = images.shape[-2:]
        boxes = torch.tensor([[0, 0, width / 2, height], [width / 2, 0, width, height]])
        return [{"boxes": boxes, "scores": row, "labels": torch.tensor([1, 2])} for row in scores]


@pytest.fixture
def detector() -> LoadedModel:
    return LoadedModel(
        model=TwoObjects().eval(),
        preprocess=Preprocess(size=16, mean=(0, 0, 0), std=(1, 1, 1)),
        categories=["background", "red", "green"],
        name="two-objects",
        default_layer="features",
        task="detection",
    )


def test_detector_outputs_never_collide_and_a_rerun_finds_them(detector, tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.new("RGB", (32, 24), (255, 255, 0)).save(photos / "b.png")  # red and green: two
    Image.new("RGB", (24, 32), (255, 0, 0)).save(photos / "b_rank1.png")  # red only: one
    out = tmp_path / "out"
    outputs = Outputs(panel=False, heatmap="npz")
    summary = job.explain_files(photos, out, detector, outputs=outputs)
    assert summary["counts"]["ok"] == 2
    rows = {Path(row["input"]).name: row for row in rows_of(out)}
    assert [len(rows[name]["explained"]) for name in ("b.png", "b_rank1.png")] == [2, 1]
    files = [name for row in rows.values() for name in row["files"]]
    assert len(set(files)) == len(files) == 6  # every overlay and heatmap kept
    for name, size in (("b.png", (32, 24)), ("b_rank1.png", (24, 32))):
        for entry in rows[name]["explained"]:
            with Image.open(out / entry["files"]["overlay"]) as drawn:
                assert drawn.size == size  # its own image's overlay
    first = job.explain_files(photos, out, detector, outputs=outputs)
    assert first["counts"]["already_done"] == 2


# --- 4. The output folder removed during the run -----------------------------------------------


def test_an_output_folder_removed_mid_run_fails_in_one_line(
    cli, make_photos, tmp_path, monkeypatch
):
    photos = make_photos(tmp_path / "photos", {f"{n}.png": (32, 24) for n in range(4)})
    out = tmp_path / "out"
    real_save = job._save_png
    saved = []

    def save_then_remove_the_folder(image, path):
        real_save(image, path)
        saved.append(path)
        if len(saved) == 1:
            shutil.rmtree(out)

    monkeypatch.setattr(job, "_save_png", save_then_remove_the_folder)
    status, printed, error = cli(*photos, out=out, extra=("--batch-size", "1"))
    assert status == 1 and printed == ""
    one_line_error(error, "was removed or moved during the run", "run the same command again")
    assert not (out / "manifest.json").exists()  # nothing says "complete"


# --- 5. A row log that is a link ---------------------------------------------------------------


def test_the_row_log_never_follows_a_link(cli, make_photos, tmp_path):
    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24)})
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_bytes(b"not camviz's\n")
    out = tmp_path / "out"
    assert cli(*photos, out=out)[0] == 0
    (out / "manifest.jsonl").unlink()
    (out / "manifest.jsonl").symlink_to(elsewhere)
    status, _, error = cli(*photos, out=out)
    assert status == 1
    one_line_error(error, "manifest.jsonl", "is a link or not a regular file")
    assert elsewhere.read_bytes() == b"not camviz's\n"
    assert (out / "manifest.jsonl").is_symlink()
    # The log itself refuses a link, whatever checked the folder before.
    with pytest.raises(CamvizError, match="is a link"):
        manifest.RowLog(out / "manifest.jsonl")
    assert elsewhere.read_bytes() == b"not camviz's\n"


# --- 8. Hand-edited and foreign rows -----------------------------------------------------------


def test_hand_edited_rows_are_skipped_with_a_count_and_an_outside_file_is_not_done(
    cli, make_photos, tmp_path
):
    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24), "b.png": (24, 32)})
    out = tmp_path / "out"
    assert cli(*photos, out=out)[0] == 0
    a_row, b_row = rows_of(out)
    escaping = {**a_row, "files": ["../../etc/passwd"], "explained": []}
    junk = [
        {"input": "x", "status": "ok"},
        {"input": "x", "status": "ok", "files": None},
        {"input": ["x"], "status": "ok", "files": []},
        escaping,
    ]
    lines = [json.dumps(row) for row in (b_row, *junk)] + ["[1, 2]"]
    (out / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    status, printed, error = cli(*photos, out=out)
    assert status == 0, error
    assert "explained 1 of the 1 inputs left (1 were already done)" in printed  # a.png again
    assert "5 line(s) of" in error and "are not camviz rows" in error
    summary = json.loads((out / "manifest.json").read_text())
    assert summary["skipped_rows"] == 5 and summary["counts"]["ok"] == 2
    assert [Path(row["input"]).name for row in rows_of(out)] == ["a.png", "b.png"]


# --- SIGTERM -----------------------------------------------------------------------------------


def test_sigterm_stops_like_ctrl_c_releases_the_lock_and_the_run_resumes(
    cli, make_photos, tmp_path, monkeypatch
):
    photos = make_photos(tmp_path / "photos", {f"{n}.png": (32, 24) for n in range(3)})
    out = tmp_path / "out"
    real_explain = dataset.explain
    calls = []

    def terminated_on_the_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a batch scheduler would
        return real_explain(*args, **kwargs)

    monkeypatch.setattr(dataset, "explain", terminated_on_the_second_batch)
    handler = signal.getsignal(signal.SIGTERM)
    status, _, error = cli(*photos, out=out, extra=("--batch-size", "1"))
    assert status == 143 and error == "camviz: terminated\n"
    assert signal.getsignal(signal.SIGTERM) == handler  # put back
    assert not (out / lock.LOCK).exists()
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    monkeypatch.setattr(dataset, "explain", real_explain)
    assert cli(*photos, out=out, extra=("--batch-size", "1"))[0] == 0
    summary = json.loads((out / "manifest.json").read_text())
    assert summary["complete"] and summary["counts"]["ok"] == 3
    assert sorted(Path(row["input"]).name for row in rows_of(out)) == ["0.png", "1.png", "2.png"]


# --- File names that are not UTF-8 -------------------------------------------------------------


def test_names_that_are_not_utf8_are_valid_json_with_their_bytes_and_resume(
    cli, make_photos, tmp_path
):
    photos = tmp_path / "photos"
    photos.mkdir()
    names = [os.fsdecode(raw) for raw in (b"caf\xff.png", b"caf\xfe.png", b"plain.png")]
    for name in names:
        Image.new("RGB", (32, 24), (200, 30, 90)).save(photos / name)
    out = tmp_path / "out"
    status, _, error = cli(photos, out=out)
    assert status == 0, error
    text = (out / "manifest.jsonl").read_bytes().decode("utf-8")  # strict UTF-8
    assert "\\udc" not in text  # no lone surrogate escapes, which strict readers refuse
    rows = [json.loads(line) for line in text.splitlines()]
    by_bytes = {base64.b64decode(row["input_bytes"]): row for row in rows if "input_bytes" in row}
    assert sorted(by_bytes) == [os.fsencode(photos / names[1]), os.fsencode(photos / names[0])]
    for raw, row in by_bytes.items():
        assert row["input"] == raw.decode("utf-8", "replace")  # U+FFFD for the odd byte
    (plain,) = [row for row in rows if "input_bytes" not in row]
    assert plain["input"] == str(photos / "plain.png")
    overlays = sorted(row["files"][0] for row in rows)
    assert len(set(overlays)) == 3 and all("\ufffd" in name for name in overlays[:2])
    assert all((out / name).is_file() for name in overlays)
    status, printed, _ = cli(photos, out=out)
    assert status == 0 and printed.startswith("all 3 inputs were already done")


# --- A detector's layer ------------------------------------------------------------------------


def test_a_detectors_layer_is_checked_even_when_no_object_passes(detector, tmp_path):
    Image.new("RGB", (32, 24), (10, 10, 10)).save(tmp_path / "dark.png")  # no object at 0.5
    out = tmp_path / "out"
    none = TaskOptions(min_score=0.5)
    with pytest.raises(CamvizError, match="no layer named 'featurez'"):
        job.explain_files(tmp_path / "dark.png", out, detector, layer="featurez", task_options=none)
    assert not out.exists()  # nothing saved, no settings with the bad name
    job.explain_files(tmp_path / "dark.png", out, detector, layer="features", task_options=none)
    summary = json.loads((out / "manifest.json").read_text())
    assert summary["settings"]["layer"] == "features"
    (row,) = rows_of(out)
    assert row["reason"] == "no object scored 0.5 or more"
