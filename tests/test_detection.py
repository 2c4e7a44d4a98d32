"""camviz.Detection and camviz.DenseDetections: one object of a detector's output, explained.

Each torchvision detector family is checked against a hand reference (autograd of the
detection's score to the layer's output, then the Grad-CAM formula) and Faster R-CNN against
pytorch-grad-cam's ``FasterRCNNBoxScoreTarget``. Models have random weights and thresholds of
0, so they return detections; inputs are tiny.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models import detection

import camviz
from camviz.core.detection import DetectionScore, Followed
from camviz.core.errors import CamvizError

# name -> (builder keyword arguments, a layer with a tensor output)
FAMILIES = {
    "fasterrcnn_mobilenet_v3_large_320_fpn": (
        {"box_score_thresh": 0.0, "min_size": 64, "max_size": 96},
        "backbone.body.16",
    ),
    "retinanet_resnet50_fpn": (
        {"score_thresh": 0.0, "min_size": 64, "max_size": 96},
        "backbone.body.layer3",
    ),
    "fcos_resnet50_fpn": (
        {"score_thresh": 0.0, "min_size": 64, "max_size": 96},
        "backbone.body.layer3",
    ),
    "ssdlite320_mobilenet_v3_large": ({"score_thresh": 0.0}, "backbone.features.0"),
    "MaskRCNN": (
        {"box_score_thresh": 0.0, "min_size": 64, "max_size": 96, "box_detections_per_img": 4},
        "backbone.body.16",
    ),
    "KeypointRCNN": (
        {"box_score_thresh": 0.0, "min_size": 64, "max_size": 96, "box_detections_per_img": 4},
        "backbone.body.16",
    ),
}


@functools.cache
def build(name: str, **overrides: Any) -> nn.Module:
    """The detector with random weights (built once per test session: explain hands it
    back unchanged)."""
    torch.manual_seed(0)
    options = {**FAMILIES[name][0], **overrides}
    if name in ("MaskRCNN", "KeypointRCNN"):  # their heads on a light backbone
        light = build("fasterrcnn_mobilenet_v3_large_320_fpn")
        anchors = light.rpn.anchor_generator  # one anchor size per level of that backbone
        return getattr(detection, name)(
            light.backbone, num_classes=2, rpn_anchor_generator=anchors, **options
        ).eval()
    model = getattr(detection, name)(weights=None, weights_backbone=None, num_classes=3, **options)
    return model.eval()


def hand_gradcam(
    model: nn.Module,
    images: torch.Tensor,
    layer: str,
    score: Callable[[Any], torch.Tensor],
    raw: bool = False,
) -> torch.Tensor:
    """Grad-CAM at ``layer`` by plain autograd, at the layer's resolution: the signed sum
    ``sum_k mean(dy/dA_k) A_k`` if ``raw``, else after ReLU and min-max normalised."""
    recorded = {}
    handle = model.get_submodule(layer).register_forward_hook(
        lambda module, args, output: recorded.setdefault("A", output)
    )
    try:
        with torch.enable_grad():
            output = model(images)
            (gradients,) = torch.autograd.grad(score(output), recorded["A"])
    finally:
        handle.remove()
    cam = (gradients.mean(dim=(2, 3), keepdim=True) * recorded["A"].detach()).sum(dim=1)
    if raw:
        return cam
    cam = torch.relu(cam)
    low = cam.flatten(1).amin(1).view(-1, 1, 1)
    high = cam.flatten(1).amax(1).view(-1, 1, 1)
    return (cam - low) / (high - low).clamp_min(1e-12)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gradcam_of_one_detection_equals_the_hand_formula(name: str) -> None:
    model = build(name)
    _, layer = FAMILIES[name]
    images = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(1))
    target = camviz.Detection(1)
    # Signed maps in the method's units: random weights give maps that ReLU may empty.
    explanation = camviz.explain(
        model, images, layer=layer, target=target, relu=False, normalize=False
    )
    expected = hand_gradcam(model, images, layer, lambda output: output[0]["scores"][1], raw=True)
    scale = float(expected.abs().max())
    assert scale > 0  # the detection's score depends on the layer
    torch.testing.assert_close(explanation.layer_maps, expected, atol=1e-4 * scale, rtol=0)
    with torch.no_grad():
        output = model(images)
    torch.testing.assert_close(explanation.boxes, output[0]["boxes"][1:2])
    assert explanation.targets.tolist() == output[0]["labels"][1:2].tolist()
    torch.testing.assert_close(explanation.scores, output[0]["scores"][1:2])


def test_several_objects_and_images_give_one_map_each_sample_major() -> None:
    model = build("fasterrcnn_mobilenet_v3_large_320_fpn")
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(2))
    layer = "backbone.body.16"
    explanation = camviz.explain(model, images, layer=layer, target=camviz.Detection([0, 3]))
    assert explanation.samples.tolist() == [0, 0, 1, 1]
    for row, (image, index) in enumerate([(0, 0), (0, 3), (1, 0), (1, 3)]):
        expected = hand_gradcam(
            model, images, layer, lambda output, i=image, j=index: output[i]["scores"][j]
        )[image]
        torch.testing.assert_close(explanation.layer_maps[row], expected, atol=1e-4, rtol=0)


def test_box_target_agrees_with_pytorch_grad_cam_box_score_target() -> None:
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import FasterRCNNBoxScoreTarget

    # A size the detector neither resizes nor pads: both tools lay the map on the same pixels.
    model = build("fasterrcnn_mobilenet_v3_large_320_fpn", min_size=64, max_size=64)
    images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        found = model(images)[0]
    box, label = found["boxes"][2], int(found["labels"][2])
    target = camviz.Detection(box=box, label=label, with_box=True)
    ours = camviz.explain(model, images, layer="backbone.body.16", target=target).heatmaps[0]
    with GradCAM(model=model, target_layers=[model.backbone.body["16"]]) as cam:
        theirs = cam(images, targets=[FasterRCNNBoxScoreTarget([label], box[None].numpy())])[0]
    correlation = torch.corrcoef(torch.stack([ours.flatten(), torch.as_tensor(theirs).flatten()]))
    assert correlation[0, 1] >= 0.99


def test_a_box_target_picks_the_best_overlap_of_its_class() -> None:
    found = [
        {
            "boxes": torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10]]),
            "scores": torch.tensor([0.9, 0.8, 0.7]),
            "labels": torch.tensor([1, 2, 2]),
        }
    ]
    fns, labels = camviz.Detection(box=[0, 0, 10, 10], label=2).resolve(found)
    assert labels.tolist() == [[2]]
    assert fns[0].indices.tolist() == [2]  # class 2 at IoU 1, not class 1's nor the IoU 0.68 one
    torch.testing.assert_close(fns[0](found), torch.tensor([0.7]))
    with_box = camviz.Detection(box=[1, 1, 11, 11], label=2, with_box=True).resolve(found)[0][0]
    torch.testing.assert_close(with_box(found), torch.tensor([0.8 + 1.0]))


def test_rerun_outputs_find_the_object_again_by_class_and_overlap() -> None:
    plain = [
        {
            "boxes": torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]]),
            "scores": torch.tensor([0.9, 0.6]),
            "labels": torch.tensor([1, 2]),
        }
    ]
    (score,), _ = camviz.Detection(1).resolve(plain)
    moved = {  # another order, the box shifted a little, and a decoy of another class
        "boxes": torch.tensor([[20.0, 20, 30, 30], [21, 21, 31, 31], [0, 0, 10, 10]]),
        "scores": torch.tensor([0.95, 0.4, 0.5]),
        "labels": torch.tensor([1, 2, 1]),
    }
    gone = {
        "boxes": torch.tensor([[0.0, 0, 10, 10]]),
        "scores": torch.tensor([0.3]),
        "labels": torch.tensor([1]),
    }
    rows = torch.tensor([0, 0])
    torch.testing.assert_close(score([moved, gone], rows), torch.tensor([0.4, 0.0]))


def test_followed_boxes_move_with_a_rescaled_and_flipped_input() -> None:
    (score,), _ = camviz.Detection(0).resolve(
        [
            {
                "boxes": torch.tensor([[10.0, 4, 30, 8]]),
                "scores": torch.tensor([1.0]),
                "labels": torch.tensor([1]),
            }
        ]
    )
    moved = Followed((score,)).moved([0.5, 2.0], flip_width=100.0).scores[0]
    # x scaled by 2 -> (20, 60), then mirrored in a 100 px wide image; y scaled by 0.5.
    torch.testing.assert_close(moved.boxes, torch.tensor([[40.0, 2, 80, 4]]))
    assert moved.indices is None


def test_aug_smooth_follows_the_object_into_the_flipped_image() -> None:
    model = build("fasterrcnn_mobilenet_v3_large_320_fpn")
    images = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain, flipped = model(images)[0], model(images.flip(-1))[0]
    (score,), _ = camviz.Detection(0).resolve([plain])
    mirrored = Followed((score,)).moved([1.0, 1.0], flip_width=96.0).scores[0]
    x0, y0, x1, y1 = plain["boxes"][0]
    expected_box = torch.stack([96 - x1, y0, 96 - x0, y1])
    same = flipped["labels"] == plain["labels"][0]
    ious = torchvision.ops.box_iou(expected_box[None], flipped["boxes"])[0].where(same, -1.0)
    expected = flipped["scores"][ious.argmax()] if ious.max() >= 0.5 else torch.tensor(0.0)
    torch.testing.assert_close(mirrored([flipped], torch.tensor([0]))[0], expected)
    explanation = camviz.explain(
        model, images, layer="backbone.body.16", target=camviz.Detection(0), aug_smooth=(1.0,)
    )
    assert torch.isfinite(explanation.heatmaps).all() and explanation.heatmaps.amax() == 1


def test_score_cam_finds_the_object_again_in_each_masked_run() -> None:
    from camviz.core.maps import normalize, upsample

    model = build("fasterrcnn_mobilenet_v3_large_320_fpn")
    images = torch.rand(1, 3, 64, 96, generator=torch.Generator().manual_seed(5))
    layer = "backbone.body.0"  # 16 channels: 16 masked runs of the detector
    explanation = camviz.explain(model, images, "scorecam", layer=layer, target=camviz.Detection(0))
    recorded = {}
    handle = model.get_submodule(layer).register_forward_hook(
        lambda module, args, output: recorded.setdefault("A", output)
    )
    with torch.no_grad():
        plain = model(images)[0]
    handle.remove()
    box, label = plain["boxes"][0], plain["labels"][0]
    masks = normalize(upsample(recorded["A"][0], images.shape[2:]))
    scores = []
    for mask in masks:  # by hand: the best overlap of the same class, IoU >= 0.5, else 0
        with torch.no_grad():
            found = model(images * mask)[0]
        ious = torchvision.ops.box_iou(box[None], found["boxes"])[0]
        ious = ious.where(found["labels"] == label, torch.tensor(-1.0))
        best = int(ious.argmax()) if len(ious) else None
        scores.append(found["scores"][best] if best is not None and ious[best] >= 0.5 else 0.0)
    expected = torch.tensor(scores).softmax(0)
    assert explanation.weights is not None
    torch.testing.assert_close(explanation.weights[layer][0], expected, atol=1e-5, rtol=0)


class TinyDense(nn.Module):
    """A dense head on a 4 x 4 grid of 8 px cells: per cell a cx, cy, w, h box and 2 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(8))
        self.head = nn.Conv2d(8, 6, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        raw = self.head(self.features(images))  # (N, 6, 4, 4)
        cells = torch.stack(
            torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="xy"), dim=0
        )
        centres = (cells + 0.5) * 8 + raw[:, :2].tanh() * 4
        sizes = 8 * raw[:, 2:4].exp()
        predictions = torch.cat([centres, sizes, raw[:, 4:].sigmoid()], dim=1)
        return predictions.flatten(2).transpose(1, 2)  # (N, 16, 4 + 2)


