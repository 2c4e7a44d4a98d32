"""Pictures out: files written whole or not at all, notebook display, overlay videos.

Every file is written through :func:`camviz.io.atomic.atomic_write` (videos through
:func:`camviz.io.atomic.atomic_path`, inside :func:`camviz.io.video.write_video`), so a
crash or an error halfway never leaves a partial file behind. A matplotlib ``Figure`` is
told by its class once matplotlib is loaded, so writing an image or a tensor never imports
it.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch
from PIL import Image
from torchvision.utils import save_image

from camviz.core.errors import CamvizError
from camviz.io.atomic import atomic_write
from camviz.io.figures import as_numpy, map_values, panel
from camviz.io.pictures import Heatmap, overlay
from camviz.io.video import write_video

if TYPE_CHECKING:
    from matplotlib.colors import Colormap
    from matplotlib.figure import Figure


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


def _is_figure(obj: Any) -> TypeGuard[Figure]:
    """Whether ``obj`` is a matplotlib ``Figure`` (without importing matplotlib for it)."""
    figure_module = sys.modules.get("matplotlib.figure")
    return figure_module is not None and isinstance(obj, figure_module.Figure)


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
        alpha, colormap: As in :func:`camviz.render.overlay`.
    """
    frames = as_numpy(clip, "clip")
    if frames.ndim != 4 or frames.shape[0] not in (1, 3):
        raise CamvizError(f"a clip must be (C, T, H, W) with C = 1 or 3, got shape {frames.shape}")
    maps = map_values(heatmap, 3, frames.shape[1:])
    pixels = np.rint(np.clip(frames, 0, 1) * 255).astype(np.uint8)
    # (T, H, W, 3) RGB frames: grey clips repeat their one channel.
    rgb = np.repeat(pixels, 3 // pixels.shape[0], 0).transpose(1, 2, 3, 0)
    # Drawn one at a time as the writer takes them.
    overlays = (
        overlay(Image.fromarray(frame), values, alpha, colormap)
        for frame, values in zip(rgb, maps, strict=True)
    )
    write_video(overlays, path, fps)
    return Path(path)
