"""A detector trained on synthetic scenes: Grad-CAM of each detection points at its own object.

The shipped :class:`~camviz.evaluation.synthetic.SyntheticDetector` returns raw YOLO-style
predictions, read through :class:`camviz.DenseDetections`. Each object of held-out scenes
that the detector finds (a detection of its class with IoU >= 0.5) is explained with
``camviz.Detection(index)``, and the pointing game with tolerance 0 asks whether the map's
hottest pixel lies in that object's own box. The scenes hold two or three objects of
different classes each, so a map on the wrong object misses; a random map hits about as often
as the boxes cover the image (6 %).
"""

from __future__ import annotations

import pytest
import torch
from torchvision.ops import box_iou

import camviz
from camviz.evaluation.localization import box_masks, pointing_game
from camviz.evaluation.synthetic import TARGET_LAYER, load_detector, make_scenes

# Seed 0 trained the detector and seed 1 scored it while training: these scenes are new to it.
SCENES_SEED = 2026


@pytest.fixture(scope="module")
def explained() -> dict[str, torch.Tensor]:
    """Every found object's map, its box, and the scenes' counts, for the tests below."""
    detector = load_detector()
    scenes = make_scenes(40, objects=(2, 3), seed=SCENES_SEED)
    adapter = camviz.DenseDetections()
    with torch.inference_mode():
        detections = adapter(detector(scenes.images))
    maps, boxes, explained_boxes, found_boxes = [], [], [], []
    for n, found in enumerate(detections):
        if not len(found["boxes"]):
            continue
        overlaps = box_iou(scenes.boxes[n].float(), found["boxes"])
        same_class = scenes.labels[n].view(-1, 1) == found["labels"].view(1, -1)
        overlaps = torch.where(same_class, overlaps, 0.0)
        best_overlap, best = overlaps.max(dim=1)
        hit = best_overlap >= 0.5
        if not bool(hit.any()):
            continue
        result = camviz.explain(
            detector,
            scenes.images[n : n + 1],
            layer=TARGET_LAYER,
            target=camviz.Detection(best[hit].tolist(), adapter=adapter),
        )
        assert isinstance(result.heatmaps, torch.Tensor) and result.boxes is not None
        maps.append(result.heatmaps)
        boxes.append(scenes.boxes[n][hit])
        explained_boxes.append(result.boxes)
        found_boxes.append(found["boxes"][best[hit]])
    return {
        "maps": torch.cat(maps),
        "boxes": torch.cat(boxes),
        "explained_boxes": torch.cat(explained_boxes),
        "found_boxes": torch.cat(found_boxes),
        "objects": torch.tensor(sum(len(labels) for labels in scenes.labels)),
    }


def test_the_detector_finds_the_objects_and_each_map_is_of_its_own_detection(explained):
    found, objects = len(explained["boxes"]), int(explained["objects"])
    assert found >= 0.95 * objects, f"the detector found {found} of {objects} objects"
    # Explanation.boxes holds the box of the detection each map explains.
    assert torch.allclose(explained["explained_boxes"], explained["found_boxes"])


def test_each_detections_map_points_into_its_own_box_far_more_often_than_a_random_map(
    explained,
):
    maps, boxes = explained["maps"], explained["boxes"]
    hits = pointing_game(maps, boxes, tolerance=0).float().mean().item()
    random_maps = torch.rand(maps.shape, generator=torch.Generator().manual_seed(0))
    random_hits = pointing_game(random_maps, boxes, tolerance=0).float().mean().item()
    area_share = box_masks(boxes, *maps.shape[-2:]).float().mean().item()
    assert hits >= 0.9, (
        f"pointing game {hits:.3f} over {len(maps)} objects; a random map gets "
        f"{random_hits:.3f} (the boxes cover {area_share:.3f} of the image)"
    )
    assert random_hits < 0.2 and area_share < 0.1  # the margin is real
