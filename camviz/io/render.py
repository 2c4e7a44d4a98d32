"""Turn heatmaps and activations into pictures: colour maps, overlays, channel grids, figures.

Heatmaps are ``(H, W)`` torch tensors or numpy arrays with values in ``[0, 1]``, such as
one row of :attr:`camviz.Explanation.heatmaps`. They may come from any device. Overlays and
panels are computed with torch on the CPU, or with ``device="cuda"`` on the GPU: the photo
goes up once, the map is resized, coloured and blended there, and each picture comes back
once, as uint8, to be encoded. The same code runs on both; on the CPU torchvision's uint8
resize of the panel's photo tile gives Pillow's pixels in about half Pillow's time
(``benchmarks/bench_render_device.py``).

Overlays are drawn at the *original* image's size: the heatmap (computed at the model's
input size) is stretched back onto the photo, not the photo squeezed to the model's size.

Overlays and :func:`panel_image` are drawn with colour look-up tables
(:mod:`camviz.io.colormaps`, the same colours as matplotlib's) and Pillow: no matplotlib,
so a folder job draws them with a few tensor operations. Pixel-level maps (vanilla gradients,
guided backprop) are customarily shown clipped at a high percentile (``clip=99``): a few
pixels hold the maximum, and unclipped the overlay looks empty.

Figures (:func:`panel`, :func:`channel_figure`, for notebooks) are built with
:class:`matplotlib.figure.Figure` directly, never through ``pyplot`` (whose global registry
leaks figures in a loop and wants a GUI backend).

Every file is written through :func:`camviz.io.atomic.atomic_write`, so a crash or an error
halfway never leaves a partial file behind.
"""

from __future__ import annotations

import io
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeGuard

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torchvision.transforms.v2.functional import resize
from torchvision.utils import make_grid, save_image

from camviz.core.errors import CamvizError
from camviz.core.maps import normalize as normalize_maps
from camviz.core.maps import upsample
from camviz.io.atomic import atomic_write
from camviz.io.colormaps import apply, lookup_table, matplotlib_colormap
from camviz.io.images import to_rgb

if TYPE_CHECKING:
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure

Heatmap: TypeAlias = torch.Tensor | np.ndarray
Order = Literal["first", "strongest"]
Scaling = Literal["channel", "shared"]

# Values this far outside [0, 1] are float noise from resizing, not a wrong input.
_TOLERANCE = 1e-4

#: The percentile at which pixel-level saliency maps are clipped for display.
SALIENCY_PERCENTILE = 99.0

