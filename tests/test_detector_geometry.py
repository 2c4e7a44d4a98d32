"""Maps of torchvision detectors lie on each original image through the detector's own
resize and padding (:mod:`camviz.core.placement`); a list of images of different sizes is
explained as one batch, one map per image at its own size.

References are built by hand: autograd on the explained score to the layer's output, the
formula, then the geometry as torchvision defines it (upsample to the padded batch, crop the
image's resized corner, resize to the image's size). Random weights, tiny images.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

import camviz
from camviz.cams.engine import layer_pass
from camviz.core.errors import CamvizError
from camviz.core.inputs import as_inputs
from camviz.core.placement import Letterbox, Stretch

FASTER_LAYER = "backbone.body.7"  # stride 16: a 4 x 8 grid on the 64 x 128 padded batch
SSD_LAYER = "backbone.features.0.6"  # stride 16 of SSD's 80 x 80 fixed size: 5 x 5


def top3(output: Sequence[dict[str, torch.Tensor]], rows: torch.Tensor) -> torch.Tensor:
    """The sum of the three best detection scores of each output row."""
    return torch.stack([detections["scores"][:3].sum() for detections in output])


def _spread_scores(model: nn.Module, head: nn.Module) -> nn.Module:
    """Random class weights large enough that detection scores do not tie (torchvision
    starts them near zero, so every score is about 1 / classes)."""
    torch.manual_seed(1)
    for parameter in head.parameters():
        nn.init.normal_(parameter, std=0.5)
    return model.eval()


@pytest.fixture(scope="module")
def faster() -> nn.Module:
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead

    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None,
        weights_backbone=None,
        min_size=64,
        max_size=128,
        box_score_thresh=0.0,
        rpn_pre_nms_top_n_test=50,
        rpn_post_nms_top_n_test=20,
    )
    # A small box head (torchvision's has 1024 features): fast re-runs for Score-CAM.
    model.roi_heads.box_head = TwoMLPHead(256 * 7 * 7, 32)
    model.roi_heads.box_predictor = FastRCNNPredictor(32, 4)
    return _spread_scores(model, model.roi_heads.box_predictor.cls_score)


@pytest.fixture(scope="module")
def ssd() -> nn.Module:
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    torch.manual_seed(0)
    model = ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4, score_thresh=0.0
    )
    model.transform.fixed_size = (80, 80)  # SSD's stretch to a fixed size, smaller
    return _spread_scores(model, model.head.classification_head)


def _images(*sizes: tuple[int, int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.rand(3, *size, generator=generator) for size in sizes]


def _minmax(values: torch.Tensor) -> torch.Tensor:
    return (values - values.min()) / (values.max() - values.min())


def _minmax_each(maps: torch.Tensor) -> torch.Tensor:
    """Score-CAM's mask normalisation: each map to [0, 1], a constant one to zeros."""
    low = maps.amin(dim=(1, 2), keepdim=True)
    span = maps.amax(dim=(1, 2), keepdim=True) - low
    return torch.where(span > 0, (maps - low) / span, 0.0)


def _laid_by_hand(
    model: nn.Module, images: list[torch.Tensor], n: int, grids: torch.Tensor
) -> torch.Tensor:
    """``(R, h, w)`` grid maps laid on image ``n`` of a batch as torchvision's transform
    places it: upsampled to the padded batch, cropped to the resized image, resized back."""
    batch, _ = model.transform(images)
    height, width = batch.image_sizes[n]
    padded = F.interpolate(
        grids[:, None], size=batch.tensors.shape[-2:], mode="bilinear", align_corners=False
    )
    crop = padded[..., :height, :width]
    return F.interpolate(crop, size=images[n].shape[-2:], mode="bilinear", align_corners=False)[
        :, 0
    ]


