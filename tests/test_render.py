"""camviz.io.render: colours, blends and grids checked pixel by pixel; writes that are atomic."""

from __future__ import annotations

import importlib
import io
import os
import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image

from camviz.core.errors import CamvizError
from camviz.io.atomic import atomic_path, atomic_write, is_temporary
from camviz.io.pictures import check_render_options
from camviz.io.render import (
    channel_figure,
    channel_grid,
    colorize,
    heatmap_image,
    overlay,
    panel,
    save,
    select_channels,
    show,
)


def read(path: Path) -> np.ndarray:
    with Image.open(path) as written:
        return np.asarray(written)


def matplotlib_colours(values: np.ndarray, name: str) -> np.ndarray:
    return matplotlib.colormaps[name](values, bytes=True)[..., :3].astype(np.float64)


def expected_blend(image: np.ndarray, values: np.ndarray, alpha: float, name: str) -> np.ndarray:
    return np.rint((1 - alpha) * image + alpha * matplotlib_colours(values, name))


@pytest.fixture
def image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))  # 8 wide, 6 high


def test_colorize_gives_the_colour_map_end_points() -> None:
    heatmap = np.array([[0.0, 1.0]])
    assert colorize(heatmap, "gray").tolist() == [[[0, 0, 0], [255, 255, 255]]]
    low, high = colorize(heatmap, "jet")[0].tolist()
    assert low[0] == low[1] == 0 and 120 <= low[2] <= 130  # dark blue
    assert 120 <= high[0] <= 130 and high[1] == high[2] == 0  # dark red


def test_torch_and_numpy_heatmaps_give_the_same_colours() -> None:
    values = torch.rand(5, 7, dtype=torch.float64, requires_grad=True)
    from_torch = colorize(values.unsqueeze(0), "viridis")  # a leading 1 is dropped
    from_numpy = colorize(values.detach().numpy(), "viridis")
    np.testing.assert_array_equal(from_torch, from_numpy)
    assert from_torch.shape == (5, 7, 3) and from_torch.dtype == np.uint8


def test_overlay_is_the_alpha_blend_of_image_and_colour_map(image: Image.Image) -> None:
    values = np.linspace(0, 1, 48).reshape(6, 8)
    blended = overlay(image, torch.from_numpy(values), alpha=0.3, colormap="inferno")
    expected = expected_blend(np.asarray(image, dtype=np.float64), values, 0.3, "inferno")
    np.testing.assert_allclose(np.asarray(blended), expected, atol=1)


@pytest.mark.parametrize(("alpha", "source"), [(0.0, "image"), (1.0, "colours")])
def test_overlay_alpha_end_points(image: Image.Image, alpha: float, source: str) -> None:
    values = np.full((6, 8), 0.5)
    result = np.asarray(overlay(image, values, alpha=alpha, colormap="jet"))
    expected = np.asarray(image) if source == "image" else matplotlib_colours(values, "jet")
    np.testing.assert_array_equal(result, expected)


def test_overlay_stretches_a_smaller_heatmap_to_the_image_size() -> None:
    photo = Image.new("RGB", (4, 3), (100, 150, 200))  # 4 wide, 3 high
    heatmap = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    result = overlay(photo, heatmap, alpha=0.5, colormap="viridis")
    assert result.size == photo.size
    # Bilinear, pixel centres: columns sample x = -0.25, 0.25, 0.75, 1.25 of the 2-wide map,
    # which clamp to 0 and 1 at the borders.
    row = np.array([0.0, 0.25, 0.75, 1.0])
    expected = expected_blend(
        np.asarray(photo, dtype=np.float64), np.tile(row, (3, 1)), 0.5, "viridis"
    )
    np.testing.assert_allclose(np.asarray(result), expected, atol=1)


def test_overlay_composites_an_rgba_image_on_white(image: Image.Image) -> None:
    transparent = Image.new("RGBA", (8, 6), (0, 0, 0, 0))
    values = np.zeros((6, 8))
    result = np.asarray(overlay(transparent, values, alpha=0.5, colormap="gray"))
    assert (result == 128).all()  # half white, half black


def test_heatmap_image_takes_a_pillow_size() -> None:
    shown = heatmap_image(torch.rand(3, 5), "magma", size=(40, 30))
    assert shown.mode == "RGB" and shown.size == (40, 30)
    alone = heatmap_image(np.array([[0.0, 1.0]]), "gray")
    assert np.asarray(alone).tolist() == [[[0, 0, 0], [255, 255, 255]]]


