"""The device path of overlays and panels (what a GPU runs), run here on the CPU: the same
pixels as the CPU path and as matplotlib's colours, and the device the folder job picks."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image

from camviz.io.render import overlay, panel_image, picture_device


@pytest.fixture
def photo() -> Image.Image:
    """A smooth photo-like gradient with noise, large enough to be scaled down in a panel."""
    generator = np.random.default_rng(0)
    rows, columns = np.mgrid[0:90, 0:120]
    base = np.stack([rows * 2.5, columns * 2, (rows + columns) * 1.2], axis=-1)
    noise = generator.normal(0, 12, base.shape)
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


@pytest.fixture
def heatmap() -> torch.Tensor:
    torch.manual_seed(0)
    values = torch.rand(7, 9)
    return (values - values.min()) / (values.max() - values.min())


def test_device_overlay_is_the_blend_formula_with_matplotlib_colours(photo):
    """At the photo's size no resize is involved: round((1 - a) * pixel + a * colour)."""
    torch.manual_seed(1)
    values = torch.rand(photo.height, photo.width)
    drawn = np.asarray(overlay(photo, values, alpha=0.3, colormap="viridis", device="cpu"))
    colours = matplotlib.colormaps["viridis"](values.numpy(), bytes=True)[..., :3]
    expected = np.rint(0.7 * np.asarray(photo, np.float64) + 0.3 * colours.astype(np.float64))
    difference = np.abs(drawn.astype(np.int16) - expected.astype(np.int16))
    # Exact but for ties (0.7 * p + 0.3 * c ending in .5), rounded in float32 either way.
    assert difference.max() <= 1 and (difference == 0).mean() > 0.98
    np.testing.assert_array_equal(drawn, np.asarray(overlay(photo, values, 0.3, "viridis")))


@pytest.mark.parametrize("clip", [None, 99.0])
def test_device_panel_equals_the_pillow_panel_within_one_level(photo, heatmap, clip):
    pillow = np.asarray(panel_image(photo, heatmap, title="t", width=50, clip=clip), np.int16)
    torch_drawn = panel_image(photo, heatmap, title="t", width=50, clip=clip, device="cpu")
    difference = np.abs(np.asarray(torch_drawn, np.int16) - pillow)
    # The photo tile is resized by torch instead of Pillow: at most one level apart.
    assert torch_drawn.size == (3 * 50 + 40, pillow.shape[0])
    assert difference.max() <= 1 and difference.mean() < 0.1


def test_the_folder_job_draws_on_the_models_accelerator_and_with_pillow_on_a_cpu():
    assert picture_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert picture_device(torch.device("mps")) == torch.device("mps")
    assert picture_device(torch.device("cpu")) is None
    assert picture_device(None) is None
