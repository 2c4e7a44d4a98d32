"""Pictures drawn with torch, OpenCV and Pillow: colours, overlays, panels, grids, boxes.

This is the batch path of ``camviz explain``, and it never imports matplotlib (about 2 s,
and a global font cache): maps are coloured with the look-up tables of
:mod:`camviz.io.colormaps` (the same colours as matplotlib's; only a colour map whose table
does not ship is asked of matplotlib), blended (:mod:`camviz.io.blending`) and captioned
with Pillow's font (titles from words rendered once, :mod:`camviz.io.titles`), a few array
operations per picture. The matplotlib figures are in :mod:`camviz.io.figures`, files in
:mod:`camviz.io.output`; users reach all three through :mod:`camviz.render`.

Heatmaps are ``(H, W)`` torch tensors or numpy arrays with values in ``[0, 1]``, such as
one row of :attr:`camviz.Explanation.heatmaps`. They may come from any device. Overlays and
panels are computed on the CPU (with OpenCV's look-up table and blend), or with
``device="cuda"`` on the GPU with torch: the photo goes up once, the map is resized,
coloured and blended there, and each picture comes back once, as uint8, to be encoded. On
both, torchvision's uint8 resize of the panel's photo tile gives Pillow's pixels in about
half Pillow's time (``benchmarks/bench_render_device.py``). :func:`overlay_and_panel` draws
both pictures of one map and makes what they share once (the folder job's files).

Overlays are drawn at the *original* image's size: the heatmap (computed at the model's
input size) is stretched back onto the photo, not the photo squeezed to the model's size.
Pixel-level maps (vanilla gradients, guided backprop) are customarily shown clipped at a
high percentile (``clip=99``): a few pixels hold the maximum, and unclipped the overlay
looks empty.

The helpers without a leading underscore that :mod:`camviz.render` does not list
(:func:`as_map`, :func:`clipped`, :func:`resized_map`, ...) are shared with the figures, the
files and the command line; they are not part of the public API.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, TypeAlias

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torchvision.utils import make_grid

from camviz.core.errors import CamvizError
from camviz.core.maps import normalize as normalize_maps
from camviz.core.maps import upsample
from camviz.io.blending import Blend, blend, resized_pixels
from camviz.io.colormaps import apply, lookup_table
from camviz.io.images import to_rgb
from camviz.io.titles import draw_title

if TYPE_CHECKING:
    from matplotlib.colors import Colormap

Heatmap: TypeAlias = torch.Tensor | np.ndarray
Order = Literal["first", "strongest", "weight"]
Scaling = Literal["channel", "shared"]

#: Values this far outside ``[0, 1]`` are float noise from resizing, not a wrong input.
MAP_TOLERANCE = 1e-4

#: The percentile at which pixel-level saliency maps are clipped for display.
SALIENCY_PERCENTILE = 99.0

#: Width, in pixels, of each of the three pictures of :func:`panel_image` and of each tile
#: of :func:`detection_panel`.
PANEL_TILE_WIDTH = 400

# Gap between pictures and text sizes of the panels (pixels).
_PANEL_GAP = 10
_TITLE_SIZE = 18
_CAPTION_SIZE = 14

#: The colour of drawn boxes and of their labels' backgrounds: white, framed in black, so it
#: stands out on a photo and on every colour of the heatmap.
BOX_COLOUR = (255, 255, 255)

# Width of a box's white line and of the black frame on each side of it (pixels).
_BOX_WIDTH = 2
_BOX_FRAME = 1

# Tiles per row of a detection panel.
_DETECTION_COLUMNS = 4


def colorize(heatmap: Heatmap, colormap: str | Colormap = "jet") -> np.ndarray:
    """Colour a heatmap with a matplotlib colour map.

    Args:
        heatmap: ``(H, W)`` values in ``[0, 1]`` (leading dimensions of size 1 are dropped).
        colormap: Any matplotlib colour map name (``"jet"``, ``"viridis"``, ``"turbo"``...)
            or a ``Colormap``.

    Returns:
        An ``(H, W, 3)`` uint8 array.

    Raises:
        CamvizError: The heatmap is not 2-D, holds values outside ``[0, 1]`` or NaN, or the
            colour map is unknown.
    """
    return _colour(as_map(heatmap), colormap)


def heatmap_image(
    heatmap: Heatmap,
    colormap: str | Colormap = "jet",
    size: tuple[int, int] | None = None,
    *,
    clip: float | None = None,
) -> Image.Image:
    """The coloured heatmap on its own, as an RGB image.

    Args:
        heatmap: ``(H, W)`` values in ``[0, 1]``.
        colormap: A matplotlib colour map name or ``Colormap``.
        size: ``(width, height)`` to resize the map to first (bilinear), in Pillow's order
            so that ``size=image.size`` matches an image; ``None`` keeps the map's size.
        clip: Draw values above this percentile of the map (0-100) as the top colour
            (:data:`SALIENCY_PERCENTILE` for pixel-level maps); ``None`` draws them as
            they are.
    """
    values = clipped(as_map(heatmap), clip)
    if size is not None:
        values = resized_map(values, size)
    return Image.fromarray(_colour(values, colormap))


def overlay(
    image: Image.Image,
    heatmap: Heatmap,
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
    *,
    clip: float | None = None,
    device: torch.device | str | None = None,
) -> Image.Image:
    """Blend a coloured heatmap onto an image, at the image's own size.

    Each pixel is ``(1 - alpha) * image + alpha * colour``, with the heatmap first resized
    (bilinear) to the image's size and then coloured, so the colours are those of the map's
    own values.

    Args:
        image: The original image (any mode; converted as :func:`camviz.images.to_rgb`).
        heatmap: ``(H, W)`` values in ``[0, 1]``, of any size.
        alpha: Weight of the heatmap, from 0 (image only) to 1 (heatmap only).
        colormap: A matplotlib colour map name or ``Colormap``.
        clip: Percentile at which to clip the map first; see :func:`heatmap_image`.
        device: Where the map is resized, coloured and blended (``"cuda"``: on the GPU,
            see the module docstring); ``None`` computes on the CPU.

    Returns:
        An RGB image of ``image.size``.
    """
    drawing = _drawing(image, heatmap, alpha, colormap, clip, device)
    return _picture(drawing.blended(drawing.size))


def panel_image(
    image: Image.Image,
    heatmap: Heatmap,
    *,
    title: str = "",
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
    clip: float | None = None,
    width: int = PANEL_TILE_WIDTH,
    device: torch.device | str | None = None,
) -> Image.Image:
    """Image, heatmap and overlay side by side under ``title``, drawn with Pillow.

    The picture :func:`panel` draws with matplotlib, many times faster: each of the
    three is ``width`` pixels wide (the photo's aspect kept), captioned, on white, the
    title above in Pillow's default font. ``camviz explain`` writes these.

    Args:
        image: The original image.
        heatmap: ``(H, W)`` values in ``[0, 1]``, of any size.
        title: The title, e.g. ``"tabby, tabby cat: p=0.62 (gradcam, layer bn2)"``.
        alpha: Weight of the heatmap in the overlay.
        colormap: A matplotlib colour map name or ``Colormap``.
        clip: Percentile at which to clip the map first; see :func:`heatmap_image`.
        width: Width of each of the three pictures, in pixels.
        device: Where the pictures are computed; see :func:`overlay`.
    """
    return _panel(_drawing(image, heatmap, alpha, colormap, clip, device), title, width)


def overlay_and_panel(
    image: Image.Image,
    heatmap: Heatmap,
    *,
    title: str = "",
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
    clip: float | None = None,
    device: torch.device | str | None = None,
) -> tuple[Image.Image, Image.Image]:
    """:func:`overlay` and :func:`panel_image` of one photo and map (the same pictures),
    drawn together, so that what both hold is made once: for a photo 400 pixels wide the
    panel's overlay tile is the overlay itself. The folder job draws its files with it."""
    drawing = _drawing(image, heatmap, alpha, colormap, clip, device)
    return _picture(drawing.blended(drawing.size)), _panel(drawing, title, PANEL_TILE_WIDTH)


def _drawing(
    image: Image.Image,
    heatmap: Heatmap,
    alpha: float,
    colormap: str | Colormap,
    clip: float | None,
    device: torch.device | str | None,
) -> Blend:
    """The photo and the map, checked, on ``device``, ready to be drawn."""
    _check_alpha(alpha)
    pixels = _pixels(as_rgb(image), device)
    values = clipped(as_map(heatmap, pixels.device), clip)
    return Blend(pixels, values, lookup_table(colormap), alpha)


def _panel(drawing: Blend, title: str, width: int) -> Image.Image:
    """The panel of :func:`panel_image`: three pictures ``width`` wide, captioned, titled."""
    size = (width, max(1, round(drawing.size[1] * width / drawing.size[0])))
    top = _PANEL_GAP + (_TITLE_SIZE + _PANEL_GAP if title else 0)
    picture_top = top + _CAPTION_SIZE + _PANEL_GAP // 2
    # Laid out as one array, the white canvas and the captions copied in: one picture made.
    captions = _panel_captions(width)
    canvas = np.full((picture_top + size[1] + _PANEL_GAP, captions.shape[1], 3), 255, np.uint8)
    canvas[top:picture_top] = captions
    tiles = (drawing.photo(size), drawing.colours(size), drawing.blended(size))
    for number, tile in enumerate(tiles):  # each comes back from the device once
        left = _PANEL_GAP + number * (width + _PANEL_GAP)
        canvas[picture_top : picture_top + size[1], left : left + width] = tile.cpu().numpy()
    picture = Image.fromarray(canvas)
    draw_title(picture, title, _PANEL_GAP, _TITLE_SIZE)
    return picture


@functools.cache
def _panel_captions(width: int) -> np.ndarray:
    """The rows of :func:`panel_image`'s captions for pictures ``width`` wide, down to where
    the pictures begin, drawn once: rendering text took a third of a panel's drawing."""
    size = (3 * width + 4 * _PANEL_GAP, _CAPTION_SIZE + _PANEL_GAP // 2)
    canvas = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(_CAPTION_SIZE)
    for number, caption in enumerate(("image", "heatmap", "overlay")):
        left = _PANEL_GAP + number * (width + _PANEL_GAP)
        draw.text((left + width / 2, 0), caption, fill="black", font=font, anchor="ma")
    return np.asarray(canvas)


def clipped(values: torch.Tensor, percentile: float | None) -> torch.Tensor:
    """``values / q`` clipped to ``[0, 1]``, ``q`` being the ``percentile``-th percentile of
    the values (the smallest value with at least that share of the values at or below it;
    the smallest positive value if that is 0); the values as they are for ``None`` or an
    all-zero map.

    Raises:
        CamvizError: A percentile outside ``(0, 100]``.
    """
    if percentile is None:
        return values
    if not 0 < percentile <= 100:
        raise CamvizError(f"clip must be a percentile in (0, 100], got {percentile}")
    positive = values[values > 0]
    if positive.numel() == 0:
        return values
    # Over the whole map: the zeros count, as they do in the customary np.percentile(map, 99).
    flat = values.flatten().float()
    level = flat.kthvalue(max(1, math.ceil(percentile / 100 * flat.numel()))).values.item()
    if level <= 0:
        level = positive.min().item()
    return (values / level).clamp(0, 1)


def check_render_options(alpha: float, colormap: str | Colormap) -> None:
    """Refuse a bad ``alpha`` or colour map now, before any model work is spent.

    Raises:
        CamvizError: ``alpha`` is outside ``[0, 1]`` or the colour map is unknown.
    """
    _check_alpha(alpha)
    lookup_table(colormap)


def select_channels(
    activations: torch.Tensor,
    channels: int | Sequence[int] | None = None,
    order: Order = "first",
    normalize: Scaling = "channel",
    weights: torch.Tensor | Sequence[float] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Pick channels of one layer output and scale them to ``[0, 1]`` for display.

    Args:
        activations: ``(C, h, w)`` or ``(1, C, h, w)`` layer output, on any device.
        channels: ``None`` for all channels; an int ``n`` for (at most) ``n`` channels
            chosen by ``order``; or a sequence of channel indices, shown in that order.
        order: With an int ``channels``: ``"first"`` takes channels ``0 .. n-1``;
            ``"strongest"`` takes the ``n`` channels with the highest mean activation over
            ``h x w`` (signed, before scaling), strongest first; ``"weight"`` the ``n``
            with the largest ``weights``, largest first (ties by lower index).
        normalize: ``"channel"`` scales each channel by its own min and max, showing every
            channel's pattern; ``"shared"`` uses one min and max for all picked channels,
            showing which channels are strong. A constant channel becomes zeros, never NaN.
        weights: ``(C,)`` for ``order="weight"``: the explained class's channel weights,
            such as ``explanation.weights[layer][0]`` of a Grad-CAM explanation.

    Returns:
        ``(indices, maps)``: the picked channel indices, and their ``(n, h, w)`` float32
        CPU maps in ``[0, 1]``.
    """
    maps = _as_channels(activations)
    count = maps.shape[0]
    if channels is None:
        indices = list(range(count))
    elif isinstance(channels, int):
        if channels < 1:
            raise CamvizError(f"channels must be at least 1, got {channels}")
        indices = _ordered(maps, order, weights)[:channels]
    else:
        indices = [int(index) for index in channels]
        outside = [index for index in indices if not 0 <= index < count]
        if outside or not indices:
            raise CamvizError(
                f"channel indices must lie in 0..{count - 1} (the layer has {count} "
                f"channels), got {outside or 'none'}"
            )
    picked = maps[indices]
    if normalize == "channel":
        return indices, normalize_maps(picked)
    if normalize == "shared":
        return indices, normalize_maps(picked.reshape(1, -1)).view_as(picked)
    raise CamvizError(f"normalize must be 'channel' or 'shared', not {normalize!r}")


def _ordered(
    maps: torch.Tensor, order: Order, weights: torch.Tensor | Sequence[float] | None
) -> list[int]:
    """Every channel of ``(C, h, w)`` maps in the order ``order`` names (ties by index)."""
    count = maps.shape[0]
    if order == "first":
        return list(range(count))
    if order == "strongest":
        strength = maps.mean(dim=(1, 2))
    elif order == "weight":
        if weights is None:
            raise CamvizError(
                "order='weight' needs weights=, the (C,) channel weights of an explanation "
                "(explanation.weights[layer][0])"
            )
        strength = torch.as_tensor(weights).detach().float().cpu().flatten()
        if strength.numel() != count:
            raise CamvizError(
                f"weights has {strength.numel()} values, but the layer has {count} channels"
            )
    else:
        raise CamvizError(f"order must be 'first', 'strongest' or 'weight', not {order!r}")
    return torch.argsort(strength, descending=True, stable=True).tolist()


def channel_grid(
    activations: torch.Tensor,
    path: str | os.PathLike[str] | None = None,
    *,
    channels: int | Sequence[int] | None = None,
    order: Order = "first",
    ncols: int | None = None,
    colormap: str | Colormap | None = None,
    normalize: Scaling = "channel",
    weights: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Tile a layer's channels into one image, each channel scaled to ``[0, 1]``.

    Args:
        activations: ``(C, h, w)`` or ``(1, C, h, w)`` layer output.
        path: Where to write the grid (PNG, JPEG...), atomically; ``None`` writes nothing.
        channels: Which channels; see :func:`select_channels`.
        order: ``"first"``, ``"strongest"`` (highest mean activation) or ``"weight"``
            (largest ``weights``); see :func:`select_channels`.
        ncols: Tiles per row; ``None`` makes the grid about square.
        colormap: A matplotlib colour map for the tiles; ``None`` draws them in grey.
        normalize: ``"channel"`` or ``"shared"``; see :func:`select_channels`.
        weights: The channel weights ``order="weight"`` sorts by.

    Returns:
        The ``(3, H, W)`` float grid in ``[0, 1]``, tiles separated by 1-pixel white lines
        (a single channel comes back as its tile alone).
    """
    _, maps = select_channels(activations, channels, order, normalize, weights)
    if colormap is None:
        tiles = maps.unsqueeze(1).expand(-1, 3, -1, -1)
    else:
        tiles = torch.from_numpy(_colour(maps, colormap)).permute(0, 3, 1, 2).float() / 255
    grid = make_grid(tiles, nrow=grid_columns(len(maps), ncols), padding=1, pad_value=1.0)
    if path is not None:
        # Imported here: camviz.io.output imports this module (its videos draw overlays).
        from camviz.io.output import save

        save(grid, path)
    return grid


def as_map(heatmap: Heatmap, device: torch.device | str = "cpu") -> torch.Tensor:
    """A heatmap as an ``(H, W)`` float32 tensor in ``[0, 1]`` on ``device``."""
    if isinstance(heatmap, np.ndarray):
        values = torch.from_numpy(np.array(heatmap, dtype=np.float32)).to(device)
    elif isinstance(heatmap, torch.Tensor):
        values = heatmap.detach().to(device, torch.float32)
    else:
        raise CamvizError(
            f"a heatmap must be a torch tensor or numpy array, not {type(heatmap).__name__}"
        )
    while values.dim() > 2 and values.shape[0] == 1:
        values = values[0]
    if values.dim() != 2 or values.numel() == 0:
        raise CamvizError(
            f"a heatmap must be one (H, W) map, got shape {tuple(heatmap.shape)}; "
            "pass one map, e.g. explanation.heatmaps[0]"
        )
    if not torch.isfinite(values).all():
        raise CamvizError("the heatmap holds NaN or infinite values; check the model's output")
    low, high = values.min().item(), values.max().item()
    if low < -MAP_TOLERANCE or high > 1 + MAP_TOLERANCE:
        raise CamvizError(
            f"heatmap values must lie in [0, 1], got {low:.3g} to {high:.3g}; normalise the "
            "map first (camviz.core.maps.normalize scales each map of a batch to [0, 1])"
        )
    return values.clamp(0, 1)


def _as_channels(activations: torch.Tensor) -> torch.Tensor:
    """Layer output as ``(C, h, w)`` float32 on the CPU."""
    if not isinstance(activations, torch.Tensor):
        raise CamvizError(f"activations must be a tensor, not {type(activations).__name__}")
    maps = activations.detach()
    if maps.dim() == 4 and maps.shape[0] == 1:
        maps = maps[0]
    if maps.dim() != 3:
        raise CamvizError(
            f"activations must be (C, h, w) or (1, C, h, w), got shape "
            f"{tuple(activations.shape)}; pass one sample, e.g. activations[0]"
        )
    return maps.to("cpu", torch.float32)


def as_rgb(image: Image.Image) -> Image.Image:
    """A PIL image as RGB (itself when it is), anything else refused in one line."""
    if not isinstance(image, Image.Image):
        raise CamvizError(
            f"the image must be a PIL image, not {type(image).__name__}; use the originals "
            "returned by camviz.images.load_batch"
        )
    return image if image.mode == "RGB" else to_rgb(image)


def _pixels(rgb: Image.Image, device: torch.device | str | None) -> torch.Tensor:
    """An RGB image's ``(H, W, 3)`` uint8 pixels on ``device`` (``None``: the CPU)."""
    pixels = torch.from_numpy(np.array(rgb))
    return pixels if device is None else pixels.to(device)


def _picture(pixels: torch.Tensor) -> Image.Image:
    """``(H, W, 3)`` uint8 pixels from any device as a Pillow image (one copy to the CPU)."""
    return Image.fromarray(pixels.cpu().numpy())


def resized_map(values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of an ``(h, w)`` map to Pillow's ``(width, height)``."""
    width, height = size
    return upsample(values.unsqueeze(0), (height, width))[0].clamp(0, 1)


def _check_alpha(alpha: float) -> None:
    if not 0 <= alpha <= 1:
        raise CamvizError(f"alpha must lie in [0, 1], got {alpha}")


def _colour(values: torch.Tensor, colormap: str | Colormap) -> np.ndarray:
    """``(...)`` values in ``[0, 1]`` to ``(..., 3)`` uint8 colours."""
    return apply(values, lookup_table(colormap)).numpy()


def grid_columns(count: int, ncols: int | None) -> int:
    """Columns of a grid of ``count`` tiles: ``ncols``, or about square for ``None``."""
    if ncols is None:
        return max(1, math.ceil(math.sqrt(count)))
    if ncols < 1:
        raise CamvizError(f"ncols must be at least 1, got {ncols}")
    return ncols


# Detections: boxes and labels drawn with Pillow ---------------------------------------------


def draw_box(image: Image.Image, box: Sequence[float], label: str = "") -> Image.Image:
    """``image`` with a box drawn on it and, at its top-left corner, its label.

    The box is a :data:`BOX_COLOUR` line from the box's edge inwards, framed in black (so
    it shows on any colour); the label is black on that colour, above the box (below it, or
    inside its top, where the picture has no room), never beyond the picture's edges.

    Args:
        image: The picture (an overlay at the photo's size); drawn on in place.
        box: ``(x0, y0, x1, y1)`` in the picture's pixels, as detectors return them.
        label: The text, e.g. ``"person 0.91"``.

    Returns:
        ``image``.
    """
    x0, y0, x1, y1 = (round(float(value)) for value in box)
    draw = ImageDraw.Draw(image)
    # Line i runs i pixels inside the box's edge: white from the edge inwards, black around.
    for inset in range(-_BOX_FRAME, _BOX_WIDTH + _BOX_FRAME):
        if x1 - inset >= x0 + inset and y1 - inset >= y0 + inset:
            colour = BOX_COLOUR if 0 <= inset < _BOX_WIDTH else (0, 0, 0)
            draw.rectangle((x0 + inset, y0 + inset, x1 - inset, y1 - inset), outline=colour)
    outer = _BOX_FRAME
    if label:
        # Readable on a large photo too: about a 30th of its shorter side.
        font = ImageFont.load_default(max(_CAPTION_SIZE, min(image.size) // 30))
        left, top, right, bottom = draw.textbbox((0, 0), label, font=font)
        width, height = right - left + 4, bottom - top + 4
        x = min(max(0, x0 - outer), max(0, image.width - width))
        # Above the box; below it where there is no room; inside its top as a last resort.
        above, below = y0 - outer - height, y1 + outer + 1
        y = above if above >= 0 else below if below + height < image.height else y0 + outer
        draw.rectangle((x, y, x + width, y + height), fill=BOX_COLOUR)
        draw.text((x + 2 - left, y + 2 - top), label, fill="black", font=font)
    return image


def detection_panel(
    image: Image.Image,
    heatmaps: Sequence[Heatmap],
    boxes: Sequence[Sequence[float]],
    labels: Sequence[str],
    *,
    title: str = "",
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
    clip: float | None = None,
    width: int = PANEL_TILE_WIDTH,
) -> Image.Image:
    """The photo with every box, then each object's overlay with its box, in a grid.

    Tiles are ``width`` pixels wide (the photo's aspect kept), :data:`_DETECTION_COLUMNS` a
    row, each captioned (``"all objects"``, then each label), on white, under ``title``.

    Args:
        image: The original image.
        heatmaps: One ``(H, W)`` map in ``[0, 1]`` per object.
        boxes: One ``(x0, y0, x1, y1)`` box per object, in the image's pixels.
        labels: One label per object, e.g. ``"person 0.91"``.
        title: The title, e.g. ``"gradcam, layer backbone"``.
        alpha, colormap, clip: As in :func:`overlay`.
        width: Width of each tile, in pixels.
    """
    if not len(heatmaps) == len(boxes) == len(labels):
        raise CamvizError(
            f"got {len(heatmaps)} maps, {len(boxes)} boxes and {len(labels)} labels; give one "
            "of each per object"
        )
    rgb = as_rgb(image)
    scale = width / rgb.width
    size = (width, max(1, round(rgb.height * scale)))
    pixels = resized_pixels(_pixels(rgb, None), size)
    table = lookup_table(colormap)
    scaled = [[value * scale for value in box] for box in boxes]
    everything = _picture(pixels)
    for box in scaled:
        draw_box(everything, box)
    tiles = [("all objects", everything)]
    for heatmap, box, label in zip(heatmaps, scaled, labels, strict=True):
        values = resized_map(clipped(as_map(heatmap), clip), size)
        tile = _picture(blend(pixels, values, alpha, table))
        tiles.append((label, draw_box(tile, box)))
    return _tile_grid(tiles, size, title)


def _tile_grid(
    tiles: Sequence[tuple[str, Image.Image]], size: tuple[int, int], title: str
) -> Image.Image:
    """Captioned pictures of one ``size`` in rows of :data:`_DETECTION_COLUMNS`, on white."""
    columns = min(len(tiles), _DETECTION_COLUMNS)
    rows = math.ceil(len(tiles) / columns)
    top = _PANEL_GAP + (_TITLE_SIZE + _PANEL_GAP if title else 0)
    cell = (size[0] + _PANEL_GAP, _CAPTION_SIZE + _PANEL_GAP // 2 + size[1] + _PANEL_GAP)
    canvas = Image.new("RGB", (columns * cell[0] + _PANEL_GAP, top + rows * cell[1]), "white")
    draw_title(canvas, title, _PANEL_GAP, _TITLE_SIZE)
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(_CAPTION_SIZE)
    for number, (caption, tile) in enumerate(tiles):
        left = _PANEL_GAP + (number % columns) * cell[0]
        row_top = top + (number // columns) * cell[1]
        draw.text((left + size[0] / 2, row_top), caption, fill="black", font=font, anchor="ma")
        canvas.paste(tile, (left, row_top + _CAPTION_SIZE + _PANEL_GAP // 2))
    return canvas