@pytest.mark.parametrize(
    ("heatmap", "message"),
    [
        (np.array([[0.0, 1.5]]), r"\[0, 1\]"),
        (np.array([[np.nan, 0.5]]), "NaN"),
        (torch.rand(2, 4, 4), "one \\(H, W\\) map"),
        (np.zeros(4), "one \\(H, W\\) map"),
        ([[0.5]], "tensor or numpy"),
    ],
)
def test_bad_heatmaps_are_refused(image: Image.Image, heatmap, message: str) -> None:
    with pytest.raises(CamvizError, match=message):
        overlay(image, heatmap)


def test_a_map_out_of_range_is_refused_naming_a_function_that_normalises_it(image) -> None:
    heatmap = torch.linspace(-1.0, 3.0, 48).view(6, 8)
    with pytest.raises(CamvizError, match=r"got -1 to 3; normalise the map first") as error:
        overlay(image, heatmap)
    named = re.search(r"camviz(?:\.\w+)+", str(error.value))
    assert named is not None
    module, name = named.group(0).rsplit(".", 1)
    normalised = getattr(importlib.import_module(module), name)(heatmap[None])[0]
    torch.testing.assert_close(normalised, (heatmap + 1) / 4)
    expected = expected_blend(np.asarray(image, dtype=np.float64), normalised.numpy(), 0.5, "jet")
    np.testing.assert_allclose(np.asarray(overlay(image, normalised)), expected, atol=1)


def test_bad_alpha_and_colour_map_are_refused(image: Image.Image) -> None:
    values = np.zeros((6, 8))
    with pytest.raises(CamvizError, match="alpha"):
        overlay(image, values, alpha=1.5)
    with pytest.raises(CamvizError, match="did you mean viridis"):
        overlay(image, values, colormap="virdis")


@pytest.mark.parametrize(
    ("alpha", "colormap", "message"), [(-0.1, "jet", "alpha"), (0.5, "jett", "did you mean jet")]
)
def test_render_options_are_checked_up_front(alpha: float, colormap: str, message: str) -> None:
    check_render_options(0.0, "turbo")
    with pytest.raises(CamvizError, match=message):
        check_render_options(alpha, colormap)


# Channels

# Three 2x2 channels: a ramp (mean 1.5), a constant (mean 5), and one with negatives (mean 0.5).
ACTIVATIONS = torch.tensor(
    [
        [[0.0, 1.0], [2.0, 3.0]],
        [[5.0, 5.0], [5.0, 5.0]],
        [[-1.0, -1.0], [1.0, 3.0]],
    ]
)


def test_each_channel_is_scaled_on_its_own_and_a_constant_one_is_zero() -> None:
    indices, maps = select_channels(ACTIVATIONS)
    assert indices == [0, 1, 2]
    expected = [[[0, 1 / 3], [2 / 3, 1]], [[0, 0], [0, 0]], [[0, 0], [0.5, 1]]]
    torch.testing.assert_close(maps, torch.tensor(expected))


def test_shared_scaling_uses_one_range_for_all_channels() -> None:
    _, maps = select_channels(ACTIVATIONS, normalize="shared")
    torch.testing.assert_close(maps, (ACTIVATIONS + 1) / 6)


@pytest.mark.parametrize(
    ("channels", "order", "expected"),
    [
        (2, "first", [0, 1]),
        (2, "strongest", [1, 0]),
        (3, "strongest", [1, 0, 2]),
        (10, "strongest", [1, 0, 2]),
        ([2, 0], "first", [2, 0]),
    ],
)
def test_channel_choice(channels, order: str, expected: list[int]) -> None:
    indices, maps = select_channels(ACTIVATIONS.unsqueeze(0), channels, order)
    assert indices == expected
    torch.testing.assert_close(maps, select_channels(ACTIVATIONS)[1][expected])


def test_strongest_ties_go_to_the_lower_index() -> None:
    assert select_channels(torch.ones(4, 2, 2), 2, "strongest")[0] == [0, 1]


@pytest.mark.parametrize(
    ("activations", "options", "message"),
    [
        (torch.zeros(2, 3, 2, 2), {}, "one sample"),
        (ACTIVATIONS, {"channels": [3]}, "0..2"),
        (ACTIVATIONS, {"channels": 0}, "at least 1"),
        (ACTIVATIONS, {"channels": 2, "order": "loudest"}, "strongest"),
        (ACTIVATIONS, {"normalize": "global"}, "shared"),
    ],
)
def test_bad_channel_arguments(activations, options: dict, message: str) -> None:
    with pytest.raises(CamvizError, match=message):
        select_channels(activations, **options)


def tile(grid: torch.Tensor, index: int, size: int = 2, padding: int = 1) -> torch.Tensor:
    """Tile ``index`` of a one-row grid."""
    left = padding + index * (size + padding)
    return grid[:, padding : padding + size, left : left + size]


