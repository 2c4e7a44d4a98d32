"""The ``camviz`` command line, run for real: results on the shipped photos, and one clear
line with a non-zero exit, no traceback and no files for every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from camviz.cli import main

CAT_CLASSES = {281, 282, 283, 284, 285}  # tabby, tiger cat, Persian, Siamese, Egyptian cat
ESPRESSO = 967


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "camviz", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def explained(tmp_path_factory, cat_path, coffee_path, manifest_rows):
    out = tmp_path_factory.mktemp("explain") / "results"
    assert main(["explain", str(cat_path), str(coffee_path), "--out", str(out)]) == 0
    return out, json.loads((out / "manifest.json").read_text()), manifest_rows(out)


def test_explain_writes_overlays_panels_and_manifest(explained, cat_path, coffee_path):
    out, manifest, rows = explained
    assert manifest["model"] == "efficientnet_lite0" and manifest["method"] == "gradcam"
    cat, coffee = rows
    assert cat["top5"][0]["id"] in CAT_CLASSES
    assert coffee["top5"][0]["id"] == ESPRESSO
    for entry, photo in ((cat, cat_path), (coffee, coffee_path)):
        probabilities = [row["probability"] for row in entry["top5"]]
        assert probabilities == sorted(probabilities, reverse=True) and sum(probabilities) <= 1
        assert entry["explained"][0]["id"] == entry["top5"][0]["id"]
        assert entry["explained"][0]["name"] == entry["top5"][0]["name"]
        overlay_path = out / entry["explained"][0]["files"]["overlay"]
        with Image.open(overlay_path) as overlay, Image.open(photo) as original:
            assert overlay.size == original.size
    assert sorted(path.name for path in out.iterdir()) == sorted(
        ["manifest.json", "manifest.jsonl", *cat["files"], *coffee["files"]]
    )


def test_top_k_writes_one_overlay_per_rank(tmp_path, cat_path, manifest_rows):
    assert main(["explain", str(cat_path), "--target", "top2", "--out", str(tmp_path)]) == 0
    (row,) = manifest_rows(tmp_path)
    assert [entry["id"] for entry in row["explained"]] == [entry["id"] for entry in row["top5"][:2]]
    assert (tmp_path / "chelsea_rank2_overlay.png").is_file()


def test_help_does_not_import_torch():
    code = (
        "import sys; from camviz.cli import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False"
    assert run_cli("--help").returncode == 0


def test_layers_lists_names_with_shapes(capsys):
    assert main(["layers", "--size", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    bn2 = next(line for line in lines if line.split()[0] == "bn2")
    assert bn2.split()[1] == "BatchNormAct2d" and "(1, 1280, 2, 2)" in bn2


def bad_image(tmp_path: Path) -> Path:
    path = tmp_path / "notes.jpg"
    path.write_text("this is not a picture")
    return path


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda tmp, cat: [str(tmp / "missing.png")], "missing.png"),
        (lambda tmp, cat: [str(bad_image(tmp))], "notes.jpg"),
        (lambda tmp, cat: [str(bad_image(tmp)), str(tmp / "missing.png")], "notes.jpg"),
        (lambda tmp, cat: [str(cat), "--model", "resnet5"], "resnet50"),
        (lambda tmp, cat: [str(cat), "--layer", "bn3"], "no layer named 'bn3'"),
        (lambda tmp, cat: [str(cat), "--target", "1000"], "class id 1000 is out of range"),
        (lambda tmp, cat: [str(cat), "--method", "nocam"], "unknown CAM method 'nocam'"),
        (lambda tmp, cat: [str(cat), "--alpha", "1.5"], "alpha"),
        (lambda tmp, cat: [str(cat), "--colormap", "jett"], "jet"),
        (lambda tmp, cat: [str(cat), "--weights", str(tmp / "none.pt")], "none.pt"),
    ],
)
def test_bad_input_gives_one_line_and_no_files(tmp_path, cat_path, capsys, make_args, message):
    out = tmp_path / "out"
    status = main(["explain", *make_args(tmp_path, cat_path), "--out", str(out)])
    error = capsys.readouterr().err
    assert status == 1
    assert error.startswith("camviz: error: ") and error.count("\n") == 1, error
    assert message in error
    assert not out.exists()


def test_unreadable_image_among_good_ones_is_skipped_and_listed(
    tmp_path, cat_path, tiny_checkpoint, capsys, manifest_rows
):
    out = tmp_path / "out"
    notes = bad_image(tmp_path)
    args = [str(cat_path), str(notes), "--model", "resnet18", "--weights", tiny_checkpoint]
    assert main(["explain", *args, "--input-size", "64", "--no-panel", "--out", str(out)]) == 0
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(f"camviz: skipped {notes}: ")
    cat, notes_row = manifest_rows(out)
    assert cat["status"] == "ok" and cat["files"] == ["chelsea_overlay.png"]
    assert notes_row["status"] == "error" and "not an image" in notes_row["reason"]
    assert notes_row["files"] == [] and not list(out.glob("notes*"))


def test_unwritable_output_folder(tmp_path, cat_path, capsys):
    a_file = tmp_path / "results.txt"
    a_file.write_text("taken")
    assert main(["explain", str(cat_path), "--out", str(a_file / "sub")]) == 1
    assert "is a file" in capsys.readouterr().err
    assert a_file.read_text() == "taken"


def test_weights_that_cannot_be_downloaded_say_what_to_do(tmp_path, cat_path, capsys, monkeypatch):
    import urllib.error

    import torch.hub

    def offline(url, destination, *args, **kwargs):
        raise urllib.error.URLError("no network")

    # The real torchvision download path runs; only the network transfer is replaced, so
    # the test means the same on a machine that is online.
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    out = tmp_path / "o"
    assert main(["explain", str(cat_path), "--model", "resnet18", "--out", str(out)]) == 1
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--weights PATH" in last_line and "efficientnet_lite0" in last_line
    assert not out.exists()
    assert not list((tmp_path / "hub").rglob("*.pth"))


def test_layout_is_checked_as_an_argument_and_recorded(
    tmp_path, cat_path, tiny_checkpoint, capsys, manifest_rows
):
    model = ["--model", "resnet18", "--weights", tiny_checkpoint]
    with pytest.raises(SystemExit) as exited:
        main(["explain", str(cat_path), *model, "--layout", "grid", "--out", str(tmp_path)])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and "unknown layout 'grid'" in error and "Traceback" not in error
    out = tmp_path / "out"
    args = [str(cat_path), *model, "--layer", "layer4", "--layout", "channels_first"]
    args += ["--input-size", "64"]
    assert main(["explain", *args, "--no-panel", "--out", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["settings"]["layout"] == "channels_first"
    assert manifest_rows(out)[0]["status"] == "ok"