# panel_image: width of each of its three pictures, gap between them, text sizes (pixels).
PANEL_TILE_WIDTH = 400
_PANEL_GAP = 10
_TITLE_SIZE = 18
_CAPTION_SIZE = 14


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
    return _colour(_as_map(heatmap), colormap)


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
    values = clipped(_as_map(heatmap), clip)
    if size is not None:
        values = _resized(values, size)
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
    _check_alpha(alpha)
    pixels = _pixels(_as_rgb(image), device)
    height, width = pixels.shape[:2]
    values = _resized(clipped(_as_map(heatmap, pixels.device), clip), (width, height))
    return _picture(blend(pixels, values, alpha, lookup_table(colormap)))


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
    _check_alpha(alpha)
    rgb = _as_rgb(image)
    size = (width, max(1, round(rgb.height * width / rgb.width)))
    pixels = _resized_pixels(_pixels(rgb, device), size)
    values = _resized(clipped(_as_map(heatmap, pixels.device), clip), size)
    table = lookup_table(colormap)
    gap = torch.full((size[1], _PANEL_GAP, 3), 255, dtype=torch.uint8, device=pixels.device)
    # The three pictures side by side with their gaps: one copy back to the CPU.
    strip = torch.cat(
        [pixels, gap, apply(values, table), gap, blend(pixels, values, alpha, table)], dim=1
    )
    top = _PANEL_GAP + (_TITLE_SIZE + _PANEL_GAP if title else 0)
    picture_top = top + _CAPTION_SIZE + _PANEL_GAP // 2
    canvas = Image.new(
        "RGB", (3 * width + 4 * _PANEL_GAP, picture_top + size[1] + _PANEL_GAP), "white"
    )
    draw = ImageDraw.Draw(canvas)
    if title:
        font = ImageFont.load_default(_TITLE_SIZE)
        draw.text((canvas.width / 2, _PANEL_GAP), title, fill="black", font=font, anchor="ma")
    font = ImageFont.load_default(_CAPTION_SIZE)
    for number, caption in enumerate(("image", "heatmap", "overlay")):
        left = _PANEL_GAP + number * (width + _PANEL_GAP)
        draw.text((left + width / 2, top), caption, fill="black", font=font, anchor="ma")
    canvas.paste(_picture(strip), (_PANEL_GAP, picture_top))
    return canvas


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
) -> tuple[list[int], torch.Tensor]:
    """Pick channels of one layer output and scale them to ``[0, 1]`` for display.

    Args:
        activations: ``(C, h, w)`` or ``(1, C, h, w)`` layer output, on any device.
        channels: ``None`` for all channels; an int ``n`` for (at most) ``n`` channels
            chosen by ``order``; or a sequence of channel indices, shown in that order.
        order: With an int ``channels``: ``"first"`` takes channels ``0 .. n-1``;
            ``"strongest"`` takes the ``n`` channels with the highest mean activation over
            ``h x w`` (signed, before scaling), strongest first, ties by lower index.
        normalize: ``"channel"`` scales each channel by its own min and max, showing every
            channel's pattern; ``"shared"`` uses one min and max for all picked channels,
            showing which channels are strong. A constant channel becomes zeros, never NaN.

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
        if order == "first":
            indices = list(range(min(channels, count)))
        elif order == "strongest":
            strength = maps.mean(dim=(1, 2))
            indices = torch.argsort(strength, descending=True, stable=True)[:channels].tolist()
        else:
            raise CamvizError(f"order must be 'first' or 'strongest', not {order!r}")
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


def channel_grid(
    activations: torch.Tensor,
    path: str | os.PathLike[str] | None = None,
    *,
    channels: int | Sequence[int] | None = None,
    order: Order = "first",
    ncols: int | None = None,
    colormap: str | Colormap | None = None,
    normalize: Scaling = "channel",
) -> torch.Tensor:
    """Tile a layer's channels into one image, each channel scaled to ``[0, 1]``.

    Args:
        activations: ``(C, h, w)`` or ``(1, C, h, w)`` layer output.
        path: Where to write the grid (PNG, JPEG...), atomically; ``None`` writes nothing.
        channels: Which channels; see :func:`select_channels`.
        order: ``"first"`` or ``"strongest"`` (highest mean activation); see
            :func:`select_channels`.
        ncols: Tiles per row; ``None`` makes the grid about square.
        colormap: A matplotlib colour map for the tiles; ``None`` draws them in grey.
        normalize: ``"channel"`` or ``"shared"``; see :func:`select_channels`.

    Returns:
        The ``(3, H, W)`` float grid in ``[0, 1]``, tiles separated by 1-pixel white lines
        (a single channel comes back as its tile alone).
    """
    _, maps = select_channels(activations, channels, order, normalize)
    if colormap is None:
        tiles = maps.unsqueeze(1).expand(-1, 3, -1, -1)
    else:
        tiles = torch.from_numpy(_colour(maps, colormap)).permute(0, 3, 1, 2).float() / 255
    grid = make_grid(tiles, nrow=_columns(len(maps), ncols), padding=1, pad_value=1.0)
    if path is not None:
        save(grid, path)
    return grid


def channel_figure(
    activations: torch.Tensor,
    layer_name: str,
    *,
    channels: int | Sequence[int] | None = 16,
    order: Order = "first",
    ncols: int | None = None,
    colormap: str | Colormap | None = "viridis",
    normalize: Scaling = "channel",
) -> Figure:
    """A figure of a layer's channels, each titled with its index, the layer as suptitle.

    Arguments are those of :func:`channel_grid`; ``channels`` defaults to 16 because every
    channel is its own matplotlib axes, and thousands of them take long to draw.
    """
    from matplotlib.figure import Figure

    indices, maps = select_channels(activations, channels, order, normalize)
    columns = _columns(len(indices), ncols)
    rows = math.ceil(len(indices) / columns)
    figure = Figure(figsize=(1.5 * columns, 1.5 * rows + 0.5), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    cmap = matplotlib_colormap("gray" if colormap is None else colormap)
    for ax, index, channel in zip(axes, indices, maps, strict=False):
        ax.imshow(channel.numpy(), cmap=cmap, vmin=0, vmax=1)
        ax.set_title(str(index), fontsize=8)
    for ax in axes:
        ax.set_axis_off()
    figure.suptitle(layer_name)
    return figure


def panel(
    image: Image.Image,
    heatmap: Heatmap,
    *,
    title: str = "",
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
) -> Figure:
    """Image, heatmap and overlay side by side, all at the image's size, under ``title``:
    a matplotlib ``Figure``, for notebooks and PDF/SVG; :func:`panel_image` draws the same
    picture with Pillow, much faster.

    Args:
        image: The original image.
        heatmap: ``(H, W)`` values in ``[0, 1]``, of any size.
        title: The figure's title, e.g. ``"tabby, tabby cat - 0.62 (gradcam, layer bn2)"``.
        alpha: Weight of the heatmap in the overlay.
        colormap: A matplotlib colour map name or ``Colormap``.
    """
    from matplotlib.figure import Figure

    rgb = _as_rgb(image)
    values = _resized(_as_map(heatmap), rgb.size)
    blended = overlay(rgb, values, alpha, colormap)
    width, height = rgb.size
    figure = Figure(figsize=(12, 4 * height / width + 0.6), layout="constrained")
    axes = figure.subplots(1, 3)
    axes[0].imshow(rgb)
    axes[1].imshow(values.numpy(), cmap=matplotlib_colormap(colormap), vmin=0, vmax=1)
    axes[2].imshow(blended)
    for ax, name in zip(axes, ("image", "heatmap", "overlay"), strict=True):
        ax.set_title(name, fontsize=9)
        ax.set_axis_off()
    figure.suptitle(title)
    return figure


def show(
    obj: Image.Image | Figure | torch.Tensor,
    heatmap: Heatmap | None = None,
    *,
    title: str = "",
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
    dpi: int = 100,
) -> Image.Image:
    """Something to display in a notebook: end a cell with ``camviz.render.show(...)``.

    Returns a Pillow image, which Jupyter always draws inline. A bare ``Figure`` is only
    drawn inline once pyplot's inline backend is active, so figures are rasterised here.

    Args:
        obj: An image (with ``heatmap``: shown as a :func:`panel`), a ``Figure``, or a
            ``(3, H, W)`` / ``(H, W)`` tensor in ``[0, 1]`` such as a :func:`channel_grid`.
        heatmap: With an image, the heatmap to show beside and over it.
        title, alpha, colormap: For the panel, as in :func:`panel`.
        dpi: Resolution at which figures are rasterised.
    """
    if isinstance(obj, Image.Image):
        if heatmap is None:
            return obj
        obj = panel(obj, heatmap, title=title, alpha=alpha, colormap=colormap)
    buffer = io.BytesIO()
    if _is_figure(obj):
        obj.savefig(buffer, format="png", dpi=dpi)
    elif isinstance(obj, torch.Tensor):
        save_image(obj.detach().cpu(), buffer, format="png")
    else:
        raise CamvizError(f"show takes an image, a Figure or a tensor, not {type(obj).__name__}")
    buffer.seek(0)
    with Image.open(buffer) as shown:
        return shown.convert("RGB")


def save(obj: Image.Image | Figure | torch.Tensor, path: str | os.PathLike[str]) -> Path:
    """Write an image, a figure or an image tensor to ``path``, atomically.

    The format follows the file extension (``.png``, ``.jpg``, ``.webp``; figures also
    ``.pdf`` and ``.svg``). Missing folders are created.

    Args:
        obj: A Pillow image, a matplotlib ``Figure``, or a float tensor in ``[0, 1]``
            (``(3, H, W)``, ``(H, W)`` or a batch, written with
            ``torchvision.utils.save_image``, e.g. a :func:`channel_grid`).
        path: The file to write.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        CamvizError: An unknown extension for ``obj``, an unwritable folder, or a path that
            is a folder.
    """
    path = Path(path)
    if _is_figure(obj):
        supported = obj.canvas.get_supported_filetypes()
        figure_format = path.suffix.lower().lstrip(".")
        if figure_format not in supported:
            raise _unknown_format(path, ["." + name for name in supported])
        with atomic_write(path) as file:
            obj.savefig(file, format=figure_format)
    elif isinstance(obj, (Image.Image, torch.Tensor)):
        image_format = Image.registered_extensions().get(path.suffix.lower())
        if image_format is None or image_format not in Image.SAVE:
            raise _unknown_format(path, [".png", ".jpg", ".webp", ".bmp", ".tiff"])
        with atomic_write(path) as file:
            if isinstance(obj, Image.Image):
                obj.save(file, format=image_format)
            else:
                save_image(obj.detach().cpu(), file, format=image_format)
    else:
        raise CamvizError(
            f"save takes a PIL image, a matplotlib Figure or a tensor, not {type(obj).__name__}"
        )
    return path


def _unknown_format(path: Path, examples: Sequence[str]) -> CamvizError:
    return CamvizError(
        f"cannot tell the file format of {path} from its extension "
        f"{path.suffix or '(none)'!r}; use one of {', '.join(examples)}"
    )


def _as_map(heatmap: Heatmap, device: torch.device | str = "cpu") -> torch.Tensor:
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
    if low < -_TOLERANCE or high > 1 + _TOLERANCE:
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


def _as_rgb(image: Image.Image) -> Image.Image:
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


def _resized_pixels(pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``(H, W, 3)`` uint8 pixels resized (antialiased bilinear, as Pillow's) to Pillow's
    ``(width, height)``, on their device."""
    width, height = size
    if pixels.shape[:2] == (height, width):
        return pixels
    resized = resize(pixels.permute(2, 0, 1), [height, width], antialias=True)
    return resized.permute(1, 2, 0)


