"""Overlays and panels drawn with colour look-up tables and Pillow: the same pixels as the
matplotlib rendering, clipped saliency maps, and no matplotlib in the batch path."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from conftest import conv_net
from PIL import Image, ImageDraw, ImageFont

import camviz
from camviz.core.maps import upsample
from camviz.io import colormaps
from camviz.io.pictures import PANEL_TILE_WIDTH, clipped, overlay_and_panel
from camviz.io.render import heatmap_image, overlay, panel_image
from camviz.io.titles import draw_title


@pytest.fixture
def photo() -> Image.Image:
    generator = np.random.default_rng(0)
    return Image.fromarray(generator.integers(0, 256, (30, 40, 3), dtype=np.uint8))


@pytest.fixture
def heatmap() -> torch.Tensor:
    torch.manual_seed(0)
    values = torch.rand(7, 9)
    return (values - values.min()) / (values.max() - values.min())


def matplotlib_overlay(photo: Image.Image, heatmap: torch.Tensor, alpha: float, cmap) -> np.ndarray:
    """The overlay as camviz drew it with matplotlib: colour the resized map, blend, round."""
    resized = upsample(heatmap[None], (photo.height, photo.width))[0].clamp(0, 1).numpy()
    colours = matplotlib.colormaps[cmap](resized, bytes=True)[..., :3].astype(np.float32)
    pixels = np.asarray(photo, dtype=np.float32)
    return np.rint((1 - alpha) * pixels + alpha * colours).astype(np.uint8)


@pytest.mark.parametrize("cmap", ["jet", "viridis", "gray", "twilight"])  # twilight: 510 colours
def test_overlay_matches_the_matplotlib_rendering(photo, heatmap, cmap):
    drawn = np.asarray(overlay(photo, heatmap, alpha=0.4, colormap=cmap))
    expected = matplotlib_overlay(photo, heatmap, 0.4, cmap)
    assert np.abs(drawn.astype(int) - expected).max() <= 1
    assert (drawn == expected).mean() > 0.999  # float rounding at most, on a few pixels


def test_shipped_tables_are_matplotlib_colours():
    for name in colormaps.SHIPPED_NAMES:
        cmap = matplotlib.colormaps[name]
        expected = cmap(np.arange(cmap.N), bytes=True)[:, :3]
        np.testing.assert_array_equal(colormaps.lookup_table(name).numpy(), expected)
    values = torch.tensor([0.0, 0.5, 1 / 256 - 1e-6, 1 / 256, 0.999, 1.0])
    expected = matplotlib.colormaps["jet"](values.numpy(), bytes=True)[:, :3]
    np.testing.assert_array_equal(colormaps.apply(values, colormaps.lookup_table("jet")), expected)


def test_panel_image_holds_the_image_the_heatmap_and_the_overlay(heatmap):
    generator = np.random.default_rng(1)
    photo = Image.fromarray(generator.integers(0, 256, (300, 400, 3), dtype=np.uint8))
    assert photo.width == PANEL_TILE_WIDTH  # so the tiles are the photo's own size
    drawn = np.asarray(panel_image(photo, heatmap, title="tabby cat: p=0.62", alpha=0.5))
    gap = 10
    top = drawn.shape[0] - gap - photo.height
    tiles = [
        drawn[top : top + photo.height, gap + k * (400 + gap) : gap + k * (400 + gap) + 400]
        for k in range(3)
    ]
    np.testing.assert_array_equal(tiles[0], np.asarray(photo))
    resized = upsample(heatmap[None], (300, 400))[0].clamp(0, 1).numpy()
    jet = matplotlib.colormaps["jet"](resized, bytes=True)[..., :3]
    assert np.abs(tiles[1].astype(int) - jet).max() <= 1
    expected = matplotlib_overlay(photo, heatmap, 0.5, "jet")
    assert np.abs(tiles[2].astype(int) - expected).max() <= 1
    # The title and the captions are drawn in black on white above the pictures.
    assert (drawn[:top] < 100).all(axis=-1).sum() > 100
    assert (drawn[:top] == 255).all(axis=-1).mean() > 0.8


def test_panel_image_scales_large_photos_to_the_tile_width(heatmap):
    photo = Image.new("RGB", (1600, 1200), "red")
    drawn = panel_image(photo, heatmap)
    assert drawn.width == 3 * PANEL_TILE_WIDTH + 4 * 10
    assert drawn.getpixel((10, drawn.height - 11)) == (255, 0, 0)


def test_clipping_at_a_percentile_saturates_the_top_values():
    values = torch.arange(100, dtype=torch.float32).view(10, 10) / 99
    # The 99th percentile of 100 values: the 99th smallest, 98 / 99.
    torch.testing.assert_close(clipped(values, 99), (values / (98 / 99)).clamp(0, 1))
    assert torch.equal(clipped(values, None), values)
    # Nearly all zeros: the smallest positive value is the level, not 0.
    sparse = torch.zeros(20, 20)
    sparse[0, :3] = torch.tensor([0.2, 0.5, 1.0])
    torch.testing.assert_close(clipped(sparse, 99), (sparse / 0.2).clamp(0, 1))
    assert torch.equal(clipped(torch.zeros(4, 4), 99), torch.zeros(4, 4))


def test_clipped_saliency_overlay_is_not_empty(photo):
    """A saliency map whose maximum sits on one pixel: unclipped, the overlay is nearly the
    colour of 0 everywhere; clipped at the 99th percentile, the evidence shows."""
    torch.manual_seed(0)
    saliency = torch.rand(30, 40) * 0.05
    saliency[3, 4] = 1.0
    plain = np.asarray(heatmap_image(saliency, "gray"))
    shown = np.asarray(heatmap_image(saliency, "gray", clip=99))
    assert plain.mean() < 10 and shown.mean() > 100


def matplotlib_imports(path: Path, *, top_level_only: bool) -> list[int]:
    """Lines of ``path`` that import matplotlib (outside ``if TYPE_CHECKING:`` blocks)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    lines = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        if id(node) not in typing_only and any(n.split(".")[0] == "matplotlib" for n in names):
            lines.append(node.lineno)
    return lines


