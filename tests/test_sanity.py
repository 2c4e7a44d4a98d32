"""Sanity checks: rank correlation and SSIM against scipy, an edge detector flagged, Grad-CAM
not, and the user's model untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from scipy import ndimage, stats
from torch import nn

from camviz.core.errors import CamvizError
from camviz.evaluation.sanity import cascading_randomization, spearman, ssim
from camviz.evaluation.synthetic import TARGET_LAYER, load_model, make_dataset


def sobel_map(model, inputs, target):
    """An edge detector posing as a saliency method: it never looks at the model."""
    grey = inputs.mean(dim=1, keepdim=True)
    kernel = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]).view(1, 1, 3, 3)
    across = F.conv2d(grey, kernel, padding=1)
    down = F.conv2d(grey, kernel.transpose(2, 3), padding=1)
    magnitude = (across**2 + down**2).sqrt()[:, 0]
    return magnitude / magnitude.flatten(1).amax(dim=1).view(-1, 1, 1)


def reference_ssim(first: np.ndarray, second: np.ndarray) -> float:
    """SSIM with scipy's Gaussian filter (sigma 1.5, radius 5) and the borders cropped."""

    def local_mean(values):
        return ndimage.gaussian_filter(values, sigma=1.5, truncate=3.5)

    mean_x, mean_y = local_mean(first), local_mean(second)
    var_x = local_mean(first * first) - mean_x**2
    var_y = local_mean(second * second) - mean_y**2
    cov = local_mean(first * second) - mean_x * mean_y
    c1, c2 = 0.01**2, 0.03**2
    value = ((2 * mean_x * mean_y + c1) * (2 * cov + c2)) / (
        (mean_x**2 + mean_y**2 + c1) * (var_x + var_y + c2)
    )
    return float(value[5:-5, 5:-5].mean())


def test_spearman_matches_scipy_with_many_ties():
    generator = torch.Generator().manual_seed(0)
    first = torch.rand(4, 12, 12, generator=generator)
    second = 0.5 * first + torch.rand(4, 12, 12, generator=generator)
    first[first < 0.4] = 0  # ReLU-like ties
    second = (second * 4).round()  # few distinct values
    expected = [
        stats.spearmanr(a.flatten().numpy(), b.flatten().numpy()).statistic
        for a, b in zip(first, second, strict=True)
    ]
    torch.testing.assert_close(spearman(first, second), torch.tensor(expected, dtype=torch.float32))
    assert spearman(first, first).tolist() == pytest.approx([1.0] * 4)
    assert spearman(first, torch.ones_like(first)).tolist() == [0.0] * 4


def test_ssim_matches_a_scipy_implementation():
    generator = torch.Generator().manual_seed(1)
    first = torch.rand(3, 24, 20, generator=generator, dtype=torch.float64)
    second = (first + 0.3 * torch.rand(3, 24, 20, generator=generator, dtype=torch.float64)) / 1.3
    expected = [reference_ssim(a.numpy(), b.numpy()) for a, b in zip(first, second, strict=True)]
    torch.testing.assert_close(ssim(first, second), torch.tensor(expected, dtype=torch.float32))
    torch.testing.assert_close(ssim(first, first), torch.ones(3))


@pytest.fixture(scope="module")
def synthetic():
    return load_model(), make_dataset(6, seed=12345)


def test_an_edge_detector_is_flagged_and_gradcam_is_not(synthetic):
    model, data = synthetic
    edges = cascading_randomization(model, data.images, sobel_map)
    assert edges.flagged
    torch.testing.assert_close(edges.spearman, torch.ones_like(edges.spearman))
    gradcam = cascading_randomization(model, data.images, "gradcam", layer=TARGET_LAYER)
    assert not gradcam.flagged
    assert gradcam.spearman[-1].mean() < 0.3 and gradcam.ssim[-1].mean() < 0.5
    # Output first: the classifier, then the convolutions and BatchNorms from the top down.
    assert gradcam.stages[:3] == ["classifier", "features.12", "features.11"]
    assert gradcam.stages[-1] == "features.0" and len(gradcam.stages) == 9
    assert gradcam.spearman.shape == gradcam.ssim.shape == (9, 6)
    assert "gradcam: passes" in gradcam.table() and "flagged" in edges.table()


def test_the_users_model_is_never_randomised(synthetic):
    model, data = synthetic
    model.train()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        report = cascading_randomization(
            model, data.images[:2], "gradcam", layer=TARGET_LAYER, stages=["classifier"]
        )
        assert report.stages == ["classifier"]
        after = model.state_dict()
        assert all(torch.equal(before[name], after[name]) for name in before)
        assert all(module.training for module in model.modules())
        assert all(p.grad is None and p.requires_grad for p in model.parameters())
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    finally:
        model.eval()


def test_same_seed_same_report(synthetic):
    model, data = synthetic
    runs = [
        cascading_randomization(
            model, data.images[:2], "gradcam", layer=TARGET_LAYER, stages=["features.*"], seed=3
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0].spearman, runs[1].spearman)


def test_user_mistakes_are_one_line_errors(synthetic):
    model, data = synthetic
    with pytest.raises(CamvizError, match="did you mean"):
        cascading_randomization(model, data.images, "gradcam", stages=["clasifier"])
    with pytest.raises(CamvizError, match="unknown CAM method"):
        cascading_randomization(model, data.images, "no-such-cam")
    with pytest.raises(CamvizError, match="shape"):
        spearman(torch.zeros(2, 3, 3), torch.zeros(2, 4, 4))


class GatedBlock(nn.Module):
    """A ConvNeXt-like block: it owns ``gamma`` and uses it after its own conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.gamma = nn.Parameter(torch.full((1, 4, 1, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.conv(x)


class OffsetNet(nn.Module):
    """A ViT-like parent: it owns ``offset`` (a position embedding) and adds it after the
    stem, before the block and the head that it also owns."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.offset = nn.Parameter(torch.randn(1, 4, 16, 16))
        self.block = GatedBlock()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.stem(x) + self.offset
        return self.head(self.block(tokens).mean(dim=(2, 3)))


def test_each_stage_randomises_one_layer_and_a_parents_own_parameters_where_they_act():
    torch.manual_seed(0)
    model = OffsetNet()
    trained = {name: value.clone() for name, value in model.named_parameters()}
    random_after_each_stage = []

    def record_random_parameters(copied, inputs, target):
        random_after_each_stage.append(
            {
                name
                for name, value in copied.named_parameters()
                if not torch.equal(value, trained[name])
            }
        )
        return inputs.mean(dim=1)

    report = cascading_randomization(
        model, torch.rand(2, 3, 16, 16), record_random_parameters, target=0
    )
    assert report.stages == ["head", "block.gamma", "block.conv", "offset", "stem"]
    head = {"head.weight", "head.bias"}
    conv = {"block.conv.weight", "block.conv.bias"}
    stem = {"stem.weight", "stem.bias"}
    assert random_after_each_stage == [
        set(),  # the original maps
        head,
        head | {"block.gamma"},  # a constant layer scale changes too
        head | {"block.gamma"} | conv,
        head | {"block.gamma"} | conv | {"offset"},
        head | {"block.gamma"} | conv | {"offset"} | stem,
    ]
