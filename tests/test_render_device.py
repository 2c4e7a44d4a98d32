"""Overlays and panels computed with torch on the model's device (what a GPU runs), here on
the CPU: the pixels of the blend formula with matplotlib's colours, the panel's tiles within
one level of the Pillow-drawn ones, and the folder job drawing on the model's device."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
import torch
from conftest import conv_net
from PIL import Image

from camviz.core.maps import upsample
from camviz.io import blending, pictures
from camviz.io.images import Preprocess
from camviz.io.models import LoadedModel
from camviz.io.pictures import clipped, overlay_and_panel
from camviz.io.render import overlay, panel_image


@pytest.fixture
def photo() -> Image.Image:
    """A smooth gradient with noise, 3x the test's panel tiles (Pillow's reducing_gap
    shortcut, which torch does not take, starts at 4x)."""
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


def _within_a_level(drawn: np.ndarray, expected: np.ndarray) -> None:
    difference = np.abs(drawn.astype(np.int16) - expected.astype(np.int16))
    # Exact but for float rounding of ties (a blend ending in .5) and resampling.
    assert difference.max() <= 1 and (difference == 0).mean() > 0.98


def test_overlay_on_a_device_is_the_blend_formula_with_matplotlib_colours(photo):
    """At the photo's size no resize is involved: round((1 - a) * pixel + a * colour)."""
    torch.manual_seed(1)
    values = torch.rand(photo.height, photo.width)
    drawn = np.asarray(overlay(photo, values, alpha=0.3, colormap="viridis", device="cpu"))
    colours = matplotlib.colormaps["viridis"](values.numpy(), bytes=True)[..., :3]
    expected = np.rint(0.7 * np.asarray(photo, np.float64) + 0.3 * colours.astype(np.float64))
    _within_a_level(drawn, expected)
    np.testing.assert_array_equal(drawn, np.asarray(overlay(photo, values, 0.3, "viridis")))


@pytest.mark.parametrize("clip", [None, 99.0])
def test_panel_tiles_equal_the_pillow_drawn_ones_within_one_level(photo, heatmap, clip):
    width, height = 40, 30
    drawn = np.asarray(panel_image(photo, heatmap, width=width, clip=clip, device="cpu"))
    # The tiles as the first Pillow panels drew them: Pillow's resize, the colours of the
    # resized map, the blend.
    tile = np.asarray(photo.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=2.0))
    values = upsample(clipped(heatmap, clip)[None], (height, width))[0].clamp(0, 1).numpy()
    colours = matplotlib.colormaps["jet"](values, bytes=True)[..., :3]
    blended = np.rint(0.5 * tile.astype(np.float64) + 0.5 * colours.astype(np.float64))
    gap = pictures._PANEL_GAP
    top = gap + pictures._CAPTION_SIZE + gap // 2  # no title
    for number, expected in enumerate((tile, colours, blended)):
        left = gap + number * (width + gap)
        _within_a_level(drawn[top : top + height, left : left + width], expected)
    assert drawn.shape == (top + height + gap, 3 * width + 4 * gap, 3)


def test_large_downscales_give_pillows_exact_resize(photo):
    """From 4x down Pillow's panels took its reducing_gap shortcut (a box filter first);
    torch resizes exactly, as Pillow does without the shortcut."""
    pixels = torch.from_numpy(np.array(photo))
    tile = blending.resized_pixels(pixels, (24, 18)).numpy()
    _within_a_level(tile, np.asarray(photo.resize((24, 18), Image.Resampling.BILINEAR)))


def test_the_folder_job_draws_on_a_cuda_gpu_and_else_on_the_cpu(tmp_path, photo, monkeypatch):
    from camviz.pipeline import job

    assert job.drawing_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert job.drawing_device(torch.device("mps")) is None  # MPS has no kthvalue (clip=)
    assert job.drawing_device(torch.device("cpu")) is None
    assert job.drawing_device(None) is None
    devices = []

    def spy(draw):
        def drawn(*args, **kwargs):
            devices.append(kwargs["device"])
            return draw(*args, **kwargs)

        return drawn

    monkeypatch.setattr(job, "overlay_and_panel", spy(overlay_and_panel))
    monkeypatch.setattr(job, "drawing_device", lambda device: device)  # the CPU as the GPU
    model = conv_net(4, classes=None, padding=1)  # four scores
    photo.save(tmp_path / "photo.png")
    loaded = LoadedModel(model, Preprocess(size=16), ["a", "b", "c", "d"], "tiny")
    job.explain_files(tmp_path / "photo.png", tmp_path / "out", loaded, layer="1")
    assert devices == [torch.device("cpu")]  # the overlay and the panel, drawn together
    with Image.open(tmp_path / "out" / "photo_overlay.png") as written:
        assert written.size == photo.size