def test_no_module_of_the_batch_path_imports_matplotlib():
    """No module of the batch path (core, cams, pipeline, io) imports matplotlib when it is
    imported, and camviz.io.pictures does not import it at all."""
    root = Path(camviz.__file__).parent
    for folder in ("core", "cams", "pipeline", "io"):
        for path in root.glob(f"{folder}/*.py"):
            assert matplotlib_imports(path, top_level_only=True) == [], path
    assert matplotlib_imports(root / "io" / "pictures.py", top_level_only=False) == []


DRAW_WITHOUT_MATPLOTLIB = """
import sys

import numpy as np
import torch
from PIL import Image

import camviz.render as render
from camviz.io import pictures


def loaded():
    return sorted(name for name in sys.modules if name.split(".")[0] == "matplotlib")


photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8))
heatmap = torch.rand(7, 9)
pictures.overlay(photo, heatmap, colormap="turbo")
render.panel_image(photo, heatmap, title="t", clip=99)
render.detection_panel(photo, [heatmap], [(2, 3, 20, 25)], ["cat 0.90"])
render.channel_grid(torch.rand(4, 5, 5), colormap="viridis")
render.save(render.overlay(photo, heatmap), sys.argv[1])
print(len(loaded()))
render.panel(photo, heatmap)  # a figure: now matplotlib is loaded
print(len(loaded()) > 0)
"""


def test_pictures_are_drawn_and_written_without_loading_matplotlib(tmp_path):
    """In a fresh process, importing camviz.render and drawing overlays, panels, detection
    panels and grids, and writing one, leaves matplotlib out of sys.modules; drawing a
    figure then loads it (so the check sees it)."""
    result = subprocess.run(
        [sys.executable, "-c", DRAW_WITHOUT_MATPLOTLIB, str(tmp_path / "overlay.png")],
        cwd=Path(camviz.__file__).parent.parent,  # this checkout's camviz comes first
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"]
    assert (tmp_path / "overlay.png").is_file()


def test_folder_job_draws_pixel_level_maps_clipped_and_panels_as_jpeg(tmp_path, photo):
    from camviz.io.images import Preprocess
    from camviz.io.models import LoadedModel
    from camviz.pipeline.job import Outputs, explain_files

    model = conv_net(4, padding=1)
    loaded = LoadedModel(model, Preprocess(size=16), ["a", "b", "c"], "tiny")
    photo.save(tmp_path / "photo.png")
    outputs = Outputs(overlay=True, panel=True, heatmap="npz")
    explain_files(
        tmp_path / "photo.png",
        tmp_path / "out",
        loaded,
        method="vanilla_gradients",
        outputs=outputs,
    )
    heatmap = torch.from_numpy(np.load(tmp_path / "out" / "photo_heatmap.npz")["heatmap"])
    with Image.open(tmp_path / "out" / "photo_overlay.png") as written:
        drawn = np.asarray(written)
    np.testing.assert_array_equal(drawn, np.asarray(overlay(photo, heatmap, clip=99)))
    assert not np.array_equal(drawn, np.asarray(overlay(photo, heatmap)))
    with Image.open(tmp_path / "out" / "photo_panel.jpg") as panel:
        assert panel.format == "JPEG" and panel.width == 3 * PANEL_TILE_WIDTH + 4 * 10


@pytest.mark.parametrize("size", [(400, 300), (60, 45)])
def test_overlay_and_panel_drawn_together_are_the_pictures_drawn_apart(heatmap, size):
    """The folder job draws both from one blend (at 400 pixels wide the panel's overlay tile
    is the overlay): the pictures of overlay and panel_image, pixel for pixel."""
    generator = np.random.default_rng(2)
    photo = Image.fromarray(generator.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    options = {"alpha": 0.3, "colormap": "viridis", "clip": 99.0}
    drawn, panel = overlay_and_panel(photo, heatmap, title="tabby cat: p=0.62", **options)
    np.testing.assert_array_equal(np.asarray(drawn), np.asarray(overlay(photo, heatmap, **options)))
    alone = panel_image(photo, heatmap, title="tabby cat: p=0.62", **options)
    np.testing.assert_array_equal(np.asarray(panel), np.asarray(alone))


def test_a_title_set_word_by_word_is_pillows_line_of_text():
    """Titles are pasted from words rendered once: the same ink as Pillow's own rendering
    of the whole line, in the same place to a pixel."""
    title = "tabby, tabby cat: p=0.62 (gradcam, layer bn2)"
    ours, pillows = (Image.new("L", (700, 40), 255) for _ in range(2))
    draw_title(ours, title, 10, 18)
    font = ImageFont.load_default(18)
    ImageDraw.Draw(pillows).text((350, 10), title, fill=0, font=font, anchor="ma")
    ink = [255 - np.asarray(picture, dtype=np.int64) for picture in (ours, pillows)]
    assert abs(ink[0].sum() - ink[1].sum()) < 0.02 * ink[1].sum()
    for axis in (0, 1):  # the inked columns and rows, within one pixel
        spans = [np.flatnonzero(values.sum(axis=axis) > 0) for values in ink]
        assert abs(spans[0][0] - spans[1][0]) <= 1 and abs(spans[0][-1] - spans[1][-1]) <= 1
