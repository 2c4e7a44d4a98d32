"""Turn heatmaps and activations into pictures: colour maps, overlays, channel grids, figures.

The public face of three modules, importable as ``camviz.render``:

* :mod:`camviz.io.pictures`, drawn with torch and Pillow, without matplotlib: the batch path
  of ``camviz explain`` (:func:`overlay`, :func:`panel_image`, :func:`detection_panel`,
  :func:`draw_box`), colours (:func:`colorize`, :func:`heatmap_image`) and channel grids
  as tensors (:func:`select_channels`, :func:`channel_grid`);
* :mod:`camviz.io.figures`, matplotlib figures for notebooks and PDF/SVG (:func:`panel`,
  :func:`channel_figure`, concepts, the maps of signals, volumes and signed maps, and
  :func:`token_figure`, a generated answer's maps token by token);
  matplotlib is imported when a figure is first drawn, not when this module is imported;
* :mod:`camviz.io.output`, files and display (:func:`save`, :func:`show`, and
  :func:`clip_video`, which hands its frames to the video writer).

Heatmaps are ``(H, W)`` torch tensors or numpy arrays with values in ``[0, 1]``, such as one
row of :attr:`camviz.Explanation.heatmaps`, from any device. Every file is written through
:func:`camviz.io.atomic.atomic_write`, so a crash or an error halfway never leaves a partial
file behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from camviz._deprecation import moved_names
from camviz.io.figures import (
    channel_figure,
    concept_figure,
    concept_overlay,
    map_figure,
    panel,
    signal_figure,
    signed_figure,
    token_figure,
    volume_montage,
)
from camviz.io.output import clip_video, save, show
from camviz.io.pictures import (
    BOX_COLOUR,
    SALIENCY_PERCENTILE,
    Heatmap,
    Order,
    Scaling,
    channel_grid,
    colorize,
    detection_panel,
    draw_box,
    heatmap_image,
    overlay,
    panel_image,
    select_channels,
)

__all__ = [
    "BOX_COLOUR",
    "SALIENCY_PERCENTILE",
    "Heatmap",
    "Order",
    "Scaling",
    "channel_figure",
    "channel_grid",
    "clip_video",
    "colorize",
    "concept_figure",
    "concept_overlay",
    "detection_panel",
    "draw_box",
    "heatmap_image",
    "map_figure",
    "overlay",
    "panel",
    "panel_image",
    "save",
    "select_channels",
    "show",
    "signal_figure",
    "signed_figure",
    "token_figure",
    "volume_montage",
]

if not TYPE_CHECKING:  # type checkers see no old name, so camviz's own code uses none
    __getattr__ = moved_names(
        __name__,
        {
            "PANEL_TILE_WIDTH": "camviz.io.pictures:PANEL_TILE_WIDTH",
            "SIGNED_COLORMAP": "camviz.io.figures:SIGNED_COLORMAP",
            "blend": "camviz.io.blending:blend",
            "check_render_options": "camviz.io.pictures:check_render_options",
            "clipped": "camviz.io.pictures:clipped",
        },
    )
