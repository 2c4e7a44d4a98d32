"""Ablation-CAM on torchvision detectors with the plain pass's proposals held, and the exact
backward shortcut through RetinaNet's, FCOS's and SSD's dense heads.

Ablation-CAM is checked against whole-network passes written here by hand: each channel
zeroed by a hook, the region proposal network's answer replaced by the proposal of the
explained detection (found by its score among the rows of the box predictor), the object
followed by class and IoU. The dense-head shortcut is checked against the plain backward pass.
Detectors are built from torchvision's classes on a tiny feature pyramid (8 channels), with
random weights and thresholds of 0, so that they return detections.
"""

from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn
from torchvision.models import detection
from torchvision.models.detection.anchor_utils import AnchorGenerator, DefaultBoxGenerator
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.ops import MultiScaleRoIAlign, box_iou

import camviz
from camviz.core.denseheads import DenseRows
from camviz.core.detection import DetectionScore
from camviz.core.heldscores import HeldRows, copy_scores

SIZE = 64


def _pyramid(channels: int = 8) -> nn.Module:
    """A two-stage trunk (strides 4 and 8) under a small FPN: levels '0', '1', 'pool'."""
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=4, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
    )
    return BackboneWithFPN(trunk, {"1": "0", "3": "1"}, [8, 8], channels)


def _anchors() -> AnchorGenerator:
    return AnchorGenerator(((16,), (32,), (64,)), ((0.5, 1.0, 2.0),) * 3)


@functools.cache
def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    sizes = {"min_size": SIZE, "max_size": SIZE}
    if kind == "fasterrcnn":
        model: nn.Module = detection.FasterRCNN(
            _pyramid(),
            num_classes=3,
            rpn_anchor_generator=_anchors(),
            box_roi_pool=MultiScaleRoIAlign(["0", "1"], 7, 2),
            box_score_thresh=0.0,
            rpn_post_nms_top_n_test=40,
            box_detections_per_img=10,
            **sizes,
        )
    elif kind == "maskrcnn":
        model = detection.MaskRCNN(
            _pyramid(),
            num_classes=3,
            rpn_anchor_generator=_anchors(),
            box_roi_pool=MultiScaleRoIAlign(["0", "1"], 7, 2),
            mask_roi_pool=MultiScaleRoIAlign(["0", "1"], 14, 2),
            box_score_thresh=0.0,
            rpn_post_nms_top_n_test=40,
            box_detections_per_img=10,
            **sizes,
        )
    elif kind == "retinanet":
        model = detection.RetinaNet(
            _pyramid(), num_classes=3, anchor_generator=_anchors(), score_thresh=0.0, **sizes
        )
        # torchvision's initialisation (std 0.01 through five convolutions) leaves every
        # score at the prior's 0.01 to the last bit: no channel would change it.
        for convolution in model.head.classification_head.modules():
            if isinstance(convolution, nn.Conv2d):
                nn.init.normal_(convolution.weight, std=0.1)
    elif kind == "fcos":
        anchors = AnchorGenerator(((8,), (16,), (32,)), ((1.0,),) * 3)
        model = detection.FCOS(  # 32 channels: its GroupNorm has 32 groups
            _pyramid(32), num_classes=3, anchor_generator=anchors, score_thresh=0.0, **sizes
        )
    else:  # ssd: a head with one convolution per level
        head = detection.ssd.SSDHead([8, 8, 8], [4, 4, 4], 3)
        boxes = DefaultBoxGenerator([[2], [2], [2]])
        model = detection.ssd.SSD(_pyramid(), boxes, (SIZE, SIZE), 3, head=head, score_thresh=0.0)
    return model.eval()


