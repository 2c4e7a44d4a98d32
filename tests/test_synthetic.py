"""The synthetic localisation set and scenes: deterministic, exact boxes, masks and class maps,
and the shipped weights."""

from __future__ import annotations

import pytest
import torch

from camviz.core.errors import CamvizError
from camviz.evaluation.synthetic import (
    CLASSES,
    SEGMENTATION_CLASSES,
    SHIPPED_WEIGHTS,
    SyntheticCNN,
    SyntheticDetector,
    load_detector,
    load_model,
    make_dataset,
    make_scenes,
)


@pytest.fixture(scope="module")
def data():
    return make_dataset(256, seed=7)


def test_same_seed_same_images_other_seed_other_images(data):
    again = make_dataset(256, seed=7)
    other = make_dataset(256, seed=8)
    for name in ("images", "labels", "boxes", "masks"):
        assert torch.equal(getattr(data, name), getattr(again, name))
    assert not torch.equal(data.images, other.images)


def assert_tight(boxes: torch.Tensor, masks: torch.Tensor) -> None:
    """Every ``(x0, y0, x1, y1)`` box holds all of its mask, and each edge touches it."""
    size = masks.shape[-1]
    rows = torch.arange(size).view(1, -1, 1)
    cols = torch.arange(size).view(1, 1, -1)
    x0, y0, x1, y1 = (boxes[:, i].view(-1, 1, 1) for i in range(4))
    inside = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)
    assert not bool((masks & ~inside).any())  # no object pixel outside its box
    assert bool(masks.any(dim=2).gather(1, boxes[:, 1:2]).all())  # top row
    assert bool(masks.any(dim=2).gather(1, boxes[:, 3:4] - 1).all())  # bottom
    assert bool(masks.any(dim=1).gather(1, boxes[:, 0:1]).all())  # left column
    assert bool(masks.any(dim=1).gather(1, boxes[:, 2:3] - 1).all())  # right


def test_boxes_are_tight_around_the_object_masks(data):
    assert_tight(data.boxes, data.masks)
    sides = torch.stack([data.boxes[:, 2] - data.boxes[:, 0], data.boxes[:, 3] - data.boxes[:, 1]])
    assert int(sides.min()) >= 8 and int(sides.max()) <= 21


def test_objects_are_drawn_in_one_colour_and_classes_are_balanced(data):
    for index in range(8):
        colours = data.images[index][:, data.masks[index]]
        assert torch.equal(colours, colours[:, :1].expand_as(colours))
    assert data.images.min() >= 0 and data.images.max() <= 1
    counts = torch.bincount(data.labels, minlength=len(CLASSES))
    assert int(counts.min()) >= 256 / len(CLASSES) * 0.6


def test_the_shipped_weights_are_small_and_classify_held_out_images():
    assert SHIPPED_WEIGHTS.stat().st_size < 200_000
    model = load_model()
    held_out = make_dataset(200, seed=424242)
    with torch.inference_mode():
        accuracy = (model(held_out.images).argmax(dim=1) == held_out.labels).float().mean()
    assert accuracy >= 0.95
    assert not model.training


def test_random_weights_and_a_wrong_file(tmp_path):
    assert isinstance(load_model(None), SyntheticCNN)
    assert isinstance(load_detector(None), SyntheticDetector)
    wrong = tmp_path / "wrong.pt"
    torch.save({"weight": torch.zeros(3)}, wrong)
    with pytest.raises(CamvizError, match=r"train_synthetic\.py$"):
        load_model(wrong)
    with pytest.raises(CamvizError, match=r"SyntheticDetector .* --model detector$"):
        load_detector(wrong)


def test_bad_arguments():
    with pytest.raises(CamvizError, match="size >= 32"):
        make_dataset(4, size=16)


@pytest.fixture(scope="module")
def scenes():
    return make_scenes(64, objects=(2, 4), seed=3)


def test_scenes_same_seed_same_scenes(scenes):
    again, other = make_scenes(64, objects=(2, 4), seed=3), make_scenes(64, objects=(2, 4), seed=4)
    assert torch.equal(scenes.images, again.images)
    assert torch.equal(scenes.class_map, again.class_map)
    for name in ("labels", "boxes", "masks"):
        assert all(map(torch.equal, getattr(scenes, name), getattr(again, name)))
    assert not torch.equal(scenes.images, other.images)


def test_scene_objects_are_apart_of_different_classes_with_tight_boxes(scenes):
    counts = [len(labels) for labels in scenes.labels]
    assert min(counts) == 2 and max(counts) == 4
    for labels, boxes, masks in zip(scenes.labels, scenes.boxes, scenes.masks, strict=True):
        assert len(set(labels.tolist())) == len(labels)  # one object per class
        assert int(masks.sum(dim=0).max()) == 1  # no pixel in two objects
        assert_tight(boxes, masks)
        sides = boxes[:, 2:] - boxes[:, :2]
        assert int(sides.min()) >= 8 and int(sides.max()) <= 21


def test_the_class_map_labels_each_object_pixel_with_its_class_and_the_rest_background(scenes):
    assert SEGMENTATION_CLASSES[1:] == CLASSES
    for class_map, labels, masks in zip(scenes.class_map, scenes.labels, scenes.masks, strict=True):
        expected = (masks * (labels + 1).view(-1, 1, 1)).sum(dim=0)
        assert torch.equal(class_map, expected)
    for index in range(8):  # and every object is drawn in one colour
        for mask in scenes.masks[index]:
            colours = scenes.images[index][:, mask]
            assert torch.equal(colours, colours[:, :1].expand_as(colours))


def test_the_shipped_detector_is_small_and_outputs_boxes_and_probabilities():
    from camviz.evaluation.synthetic import SHIPPED_DETECTOR

    assert SHIPPED_DETECTOR.stat().st_size < 200_000
    detector = load_detector()
    assert not detector.training
    images = make_scenes(2, seed=11).images
    with torch.inference_mode():
        output = detector(images)
        cells = detector.cells(images)
    assert output.shape == (2, 64, 4 + len(CLASSES))
    # Cell (row 2, col 5) is row 2 * 8 + 5 of the output: its centre lies in that cell.
    centre_x, centre_y, width, height = output[1, 21, :4]
    assert 40 <= centre_x < 48 and 16 <= centre_y < 24
    assert torch.allclose(width, cells[1, 2, 2, 5].exp() * 8)
    assert torch.allclose(height, cells[1, 3, 2, 5].exp() * 8)
    assert torch.allclose(output[1, 21, 4:], cells[1, 4:, 2, 5].sigmoid())


def test_bad_scene_arguments():
    with pytest.raises(CamvizError, match="objects"):
        make_scenes(4, objects=(2, 5))
    with pytest.raises(CamvizError, match="objects"):
        make_scenes(4, objects=(3, 2))