def _picture(pixels: torch.Tensor) -> Image.Image:
    """``(H, W, 3)`` uint8 pixels from any device as a Pillow image (one copy to the CPU)."""
    return Image.fromarray(pixels.cpu().numpy())


def _resized(values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of an ``(h, w)`` map to Pillow's ``(width, height)``."""
    width, height = size
    return upsample(values.unsqueeze(0), (height, width))[0].clamp(0, 1)


def blend(
    pixels: torch.Tensor, values: torch.Tensor, alpha: float, table: torch.Tensor
) -> torch.Tensor:
    """``(H, W, 3)`` uint8 pixels blended with the colours of ``(H, W)`` values in ``[0, 1]``,
    ``round((1 - alpha) * pixel + alpha * colour)``, on the tensors' device (a GPU too)."""
    colours = apply(values, table).float()
    blended = pixels.float().mul_(1 - alpha).add_(colours, alpha=alpha)
    return blended.round_().to(torch.uint8)


def _check_alpha(alpha: float) -> None:
    if not 0 <= alpha <= 1:
        raise CamvizError(f"alpha must lie in [0, 1], got {alpha}")


def _colour(values: torch.Tensor, colormap: str | Colormap) -> np.ndarray:
    """``(...)`` values in ``[0, 1]`` to ``(..., 3)`` uint8 colours."""
    return apply(values, lookup_table(colormap)).numpy()


def _is_figure(obj: Any) -> TypeGuard[Figure]:
    """Whether ``obj`` is a matplotlib ``Figure`` (without importing matplotlib for it)."""
    figure_module = sys.modules.get("matplotlib.figure")
    return figure_module is not None and isinstance(obj, figure_module.Figure)


def _columns(count: int, ncols: int | None) -> int:
    if ncols is None:
        return max(1, math.ceil(math.sqrt(count)))
    if ncols < 1:
        raise CamvizError(f"ncols must be at least 1, got {ncols}")
    return ncols


# Concepts (Deep Feature Factorization) ------------------------------------------------------


def concept_overlay(
    image: Image.Image, maps: torch.Tensor, alpha: float = 0.6, colormap: str = "tab10"
) -> Image.Image:
    """One colour per concept over an image: each pixel takes the colour of its strongest
    concept, as opaque as that concept is strong there.

    Args:
        image: The original image.
        maps: ``(k, h, w)`` non-negative concept maps of this image, such as
            ``camviz.factorize(...).maps[0]``; each is scaled by its own maximum.
        alpha: Opacity of the colours where a concept is at its strongest.
        colormap: A qualitative matplotlib colour map; concept ``j`` gets its colour ``j``.

    Returns:
        An RGB image of ``image.size``.
    """
    if not isinstance(maps, torch.Tensor) or maps.dim() != 3:
        raise CamvizError("concept maps must be one (k, h, w) tensor, e.g. concepts.maps[0]")
    if not 0 <= alpha <= 1:
        raise CamvizError(f"alpha must lie in [0, 1], got {alpha}")
    rgb = image if image.mode == "RGB" else to_rgb(image)
    width, height = rgb.size
    values = maps.detach().to("cpu", torch.float32).clamp_min(0)
    values = values / values.flatten(1).amax(1).clamp_min(1e-12).view(-1, 1, 1)
    strength, winner = upsample(values, (height, width)).clamp(0, 1).max(dim=0)
    colours = 255 * _concept_colours(colormap, len(values))[winner.numpy()]
    weight = alpha * strength.numpy()[..., None]
    pixels = np.asarray(rgb, dtype=np.float32)
    return Image.fromarray(np.rint((1 - weight) * pixels + weight * colours).astype(np.uint8))


def concept_figure(
    image: Image.Image,
    maps: torch.Tensor,
    labels: Sequence[str] | None = None,
    *,
    title: str = "",
    alpha: float = 0.6,
    colormap: str = "tab10",
) -> Figure:
    """The image beside its :func:`concept_overlay`, with a legend of the concepts' colours.

    Args:
        image: The original image.
        maps: ``(k, h, w)`` concept maps of this image.
        labels: One label per concept (e.g. its top classes); ``None``: ``concept 1..k``.
        title: The figure's title.
        alpha, colormap: As in :func:`concept_overlay`.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    shown = concept_overlay(image, maps, alpha, colormap)
    names = list(labels) if labels is not None else [f"concept {j + 1}" for j in range(len(maps))]
    if len(names) != len(maps):
        raise CamvizError(f"got {len(names)} labels for {len(maps)} concepts")
    width, height = shown.size
    figure = Figure(figsize=(8, 4 * height / width + 1.2), layout="constrained")
    axes = figure.subplots(1, 2)
    axes[0].imshow(image)
    axes[1].imshow(shown)
    for ax in axes:
        ax.set_axis_off()
    colours = _concept_colours(colormap, len(names))
    handles = [Patch(color=tuple(c), label=n) for c, n in zip(colours, names, strict=True)]
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(names), 2))
    figure.suptitle(title)
    return figure


def _concept_colours(colormap: str, count: int) -> np.ndarray:
    """``(count, 3)`` RGB colours in ``[0, 1]``: entry ``j`` of a qualitative colour map."""
    cmap = matplotlib_colormap(colormap)
    return np.array([cmap(j % cmap.N)[:3] for j in range(count)], dtype=np.float32)


# Maps of every shape: signed maps, signals, volumes and clips -----------------------------
#
# These draw maps of any spatial rank, signed or not (``explain(..., relu=False)``), with
# matplotlib figures and a colour bar. A signed map gets a diverging colour map centred on
# zero (``vmin = -vmax``); a map in ``[0, 1]`` gets the given colour map on ``[0, 1]``.

SIGNED_COLORMAP = "RdBu_r"


def map_figure(
    sample: torch.Tensor, heatmap: Heatmap, *, title: str = "", **options: object
) -> Figure:
    """The picture that fits the sample's shape: :func:`signal_figure` for ``(C, L)``,
    :func:`signed_figure` for ``(C, H, W)`` and :func:`volume_montage` for ``(C, D, H, W)``.

    Args:
        sample: One input sample, channels first, as given to :func:`camviz.explain`.
        heatmap: Its map, ``(L,)``, ``(H, W)`` or ``(D, H, W)`` (one row of ``heatmaps``).
        title: The figure's title.
        **options: Passed to the function chosen.
    """
    if not isinstance(sample, torch.Tensor) or sample.dim() not in (2, 3, 4):
        shape = tuple(sample.shape) if isinstance(sample, torch.Tensor) else type(sample).__name__
        raise CamvizError(
            f"map_figure takes one sample (C, L), (C, H, W) or (C, D, H, W), got {shape}; "
            "pass inputs[n], not the batch"
        )
    draw = {2: signal_figure, 3: signed_figure, 4: volume_montage}[sample.dim()]
    return draw(sample, heatmap, title=title, **options)  # type: ignore[operator]


def signed_figure(
    image: Image.Image | torch.Tensor | None,
    heatmap: Heatmap,
    *,
    title: str = "",
    alpha: float = 0.5,
    colormap: str | Colormap | None = None,
) -> Figure:
    """A 2-D map, signed or not, over an image (a PIL image or a ``(C, H, W)`` tensor shown in
    grey) or alone, with a colour bar."""
    from matplotlib.figure import Figure

    values = _map_values(heatmap, 2)
    cmap, low, high = _scale(values, colormap)
    figure = Figure(figsize=(5, 4), layout="constrained")
    ax = figure.subplots()
    if image is not None:
        ax.imshow(_grey(image, values.shape), cmap="gray", extent=_extent(values))
    shown = ax.imshow(
        values,
        cmap=cmap,
        vmin=low,
        vmax=high,
        alpha=alpha if image is not None else 1.0,
        extent=_extent(values),
    )
    ax.set_axis_off()
    figure.colorbar(shown, ax=ax, shrink=0.8)
    figure.suptitle(title)
    return figure


def signal_figure(
    signal: torch.Tensor,
    heatmap: Heatmap,
    *,
    per_channel: bool = False,
    title: str = "",
    colormap: str | Colormap | None = None,
    channel_names: Sequence[str] | None = None,
) -> Figure:
    """A signal with its map as a colour band under it.

    Args:
        signal: ``(C, L)`` or ``(L,)`` values.
        heatmap: ``(L,)`` map (at the signal's length; resized if not).
        per_channel: One row (signal and band) per channel; else every channel in one plot
            over one band.
        title: The figure's title.
        colormap: Default: diverging for a signed map, ``"jet"`` for one in ``[0, 1]``.
        channel_names: Legend names of the channels.
    """
    from matplotlib.figure import Figure

    values = _as_numpy(signal, "signal")
    values = values[None] if values.ndim == 1 else values
    if values.ndim != 2:
        raise CamvizError(f"a signal must be (C, L) or (L,), got shape {values.shape}")
    band = _map_values(heatmap, 1, (values.shape[1],))
    cmap, low, high = _scale(band, colormap)
    rows = values.shape[0] if per_channel else 1
    figure = Figure(figsize=(8, 1.6 * rows + 0.8), layout="constrained")
    axes = figure.subplots(2 * rows, 1, sharex=True, height_ratios=[4, 1] * rows, squeeze=False)[
        :, 0
    ]
    names = (
        list(channel_names)
        if channel_names is not None
        else [f"channel {c}" for c in range(values.shape[0])]
    )
    steps = np.arange(values.shape[1])
    for row in range(rows):
        line_axis, band_axis = axes[2 * row], axes[2 * row + 1]
        for channel in [row] if per_channel else range(values.shape[0]):
            line_axis.plot(steps, values[channel], linewidth=1, label=names[channel])
        if values.shape[0] > 1 and (per_channel or row == 0):
            line_axis.legend(loc="upper right", fontsize=7)
        shown = band_axis.imshow(
            band[None],
            aspect="auto",
            cmap=cmap,
            vmin=low,
            vmax=high,
            extent=(-0.5, values.shape[1] - 0.5, 0, 1),
        )
        band_axis.set_yticks([])
    figure.colorbar(shown, ax=list(axes), shrink=0.6, label="map")
    figure.suptitle(title)
    return figure


def volume_montage(
    volume: torch.Tensor,
    heatmap: Heatmap,
    *,
    title: str = "",
    alpha: float = 0.5,
    colormap: str | Colormap | None = None,
    max_slices: int = 16,
    ncols: int | None = None,
) -> Figure:
    """Slices of a volume (or frames of a clip) with the map over each; the slice where the
    map peaks is framed in red and titled ``peak``.

    Args:
        volume: ``(C, D, H, W)`` or ``(D, H, W)`` values, shown in grey (channel mean).
        heatmap: ``(D, H, W)`` map (resized to the volume if not).
        title: The figure's title.
        alpha: Weight of the map over each slice.
        colormap: Default: diverging for a signed map, ``"jet"`` for one in ``[0, 1]``.
        max_slices: At most this many slices, evenly spaced, the peak always among them.
        ncols: Columns of the montage (default: about square).
    """
    from matplotlib.figure import Figure

    values = _as_numpy(volume, "volume")
    values = values.mean(0) if values.ndim == 4 else values
    if values.ndim != 3:
        raise CamvizError(f"a volume must be (C, D, H, W) or (D, H, W), got shape {values.shape}")
    maps = _map_values(heatmap, 3, values.shape)
    cmap, low, high = _scale(maps, colormap)
    depth = values.shape[0]
    strength = np.abs(maps).reshape(depth, -1).max(1)
    peak = int(strength.argmax())
    chosen = sorted(
        {*np.linspace(0, depth - 1, min(depth, max_slices)).round().astype(int).tolist()} | {peak}
    )
    if len(chosen) > max_slices:
        chosen.remove(min((c for c in chosen if c != peak), key=lambda c: abs(c - peak)))
    columns = _columns(len(chosen), ncols)
    rows = math.ceil(len(chosen) / columns)
    figure = Figure(figsize=(2.2 * columns + 0.8, 2.2 * rows + 0.5), layout="constrained")
    axes = np.atleast_1d(figure.subplots(rows, columns, squeeze=False)).ravel()
    grey = (values - values.min()) / max(float(values.max() - values.min()), 1e-12)
    for ax, index in zip(axes, chosen, strict=False):
        ax.imshow(grey[index], cmap="gray", vmin=0, vmax=1)
        shown = ax.imshow(maps[index], cmap=cmap, vmin=low, vmax=high, alpha=alpha)
        ax.set_title(f"slice {index}" + (" (peak)" if index == peak else ""), fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
        if index == peak:
            for spine in ax.spines.values():
                spine.set_edgecolor("red")
                spine.set_linewidth(3)
    for ax in axes[len(chosen) :]:
        ax.set_axis_off()
    figure.colorbar(shown, ax=list(axes), shrink=0.6, label="map")
    figure.suptitle(title)
    return figure


def clip_video(
    clip: torch.Tensor,
    heatmap: Heatmap,
    path: str | os.PathLike[str],
    *,
    fps: float = 8.0,
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
) -> Path:
    """Write a video clip with its map over every frame (the video writer of
    :func:`camviz.io.video.write_video`), atomically.

    Args:
        clip: ``(C, T, H, W)`` frames with values in ``[0, 1]`` (C = 3 or 1), as a video
            model takes them before normalisation.
        heatmap: ``(T, H, W)`` map in ``[0, 1]`` (``explanation.heatmaps[n]``).
        path: The video file (``.mp4``, ``.avi``).
        fps: Frames per second.
        alpha, colormap: As in :func:`overlay`.
    """
    import tempfile

    from camviz.io.video import write_video

    frames = _as_numpy(clip, "clip")
    if frames.ndim != 4 or frames.shape[0] not in (1, 3):
        raise CamvizError(f"a clip must be (C, T, H, W) with C = 1 or 3, got shape {frames.shape}")
    maps = _map_values(heatmap, 3, frames.shape[1:])
    pixels = np.rint(np.clip(frames, 0, 1) * 255).astype(np.uint8)
    with tempfile.TemporaryDirectory(prefix="camviz-clip-") as folder:
        files = []
        for index in range(frames.shape[1]):
            frame = Image.fromarray(
                np.repeat(pixels[:, index], 3 // pixels.shape[0], 0).transpose(1, 2, 0)
            )
            file = Path(folder) / f"{index:05d}.png"
            overlay(frame, maps[index], alpha, colormap).save(file)
            files.append(file)
        write_video(files, path, fps)
    return Path(path)


def _as_numpy(values: object, what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float32).numpy()
    if isinstance(values, np.ndarray):
        return values.astype(np.float32)
    raise CamvizError(
        f"the {what} must be a torch tensor or numpy array, not {type(values).__name__}"
    )


def _map_values(heatmap: Heatmap, rank: int, size: Sequence[int] | None = None) -> np.ndarray:
    """A finite map of ``rank`` axes as a numpy array, resized to ``size`` if given."""
    values = torch.as_tensor(_as_numpy(heatmap, "heatmap"))
    while values.dim() > rank and values.shape[0] == 1:
        values = values[0]
    if values.dim() != rank:
        raise CamvizError(
            f"expected one map with {rank} axes, got shape {tuple(values.shape)}; pass one "
            "map, e.g. explanation.heatmaps[0]"
        )
    if not bool(torch.isfinite(values).all()):
        raise CamvizError("the heatmap holds NaN or infinite values; check the model's output")
    if size is not None and tuple(values.shape) != tuple(size):
        values = upsample(values.unsqueeze(0), tuple(size))[0]
    return values.numpy()


def _scale(values: np.ndarray, colormap: str | Colormap | None) -> tuple[Colormap, float, float]:
    """The colour map and its range: centred on zero for a signed map, else ``[0, 1]`` (or
    ``[0, max]`` for a raw map above 1)."""
    peak = max(float(np.abs(values).max()), 1e-12)
    if values.min() < -_TOLERANCE:
        return matplotlib_colormap(colormap or SIGNED_COLORMAP), -peak, peak
    return matplotlib_colormap(colormap or "jet"), 0.0, peak if peak > 1 + _TOLERANCE else 1.0


def _grey(image: Image.Image | torch.Tensor, shape: tuple[int, ...]) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("L"), dtype=np.float32) / 255
    values = _as_numpy(image, "image")
    values = values.mean(0) if values.ndim == 3 else values
    return (values - values.min()) / max(float(values.max() - values.min()), 1e-12)


def _extent(values: np.ndarray) -> tuple[float, float, float, float]:
    """One shared pixel frame for an image and a map of another size."""
    return (0.0, float(values.shape[1]), float(values.shape[0]), 0.0)


# Detections: boxes and labels drawn with Pillow ---------------------------------------------

#: The colour of drawn boxes and of their labels' backgrounds: white, framed in black, so it
#: stands out on a photo and on every colour of the heatmap.
BOX_COLOUR = (255, 255, 255)

# Width of a box's white line and of the black frame on each side of it (pixels).
_BOX_WIDTH = 2
_BOX_FRAME = 1

# Tiles per row of a detection panel.
_DETECTION_COLUMNS = 4


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
    rgb = _as_rgb(image)
    scale = width / rgb.width
    size = (width, max(1, round(rgb.height * scale)))
    pixels = _resized_pixels(_pixels(rgb, None), size)
    table = lookup_table(colormap)
    scaled = [[value * scale for value in box] for box in boxes]
    everything = _picture(pixels)
    for box in scaled:
        draw_box(everything, box)
    tiles = [("all objects", everything)]
    for heatmap, box, label in zip(heatmaps, scaled, labels, strict=True):
        values = _resized(clipped(_as_map(heatmap), clip), size)
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
    draw = ImageDraw.Draw(canvas)
    if title:
        font = ImageFont.load_default(_TITLE_SIZE)
        draw.text((canvas.width / 2, _PANEL_GAP), title, fill="black", font=font, anchor="ma")
    font = ImageFont.load_default(_CAPTION_SIZE)
    for number, (caption, tile) in enumerate(tiles):
        left = _PANEL_GAP + (number % columns) * cell[0]
        row_top = top + (number // columns) * cell[1]
        draw.text((left + size[0] / 2, row_top), caption, fill="black", font=font, anchor="ma")
        canvas.paste(tile, (left, row_top + _CAPTION_SIZE + _PANEL_GAP // 2))
    return canvas
