"""Pointing game and energy-based pointing game: hand-worked maps, random maps, and the
synthetic benchmark with the shipped weights."""

from __future__ import annotations

import math

import pytest
import torch

import camviz
from camviz.core.errors import CamvizError
from camviz.evaluation.localization import box_masks, energy_pointing_game, pointing_game
from camviz.evaluation.synthetic import TARGET_LAYER, load_model, make_dataset

# A 4x4 map whose maximum (9) is at row 1, column 2.
MAP = torch.tensor(
    [
        [0.0, 1.0, 2.0, 0.0],
        [0.0, 3.0, 9.0, 1.0],
        [0.0, 0.0, 2.0, 0.0],
        [1.0, 0.0, 0.0, 1.0],
    ]
).unsqueeze(0)


def test_box_masks_are_half_open():
    masks = box_masks(torch.tensor([[1, 0, 3, 2]]), 3, 4)
    expected = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(masks[0], expected)


@pytest.mark.parametrize(
    ("box", "tolerance", "hit"),
    [
        ((2, 1, 3, 2), 0, True),  # exactly the maximum's pixel
        ((0, 0, 2, 4), 0, False),  # columns 0-1: the maximum is in column 2
        ((0, 3, 1, 4), 2, False),  # pixel (3, 0): distance sqrt(2^2 + 2^2) = 2.83 > 2
        ((0, 3, 1, 4), 2.9, True),
        ((3, 3, 4, 4), 2.3, True),  # pixel (3, 3): sqrt(2^2 + 1^2) = 2.24
        ((2, 3, 3, 4), 2, False),  # pixel (3, 2): distance 2, and a hit needs less
        ((2, 3, 3, 4), 2.01, True),
    ],
)
def test_pointing_game_by_hand(box, tolerance, hit):
    result = pointing_game(MAP, torch.tensor([box]), tolerance=tolerance)
    assert result.tolist() == [hit]


@pytest.mark.parametrize(
    ("size", "gap", "hit"),
    [
        (224, 14, True),  # the paper's 15 px at 224 x 224: distance 14 hits
        (224, 15, False),  # and distance 15 does not
        (448, 29, True),  # 30 px at twice the size
        (448, 30, False),
        (448, 0, True),  # a maximum inside always hits
    ],
)
def test_the_default_tolerance_is_the_papers_scaled_with_the_short_side(size, gap, hit):
    heatmap = torch.zeros(1, size, size * 2)  # the short side sets the scale
    heatmap[0, 100, 100] = 1
    box = torch.tensor([[100 + gap, 90, 100 + gap + 10, 110]])  # gap columns to the right
    assert pointing_game(heatmap, box).tolist() == [hit]
    assert pointing_game(heatmap, box, tolerance=0).tolist() == [gap == 0]


def test_masks_and_boxes_agree_and_a_constant_map_misses():
    maps = torch.cat([MAP, torch.full((1, 4, 4), 0.5)])
    boxes = torch.tensor([[1, 1, 3, 3], [0, 0, 4, 4]])
    masks = box_masks(boxes, 4, 4)
    assert pointing_game(maps, boxes, tolerance=0).tolist() == [True, False]
    assert torch.equal(pointing_game(maps, masks), pointing_game(maps, boxes))
    torch.testing.assert_close(energy_pointing_game(maps, masks), energy_pointing_game(maps, boxes))


def test_energy_pointing_game_by_hand():
    # Box rows 0-1, columns 1-2 holds 1 + 2 + 3 + 9 = 15 of the map's total 20.
    share = energy_pointing_game(MAP, torch.tensor([[1, 0, 3, 2]]))
    torch.testing.assert_close(share, torch.tensor([15 / 20]))
    empty = energy_pointing_game(torch.zeros(1, 4, 4), torch.tensor([[0, 0, 2, 2]]))
    assert empty.tolist() == [0.0]


def test_random_maps_score_the_box_share_within_sampling_error():
    generator = torch.Generator().manual_seed(0)
    count, size = 2000, 32
    maps = torch.rand(count, size, size, generator=generator)
    boxes = torch.tensor([[4, 8, 12, 24]]).expand(count, 4)  # 8 x 16 = 1/8 of the image
    share = 8 * 16 / size**2
    energy = energy_pointing_game(maps, boxes)
    assert abs(energy.mean().item() - share) < 4 * energy.std().item() / math.sqrt(count)
    hits = pointing_game(maps, boxes, tolerance=0).float()
    assert abs(hits.mean().item() - share) < 4 * math.sqrt(share * (1 - share) / count)


def test_gradcam_points_at_the_synthetic_objects_far_better_than_a_random_map():
    data = make_dataset(64, seed=12345)
    model = load_model()
    result = camviz.explain(model, data.images, "gradcam", layer=TARGET_LAYER, target=data.labels)
    gradcam_hits = pointing_game(result.heatmaps, data.boxes, tolerance=0).float().mean().item()
    generator = torch.Generator().manual_seed(1)
    random_maps = torch.rand(result.heatmaps.shape, generator=generator)
    random_hits = pointing_game(random_maps, data.boxes, tolerance=0).float().mean().item()
    area_share = box_masks(data.boxes, 64, 64).float().mean().item()
    assert gradcam_hits >= 0.9
    assert random_hits <= area_share + 0.1
    gradcam_energy = energy_pointing_game(result.heatmaps, data.boxes).mean().item()
    assert gradcam_energy > 4 * area_share


def test_user_mistakes_are_one_line_errors():
    with pytest.raises(CamvizError, match="one region per map"):
        pointing_game(MAP, torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]]))
    with pytest.raises(CamvizError, match="boxes or"):
        pointing_game(MAP, torch.zeros(1, 4, 4))  # float mask
    with pytest.raises(CamvizError, match="non-negative"):
        energy_pointing_game(-MAP, torch.tensor([[0, 0, 1, 1]]))
    with pytest.raises(CamvizError, match="tolerance"):
        pointing_game(MAP, torch.tensor([[0, 0, 1, 1]]), tolerance=-1)
