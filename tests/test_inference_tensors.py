"""No inference tensors in a user's model: every pass camviz runs without a gradient uses
``no_grad``, never ``inference_mode``, also when the caller is inside ``inference_mode``.

A model that caches a tensor on its first call for an input shape (Ultralytics' ``Detect``
head keeps its anchors and strides) would otherwise keep an inference tensor, and the user's
own backward pass through it would fail afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from conftest import TensorImages, tiny_vit
from torch import nn

import camviz
from camviz.core.layers import layer_shapes
from camviz.io import models
from camviz.units.fields import receptive_field


class CachingNet(nn.Module):
    """A CNN whose head scales its features by a tensor it builds on the first call for an
    input shape and keeps (as Ultralytics' ``Detect`` keeps its anchors); the product saves
    that tensor for the backward pass."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 6, 3), nn.ReLU())
        self.fc = nn.Linear(6, 3)
        self.shape: torch.Size | None = None
        self.scale = torch.ones(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features(x)
        if self.shape != features.shape[2:]:
            self.shape = features.shape[2:]
            self.scale = torch.linspace(0.5, 1.5, features.shape[-1])
        return self.fc((features * self.scale).mean((2, 3)))


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))


_CHANNEL = camviz.Unit("features", channel=1)


PASSES: dict[str, Callable[[nn.Module, torch.Tensor], object]] = {
    "default layer": lambda model, x: camviz.explain(model, x),
    "layer_shapes": lambda model, x: layer_shapes(model, x),
    "scorecam": lambda model, x: camviz.explain(model, x, method="scorecam", layer="features"),
    "ablationcam": lambda model, x: camviz.explain(
        model, x, method="ablationcam", layer="features"
    ),
    "sess": lambda model, x: camviz.explain(model, x, method="sess", layer="features"),
    "deletion": lambda model, x: camviz.metrics.deletion(model, x, torch.rand(2, 16, 16), steps=4),
    "features": lambda model, x: camviz.features(model, x, "features"),
    # A unit's layer is read by a dry pass before the explaining one.
    "unit target": lambda model, x: camviz.explain(model, x, layer="features.0", target=_CHANNEL),
    "top_examples": lambda model, x: camviz.top_examples(model, TensorImages(x), _CHANNEL, k=1),
    "visualize_unit": lambda model, x: camviz.visualize_unit(model, _CHANNEL, size=16, steps=2),
    "receptive_field": lambda model, x: receptive_field(model, x, "features", how="measured"),
    "load's class count": lambda model, x: models._output_classes(model, x),
}


@pytest.mark.parametrize("caller_inference_mode", [False, True])
@pytest.mark.parametrize("name", list(PASSES))
def test_the_model_backpropagates_after_a_pass_of_camviz(
    name: str, caller_inference_mode: bool
) -> None:
    model, untouched = CachingNet().eval(), CachingNet().eval()
    x = _images()
    if caller_inference_mode:
        with torch.inference_mode():
            PASSES[name](model, x)
    else:
        PASSES[name](model, x)
    assert model.shape is not None and not model.scale.is_inference()
    model(x).sum().backward()  # raised "Inference tensors cannot be saved for backward"
    untouched(x).sum().backward()
    for mine, theirs in zip(model.parameters(), untouched.parameters(), strict=True):
        assert mine.grad is not None and theirs.grad is not None
        torch.testing.assert_close(mine.grad, theirs.grad)


@pytest.mark.parametrize("method", ["legrad", "gradcam", "scorecam"])
def test_explain_inside_a_callers_inference_mode_gives_the_same_maps(method: str) -> None:
    model = tiny_vit()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    expected = camviz.explain(copy.deepcopy(model), images, method=method, target=2)
    with torch.inference_mode():
        inside = camviz.explain(model, images, method=method, target=2)
    torch.testing.assert_close(inside.heatmaps, expected.heatmaps)
    assert not any(tensor.is_inference() for tensor in model.state_dict().values())


def test_sanity_check_and_class_ids_made_inside_a_callers_inference_mode() -> None:
    model, x = CachingNet().eval(), _images()
    expected = camviz.sanity.cascading_randomization(model, x, layer="features", target=[2, 0])
    with torch.inference_mode():
        ids = torch.tensor([2, 0])  # an inference tensor, as a caller's argmax would be
        inside = camviz.sanity.cascading_randomization(model, x, layer="features", target=ids)
        explained = camviz.explain(model, x, layer="features", target=ids)
    torch.testing.assert_close(inside.spearman, expected.spearman)
    torch.testing.assert_close(inside.ssim, expected.ssim)
    plain = camviz.explain(model, x, layer="features", target=[2, 0])
    torch.testing.assert_close(explained.heatmaps, plain.heatmaps)
    assert explained.targets.tolist() == [2, 0]