def test_dense_detections_decode_threshold_and_suppress() -> None:
    raw = torch.tensor(
        [
            [
                [10.0, 10, 4, 4, 0.9, 0.1],  # class 0, kept
                [10.5, 10, 4, 4, 0.8, 0.1],  # overlaps the first, same class: suppressed
                [10.0, 10, 4, 4, 0.1, 0.7],  # same place, class 1: kept
                [30.0, 30, 4, 4, 0.2, 0.1],  # below the threshold
            ]
        ]
    )
    # 4 anchors of 6 columns: no axis is 4 times the other, so the layout is said.
    (found,) = camviz.DenseDetections(score_threshold=0.25, iou_threshold=0.5, channels_last=True)(
        raw
    )
    torch.testing.assert_close(found["scores"], torch.tensor([0.9, 0.7]))
    assert found["labels"].tolist() == [0, 1]
    torch.testing.assert_close(found["boxes"], torch.tensor([[8.0, 8, 12, 12], [8, 8, 12, 12]]))
    (transposed,) = camviz.DenseDetections(channels_last=False)(raw.transpose(1, 2))
    torch.testing.assert_close(transposed["scores"], found["scores"])


def test_a_dense_head_is_explained_through_the_adapter() -> None:
    model = TinyDense().eval()
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    adapter = camviz.DenseDetections(score_threshold=0.0, iou_threshold=0.3, channels_last=True)
    explanation = camviz.explain(
        model, images, layer="features.1", target=camviz.Detection(0, adapter=adapter)
    )
    expected = hand_gradcam(model, images, "features.1", lambda out: adapter(out)[0]["scores"][0])
    torch.testing.assert_close(explanation.layer_maps, expected, atol=1e-5, rtol=0)