def test_channel_grid_tiles_the_strongest_channels_in_grey(tmp_path: Path) -> None:
    grid = channel_grid(ACTIVATIONS, channels=2, order="strongest", ncols=2)
    assert grid.shape == (3, 4, 7)  # one row of two 2x2 tiles, 1-pixel white lines
    torch.testing.assert_close(tile(grid, 0), torch.zeros(3, 2, 2))  # constant channel 1
    torch.testing.assert_close(
        tile(grid, 1), torch.tensor([[0, 1 / 3], [2 / 3, 1]]).expand(3, 2, 2)
    )
    assert (grid[:, 0] == 1).all() and (grid[:, :, 3] == 1).all()


def test_channel_grid_with_a_colour_map() -> None:
    grid = channel_grid(ACTIVATIONS, channels=[2, 0], colormap="viridis")
    for index, values in enumerate([[[0, 0], [0.5, 1]], [[0, 1 / 3], [2 / 3, 1]]]):
        colours = matplotlib_colours(np.array(values), "viridis") / 255
        torch.testing.assert_close(
            tile(grid, index), torch.from_numpy(colours).permute(2, 0, 1).float()
        )


def test_one_grey_channel_is_its_own_three_channel_tile() -> None:
    grid = channel_grid(ACTIVATIONS, channels=[0])
    torch.testing.assert_close(grid, torch.tensor([[0, 1 / 3], [2 / 3, 1]]).expand(3, 2, 2))


def test_channel_grid_writes_the_grid_it_returns(tmp_path: Path) -> None:
    path = tmp_path / "grids" / "layer4.png"
    grid = channel_grid(torch.rand(1, 9, 5, 5), path)
    written = read(path).astype(np.float64)
    np.testing.assert_allclose(written, grid.permute(1, 2, 0).numpy() * 255, atol=0.5 + 1e-4)
    assert sorted(p.name for p in path.parent.iterdir()) == ["layer4.png"]


def test_channel_figure_titles_each_channel_and_the_layer() -> None:
    figure = channel_figure(ACTIVATIONS, "layer4.1.conv2", channels=2, order="strongest")
    shown = [ax for ax in figure.axes if ax.images]
    assert [ax.get_title() for ax in shown] == ["1", "0"]
    assert figure.get_suptitle() == "layer4.1.conv2"
    np.testing.assert_allclose(shown[1].images[0].get_array(), [[0, 1 / 3], [2 / 3, 1]], atol=1e-6)


# Panels and display


def test_panel_shows_image_heatmap_and_overlay_under_the_title(image: Image.Image) -> None:
    heatmap = torch.rand(3, 4)
    title = "tabby, tabby cat — 0.62 (gradcam, layer bn2)"
    figure = panel(image, heatmap, title=title, alpha=0.4, colormap="jet")
    assert isinstance(figure, Figure) and len(figure.axes) == 3
    assert figure.get_suptitle() == title
    image_ax, heatmap_ax, overlay_ax = figure.axes
    np.testing.assert_array_equal(image_ax.images[0].get_array(), np.asarray(image))
    assert heatmap_ax.images[0].get_array().shape == (6, 8)  # at the image's size
    expected = np.asarray(overlay(image, heatmap, alpha=0.4, colormap="jet"))
    np.testing.assert_array_equal(overlay_ax.images[0].get_array(), expected)


def test_show_returns_images_jupyter_can_draw(image: Image.Image) -> None:
    assert show(image) is image
    shown = show(image, torch.rand(6, 8), title="x", dpi=50)
    assert shown.mode == "RGB" and shown.width == 12 * 50
    grid = channel_grid(ACTIVATIONS)
    as_image = np.asarray(show(grid), dtype=np.float64)
    np.testing.assert_allclose(as_image, grid.permute(1, 2, 0).numpy() * 255, atol=0.5 + 1e-4)


# Writing files


