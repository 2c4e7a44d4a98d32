"""The folder job as a spec: one settings object for ``explain_files``, output names from a
pure function, and errors sorted into the rows of inputs (the model failed on one) and the
tracebacks of bugs (camviz's own code failed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

import camviz
from camviz.cams.gradcam import GradCAM
from camviz.cli import main
from camviz.core import taps
from camviz.core.errors import CamvizError, ModelError
from camviz.core.inputs import run_model
from camviz.pipeline import job
from camviz.pipeline.naming import output_owners, result_files
from camviz.pipeline.settings import JobSettings, Outputs, RenderOptions


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def test_keywords_and_a_settings_object_make_the_same_folder(
    synthetic_classifier, make_photos, tmp_path, assert_rows_match
):
    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24), "b.png": (24, 32)})
    chosen = {"method": "gradcam++", "target": "top2", "render": RenderOptions(0.3, "viridis")}
    by_keywords = job.explain_files(photos, tmp_path / "k", synthetic_classifier, **chosen)
    settings = JobSettings(**chosen)
    by_object = job.explain_files(photos, tmp_path / "o", synthetic_classifier, settings)
    assert by_object["settings"] == by_keywords["settings"]
    assert by_object["settings"]["method"] == "gradcam++"
    assert by_object["settings"]["alpha"] == 0.3 and by_object["settings"]["target"] == "top2"
    assert_rows_match(rows_of(tmp_path / "o"), rows_of(tmp_path / "k"))
    assert len(rows_of(tmp_path / "o")[0]["explained"]) == 2
    with pytest.raises(CamvizError, match=r"not both \(given: batch_size\)"):
        job.explain_files(photos, tmp_path / "x", synthetic_classifier, settings, batch_size=2)
    assert not (tmp_path / "x").exists()


def test_output_names_are_a_function_of_the_name_alone():
    every = Outputs(overlay=True, panel=True, heatmap="png16")
    one = result_files("cat", 1, every, still=True, clip=False, boxes=False)
    assert one.ranks == [
        {"overlay": "cat_overlay.png", "panel": "cat_panel.jpg", "heatmap": "cat_heatmap.png"}
    ]
    assert one.whole == []
    two = result_files("a/b", 2, Outputs(heatmap="npz"), still=False, clip=False, boxes=False)
    assert two.ranks == [  # a video frame: no panel
        {"overlay": "a/b_rank1_overlay.png", "heatmap": "a/b_rank1_heatmap.npz"},
        {"overlay": "a/b_rank2_overlay.png", "heatmap": "a/b_rank2_heatmap.npz"},
    ]
    objects = result_files("s", 2, Outputs(), still=True, clip=False, boxes=True)
    assert objects.ranks == [{"overlay": "s_rank1_overlay.png"}, {"overlay": "s_rank2_overlay.png"}]
    assert objects.whole == ["s_panel.jpg"]  # one panel of all objects
    clip = result_files("v_frames/000016", 1, Outputs(), still=False, clip=True, boxes=False)
    assert clip.ranks == [{"overlay": "v_frames/000016_overlay.mp4"}]
    assert output_owners("b_rank1_overlay.png") == {"b", "b_rank1"}
    assert output_owners("a/b_heatmap.npz") == {"a/b"}
    assert output_owners("b_overlay.gif") == set() and output_owners("notes.png") == set()


class FailsOnWideImages(nn.Module):
    """A classifier that raises, in its own forward, for images wider than they are tall."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-1] > images.shape[-2]:
            raise ValueError(f"this model takes portrait images, not width {images.shape[-1]}")
        return self.head(self.features(images).relu().mean((2, 3)))


@pytest.fixture
def fails_on_wide(synthetic_classifier) -> camviz.models.LoadedModel:
    torch.manual_seed(0)
    return camviz.models.LoadedModel(
        FailsOnWideImages().eval(), synthetic_classifier.preprocess, ["a", "b", "c"], "picky"
    )


def test_an_exception_in_the_models_forward_is_a_model_error_and_a_failure_row(
    fails_on_wide, tmp_path
):
    wide, tall = torch.rand(1, 3, 16, 24), torch.rand(1, 3, 24, 16)
    with pytest.raises(ModelError, match="ValueError: this model takes portrait") as raised:
        camviz.explain(fails_on_wide.model, wide, layer="features")
    assert isinstance(raised.value.__cause__, ValueError)
    assert camviz.explain(fails_on_wide.model, tall, layer="features").heatmaps.shape == (1, 24, 16)

    photos = tmp_path / "photos"
    photos.mkdir()
    Image.new("RGB", (48, 32), (90, 20, 200)).save(photos / "wide.png")
    Image.new("RGB", (32, 48), (20, 200, 90)).save(photos / "tall.png")
    out = tmp_path / "out"
    summary = job.explain_files(photos, out, fails_on_wide, layer="features")
    tall_row, wide_row = rows_of(out)
    assert tall_row["status"] == "ok" and wide_row["status"] == "error"
    assert wide_row["reason"] == (
        "the model failed on this input (ValueError: this model takes portrait images, not "
        "width 48)"
    )
    assert summary["failures"] == [wide_row]


def test_a_bug_of_camviz_keeps_its_traceback_instead_of_becoming_a_row(
    synthetic_classifier, make_photos, tmp_path, monkeypatch
):
    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24), "b.png": (32, 24)})

    def broken_maths(self, data):
        raise AssertionError("camviz's own assertion")

    monkeypatch.setattr(GradCAM, "channel_weights", broken_maths)
    with pytest.raises(AssertionError, match="camviz's own assertion"):
        job.explain_files(photos, tmp_path / "maths", synthetic_classifier)
    assert not (tmp_path / "maths" / "manifest.jsonl").exists()  # no row says the model failed
    monkeypatch.undo()

    def broken_hook(value, path, key):  # camviz's code inside the model's pass
        raise TypeError("camviz's own type error")

    monkeypatch.setattr(taps, "select", broken_hook)
    monkeypatch.setattr("camviz.cli.options.load_model", lambda args: synthetic_classifier)
    arguments = ["explain", *map(str, photos), "--out", str(tmp_path / "hook"), "--workers", "0"]
    with pytest.raises(TypeError, match="camviz's own type error"):
        main([*arguments, "--quiet"])  # a traceback, not "camviz: error: ..."


def test_run_model_wraps_the_models_errors_only():
    class Raising(nn.Module):
        def __init__(self, error: Exception) -> None:
            super().__init__()
            self.error = error

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise self.error

    original = KeyError("no such field")
    with pytest.raises(ModelError, match="KeyError: 'no such field'") as raised:
        run_model(Raising(original), torch.zeros(1))
    assert raised.value.__cause__ is original and isinstance(raised.value, RuntimeError)
    mistake = CamvizError("a user mistake")
    with pytest.raises(CamvizError) as passed:
        run_model(Raising(mistake), torch.zeros(1))
    assert passed.value is mistake
    memory = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 1 TB")
    with pytest.raises(RuntimeError) as passed:
        run_model(Raising(memory), torch.zeros(1))
    assert passed.value is memory  # for the per-image retry to see as it is
    # A hook of the user's own counts as the model's code.
    model = nn.Sequential(nn.Identity())
    model[0].register_forward_hook(lambda module, args, output: 1 / 0)
    with pytest.raises(ModelError, match="ZeroDivisionError"):
        run_model(model, torch.zeros(1))
