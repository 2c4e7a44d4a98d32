"""Layers given as names, patterns or the submodules themselves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.layers import resolve_layers


def test_a_submodule_is_named_as_named_modules_names_it(resnet18: nn.Module) -> None:
    resolved = resolve_layers(resnet18, [resnet18.layer4, "layer3.*.conv1", resnet18.fc])
    assert list(resolved) == ["layer4", "layer3.0.conv1", "layer3.1.conv1", "fc"]
    assert resolved["layer4"] is resnet18.layer4


def test_explaining_a_module_equals_explaining_its_name(
    resnet18: nn.Module, small_batch: torch.Tensor
) -> None:
    by_module = camviz.explain(resnet18, small_batch, layer=resnet18.layer3, target=[1, 2])
    by_name = camviz.explain(resnet18, small_batch, layer="layer3", target=[1, 2])
    assert by_module.layers == ["layer3"]
    torch.testing.assert_close(by_module.heatmaps, by_name.heatmaps, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (nn.Conv2d(3, 3, 1), "Conv2d given as layer is not a submodule of this model"),
        (3, "a layer must be a name, a wildcard pattern or a submodule of the model, not int 3"),
        ([3], "not int 3"),
        ([nn.Linear(2, 2)], "Linear given as layer is not a submodule"),
    ],
)
def test_a_layer_of_the_wrong_kind_is_one_line(resnet18: nn.Module, layer, message) -> None:
    with pytest.raises(CamvizError, match=message) as error:
        camviz.explain(resnet18, torch.randn(1, 3, 32, 32), layer=layer)
    assert "\n" not in str(error.value)


# Layer norms read by the axis their statistics run over --------------------------------------


class _FirstAxisNorm(nn.LayerNorm):
    """A layer-norm subclass with its own ``forward`` over the channel axis of ``(N, C, H,
    W)`` (as Hugging Face's ``ConvNextLayerNorm`` with ``data_format="channels_first"``)."""

    def __init__(self, channels: int, data_format: str | None = None) -> None:
        super().__init__(channels)
        if data_format is not None:
            self.data_format = data_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moved = x.movedim(1, -1)
        normed = nn.functional.layer_norm(moved, self.normalized_shape, self.weight, self.bias)
        return normed.movedim(-1, 1)


class _LastAxisNorm(nn.LayerNorm):
    """A layer-norm subclass with its own ``forward`` over the last axis (timm's style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias)


class _NormNet(nn.Module):
    """conv -> a channels-first layer norm -> mean -> linear; ``last=True`` hands the norm a
    channels-last ``(N, H, W, C)`` map instead, normalised over its last axis by its own
    ``forward``."""

    def __init__(self, channels: int, data_format: str | None = None, last: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.norm = _LastAxisNorm(channels) if last else _FirstAxisNorm(channels, data_format)
        self.last = last
        self.fc = nn.Linear(channels, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.conv(x)
        if self.last:
            return self.fc(self.norm(features.movedim(1, -1)).relu().mean((1, 2)))
        return self.fc(self.norm(features).relu().mean((2, 3)))


def _hand_gradcam(model: _NormNet, images: torch.Tensor) -> torch.Tensor:
    """Raw Grad-CAM of class 1 at the norm, its output moved to ``(N, C, H, W)`` by hand."""
    kept: list[torch.Tensor] = []

    def replace(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        kept.append(output.detach().requires_grad_())
        return kept[0]

    handle = model.norm.register_forward_hook(replace)
    try:
        score = model(images)[:, 1].sum()
    finally:
        handle.remove()
    (gradient,) = torch.autograd.grad(score, kept)
    values, slopes = kept[0].detach(), gradient
    if model.last:
        values, slopes = values.movedim(-1, 1), slopes.movedim(-1, 1)
    return torch.einsum("nc,nchw->nhw", slopes.mean((2, 3)), values)


@pytest.mark.parametrize(
    ("channels", "data_format", "last"),
    [
        (8, None, False),  # (N, 8, 16, 16): only the channel axis has 8 entries
        (16, "channels_first", False),  # (N, 16, 16, 16): both fit, data_format decides
        (8, None, True),  # (N, 16, 16, 8): only the last axis fits
    ],
)
def test_a_layer_norm_is_read_by_the_axis_its_statistics_run_over(
    channels: int, data_format: str | None, last: bool
) -> None:
    model = _NormNet(channels, data_format, last).eval()
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    result = camviz.explain(model, images, layer="norm", target=1, relu=False, normalize=False)
    hand = _hand_gradcam(model, images)
    assert hand.abs().max() > 0
    torch.testing.assert_close(result.layer_maps, hand, rtol=1e-5, atol=1e-6)


def test_a_layer_norm_that_fits_both_axes_without_a_data_format_asks_for_layout() -> None:
    model = _NormNet(16).eval()  # (N, 16, 16, 16): the channel axis and the last axis fit
    images = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(CamvizError, match="pass layout='channels_first'") as error:
        camviz.explain(model, images, layer="norm", target=1)
    assert "\n" not in str(error.value)
    told = camviz.explain(
        model, images, layer="norm", target=1, layout="channels_first", relu=False, normalize=False
    )
    torch.testing.assert_close(told.layer_maps, _hand_gradcam(model, images), rtol=1e-5, atol=1e-6)
