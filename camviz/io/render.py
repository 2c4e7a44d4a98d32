"""Turn heatmaps and activations into pictures: colour maps, overlays, channel grids, figures.

Heatmaps are ``(H, W)`` torch tensors or numpy arrays with values in ``[0, 1]``, such as
one row of :attr:`camviz.Explanation.heatmaps`. They may come from any device; drawing
happens on the CPU.

Overlays are drawn at the *original* image's size: the heatmap (computed at the model's
input size) is stretched back onto the photo, not the photo squeezed to the model's size.

Figures are built with :class:`matplotlib.figure.Figure` directly, never through
``pyplot`` (whose global registry leaks figures in a loop and wants a GUI backend).

Every file is written through :func:`camviz.io.atomic.atomic_write`, so a crash or an error
halfway never leaves a partial file behind.
"""

from __future__ import annotations

import difflib
import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypeAlias

import matplotlib
import numpy as np
import torch
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from PIL import Image
from torchvision.utils import make_grid, save_image

from camviz.core.errors import CamvizError
from camviz.core.maps import normalize as normalize_maps
from camviz.core.maps import upsample
from camviz.io.atomic import atomic_write
from camviz.io.images import to_rgb

Heatmap: TypeAlias = torch.Tensor | np.ndarray
Order = Literal["first", "strongest"]
Scaling = Literal["channel", "shared"]

# Values this far outside [0, 1] are float noise from resizing, not a wrong input.
_TOLERANCE = 1e-4


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
    heatmap: Heatmap, colormap: str | Colormap = "jet", size: tuple[int, int] | None = None
) -> Image.Image:
    """The coloured heatmap on its own, as an RGB image.

    Args:
        heatmap: ``(H, W)`` values in ``[0, 1]``.
        colormap: A matplotlib colour map name or ``Colormap``.
        size: ``(width, height)`` to resize the map to first (bilinear), in Pillow's order
            so that ``size=image.size`` matches an image; ``None`` keeps the map's size.
    """
    values = _as_map(heatmap)
    if size is not None:
        values = _resized(values, size)
    return Image.fromarray(_colour(values, colormap))


def overlay(
    image: Image.Image,
    heatmap: Heatmap,
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
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

    Returns:
        An RGB image of ``image.size``.
    """
    rgb = _as_rgb(image)
    return Image.fromarray(_blend(rgb, _resized(_as_map(heatmap), rgb.size), alpha, colormap))


def check_render_options(alpha: float, colormap: str | Colormap) -> None:
    """Refuse a bad ``alpha`` or colour map now, before any model work is spent.

    Raises:
        CamvizError: ``alpha`` is outside ``[0, 1]`` or the colour map is unknown.
    """
    _check_alpha(alpha)
    _colormap(colormap)


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
    indices, maps = select_channels(activations, channels, order, normalize)
    columns = _columns(len(indices), ncols)
    rows = math.ceil(len(indices) / columns)
    figure = Figure(figsize=(1.5 * columns, 1.5 * rows + 0.5), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    cmap = _colormap("gray" if colormap is None else colormap)
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
    """Image, heatmap and overlay side by side, all at the image's size, under ``title``.

    Args:
        image: The original image.
        heatmap: ``(H, W)`` values in ``[0, 1]``, of any size.
        title: The figure's title, e.g. ``"tabby, tabby cat - 0.62 (gradcam, layer bn2)"``.
        alpha: Weight of the heatmap in the overlay.
        colormap: A matplotlib colour map name or ``Colormap``.
    """
    rgb = _as_rgb(image)
    values = _resized(_as_map(heatmap), rgb.size)
    blended = _blend(rgb, values, alpha, colormap)
    width, height = rgb.size
    figure = Figure(figsize=(12, 4 * height / width + 0.6), layout="constrained")
    axes = figure.subplots(1, 3)
    axes[0].imshow(rgb)
    axes[1].imshow(values.numpy(), cmap=_colormap(colormap), vmin=0, vmax=1)
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
    if isinstance(obj, Figure):
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
    if isinstance(obj, Figure):
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


def _as_map(heatmap: Heatmap) -> torch.Tensor:
    """A heatmap as an ``(H, W)`` float32 CPU tensor in ``[0, 1]``."""
    if isinstance(heatmap, np.ndarray):
        values = torch.from_numpy(np.array(heatmap, dtype=np.float32))
    elif isinstance(heatmap, torch.Tensor):
        values = heatmap.detach().to("cpu", torch.float32)
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
            "map first (camviz.cams.engine.normalize)"
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


def _resized(values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of an ``(h, w)`` map to Pillow's ``(width, height)``."""
    width, height = size
    return upsample(values.unsqueeze(0), (height, width))[0].clamp(0, 1)


def _blend(
    rgb: Image.Image, values: torch.Tensor, alpha: float, colormap: str | Colormap
) -> np.ndarray:
    _check_alpha(alpha)
    colours = _colour(values, colormap).astype(np.float32)
    pixels = np.asarray(rgb, dtype=np.float32)
    return np.rint((1 - alpha) * pixels + alpha * colours).astype(np.uint8)


def _check_alpha(alpha: float) -> None:
    if not 0 <= alpha <= 1:
        raise CamvizError(f"alpha must lie in [0, 1], got {alpha}")


def _colour(values: torch.Tensor, colormap: str | Colormap) -> np.ndarray:
    """``(...)`` values in ``[0, 1]`` to ``(..., 3)`` uint8 colours."""
    return _colormap(colormap)(values.numpy(), bytes=True)[..., :3]


def _colormap(colormap: str | Colormap) -> Colormap:
    if isinstance(colormap, Colormap):
        return colormap
    try:
        return matplotlib.colormaps[colormap]
    except KeyError:
        close = difflib.get_close_matches(str(colormap), list(matplotlib.colormaps), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CamvizError(
            f"unknown colour map {colormap!r}; {hint}any matplotlib name works, e.g. jet, "
            "viridis, inferno, turbo, gray"
        ) from None


def _columns(count: int, ncols: int | None) -> int:
    if ncols is None:
        return max(1, math.ceil(math.sqrt(count)))
    if ncols < 1:
        raise CamvizError(f"ncols must be at least 1, got {ncols}")
    return ncols
