"""``camviz explain`` for segmentation models, detectors and video models, run for real on
torchvision architectures with random weights (saved by the test, passed with --weights) at
tiny sizes, every result checked against the model's own output or a direct API call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.models import get_model

import camviz
from camviz.cli import main
from camviz.io import models
from camviz.io.images import Preprocess, load_image
from camviz.io.pictures import PANEL_TILE_WIDTH
from camviz.io.render import BOX_COLOUR, overlay
from camviz.pipeline import dataset, job, tasks

SEGMENTER = "deeplabv3_mobilenet_v3_large"
DETECTOR = "fasterrcnn_mobilenet_v3_large_320_fpn"
VIDEO_MODEL = "mc3_18"
PERSON = 15  # in the VOC classes of torchvision's segmentation weights
CAT = 8


def _loaded(name: str, weights: str, size: int) -> models.LoadedModel:
    """The model and preprocessing the CLI uses for ``--model name --weights weights
    --input-size size``."""
    return models.with_input_size(models.load(name, weights=weights), size)


@pytest.fixture(scope="module")
def segmenter(tmp_path_factory, cat_path):
    """A random DeepLabV3 whose person logit is shifted so that about half the pixels of
    the test photo are predicted as person, and no pixel as cat; returns the checkpoint and
    the photo."""
    folder = tmp_path_factory.mktemp("segmentation")
    photo = folder / "photo.png"
    with Image.open(cat_path) as image:
        image.convert("RGB").resize((60, 40)).save(photo)
    torch.manual_seed(0)
    model = get_model(SEGMENTER, weights=None, weights_backbone=None).eval()
    inputs = Preprocess(size=40)(load_image(photo)).unsqueeze(0)  # DeepLab's mean and std
    with torch.no_grad():
        logits = model(inputs)["out"][0]
        others = torch.cat([logits[:PERSON], logits[PERSON + 1 :]]).amax(0)
        bias = model.classifier[4].bias
        bias[PERSON] += (others - logits[PERSON]).quantile(0.3)
        bias[CAT] -= 1e4
    path = folder / "deeplab.pt"
    torch.save(model.state_dict(), path)
    return str(path), photo


def test_segmentation_explains_the_region_predicted_as_the_class_named(
    segmenter, tmp_path, monkeypatch, manifest_rows
):
    weights, photo = segmenter
    targets = _record_targets(monkeypatch)
    out = tmp_path / "out"
    options = ["--model", SEGMENTER, "--weights", weights, "--input-size", "40"]
    options += ["--layer", "backbone.16", "--workers", "0", "--quiet"]
    assert main(["explain", str(photo), "--target", "person", "--heatmap", "npz", "--out",
                 str(out), *options]) == 0  # fmt: skip

    loaded = _loaded(SEGMENTER, weights, 40)
    inputs = loaded.preprocess(load_image(photo)).unsqueeze(0)
    with torch.no_grad():
        logits = loaded.model(inputs)["out"]
    mask = logits.argmax(1) == PERSON
    assert 0.1 < mask.float().mean() < 0.9  # a region, not the whole image
    (region,) = targets
    assert region.class_id == PERSON and torch.equal(region.mask, mask)
    (row,) = manifest_rows(out)
    (entry,) = row["explained"]
    assert (entry["id"], entry["name"], row["status"]) == (PERSON, "person", "ok")
    expected_score = (logits[:, PERSON] * mask).sum().item()
    assert entry["score"] == pytest.approx(expected_score, rel=1e-4)
    reference = camviz.explain(loaded.model, inputs, "gradcam", "backbone.16", region)
    written = np.load(out / entry["files"]["heatmap"])["heatmap"]
    assert np.abs(written - reference.heatmaps[0].numpy()).max() < 1e-5

    # No pixel of the class named: a row that says so, not a failure.
    empty = tmp_path / "empty"
    assert main(["explain", str(photo), "--target", "cat", "--out", str(empty), *options]) == 0
    (row,) = manifest_rows(empty)
    assert row["status"] == "ok" and row["explained"] == [] and row["files"] == []
    assert row["reason"] == "no pixel is predicted as 'cat'"


def _record_targets(monkeypatch) -> list:
    """Record the target of every explain call the folder job makes."""
    targets = []

    def recording(model, inputs, method, layer, target, **options):
        targets.append(target)
        return camviz.explain(model, inputs, method, layer, target, **options)

    monkeypatch.setattr(dataset, "explain", recording)
    return targets


@pytest.fixture(scope="module")
def detector(tmp_path_factory, make_photos):
    folder = tmp_path_factory.mktemp("detection")
    (photo,) = make_photos(folder, {"street.png": (160, 120)})
    torch.manual_seed(0)
    path = folder / "detector.pt"
    torch.save(get_model(DETECTOR, weights=None, weights_backbone=None).state_dict(), path)
    return str(path), photo


LAYER = "backbone.body.13"  # Grad-CAM there is not all zero for this random detector
DETECTOR_OPTIONS = ["--input-size", "64", "--layer", LAYER, "--workers", "0"]


def test_detection_writes_an_overlay_per_object_with_its_box_a_panel_and_rows(
    detector, tmp_path, manifest_rows
):
    weights, photo = detector
    out = tmp_path / "out"
    options = ["--model", DETECTOR, "--weights", weights, *DETECTOR_OPTIONS, "--quiet"]
    command = ["explain", str(photo), "--min-score", "0", "--max-objects", "3"]
    assert main([*command, "--heatmap", "npz", "--out", str(out), *options]) == 0

    loaded = _loaded(DETECTOR, weights, 64)
    loaded.model.roi_heads.score_thresh = 0.0  # what --min-score 0 asks of the detector
    image = load_image(photo)
    inputs = loaded.preprocess(image).unsqueeze(0)
    with loaded.applied() as model:  # the detector resizes to --input-size 64 in here
        with torch.no_grad():
            (found,) = model(inputs)
        reference = camviz.explain(model, inputs, "gradcam", LAYER, camviz.Detection([0, 1, 2]))
    (row,) = manifest_rows(out)
    objects = row["explained"]
    assert len(objects) == 3
    assert [entry["id"] for entry in objects] == found["labels"][:3].tolist()
    assert [entry["name"] for entry in objects] == [
        loaded.categories[label] for label in found["labels"][:3]
    ]
    assert [entry["score"] for entry in objects] == pytest.approx(found["scores"][:3].tolist())
    boxes = torch.tensor([entry["box"] for entry in objects])
    assert torch.allclose(boxes, found["boxes"][:3], atol=0.006)  # rounded to 2 decimals

    for rank, entry in enumerate(objects):
        heatmap = np.load(out / entry["files"]["heatmap"])["heatmap"]
        assert np.abs(heatmap - reference.heatmaps[rank].numpy()).max() < 1e-5
        _check_box_drawn(out, entry, image)
    assert row["files"][-1] == "street_panel.jpg"
    with Image.open(out / "street_panel.jpg") as panel:
        assert panel.width == 4 * (PANEL_TILE_WIDTH + 10) + 10  # all objects, then 3 objects

    # No object above --min-score: a row that says so, exit 0.
    none = tmp_path / "none"
    assert main(["explain", str(photo), "--min-score", "1.01", "--out", str(none), *options]) == 0
    (row,) = manifest_rows(none)
    assert row["status"] == "ok" and row["explained"] == [] and row["files"] == []
    assert row["reason"] == "no object scored 1.01 or more"

    # A job lowers the detector's own threshold (scores here are ~1/91), and hands the
    # detector back with that threshold and its resize.
    loaded.model.roi_heads.score_thresh = 0.05
    before = (loaded.model.roi_heads.score_thresh, loaded.model.transform.min_size)
    job.explain_files(
        photo, tmp_path / "api", loaded, layer=LAYER, outputs=job.Outputs(False, False),
        task_options=tasks.TaskOptions(min_score=1e-9, max_objects=1), input_size=32,
    )  # fmt: skip
    (row,) = manifest_rows(tmp_path / "api")
    assert len(row["explained"]) == 1
    assert (loaded.model.roi_heads.score_thresh, loaded.model.transform.min_size) == before


def _check_box_drawn(out, entry: dict, image: Image.Image) -> None:
    """The object's overlay has its box's edge in the box colour, and is the plain overlay
    of its map inside the box (boxes >= 40 px tall keep the label off both)."""
    with Image.open(out / entry["files"]["overlay"]) as drawn:
        pixels = np.asarray(drawn.convert("RGB"))
    x0, y0, x1, y1 = (round(value) for value in entry["box"])
    x1, y1 = min(x1, image.width - 1), min(y1, image.height - 1)  # the line's inner pixel
    edges = [((x0 + x1) // 2, y1)]
    if y1 - y0 >= 40:
        edges += [(x0, (y0 + y1) // 2), (x1, (y0 + y1) // 2)]
    for x, y in edges:
        assert tuple(pixels[y, x]) == BOX_COLOUR
    if y1 - y0 >= 40 and x1 - x0 >= 10:
        plain = np.asarray(overlay(image, np.load(out / entry["files"]["heatmap"])["heatmap"]))
        x, y = (x0 + x1) // 2, (y0 + y1) // 2
        assert np.array_equal(pixels[y, x], plain[y, x])


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    """A 10-frame 64x48 video of a moving bright square, and a random 4-class mc3_18."""
    import cv2

    folder = tmp_path_factory.mktemp("video")
    path = folder / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"mp4v"), 10, (64, 48))
    for frame in range(10):
        pixels = np.zeros((48, 64, 3), np.uint8)
        pixels[10:30, 5 + 2 * frame : 25 + 2 * frame] = 255
        writer.write(pixels)
    writer.release()
    torch.manual_seed(0)
    weights = folder / "mc3_18.pt"
    torch.save(get_model(VIDEO_MODEL, weights=None, num_classes=4).state_dict(), weights)
    return path, str(weights)


def test_video_model_writes_an_overlay_video_and_a_row_per_clip(video, tmp_path, manifest_rows):
    import cv2

    path, weights = video
    out = tmp_path / "out"
    options = ["--model", VIDEO_MODEL, "--weights", weights, "--input-size", "24"]
    options += ["--clip-len", "4", "--stride", "4", "--heatmap", "npz", "--workers", "0"]
    assert main(["explain", str(path), "--out", str(out), "--quiet", *options]) == 0

    rows = manifest_rows(out)
    # Clips of 4 frames every 4th frame, and one ending with the 10-frame video.
    assert [row["frame"] for row in rows] == [0, 4, 6]
    whole = cv2.VideoCapture(str(out / "clip_overlay.mp4"))
    assert whole.get(cv2.CAP_PROP_FRAME_COUNT) == 4 + 2 + 4  # frames 0..9, each once
    whole.release()
    loaded = _loaded(VIDEO_MODEL, weights, 24)
    capture = cv2.VideoCapture(str(path))
    frames = []
    while (read := capture.read())[0]:
        frames.append(Image.fromarray(np.ascontiguousarray(read[1][..., ::-1])))
    capture.release()
    clips = [
        torch.stack([loaded.preprocess(frame) for frame in frames[start : start + 4]], dim=1)
        for start in (0, 4, 6)
    ]
    reference = camviz.explain(loaded.model, torch.stack(clips), "gradcam")
    for number, row in enumerate(rows):
        (entry,) = row["explained"]
        assert entry["id"] == reference.targets[number].item() == row["top5"][0]["id"]
        heatmap = np.load(out / entry["files"]["heatmap"])["heatmap"]
        assert heatmap.shape[0] == 4
        assert np.abs(heatmap - reference.heatmaps[number].numpy()).max() < 1e-5
        written = cv2.VideoCapture(str(out / entry["files"]["overlay"]))
        shape = [written.get(cv2.CAP_PROP_FRAME_COUNT), written.get(cv2.CAP_PROP_FRAME_WIDTH)]
        written.release()
        assert shape == [4, 64]  # T frames at the video's own size


def test_a_model_the_input_does_not_fit_fails_with_one_line(video, detector, tmp_path, capsys):
    clip, video_weights = video
    detector_weights, photo = detector
    runs = [
        (photo, ["--model", VIDEO_MODEL, "--weights", video_weights], "is a video model"),
        (clip, ["--model", DETECTOR, "--weights", detector_weights], "is a detection model"),
    ]
    for number, (source, options, expected) in enumerate(runs):
        out = tmp_path / f"out{number}"
        capsys.readouterr()
        assert main(["explain", str(source), "--out", str(out), "--workers", "0", *options]) == 1
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in lines[0]
        assert not out.exists()


def test_segmentation_default_is_each_images_largest_class_but_the_background():
    # Image 0: background on 8 pixels, class 2 on 5, class 1 on 3; image 1: background only.
    predicted = torch.zeros(2, 4, 4, dtype=torch.long)
    predicted[0].view(-1)[8:13] = 2
    predicted[0].view(-1)[13:] = 1
    logits = torch.nn.functional.one_hot(predicted, 3).permute(0, 3, 1, 2).float()
    groups = tasks.plan(
        "segmentation", lambda batch: {"out": logits}, logits, None,
        [tasks.BACKGROUND, "cat", "dog"], tasks.TaskOptions(),
    )  # fmt: skip
    explained, empty = sorted(groups, key=lambda group: group.reason is not None)
    assert explained.positions == [0] and explained.target.class_id == 2
    assert torch.equal(explained.target.mask, predicted[:1] == 2)
    assert empty.positions == [1] and empty.reason == (
        "no pixel is predicted as any class but the background"
    )


def test_detection_keeps_objects_above_the_score_of_the_class_asked_best_first():
    found = {
        "boxes": torch.arange(20.0).view(5, 4),
        "scores": torch.tensor([0.9, 0.8, 0.6, 0.55, 0.3]),
        "labels": torch.tensor([1, 2, 1, 1, 1]),
    }
    categories = [tasks.BACKGROUND, "person", "car"]

    def plan(target, **options):
        return tasks.plan(
            "detection", lambda batch: [found], torch.zeros(1, 3, 8, 8), target, categories,
            tasks.TaskOptions(**options),
        )  # fmt: skip

    (group,) = plan("person", min_score=0.5, max_objects=2)
    assert group.target.index == [0, 2] and group.boxes == found["boxes"][[0, 2]].tolist()
    (group,) = plan(None, min_score=0.5)
    assert group.target.index == [0, 1, 2, 3]
    (group,) = plan("car", min_score=0.85)
    assert group.reason == "no object of class 'car' scored 0.85 or more"