def test_bad_detection_targets_say_what_is_wrong_in_one_line() -> None:
    found = [
        {
            "boxes": torch.zeros(2, 4),
            "scores": torch.ones(2),
            "labels": torch.ones(2, dtype=torch.long),
        }
    ]
    cases: list[tuple[Callable[[], object], str]] = [
        (
            lambda: camviz.Detection(5).resolve(found),
            "detection 5 does not exist: image 0 has detections 0..1",
        ),
        (
            lambda: camviz.Detection(box=[0, 0, 5, 5], label=1).resolve(found),
            "no detection of class 1",
        ),
        (
            lambda: camviz.Detection(0).resolve(torch.zeros(2, 5)),
            "Detection needs a detector's output",
        ),
        (lambda: camviz.Detection(), "needs an index"),
        (lambda: camviz.Detection(box=[0, 0, 1, 1]), "needs label="),
        (lambda: camviz.Detection(0, iou=2), "iou must be in [0, 1]"),
        (lambda: camviz.DenseDetections()(torch.zeros(1, 5, 4)), "(N, anchors, 4 + classes)"),
    ]
    for call, message in cases:
        with pytest.raises(CamvizError) as error:
            call()
        assert message in str(error.value) and "\n" not in str(error.value)


def test_detection_score_is_a_row_target() -> None:
    # Perturbation methods call score functions with rows; take_rows keeps a detector's
    # per-image dicts whole.
    from camviz.core.targets import take_rows

    found = [
        {"boxes": torch.zeros(1, 4), "scores": torch.tensor([0.5]), "labels": torch.tensor([1])}
    ]
    assert take_rows(found * 2, torch.tensor([1])) == [found[0]]
    (score,), _ = camviz.Detection(0).resolve(found)
    assert isinstance(score, DetectionScore)


