"""Segmentation and video models of torchvision, explained by hand-checked formulas.

Segmentation: Grad-CAM of a :class:`camviz.Region` (a class's logits summed over a mask)
against autograd by hand and against pytorch-grad-cam's ``SemanticSegmentationTarget``.
Video: 3-D Grad-CAM of ``r3d_18`` against the formula over ``(T, H, W)``. Random weights,
tiny inputs.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

import camviz


def grad_cam_by_hand(
    model: nn.Module, inputs: torch.Tensor, layer: str, score: object
) -> torch.Tensor:
    """The signed Grad-CAM sum ``sum_k mean(dy/dA_k) A_k`` at ``layer``, by plain autograd,
    for any number of spatial axes."""
    recorded = {}
    handle = model.get_submodule(layer).register_forward_hook(
        lambda module, args, output: recorded.setdefault("A", output)
    )
    try:
        with torch.enable_grad():
            (gradients,) = torch.autograd.grad(score(model(inputs)), recorded["A"])  # type: ignore[operator]
    finally:
        handle.remove()
    axes = tuple(range(2, gradients.dim()))
    return (gradients.mean(dim=axes, keepdim=True) * recorded["A"].detach()).sum(dim=1)


@pytest.fixture(scope="module")
def segmenter() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=4, aux_loss=False
    ).eval()


class _OutTensor(nn.Module):
    """torchvision's segmentation models return {"out": logits}; pytorch-grad-cam wants the
    logits tensor (its documented wrapper)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)["out"]


def test_region_grad_cam_equals_the_hand_formula_and_pytorch_grad_cam(
    segmenter: nn.Module,
) -> None:
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import SemanticSegmentationTarget

    images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = segmenter(images)["out"]
    predicted = logits[0].argmax(0)
    class_id = int(predicted.flatten().mode().values)
    mask = predicted == class_id
    layer = "backbone.12"
    region = camviz.Region(class_id, mask)
    raw = camviz.explain(segmenter, images, layer=layer, target=region, relu=False, normalize=False)
    expected = grad_cam_by_hand(
        segmenter, images, layer, lambda out: (out["out"][0, class_id] * mask).sum()
    )
    scale = float(expected.abs().max())
    assert scale > 0
    torch.testing.assert_close(raw.layer_maps, expected, atol=1e-4 * scale, rtol=0)

    ours = camviz.explain(segmenter, images, layer=layer, target=region).heatmaps[0]
    wrapped = _OutTensor(segmenter)
    target = SemanticSegmentationTarget(class_id, mask.float().numpy())
    with GradCAM(model=wrapped, target_layers=[wrapped.model.backbone["12"]]) as cam:
        theirs = torch.as_tensor(cam(images, targets=[target])[0])
    correlation = torch.corrcoef(torch.stack([ours.flatten(), theirs.flatten()]))[0, 1]
    assert correlation >= 0.99


def test_r3d_18_grad_cam_equals_the_formula_over_time_and_space() -> None:
    torch.manual_seed(0)
    model = torchvision.models.video.r3d_18(weights=None, num_classes=5).eval()
    clip = torch.rand(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(2))
    layer = "layer3"  # (1, 256, 2, 4, 4): a grid over time as well as space
    explanation = camviz.explain(model, clip, layer=layer, target=3, relu=False, normalize=False)
    expected = grad_cam_by_hand(model, clip, layer, lambda out: out[0, 3])
    assert expected.shape == (1, 2, 4, 4)
    scale = float(expected.abs().max())
    torch.testing.assert_close(explanation.layer_maps, expected, atol=1e-4 * scale, rtol=0)
    assert explanation.heatmaps.shape == (1, 8, 32, 32)  # laid on every frame of the clip
