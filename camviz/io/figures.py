"""Figures for notebooks and PDF/SVG, drawn with matplotlib, imported on first use.

Figures (:func:`panel`, :func:`channel_figure`, the concept pictures, the figures of maps
of every shape and :func:`token_figure`'s strip of a generated answer) are built with
:class:`matplotlib.figure.Figure` directly, never through ``pyplot`` (whose global registry
leaks figures in a loop and wants a GUI backend). matplotlib is imported inside each
function, so importing this module (and :mod:`camviz.render`, which re-exports it) costs
nothing until a figure is drawn. The pictures without matplotlib are in
:mod:`camviz.io.pictures`.

Maps of every shape (signals, images, volumes, clips; ``explain(..., relu=False)``) are
drawn signed or not, with a colour bar: a signed map gets a diverging colour map centred on
zero (``vmin = -vmax``), a map in ``[0, 1]`` the given colour map on ``[0, 1]``. Their
checks of maps of any rank (:func:`map_values`) also serve :func:`camviz.render.clip_video`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from PIL import Image

from camviz.core.errors import CamvizError
from camviz.core.maps import upsample
from camviz.io.colormaps import matplotlib_colormap
from camviz.io.pictures import (
    MAP_TOLERANCE,
    Heatmap,
    Order,
    Scaling,
    as_map,
    as_rgb,
    grid_columns,
    overlay,
    resized_map,
    select_channels,
)

if TYPE_CHECKING:
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure

#: The default colour map of a signed map: diverging, centred on zero.
SIGNED_COLORMAP = "RdBu_r"


def channel_figure(
    activations: torch.Tensor,
    layer_name: str,
    *,
    channels: int | Sequence[int] | None = 16,
    order: Order = "first",
    ncols: int | None = None,
    colormap: str | Colormap | None = "viridis",
    normalize: Scaling = "channel",
    weights: torch.Tensor | Sequence[float] | None = None,
    beside: Mapping[int, Image.Image | torch.Tensor] | None = None,
) -> Figure:
    """A figure of a layer's channels, each titled with its index, the layer as suptitle.

    Arguments are those of :func:`channel_grid`; ``channels`` defaults to 16 because every
    channel is its own matplotlib axes, and thousands of them take long to draw. ``beside``
    puts a picture next to each channel it names: its top examples
    (:func:`camviz.units.gallery.example_grid`) or its optimised image
    (:func:`camviz.visualize_unit`, ``(3, H, W)`` in ``[0, 1]``).
    """
    from matplotlib.figure import Figure

    indices, maps = select_channels(activations, channels, order, normalize, weights)
    pictures = dict(beside or {})
    per_channel = 2 if pictures else 1
    columns = grid_columns(len(indices), ncols)
    rows = math.ceil(len(indices) / columns)
    size = (1.5 * columns * per_channel, 1.5 * rows + 0.5)
    figure = Figure(figsize=size, layout="constrained")
    axes = figure.subplots(rows, columns * per_channel, squeeze=False).ravel()
    cmap = matplotlib_colormap("gray" if colormap is None else colormap)
    for number, (index, channel) in enumerate(zip(indices, maps, strict=True)):
        ax = axes[number * per_channel]
        ax.imshow(channel.numpy(), cmap=cmap, vmin=0, vmax=1)
        ax.set_title(str(index), fontsize=8)
        if index in pictures:
            axes[number * per_channel + 1].imshow(_picture_array(pictures[index]))
    for ax in axes:
        ax.set_axis_off()
    figure.suptitle(layer_name)
    return figure


def _picture_array(picture: Image.Image | torch.Tensor) -> np.ndarray:
    """An image or a ``(3, H, W)`` tensor in ``[0, 1]`` as an ``(H, W, 3)`` array."""
    if isinstance(picture, Image.Image):
        return np.asarray(picture.convert("RGB"))
    return picture.detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy()


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

    rgb = as_rgb(image)
    values = resized_map(as_map(heatmap), rgb.size)
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


class TokenMaps(Protocol):
    """What :func:`token_figure` draws: one map per token (:class:`camviz.Generation`)."""

    tokens: list[str]
    heatmaps: torch.Tensor


def token_figure(
    image: Image.Image,
    generation: TokenMaps,
    *,
    ncols: int | None = 8,
    alpha: float = 0.5,
    colormap: str | Colormap = "jet",
) -> Figure:
    """A strip of a generated answer: each token's text over its map's overlay on the image,
    in reading order.

    Args:
        image: The photo the answer was generated for.
        generation: The result of :func:`camviz.explain_generation`.
        ncols: Panels per row (``None``: about square).
        alpha, colormap: As in :func:`overlay`.
    """
    from matplotlib.figure import Figure

    rgb = as_rgb(image)
    maps = generation.heatmaps
    if len(generation.tokens) != len(maps) or len(maps) == 0:
        raise CamvizError(
            f"token_figure needs one map per token, got {len(generation.tokens)} tokens and "
            f"{len(maps)} maps"
        )
    columns = min(grid_columns(len(maps), ncols), len(maps))
    rows = math.ceil(len(maps) / columns)
    width, height = rgb.size
    figure = Figure(figsize=(2 * columns, 2 * rows * height / width + 0.4), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, token, heatmap in zip(axes, generation.tokens, maps, strict=False):
        ax.imshow(overlay(rgb, heatmap, alpha, colormap))
        ax.set_title(token.strip() or repr(token), fontsize=9)
    for ax in axes:
        ax.set_axis_off()
    return figure


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
    rgb = as_rgb(image)
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

    values = map_values(heatmap, 2)
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

    values = as_numpy(signal, "signal")
    values = values[None] if values.ndim == 1 else values
    if values.ndim != 2:
        raise CamvizError(f"a signal must be (C, L) or (L,), got shape {values.shape}")
    band = map_values(heatmap, 1, (values.shape[1],))
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

    values = as_numpy(volume, "volume")
    values = values.mean(0) if values.ndim == 4 else values
    if values.ndim != 3:
        raise CamvizError(f"a volume must be (C, D, H, W) or (D, H, W), got shape {values.shape}")
    maps = map_values(heatmap, 3, values.shape)
    cmap, low, high = _scale(maps, colormap)
    depth = values.shape[0]
    strength = np.abs(maps).reshape(depth, -1).max(1)
    peak = int(strength.argmax())
    chosen = sorted(
        {*np.linspace(0, depth - 1, min(depth, max_slices)).round().astype(int).tolist()} | {peak}
    )
    if len(chosen) > max_slices:
        chosen.remove(min((c for c in chosen if c != peak), key=lambda c: abs(c - peak)))
    columns = grid_columns(len(chosen), ncols)
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


def as_numpy(values: object, what: str) -> np.ndarray:
    """A tensor or numpy array as float32 numpy on the CPU; ``what`` names it in the error."""
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.float32).numpy()
    if isinstance(values, np.ndarray):
        return values.astype(np.float32)
    raise CamvizError(
        f"the {what} must be a torch tensor or numpy array, not {type(values).__name__}"
    )


def map_values(heatmap: Heatmap, rank: int, size: Sequence[int] | None = None) -> np.ndarray:
    """A finite map of ``rank`` axes as a numpy array, resized to ``size`` if given."""
    values = torch.as_tensor(as_numpy(heatmap, "heatmap"))
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
    if values.min() < -MAP_TOLERANCE:
        return matplotlib_colormap(colormap or SIGNED_COLORMAP), -peak, peak
    return matplotlib_colormap(colormap or "jet"), 0.0, peak if peak > 1 + MAP_TOLERANCE else 1.0


def _grey(image: Image.Image | torch.Tensor, shape: tuple[int, ...]) -> np.ndarray:
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("L"), dtype=np.float32) / 255
    values = as_numpy(image, "image")
    values = values.mean(0) if values.ndim == 3 else values
    return (values - values.min()) / max(float(values.max() - values.min()), 1e-12)


def _extent(values: np.ndarray) -> tuple[float, float, float, float]:
    """One shared pixel frame for an image and a map of another size."""
    return (0.0, float(values.shape[1]), float(values.shape[0]), 0.0)
