"""The synthetic localisation set: deterministic, exact boxes, and the shipped weights."""

from __future__ import annotations

import pytest
import torch

from camviz.core.errors import CamvizError
from camviz.evaluation.synthetic import (
    CLASSES,
    SHIPPED_WEIGHTS,
    SyntheticCNN,
    load_model,
    make_dataset,
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


def test_boxes_are_tight_around_the_object_masks(data):
    rows = torch.arange(64).view(1, -1, 1)
    cols = torch.arange(64).view(1, 1, -1)
    x0, y0, x1, y1 = (data.boxes[:, i].view(-1, 1, 1) for i in range(4))
    inside = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)
    assert not bool((data.masks & ~inside).any())  # no object pixel outside its box
    # Every edge of the box touches the object.
    assert bool(data.masks.any(dim=2).gather(1, data.boxes[:, 1:2]).all())  # top row
    assert bool(data.masks.any(dim=2).gather(1, data.boxes[:, 3:4] - 1).all())  # bottom
    assert bool(data.masks.any(dim=1).gather(1, data.boxes[:, 0:1]).all())  # left column
    assert bool(data.masks.any(dim=1).gather(1, data.boxes[:, 2:3] - 1).all())  # right
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
    wrong = tmp_path / "wrong.pt"
    torch.save({"weight": torch.zeros(3)}, wrong)
    with pytest.raises(CamvizError, match="train_synthetic"):
        load_model(wrong)


def test_bad_arguments():
    with pytest.raises(CamvizError, match="size >= 32"):
        make_dataset(4, size=16)
