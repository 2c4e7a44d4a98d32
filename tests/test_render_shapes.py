"""Pictures for maps of every shape: signed maps centred on zero, signals with a colour band,
volume montages with the peak slice marked, and overlay videos of clips."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from camviz import render
from camviz.core.errors import CamvizError
from camviz.io import output
from camviz.io.figures import SIGNED_COLORMAP
from camviz.io.video import frame_count


def images_of(figure):
    return [image for ax in figure.axes for image in ax.get_images()]


def test_a_signal_gets_its_map_as_a_band_with_a_diverging_scale_centred_on_zero():
    signal = torch.randn(2, 40)
    heatmap = torch.linspace(-0.5, 2.0, 40)
    figure = render.signal_figure(signal, heatmap, title="ecg")
    (band,) = images_of(figure)
    np.testing.assert_allclose(band.get_array()[0], heatmap.numpy(), rtol=1e-6)
    assert band.get_clim() == (-2.0, 2.0)
    assert band.get_cmap().name == SIGNED_COLORMAP
    lines = [line.get_ydata() for ax in figure.axes for line in ax.get_lines()]
    np.testing.assert_allclose(np.stack(lines), signal.numpy())
    per_channel = render.signal_figure(signal, heatmap.clamp(0, 1), per_channel=True)
    assert [image.get_clim() for image in images_of(per_channel)] == [(0.0, 1.0)] * 2
    assert len(figure.axes) == 3 and len(per_channel.axes) == 5  # plots, bands, colour bar


def test_a_map_shorter_than_the_signal_is_stretched_to_it():
    figure = render.signal_figure(torch.randn(30), torch.tensor([0.0, 1.0, 0.0]))
    (band,) = images_of(figure)
    # Linear interpolation between sample centres: step i of 30 lies at (i + 0.5) / 10 - 0.5
    # on the map's axis of 3 (clamped at its ends).
    where = np.clip((np.arange(30) + 0.5) / 10 - 0.5, 0, 2)
    expected = np.interp(where, [0, 1, 2], [0.0, 1.0, 0.0])
    np.testing.assert_allclose(band.get_array(), expected[None], atol=1e-6)


def test_a_volume_montage_marks_the_slice_where_the_map_peaks():
    volume = torch.rand(1, 24, 8, 8)
    heatmap = torch.zeros(24, 8, 8)
    heatmap[13, 2, 5] = 1.0
    heatmap[3] = 0.5
    figure = render.volume_montage(volume, heatmap, max_slices=6)
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert len(titles) == 6 and "slice 13 (peak)" in titles
    peak_axis = next(ax for ax in figure.axes if ax.get_title() == "slice 13 (peak)")
    np.testing.assert_array_equal(peak_axis.get_images()[1].get_array(), heatmap[13].numpy())
    assert peak_axis.spines["top"].get_edgecolor()[:3] == (1.0, 0.0, 0.0)


def test_a_signed_2d_map_has_a_symmetric_colour_bar_and_map_figure_picks_by_shape():
    heatmap = torch.tensor([[-1.0, 0.25], [0.5, 0.0]])
    figure = render.signed_figure(torch.rand(3, 16, 16), heatmap)
    maps = images_of(figure)[1]
    assert maps.get_clim() == (-1.0, 1.0)
    assert len(figure.axes) == 2  # the picture and its colour bar
    assert len(images_of(render.map_figure(torch.rand(2, 20), torch.rand(20)))) == 1
    assert len(images_of(render.map_figure(torch.rand(3, 4, 6, 6), torch.rand(4, 6, 6)))) == 8
    with pytest.raises(CamvizError, match=r"one sample \(C, L\)"):
        render.map_figure(torch.rand(2, 3, 4, 6, 6), torch.rand(4, 6, 6))


def test_a_clip_becomes_an_overlay_video(tmp_path):
    clip = torch.rand(3, 5, 32, 32)
    path = render.clip_video(clip, torch.rand(5, 32, 32), tmp_path / "clip.mp4", fps=5)
    assert frame_count(path) == 5
    with pytest.raises(CamvizError, match="NaN"):
        render.clip_video(clip, torch.full((5, 32, 32), float("nan")), tmp_path / "bad.mp4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]


@pytest.mark.parametrize("channels", [3, 1])
def test_a_clip_hands_its_overlays_to_the_video_writer_without_picture_files(
    tmp_path, monkeypatch, channels
):
    clip, heatmap = torch.rand(channels, 4, 8, 10), torch.rand(4, 8, 10)
    handed = []

    def writer(frames, path, fps):
        handed.extend(frames)
        return len(handed)

    def no_files(*args, **kwargs):
        raise AssertionError("a frame was written to a file")

    monkeypatch.setattr(output, "write_video", writer)
    monkeypatch.setattr(Image.Image, "save", no_files)
    render.clip_video(clip, heatmap, tmp_path / "clip.mp4", alpha=0.4, colormap="viridis")
    assert len(handed) == 4
    for index, picture in enumerate(handed):
        pixels = np.rint(clip[:, index].expand(3, -1, -1).permute(1, 2, 0).numpy() * 255)
        frame = Image.fromarray(pixels.astype(np.uint8))
        expected = render.overlay(frame, heatmap[index], 0.4, "viridis")
        assert np.array_equal(np.asarray(picture), np.asarray(expected))
