"""The pictures of the page: the photo with its objects, overlays, panels and channels.

Every overlay is :func:`camviz.overlay` of an explanation's map on the photo the user gave,
at its own size, so the page shows what the Python API draws. Detected boxes are in the
model input's pixels; they are scaled onto the photo here (the one place that converts
between the two), and so are clicks on the photo.

The channel view tiles a layer's channels with :func:`camviz.channel_grid` (the grid of
``camviz features``), ordered by the explained class's channel weights
(``order="weight"`` with :attr:`camviz.Explanation.weights` of the method shown, or
Grad-CAM's for methods that do not weigh channels), strongest first; a click on a tile
maps back to its channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from PIL import Image

from camviz.cams.engine import Explanation, explain
from camviz.cams.registry import get
from camviz.core.errors import CamvizError
from camviz.core.grids import as_spatial, patch_size
from camviz.core.layerkinds import module_kind
from camviz.core.lineage import Lineage
from camviz.debug.extraction import features
from camviz.explorer.session import Session, Settings
from camviz.io.render import SALIENCY_PERCENTILE, channel_grid, draw_box, overlay, select_channels

__all__ = ["CHANNELS_SHOWN", "ChannelView", "channel_view", "photo", "to_input", "view_overlay"]

#: The most channels the channel view tiles (the strongest by weight).
CHANNELS_SHOWN = 64

# The method whose weights order the channels when the method shown has none.
_WEIGHING = "gradcam"

# Tiles per row of the channel grid, and the least side of a tile on screen, in pixels.
_GRID_COLUMNS = 8
_TILE_SIDE = 48


def _scale(session: Session) -> tuple[float, float]:
    """Photo pixels per input pixel, along x and y."""
    if session.image is None or session.inputs is None:
        raise CamvizError("no image yet; upload one or pick one from the list")
    height, width = session.inputs.shape[-2:]
    return session.image.width / width, session.image.height / height


def to_input(session: Session, x: float, y: float) -> tuple[float, float]:
    """A click on photo pixel ``(x, y)`` as a pixel of the model's input."""
    scale_x, scale_y = _scale(session)
    return x / scale_x, y / scale_y


def _on_photo(session: Session, box: Sequence[float]) -> tuple[float, ...]:
    scale_x, scale_y = _scale(session)
    return (box[0] * scale_x, box[1] * scale_y, box[2] * scale_x, box[3] * scale_y)


def photo(session: Session) -> Image.Image | None:
    """The photo, with every offered object's box for a detector (click one to explain it)."""
    if session.image is None:
        return None
    picture = session.image.copy()
    for candidate in session.candidates:
        if candidate.box is not None:
            draw_box(picture, _on_photo(session, candidate.box), candidate.label)
    return picture


def view_overlay(
    session: Session, explained: Explanation | None = None, settings: Settings | None = None
) -> Image.Image:
    """:func:`camviz.overlay` of a map on the photo, with the session's opacity and colour
    map (pixel-level maps clipped as camviz draws them), and the explained box if any."""
    if session.image is None:
        raise CamvizError("no image yet; upload one or pick one from the list")
    settings = settings or session.settings
    pixel_level = settings is not None and get(settings.method).pixel_level
    picture = overlay(
        session.image,
        session.heatmap(explained),
        session.alpha,
        session.colormap,
        clip=SALIENCY_PERCENTILE if pixel_level else None,
    )
    chosen = session.chosen
    if chosen is not None and chosen.box is not None:
        draw_box(picture, _on_photo(session, chosen.box), chosen.label)
    return picture