def _layer_output(
    model: nn.Module, layer: str, images: list[torch.Tensor], target: Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output ``A`` and ``dy/dA`` by plain autograd."""
    seen = {}
    handle = model.get_submodule(layer).register_forward_hook(
        lambda module, args, output: seen.update(a=output)
    )
    try:
        scores = target(model(images), torch.arange(len(images)))
        (gradient,) = torch.autograd.grad(scores.sum(), seen["a"])
    finally:
        handle.remove()
    return seen["a"].detach(), gradient


def _gradcam_by_hand(model: nn.Module, layer: str, images: list[torch.Tensor]) -> list:
    activations, gradients = _layer_output(model, layer, images, top3)
    weights = gradients.mean(dim=(2, 3), keepdim=True)
    grids = torch.relu((weights * activations).sum(dim=1))
    return [
        _minmax(_laid_by_hand(model, images, n, grids[n : n + 1])[0]) for n in range(len(images))
    ]


def test_faster_rcnn_map_lies_on_the_non_square_image_through_resize_and_padding(faster):
    images = _images((48, 80), (48, 80))
    # By hand: scale min(64 / 48, 128 / 80) = 4/3, so 64 x 106, padded to multiples of 32.
    batch, _ = faster.transform(images)
    assert batch.image_sizes == [(64, 106)] * 2 and batch.tensors.shape[-2:] == (64, 128)

    explanation = camviz.explain(faster, torch.stack(images), "gradcam", FASTER_LAYER, top3)

    assert explanation.heatmaps.shape == (2, 48, 80)
    expected = torch.stack(_gradcam_by_hand(faster, FASTER_LAYER, images))
    torch.testing.assert_close(explanation.heatmaps, expected, atol=1e-4, rtol=0)
    # Stretching the grid over the whole image (no crop) would be visibly wrong.
    stretched = F.interpolate(explanation.layer_maps[:, None], (48, 80), mode="bilinear")[:, 0]
    assert (_minmax(stretched[0]) - expected[0]).abs().max() > 0.05


def test_ssd_map_lies_on_the_image_through_its_fixed_size_stretch(ssd):
    (image,) = _images((48, 80))

    explanation = camviz.explain(ssd, image[None], "gradcam", SSD_LAYER, top3)

    (expected,) = _gradcam_by_hand(ssd, SSD_LAYER, [image])
    torch.testing.assert_close(explanation.heatmaps[0], expected, atol=1e-4, rtol=0)


def test_placement_recorded_from_the_detector_transform(faster):
    images = _images((48, 80), (72, 40))
    recorded = layer_pass(faster, as_inputs(images, faster), [FASTER_LAYER], top3)
    # 72 x 40: scale min(64 / 40, 128 / 72) = 1.6, so 115 x 64; the batch pads to 128 x 128.
    assert recorded.placement == Letterbox(
        padded=(128, 128),
        resized=((64, 106), (115, 64)),
        original=((48, 80), (72, 40)),
        canvas=(72, 80),
    )
    plain = layer_pass(
        nn.Sequential(nn.Conv2d(3, 2, 3)),
        torch.rand(1, 3, 8, 12),
        ["0"],
        lambda out: out.sum(dim=(1, 2, 3)),
    )
    assert plain.placement == Stretch((8, 12))


def test_list_of_images_gives_one_map_per_image_at_its_own_size(faster):
    images = _images((48, 80), (72, 40))

    explanation = camviz.explain(faster, images, "gradcam", FASTER_LAYER, top3)

    assert isinstance(explanation.heatmaps, list)
    assert [tuple(heatmap.shape) for heatmap in explanation.heatmaps] == [(48, 80), (72, 40)]
    for heatmap, expected in zip(
        explanation.heatmaps, _gradcam_by_hand(faster, FASTER_LAYER, images), strict=True
    ):
        torch.testing.assert_close(heatmap, expected, atol=1e-4, rtol=0)


def test_each_image_of_a_list_is_explained_as_alone(faster):
    # Both resize to a height of 64 (106 and 102 wide) and pad to 64 x 128, alone or together.
    images = _images((48, 80), (40, 64))

    together = camviz.explain(faster, images, "gradcam", FASTER_LAYER, top3)

    for image, heatmap in zip(images, together.heatmaps, strict=True):
        alone = camviz.explain(faster, [image], "gradcam", FASTER_LAYER, top3)
        torch.testing.assert_close(heatmap, alone.heatmaps[0], atol=1e-4, rtol=0)
        as_tensor = camviz.explain(faster, image[None], "gradcam", FASTER_LAYER, top3)
        torch.testing.assert_close(heatmap, as_tensor.heatmaps[0], atol=1e-4, rtol=0)


def test_scorecam_masks_a_list_of_images_through_the_detector_geometry(faster):
    layer = "backbone.body.1"  # 16 channels
    images = _images((48, 80), (40, 64))

    explanation = camviz.explain(faster, images, "scorecam", layer, top3)

    activations, _ = _layer_output(faster, layer, images, top3)
    with torch.no_grad():
        for n, image in enumerate(images):
            masks = _minmax_each(_laid_by_hand(faster, images, n, activations[n]))
            copies = [image * mask for mask in masks]  # one batch: same padding as alone
            scores = top3(faster(copies), torch.arange(len(copies)))
            weights = scores.softmax(dim=0)
            grid = torch.relu((weights[:, None, None] * activations[n]).sum(dim=0))
            expected = _minmax(_laid_by_hand(faster, images, n, grid[None])[0])
            torch.testing.assert_close(explanation.heatmaps[n], expected, atol=1e-4, rtol=0)


def test_aug_smooth_refuses_a_list_of_images_in_one_line(faster):
    with pytest.raises(CamvizError, match="aug_smooth cannot rescale a list of images"):
        camviz.explain(faster, _images((48, 80), (40, 64)), layer=FASTER_LAYER, aug_smooth=True)


def test_a_list_for_a_model_that_is_no_detector_still_means_several_inputs():
    class TwoSignals(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(3, 4, 3)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.conv(a).mean(dim=2) + b.mean(dim=(1, 2))[:, None]

    torch.manual_seed(0)
    model = TwoSignals()
    nn.init.constant_(model.conv.bias, 1.0)  # ReLU(A_0) not all zero
    a, b = torch.rand(2, 3, 10), torch.rand(2, 3, 10)  # two 3-D tensors: two inputs, not images

    explanation = camviz.explain(model, [a, b], "gradcam", "conv", 0)

    # dy/dA is 1/8 on channel 0 only: the map is ReLU(A_0), laid on the 10 samples.
    with torch.no_grad():
        grid = torch.relu(model.conv(a)[:, 0])
    expected = F.interpolate(grid[:, None], size=10, mode="linear")[:, 0]
    expected = torch.stack([_minmax(values) for values in expected])
    assert isinstance(explanation.heatmaps, torch.Tensor)
    torch.testing.assert_close(explanation.heatmaps, expected, atol=1e-5, rtol=0)


def test_aug_smooth_lays_each_pass_of_a_detector_batch_on_the_image(faster):
    (image,) = _images((48, 80))

    smoothed = camviz.explain(faster, image[None], "gradcam", FASTER_LAYER, top3, aug_smooth=(1.0,))

    # The plain and the flipped pass, each laid on the image as the detector saw it.
    plain = camviz.explain(faster, image[None], "gradcam", FASTER_LAYER, top3)
    flipped = camviz.explain(faster, image.flip(-1)[None], "gradcam", FASTER_LAYER, top3)
    laid = [_laid_by_hand(faster, [image], 0, each.layer_maps)[0] for each in (plain, flipped)]
    expected = _minmax((laid[0] + laid[1].flip(-1)) / 2)
    torch.testing.assert_close(smoothed.heatmaps[0], expected, atol=1e-4, rtol=0)


def test_noise_of_each_image_of_a_list_is_its_own_as_alone(faster):
    # Smooth Grad-CAM++ draws noise per image and scales it by the image's own range: in a
    # list, both are those of the image alone (not of the zero-padded batch).
    images = _images((48, 80), (40, 64))
    options = {"samples": 2, "seed": 3}

    together = camviz.explain(faster, images, "smooth_gradcam++", FASTER_LAYER, top3, **options)

    for image, heatmap in zip(images, together.heatmaps, strict=True):
        alone = camviz.explain(faster, [image], "smooth_gradcam++", FASTER_LAYER, top3, **options)
        torch.testing.assert_close(heatmap, alone.heatmaps[0], atol=1e-4, rtol=0)


def test_detection_targets_on_a_list_give_sample_major_maps_each_at_its_image_size(faster):
    images = _images((48, 80), (40, 64))  # one padded size alone or together (see above)

    together = camviz.explain(faster, images, "gradcam", FASTER_LAYER, camviz.Detection([0, 1]))

    assert together.samples.tolist() == [0, 0, 1, 1]
    for n, image in enumerate(images):
        alone = camviz.explain(faster, [image], "gradcam", FASTER_LAYER, camviz.Detection([0, 1]))
        for rank in range(2):
            torch.testing.assert_close(
                together.heatmaps[2 * n + rank], alone.heatmaps[rank], atol=1e-4, rtol=0
            )
        torch.testing.assert_close(together.boxes[2 * n : 2 * n + 2], alone.boxes)
