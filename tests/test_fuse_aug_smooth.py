"""Options of explain valid for every method: several target layers fused (mean or max), and
aug_smooth (flip and scale test-time augmentation, de-augmented and averaged)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from reference import min_max
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.targets import Region


def resize(maps: torch.Tensor, size) -> torch.Tensor:
    return F.interpolate(maps[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]


class SmallCNN(nn.Module):
    """Two 3x3 convs (the first with stride 2) -> ``features`` -> mean -> linear, 3 classes."""

    def __init__(self, symmetric: bool = False) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.stem = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.features = nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(6, 3)
        if symmetric:
            # Kernels equal to their mirror image make the features flip-equivariant (on odd
            # widths, where stride 2 keeps symmetric columns), and the mean over the grid
            # makes the scores flip-invariant.
            with torch.no_grad():
                for conv in (self.stem, self.features[0]):
                    conv.weight.copy_((conv.weight + conv.weight.flip(-1)) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(torch.relu(self.stem(x))).mean(dim=(2, 3)))


class LeftOrRight(nn.Module):
    """Class 0 scores the left half of the image, class 1 the right half: a flip swaps them."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, 2, 1)
        with torch.no_grad():
            self.features.weight.fill_(1.0)
            self.features.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        features = self.features(x)
        return torch.stack(
            [features[:, 0, :, :half].mean((1, 2)), features[:, 1, :, half:].mean((1, 2))], 1
        )


# Several layers ----------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gradcam", "ablationcam"])
@pytest.mark.parametrize("fuse", ["mean", "max", "product"])
def test_fused_layers_equal_the_per_layer_maps_combined_by_hand(method, fuse, untouched):
    model = SmallCNN()
    torch.manual_seed(0)
    inputs = torch.randn(2, 3, 16, 16)
    layers = ["stem", "features"]
    with untouched(model):
        fused = camviz.explain(model, inputs, method, layer=layers, target=[0, 2], fuse=fuse)
    singles = [camviz.explain(model, inputs, method, layer=name, target=[0, 2]) for name in layers]
    upsampled = torch.stack([resize(single.layer_maps, (16, 16)) for single in singles])
    combined = {"mean": upsampled.mean(0), "max": upsampled.amax(0), "product": upsampled.prod(0)}
    combined = combined[fuse]
    torch.testing.assert_close(fused.heatmaps, min_max(combined))
    for name, single in zip(layers, singles, strict=True):
        torch.testing.assert_close(fused.maps_by_layer[name], single.layer_maps)
    torch.testing.assert_close(fused.layer_maps, singles[0].layer_maps)


def test_fuse_must_be_mean_max_or_product():
    with pytest.raises(CamvizError, match="fuse must be 'mean', 'max' or 'product'"):
        camviz.explain(SmallCNN(), torch.rand(1, 3, 8, 8), layer="features", fuse="sum")


# aug_smooth --------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gradcam", "scorecam", "ablationcam"])
def test_flip_smoothing_changes_nothing_on_a_flip_equivariant_model(method, untouched):
    model = SmallCNN(symmetric=True)
    torch.manual_seed(1)
    inputs = torch.randn(2, 3, 15, 15)  # odd, so that stride 2 samples symmetric columns
    plain = camviz.explain(model, inputs, method, layer="features", target=1)
    with untouched(model):
        smoothed = camviz.explain(
            model, inputs, method, layer="features", target=1, aug_smooth=(1.0,)
        )
    torch.testing.assert_close(smoothed.layer_maps, plain.layer_maps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(smoothed.heatmaps, min_max(plain.heatmaps), rtol=1e-5, atol=1e-6)


def test_aug_smooth_averages_the_de_augmented_maps_of_every_flip_and_scale(untouched):
    model = SmallCNN()
    torch.manual_seed(2)
    inputs = torch.randn(2, 3, 16, 16)
    scales = (1.0, 0.75, 1.5)
    with untouched(model):
        smoothed = camviz.explain(model, inputs, layer="features", aug_smooth=scales)
    classes = smoothed.targets
    at_input, at_layer = [], []
    for scale in scales:
        size = (round(16 * scale), round(16 * scale))
        scaled = F.interpolate(
            inputs, size=size, mode="bilinear", align_corners=False, antialias=scale < 1
        )
        for flip in (False, True):
            augmented = scaled.flip(-1) if flip else scaled
            maps = camviz.explain(model, augmented, layer="features", target=classes).layer_maps
            back = (lambda m: m.flip(-1)) if flip else (lambda m: m)
            at_input.append(back(resize(maps, (16, 16))))
            at_layer.append(back(resize(maps, (8, 8))))
    torch.testing.assert_close(smoothed.heatmaps, min_max(torch.stack(at_input).mean(0)))
    torch.testing.assert_close(smoothed.layer_maps, min_max(torch.stack(at_layer).mean(0)))


def test_aug_smooth_explains_the_classes_of_the_plain_pass_in_every_variant():
    model = LeftOrRight()
    inputs = torch.rand(1, 3, 4, 4)
    inputs[..., :2] += 5  # the left half wins: class 0, and class 1 once flipped
    assert model(inputs).argmax().item() == 0
    assert model(inputs.flip(-1)).argmax().item() == 1
    smoothed = camviz.explain(model, inputs, layer="features", aug_smooth=(1.0,))
    plain = camviz.explain(model, inputs, layer="features", target=0)
    flipped = camviz.explain(model, inputs.flip(-1), layer="features", target=0)
    assert smoothed.targets.tolist() == [0]
    expected = min_max((plain.heatmaps + flipped.heatmaps.flip(-1)) / 2)
    torch.testing.assert_close(smoothed.heatmaps, expected)


@pytest.mark.parametrize(
    ("aug_smooth", "target", "message"),
    [
        ((), None, "aug_smooth must be True or a sequence of scales"),
        ((1.0, 0.0), None, "aug_smooth must be True or a sequence of scales"),
        ("yes", None, "aug_smooth must be True or a sequence of scales"),
        (True, Region(0, torch.ones(2, 2)), "cannot explain a Region target"),
    ],
)
def test_bad_aug_smooth_requests_are_refused(aug_smooth, target, message):
    with pytest.raises(CamvizError, match=message):
        camviz.explain(
            SmallCNN(),
            torch.rand(1, 3, 8, 8),
            layer="features",
            target=target,
            aug_smooth=aug_smooth,
        )


def test_a_model_that_rejects_rescaled_inputs_is_told_to_smooth_over_flips_only():
    class FixedSize(SmallCNN):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._assert(x.shape[-1] == 16, f"expected 16 columns, got {x.shape[-1]}")
            return super().forward(x)

    model = FixedSize()
    with pytest.raises(CamvizError, match=r"pass aug_smooth=\(1\.0,\) to average over flips"):
        camviz.explain(model, torch.rand(1, 3, 16, 16), layer="features", aug_smooth=True)
    flips = camviz.explain(model, torch.rand(1, 3, 16, 16), layer="features", aug_smooth=(1.0,))
    assert flips.heatmaps.shape == (1, 16, 16)