def test_save_writes_images_figures_and_tensors(tmp_path: Path, image: Image.Image) -> None:
    save(image, tmp_path / "image.png")
    np.testing.assert_array_equal(read(tmp_path / "image.png"), np.asarray(image))
    # An all-zero map draws jet's lowest colour, dark blue, blended half and half.
    figure = panel(image, np.zeros((6, 8)))
    _, heatmap_ax, overlay_ax = figure.axes
    assert not heatmap_ax.images[0].get_array().any()
    assert heatmap_ax.images[0].get_clim() == (0.0, 1.0)  # zero is the bottom of the scale
    dark_blue = np.zeros((6, 8, 3))
    dark_blue[..., 2] = 127.5
    expected = np.rint(0.5 * np.asarray(image, dtype=np.float64) + 0.5 * dark_blue)
    np.testing.assert_allclose(overlay_ax.images[0].get_array(), expected, atol=1)
    save(figure, tmp_path / "panel.png")
    drawn = io.BytesIO()
    figure.savefig(drawn, format="png")
    with Image.open(drawn) as rendered:
        np.testing.assert_array_equal(read(tmp_path / "panel.png"), np.asarray(rendered))
    # In the picture: the middle tile is one solid dark-blue rectangle of the image's shape.
    pixels = read(tmp_path / "panel.png")[..., :3]
    blue = (pixels == matplotlib.colormaps["jet"](0.0, bytes=True)[:3]).all(axis=-1)
    (top, left), (bottom, right) = np.argwhere(blue).min(0), np.argwhere(blue).max(0) + 1
    assert blue.sum() == (bottom - top) * (right - left)
    assert abs((right - left) / (bottom - top) - 8 / 6) < 0.01
    width = pixels.shape[1]
    assert width / 3 <= left < right <= 2 * width / 3
    save(panel(image, np.zeros((6, 8))), tmp_path / "panel.pdf")
    assert (tmp_path / "panel.pdf").read_bytes().startswith(b"%PDF")
    save(torch.zeros(3, 2, 2), tmp_path / "grid.bmp")
    assert read(tmp_path / "grid.bmp").tolist() == [[[0] * 3] * 2] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "grid.bmp",
        "image.png",
        "panel.pdf",
        "panel.png",
    ]


def test_save_refuses_unknown_extensions_without_writing(tmp_path: Path, image) -> None:
    with pytest.raises(CamvizError, match=r"\.png"):
        save(image, tmp_path / "image.heic2")
    with pytest.raises(CamvizError, match="extension '\\(none\\)'"):
        save(torch.zeros(3, 2, 2), tmp_path / "grid")
    assert list(tmp_path.iterdir()) == []


class WriterError(Exception):
    pass


def test_atomic_write_leaves_nothing_when_the_writer_fails(tmp_path: Path) -> None:
    target = tmp_path / "out.png"
    with pytest.raises(WriterError), atomic_write(target) as file:
        file.write(b"half a PNG")
        raise WriterError
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    target.write_text("old")
    with pytest.raises(WriterError), atomic_write(target, "w") as file:
        file.write("new but broken")
        raise WriterError
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


def test_atomic_path_replaces_the_file_only_when_the_writer_succeeds(tmp_path: Path) -> None:
    target = tmp_path / "clips" / "clip.mp4"
    with atomic_path(target, keep_suffix=True) as temporary:
        assert temporary.parent == target.parent and temporary.name.startswith(".clip.mp4.")
        assert temporary.suffix == ".mp4" and is_temporary(temporary.name)
        temporary.write_bytes(b"first")
    assert target.read_bytes() == b"first"
    with pytest.raises(WriterError), atomic_path(target) as temporary:
        temporary.write_bytes(b"half a video")
        raise WriterError
    assert target.read_bytes() == b"first"
    assert list(target.parent.iterdir()) == [target]


def test_a_figure_that_fails_to_render_leaves_no_file(
    tmp_path: Path, image: Image.Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_savefig(self: Figure, file, **options) -> None:
        file.write(b"\x89PNG partial")
        raise WriterError

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(WriterError):
        save(panel(image, np.zeros((6, 8))), tmp_path / "panel.png")
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_replaces_and_respects_the_umask(tmp_path: Path) -> None:
    target = tmp_path / "new" / "folder" / "manifest.json"
    with atomic_write(target, "w") as file:
        file.write('{"cat": "é"}')
    assert target.read_text(encoding="utf-8") == '{"cat": "é"}'
    assert list(target.parent.iterdir()) == [target]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_write_refuses_a_folder_and_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "shots.png").mkdir()
    with pytest.raises(CamvizError, match=r"shots\.png is a folder"):
        save(Image.new("RGB", (2, 2)), tmp_path / "shots.png")
    (tmp_path / "out").write_text("a file, not a folder")
    with pytest.raises(CamvizError) as raised:
        save(Image.new("RGB", (2, 2)), tmp_path / "out" / "cat.png")
    assert "out is a file, not a folder" in str(raised.value) and "\n" not in str(raised.value)


def test_an_unwritable_folder_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(CamvizError, match=r"cannot write .*cat\.png \(Permission denied\)"):
        save(Image.new("RGB", (2, 2)), tmp_path / "cat.png")


def test_a_failed_rename_removes_the_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(source, target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(CamvizError, match="Permission denied"):
        save(Image.new("RGB", (2, 2)), tmp_path / "cat.png")
    assert list(tmp_path.iterdir()) == []