def images(count: int, seed: int) -> torch.Tensor:
    return torch.rand(count, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def _followed(output: Any, box: torch.Tensor, label: int) -> float:
    """The score of the detection of ``label`` that best overlaps ``box`` (IoU >= 0.5), else 0
    (:class:`camviz.Detection`'s rule, written again)."""
    found = output[0]
    same = found["labels"] == label
    if not same.any():
        return 0.0
    ious = torch.where(same, box_iou(box[None], found["boxes"])[0], torch.tensor(-1.0))
    best = int(ious.argmax())
    return float(found["scores"][best]) if float(ious[best]) >= 0.5 else 0.0


def _held_proposal(model: nn.Module, image: torch.Tensor, score: float) -> torch.Tensor | None:
    """The proposal whose box-predictor row gives the detection scored ``score``."""
    if not hasattr(model, "rpn"):
        return None
    seen: dict[str, Any] = {}
    hooks = [
        model.rpn.register_forward_hook(lambda m, a, out: seen.update(boxes=out[0][0])),
        model.roi_heads.box_predictor.register_forward_hook(
            lambda m, a, out: seen.update(logits=out[0])
        ),
    ]
    with torch.no_grad():
        model(image)
    for hook in hooks:
        hook.remove()
    probabilities = seen["logits"].softmax(-1)
    row = int((probabilities - score).abs().min(1).values.argmin())
    assert float((probabilities[row] - score).abs().min()) == 0
    return seen["boxes"][row : row + 1]


def whole_network_ablation(
    model: nn.Module, image: torch.Tensor, level: str, box: torch.Tensor, label: int
) -> torch.Tensor:
    """Raw Ablation-CAM at FPN ``level`` of one image's detection of ``label`` at ``box`` (the
    one explained in a batch: random weights score every detection about alike, so this
    image's own first one may be another when it is run alone) by whole-network passes, the
    proposals (for an R-CNN) held at that detection's."""
    with torch.no_grad():
        plain = model(image)
    score = _followed(plain, box, label)
    proposal = _held_proposal(model, image, score)
    return ablated_by_hand(
        model,
        image,
        level,
        lambda output: _followed(output, box, label),
        None if proposal is None else [proposal],
        plain_score=score,
    )


def ablated_by_hand(
    model: nn.Module,
    image: torch.Tensor,
    level: str,
    score: Any,
    proposals: list[torch.Tensor] | None,
    plain_score: float | None = None,
) -> torch.Tensor:
    """Raw Ablation-CAM at FPN ``level`` of ``score(output)`` by whole-network passes of one
    image, each with one channel zeroed by a hook and (for an R-CNN) ``proposals`` in place of
    the region proposal network's answer; ``plain_score``: what the unablated pass must score
    with those proposals."""
    seen: dict[str, torch.Tensor] = {}
    zeroed: list[int] = []

    def ablate(module: nn.Module, args: Any, output: OrderedDict) -> OrderedDict:
        if "A" not in seen:
            seen["A"] = output[level].clone()
        edited = OrderedDict(output)
        if zeroed:
            edited[level] = output[level].clone()
            edited[level][:, zeroed[0]] = 0
        return edited

    hooks = [model.backbone.register_forward_hook(ablate)]
    if proposals is not None:
        hooks.append(model.rpn.register_forward_hook(lambda m, a, out: (proposals, out[1])))
    weights = []
    try:
        with torch.no_grad():
            plain = float(score(model(image)))
            if plain_score is not None:
                assert plain == pytest.approx(plain_score, rel=1e-6)
            for channel in range(seen["A"].shape[1]):
                zeroed[:] = [channel]
                weights.append((plain - float(score(model(image)))) / plain)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.einsum("c,chw->hw", torch.tensor(weights), seen["A"][0])


@pytest.fixture
def one_thread():
    """torch on one thread for the test. Random weights score every detection about 0.01, so
    which one comes first depends on the last bits of the convolutions, which the batch size
    changes on several threads: the reference, image by image, would follow another object
    than the batch explained (RetinaNet's second image, on two threads)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("kind", ["fasterrcnn", "retinanet"])
def test_ablationcam_on_a_detector_equals_whole_network_passes(
    kind: str, untouched, one_thread
) -> None:
    model = build(kind)
    batch = images(2, seed=1)
    with untouched(model):
        explanation = camviz.explain(
            model,
            batch,
            "ablationcam",
            layer="backbone",
            target=camviz.Detection(0),
            relu=False,
            normalize=False,
        )
    for sample in range(len(batch)):
        evidence = 0.0
        # Each box comes from one level (an R-CNN's RoI, a dense head's anchor): the others are 0.
        levels = [name[len("backbone[") : -1] for name in explanation.maps_by_layer]
        for level in levels:
            box, label = explanation.boxes[sample], int(explanation.targets[sample])
            expected = whole_network_ablation(model, batch[sample : sample + 1], level, box, label)
            evidence += float(expected.abs().max())
            maps = explanation.maps_by_layer[f"backbone[{level}]"]
            torch.testing.assert_close(maps[sample], expected, atol=1e-5, rtol=0)
        assert evidence > 0


def test_ablationcam_of_a_mask_score_holds_every_proposal(untouched, one_thread) -> None:
    # A score that reads masks: Mask R-CNN's mask head takes the detections of every
    # proposal, so every proposal of the plain pass is held, and no fallback warns.
    model = build("maskrcnn")
    image = images(1, seed=1)

    def mask_score(outputs):
        return torch.stack([output["masks"][:3].sum() for output in outputs])

    seen: dict[str, list[torch.Tensor]] = {}
    hook = model.rpn.register_forward_hook(lambda m, a, out: seen.update(proposals=out[0]))
    with torch.no_grad():
        model(image)
    hook.remove()
    with untouched(model), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback's warning
        explanation = camviz.explain(
            model,
            image,
            "ablationcam",
            layer="backbone",
            target=mask_score,
            relu=False,
            normalize=False,
        )
    evidence = 0.0
    for level in ("0", "1"):
        expected = ablated_by_hand(model, image, level, mask_score, seen["proposals"])
        evidence += float(expected.abs().max())
        maps = explanation.maps_by_layer[f"backbone[{level}]"]
        torch.testing.assert_close(maps[0], expected, atol=1e-5, rtol=0)
    assert evidence > 0


def test_ablationcam_on_an_rcnn_pools_only_the_explained_rows() -> None:
    model = build("fasterrcnn")
    pooled: list[int] = []  # rows of the pyramid's channels (held passes fold the copies in)
    width = model.backbone.out_channels
    hook = model.roi_heads.box_roi_pool.register_forward_hook(
        lambda module, args, output: pooled.append(output.shape[0] * output.shape[1] // width)
    )
    try:
        explanation = camviz.explain(
            model, images(1, seed=2), "ablationcam", layer="backbone[0]", target=camviz.Detection(0)
        )
    finally:
        hook.remove()
    # the engine's pass and the one that holds the proposals pool every proposal; the
    # ablated passes pool one row per copy (8 channels and the unablated check)
    assert explanation.weights is not None
    channels = explanation.weights["backbone[0]"].shape[1]
    assert pooled[0] == pooled[1] > 1 and sum(pooled[2:]) == channels + 1


@pytest.mark.parametrize("kind", ["retinanet", "fcos", "ssd"])
def test_the_dense_head_shortcut_gives_the_plain_gradient(
    kind: str, monkeypatch: pytest.MonkeyPatch, untouched
) -> None:
    model = build(kind)
    batch = images(2, seed=3)
    calls: list[tuple[str, list[tuple[int, ...]]]] = []  # each branch call's levels' sizes
    branches = ("classification_head", "regression_head")
    hooks = [
        getattr(model.head, branch).register_forward_hook(
            lambda module, args, output, branch=branch: calls.append(
                (branch, [tuple(x.shape[-2:]) for x in args[0]])
            )
        )
        for branch in branches
    ]
    raw = {"relu": False, "normalize": False}
    with torch.no_grad():
        found = model(batch)
    # the IoU with a box off the detection's own (by 15 % of its sides): the box term has a
    # gradient
    boxes = torch.stack([image["boxes"][:1] for image in found])
    sides = (boxes[..., 2:] - boxes[..., :2]).repeat(1, 1, 2)
    shifted = boxes + 0.15 * sides
    labels = torch.stack([image["labels"][:1] for image in found])
    targets = {
        "three objects": camviz.Detection([0, 1, 2]),
        "with the box": camviz.Detection(box=shifted, label=labels, iou=0.3, with_box=True),
    }
    shortened, replays = {}, {}
    try:
        with untouched(model):
            for name, target in targets.items():
                calls.clear()
                shortened[name] = camviz.explain(
                    model, batch, layer="backbone", target=target, **raw
                )
                # the forward pass hands every level (level 0 is 16 x 16); the rest replay
                replays[name] = [call for call in calls if call[1][0] != (SIZE // 4, SIZE // 4)]
    finally:
        for hook in hooks:
            hook.remove()
    shortcut = DenseRows.of(model, ["backbone"])
    assert shortcut is not None
    if kind == "fcos":  # GroupNorm: a location depends on its whole level
        assert shortcut.radius is None
    else:  # four 3x3 convolutions and one more (RetinaNet), one (SSD)
        assert shortcut.radius == {"retinanet": 5, "ssd": 1}[kind]
        # each replay: crops of 2r + 1 (SSD: of every level up to the replayed one)
        side = 2 * shortcut.radius + 1
        assert replays["three objects"]
        for _, sizes in replays["three objects"] + replays["with the box"]:
            assert sizes == [(side, side)] * len(sizes)
        # a class score reads no box: only the classification branch is replayed for it
        assert {branch for branch, _ in replays["three objects"]} == {branches[0]}
        assert {branch for branch, _ in replays["with the box"]} == set(branches)
    monkeypatch.setattr(DenseRows, "of", classmethod(lambda cls, model, taps: None))
    for name, target in targets.items():
        plain = camviz.explain(model, batch, layer="backbone", target=target, **raw)
        for level, maps in plain.maps_by_layer.items():
            scale = float(maps.abs().max()) or 1.0
            assert scale > 0 or level.endswith("[pool]")
            torch.testing.assert_close(
                shortened[name].maps_by_layer[level], maps, atol=1e-5 * scale, rtol=1e-5
            )


@pytest.mark.parametrize("with_box", [False, True])
def test_held_scores_equal_torchvision_post_processing(
    with_box: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched scores of held copies against torchvision's post-processing of each copy,
    on random rows of 4 overlapping proposals: NMS suppresses among them, and with one
    detection kept of 8 candidates the copies where the object may be cut go through
    torchvision's path. The image was halved in height by the transform."""
    model = build("fasterrcnn")
    heads = model.roi_heads
    generator = torch.Generator().manual_seed(4)
    copies, rows, classes = 32, 4, 3
    corners = torch.tensor([[10.0, 12.0, 40.0, 44.0]]) + torch.randn(rows, 4, generator=generator)
    held = HeldRows(
        heads,
        model.transform,
        torch.randn(copies * rows, classes, generator=generator),
        torch.randn(copies * rows, classes * 4, generator=generator) * 0.3,
        corners,
        (SIZE, SIZE),
        (2 * SIZE, SIZE),
    )
    reader = camviz.Detection(0).reader(None)
    for limit, overlap in ((10, 0.5), (1, 0.3)):
        monkeypatch.setattr(heads, "detections_per_img", limit)
        monkeypatch.setattr(heads, "nms_thresh", overlap)
        for label in (1, 2, -1):
            score = DetectionScore(
                boxes=torch.tensor([[10.0, 24.0, 40.0, 88.0]]),
                labels=torch.tensor([label]),
                reference=torch.tensor([[12.0, 20.0, 42.0, 90.0]]),
                indices=None,
                iou=0.3,
                with_box=with_box,
                read=reader,
            )
            expected = held.torchvision_scores(score, 0, torch.arange(copies))
            assert label < 0 or expected.count_nonzero() > copies // 4
            torch.testing.assert_close(copy_scores(held, score, 0), expected, atol=0, rtol=0)
