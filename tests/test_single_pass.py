"""The folder job chooses what a segmentation or detection batch explains inside the
explaining pass: the model runs once per explain call (counted by a forward hook), with the
maps of the targets chosen from a separate pass (:func:`camviz.pipeline.tasks.plan`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torchvision.models import get_model

import camviz
from camviz.io import models
from camviz.io.images import Preprocess, load_image
from camviz.io.models import LoadedModel, with_input_size
from camviz.pipeline import job, tasks

DETECTOR = "fasterrcnn_mobilenet_v3_large_320_fpn"


class ColourSegmenter(nn.Module):
    """Per pixel: background, "red" or "green", by the pixel's colour (a 1x1 convolution
    after a 3x3 one, so that Grad-CAM at ``features`` has something to weigh)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, 3, 3, padding=1)
        self.classifier = nn.Conv2d(3, 3, 1)
        with torch.no_grad():
            self.features.weight.zero_()
            self.features.weight[:, :, 1, 1] = torch.eye(3)
            self.features.bias.zero_()
            self.classifier.weight.copy_(
                torch.tensor([[0, 0, 0], [4, 0, 0], [0, 4, 0]])[..., None, None]
            )
            self.classifier.bias.copy_(torch.tensor([1.0, -1, -1]))

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.classifier(torch.relu(self.features(images)))}


def _counted(model: nn.Module) -> list[int]:
    passes: list[int] = []
    model.register_forward_hook(lambda *_: passes.append(1))
    return passes


def test_a_segmentation_batch_costs_one_pass_and_gives_the_maps_of_its_regions(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    colours = {"red": (255, 0, 0), "green": (0, 255, 0), "black": (0, 0, 0)}
    for name, colour in colours.items():
        picture = Image.new("RGB", (16, 16), (0, 0, 0))
        picture.paste(Image.new("RGB", (8, 8), colour), (4, 4))
        picture.save(folder / f"{name}.png")
    model = ColourSegmenter().eval()
    loaded = LoadedModel(
        model, Preprocess(size=16, mean=(0, 0, 0), std=(1, 1, 1)),
        [tasks.BACKGROUND, "red", "green"], "colour-segmenter", "features", "segmentation",
    )  # fmt: skip
    passes = _counted(model)
    outputs = job.Outputs(overlay=False, panel=False, heatmap="npz")
    job.explain_files(folder, tmp_path / "out", loaded, outputs=outputs, batch_size=4)
    assert len(passes) == 1  # one batch, one pass: nothing run to choose first

    rows = {row["input"].rsplit("/", 1)[-1]: row for row in job_rows(tmp_path / "out")}
    assert rows["black.png"]["explained"] == []
    assert rows["black.png"]["reason"] == "no pixel is predicted as any class but the background"
    for name in ("red", "green"):
        inputs = loaded.preprocess(load_image(folder / f"{name}.png")).unsqueeze(0)
        (group,) = tasks.plan(
            "segmentation", model, inputs, None, loaded.categories, tasks.TaskOptions()
        )
        reference = camviz.explain(model, inputs, "gradcam", "features", group.target)
        (entry,) = rows[f"{name}.png"]["explained"]
        assert (entry["name"], entry["score"]) == (name, pytest.approx(64 * 3.0))  # 8x8 px of 4 - 1
        written = np.load(tmp_path / "out" / entry["files"]["heatmap"])["heatmap"]
        assert np.abs(written - reference.heatmaps[0].numpy()).max() < 1e-6


def job_rows(out):
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def test_a_detector_runs_once_per_image_explained_and_never_to_choose(tmp_path, make_photos):
    folder = tmp_path / "photos"
    make_photos(folder, {"a.png": (64, 48), "b.png": (64, 48)})
    torch.manual_seed(0)
    weights = tmp_path / "detector.pt"
    torch.save(get_model(DETECTOR, weights=None, weights_backbone=None).state_dict(), weights)
    loaded = with_input_size(models.load(DETECTOR, weights=str(weights)), 64)
    model = loaded.model
    passes = _counted(model)
    options = tasks.TaskOptions(min_score=0, max_objects=2)
    outputs = job.Outputs(overlay=False, panel=False)
    job.explain_files(
        folder, tmp_path / "out", loaded, layer="backbone.body.13", outputs=outputs,
        task_options=options,
    )  # fmt: skip
    assert len(passes) == 2  # each image's explaining pass; before, one more per batch
    rows = job_rows(tmp_path / "out")
    assert [len(row["explained"]) for row in rows] == [2, 2]