@dataclass
class ChannelView:
    """A layer's channels, tiled by weight.

    Attributes:
        layer: The layer.
        order: Channel indices, strongest weight first.
        weights: ``(C,)`` the weight of each channel.
        by: The method whose weights order them.
        grid: The tiled picture, the first :data:`CHANNELS_SHOWN` channels of ``order``.
        activations: ``(C, h, w)`` the layer's output.
        columns: Tiles per row of ``grid``; ``tile``: the ``(height, width)`` of a tile.
    """

    layer: str
    order: list[int]
    weights: torch.Tensor
    by: str
    grid: Image.Image
    activations: torch.Tensor
    columns: int
    tile: tuple[int, int]

    def channel_at(self, x: float, y: float) -> int:
        """The channel whose tile holds grid pixel ``(x, y)`` (tiles have a 1-pixel gap)."""
        col, row = int((x - 1) // (self.tile[1] + 1)), int((y - 1) // (self.tile[0] + 1))
        index = row * self.columns + col
        if not 0 <= col < self.columns or not 0 <= index < min(len(self.order), CHANNELS_SHOWN):
            raise CamvizError("that is not a channel's tile; click inside one")
        return self.order[index]

    def caption(self, channel: int) -> str:
        weight = float(self.weights[channel])
        return f"channel {channel} of {self.layer}, {self.by} weight {weight:.4g}"

    def channel_map(self, session: Session, channel: int) -> Image.Image:
        """Channel ``channel`` scaled to ``[0, 1]``, over the photo."""
        if session.image is None:
            raise CamvizError("no image yet; upload one or pick one from the list")
        _, maps = select_channels(self.activations, [channel])
        return overlay(session.image, maps[0], session.alpha, session.colormap)


def channel_view(session: Session) -> ChannelView:
    """The channel view of the current layer, for the current candidate."""
    settings, inputs, chosen = session.settings, session.inputs, session.chosen
    if settings is None or inputs is None or chosen is None or session.explained is None:
        raise CamvizError("nothing explained yet; pick a class, an object or a region")
    weights, by = _channel_weights(session, settings)
    activations = _activations(session, settings.layer)
    if len(weights) != len(activations):
        raise CamvizError(
            f"{settings.layer} has {len(activations)} channels but {len(weights)} weights; "
            "pick a layer whose output is one feature map"
        )
    order, _ = select_channels(activations, len(activations), order="weight", weights=weights)
    factor = max(1, -(-_TILE_SIDE // min(activations.shape[-2:])))  # ceiling division
    tiles = F.interpolate(activations[None], scale_factor=factor, mode="nearest")[0]
    columns = min(_GRID_COLUMNS, len(order), CHANNELS_SHOWN)
    grid = channel_grid(
        tiles,
        channels=CHANNELS_SHOWN,
        order="weight",
        weights=weights,
        ncols=columns,
        colormap="viridis",
    )
    picture = Image.fromarray(grid.mul(255).round().byte().permute(1, 2, 0).numpy())
    return ChannelView(
        layer=settings.layer,
        order=order,
        weights=weights,
        by=by,
        grid=picture,
        activations=activations,
        columns=columns,
        tile=(tiles.shape[-2], tiles.shape[-1]),
    )


def _channel_weights(session: Session, settings: Settings) -> tuple[torch.Tensor, str]:
    """The explained candidate's channel weights at the layer: the current method's, or
    Grad-CAM's when it does not weigh channels."""
    explained = session.explained
    if explained is not None and explained.weights and settings.layer in explained.weights:
        return explained.weights[settings.layer][0].float().cpu(), settings.method
    chosen = session.chosen
    assert chosen is not None and session.inputs is not None  # checked by the caller
    subject = session.subject
    with subject.using():
        with_gradcam = explain(
            subject.model,
            session.inputs,
            _WEIGHING,
            settings.layer,
            chosen.target,
            precision=subject.precision,
            channels_last=subject.channels_last,
        )
    if not with_gradcam.weights or settings.layer not in with_gradcam.weights:
        raise CamvizError(f"{settings.layer} has no channel weights; pick a convolutional layer")
    return with_gradcam.weights[settings.layer][0].float().cpu(), _WEIGHING


def _activations(session: Session, layer: str) -> torch.Tensor:
    """``(C, h, w)``: the layer's output on the current image (tokens laid on their grid)."""
    subject, inputs = session.subject, session.inputs
    model = subject.model
    assert inputs is not None  # checked by the caller
    with subject.using(), Lineage(inputs) as lineage:  # where patch tokens are
        output = features(
            model,
            inputs,
            [layer],
            device="cpu",
            precision=subject.precision,
            channels_last=subject.channels_last,
        )[layer]
    kind = module_kind(dict(model.named_modules())[layer], tuple(output.shape))
    tokens = lineage.token_grid(output)
    spatial = as_spatial(output, layer, inputs.shape[-2:], patch_size(model), kind, tokens)
    if spatial.dim() != 4:
        raise CamvizError(f"{layer}'s output is not an image-like map; pick another layer")
    return spatial[0].float()