def test_the_roi_shortcut_replays_only_the_used_rows_and_changes_no_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from camviz.core.roiheads import RoIRows

    model = build("fasterrcnn_mobilenet_v3_large_320_fpn")
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(7))
    pooled_rows: list[int] = []
    handle = model.roi_heads.box_roi_pool.register_forward_hook(
        lambda module, args, output: pooled_rows.append(len(output))
    )
    targets = {
        "two objects": camviz.Detection([0, 2]),
        "every detection": lambda out: torch.stack([o["scores"].sum() for o in out]),
    }
    try:
        shortened = {
            name: camviz.explain(model, images, layer="backbone", target=target, normalize=False)
            for name, target in targets.items()
        }
        # forward (all proposals), then one replay per object: one row from each image
        assert pooled_rows[1:3] == [2, 2]
        monkeypatch.setattr(RoIRows, "of", classmethod(lambda cls, model, taps: None))
        for name, target in targets.items():
            plain = camviz.explain(model, images, layer="backbone", target=target, normalize=False)
            for level, maps in plain.maps_by_layer.items():
                scale = float(maps.abs().max()) or 1.0
                torch.testing.assert_close(
                    shortened[name].maps_by_layer[level], maps, atol=1e-5 * scale, rtol=1e-5
                )
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("name", "reads"),
    [("MaskRCNN", "masks"), ("KeypointRCNN", "keypoints_scores")],
)
def test_a_score_that_reads_masks_or_keypoints_keeps_their_gradient_under_the_roi_shortcut(
    name: str, reads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from camviz.core.roiheads import RoIRows

    # The mask and keypoint heads pool the feature maps again for the detected boxes, a
    # path beside the box rows that the shortcut replays.
    model = build(name)
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(7))

    def target(outputs):
        return torch.stack([output[reads][:2].sum() for output in outputs])

    shortened = camviz.explain(model, images, layer="backbone", target=target, normalize=False)
    monkeypatch.setattr(RoIRows, "of", classmethod(lambda cls, model, taps: None))
    plain = camviz.explain(model, images, layer="backbone", target=target, normalize=False)
    evidence = 0.0
    for level, maps in plain.maps_by_layer.items():
        scale = float(maps.abs().max())
        evidence += scale
        torch.testing.assert_close(
            shortened.maps_by_layer[level], maps, atol=1e-5 * scale, rtol=1e-5
        )
    assert evidence > 0


def test_a_row_target_on_a_detector_gets_one_row_per_image() -> None:
    model = build("fasterrcnn_mobilenet_v3_large_320_fpn")
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(8))
    seen: list[list[int]] = []

    def second_score(output: Any, rows: torch.Tensor) -> torch.Tensor:
        seen.append(rows.tolist())
        return torch.stack([output[r]["scores"][1] for r in range(len(rows))])

    by_rows = camviz.explain(model, images, layer="backbone.body.16", target=second_score)
    assert seen[0] == [0, 1]
    by_index = camviz.explain(model, images, layer="backbone.body.16", target=camviz.Detection(1))
    torch.testing.assert_close(by_rows.heatmaps, by_index.heatmaps)
