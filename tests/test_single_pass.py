"""The folder job chooses what a segmentation or detection batch explains inside the
explaining pass: the model runs once per batch (counted by a forward hook), with the maps
of the targets chosen from a separate pass (:func:`camviz.pipeline.tasks.plan`) or of each
image explained alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import camviz
from camviz.core.targets import Context
from camviz.evaluation.synthetic import CLASSES, TARGET_LAYER, load_detector, make_scenes
from camviz.io.images import Preprocess, load_image
from camviz.io.models import LoadedModel
from camviz.pipeline import job, tasks
from camviz.pipeline.choosing import DetectedObjects


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


class ListedDetections(nn.Module):
    """The synthetic dense detector answering as torchvision's detectors do: a list of
    detections per image (the job reads that format)."""

    def __init__(self) -> None:
        super().__init__()
        self.detector = load_detector()
        self.adapter = camviz.DenseDetections()

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        return self.adapter(self.detector(images))


def test_a_detection_batch_costs_one_pass_and_gives_each_image_its_own_objects(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    one, three = make_scenes(1, objects=(1, 1), seed=3), make_scenes(1, objects=(3, 3), seed=4)
    for name, scenes in {"one.png": one, "three.png": three}.items():
        pixels = (scenes.images[0] * 255).round().byte().permute(1, 2, 0).numpy()
        Image.fromarray(pixels).save(folder / name)
    model = ListedDetections().eval()
    loaded = LoadedModel(
        model, Preprocess(size=64, mean=(0, 0, 0), std=(1, 1, 1)), list(CLASSES),
        "synthetic-detector", f"detector.{TARGET_LAYER}", "detection",
    )  # fmt: skip
    images = {
        name: loaded.preprocess(load_image(folder / name)).unsqueeze(0)
        for name in ("one.png", "three.png")
    }
    options = tasks.TaskOptions(min_score=0.5, max_objects=3)
    with torch.no_grad():
        kept = {
            name: tasks.kept_detections(model(image)[0], None, options)
            for name, image in images.items()
        }
    assert len(kept["one.png"]) < len(kept["three.png"])  # so the batch pads "one.png"
    passes = _counted(model)
    outputs = job.Outputs(overlay=False, panel=False, heatmap="npz")
    job.explain_files(
        folder, tmp_path / "out", loaded, outputs=outputs, task_options=options, batch_size=2
    )
    assert len(passes) == 1  # the batch's explaining pass; before, one per image
    rows = {row["input"].rsplit("/", 1)[-1]: row for row in job_rows(tmp_path / "out")}
    for name, image in images.items():
        explained = rows[name]["explained"]
        assert len(explained) == len(kept[name])
        alone = camviz.explain(
            model, image, "gradcam", f"detector.{TARGET_LAYER}", camviz.Detection(kept[name])
        )
        for entry, heatmap, box in zip(explained, alone.heatmaps, alone.boxes, strict=True):
            written = np.load(tmp_path / "out" / entry["files"]["heatmap"])["heatmap"]
            assert np.abs(written - heatmap.numpy()).max() < 1e-5
            assert entry["box"] == pytest.approx(box.tolist(), abs=0.01)


def test_detected_objects_pad_the_images_with_fewer_objects_and_score_them_zero():
    def image(boxes, scores, labels):
        return {
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "scores": torch.tensor(scores),
            "labels": torch.tensor(labels, dtype=torch.long),
        }

    output = [
        image([[0, 0, 4, 4], [1, 1, 5, 5], [0, 0, 1, 1]], [0.9, 0.6, 0.2], [1, 2, 1]),
        image([[2, 2, 6, 6]], [0.8], [3]),
        image([], [], []),
    ]
    chosen = DetectedObjects(None, ["bg", "a", "b", "c"], tasks.TaskOptions(min_score=0.5))
    resolved = chosen.resolve(output, Context(batch_size=3))
    assert resolved.class_ids.tolist() == [[1, 2], [3, -1], [-1, -1]]
    assert resolved.reasons == (None, None, "no object scored 0.5 or more")
    assert resolved.boxes[1, 1].tolist() == [0, 0, 0, 0]
    first, second = resolved.scores
    assert first(output).tolist() == pytest.approx([0.9, 0.8, 0])
    assert second(output).tolist() == pytest.approx([0.6, 0, 0])
    # In a re-run the objects are found again by class and box; padding finds nothing.
    rows = torch.tensor([0, 1, 1])
    rerun = [output[0], output[1], output[1]]
    assert second(rerun, rows).tolist() == pytest.approx([0.6, 0, 0])
    assert first(rerun, rows).tolist() == pytest.approx([0.9, 0.8, 0.8])
