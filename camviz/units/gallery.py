"""Pictures of what units see: each unit's top images cropped to its receptive field, with
the unit's Grad-CAM map beside each crop.

The maps cost one explanation per kept image, whatever the number of units it is kept for:
an image among the top images of several channels of one layer is explained once, for a
:class:`~camviz.Unit` of those channels (one map per channel from one forward pass), at the
default layer of a unit: the last one before the unit's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw, ImageFont
from torch import nn

from camviz.cams.engine import explain
from camviz.core.targets.unit import Unit
from camviz.io.pictures import overlay
from camviz.units.fields import ReceptiveField
from camviz.units.heaps import Example
from camviz.units.scan import UnitExamples

__all__ = ["ExampleMaps", "example_grid", "example_maps"]

# Pixels: a tile's side, the gap between tiles, the caption's and the title's text.
TILE = 112
_GAP = 6
_CAPTION = 12
_TITLE = 14


@dataclass(frozen=True)
class ExampleMaps:
    """The crops of one unit's top images and the unit's map on each.

    Attributes:
        crops: Each image cropped to the field of the unit's best location in it.
        overlays: The same crops with the unit's Grad-CAM map laid on them.
        values: The unit's value on each image.
    """

    crops: list[Image.Image]
    overlays: list[Image.Image]
    values: list[float]


def example_maps(
    model: nn.Module,
    tops: Sequence[UnitExamples],
    field: ReceptiveField,
    read: Callable[[Example], Image.Image],
    preprocess: Callable[[Image.Image], torch.Tensor],
    *,
    method: str = "gradcam",
) -> list[ExampleMaps]:
    """Crops and maps of each unit's top images (one explanation per distinct image).

    Args:
        model: The network the units belong to.
        tops: Single-rank units of one layer and their examples (from a scan).
        field: The layer's receptive field for the scanned input size (the crops follow it;
            an input of another size is cropped in proportion).
        read: The photo of an example (its file, or the dataset's item).
        preprocess: The scan's preprocessing, which gave the grid locations.
        method: The CAM method of the maps.
    """
    wanted: dict[object, list[tuple[int, int]]] = {}  # image -> (unit, rank among its tops)
    for unit_number, top in enumerate(tops):
        for rank, example in enumerate(top.examples):
            wanted.setdefault(example.path or example.index, []).append((unit_number, rank))
    crops = {}
    device = next(model.parameters(), torch.empty(0)).device
    for places in wanted.values():
        first = tops[places[0][0]].examples[places[0][1]]
        photo = read(first)
        inputs = preprocess(photo).unsqueeze(0).to(device)
        heatmaps = _unit_maps(model, inputs, [tops[unit].unit for unit, _ in places], method)
        for (unit, rank), heatmap in zip(places, heatmaps, strict=True):
            example = tops[unit].examples[rank]
            box = _photo_box(field, example.location, inputs.shape[2:], photo.size)
            crops[unit, rank] = (photo.crop(box), overlay(photo, heatmap.cpu()).crop(box))
    return [
        ExampleMaps(
            [crops[unit, rank][0] for rank in range(len(top.examples))],
            [crops[unit, rank][1] for rank in range(len(top.examples))],
            [example.value for example in top.examples],
        )
        for unit, top in enumerate(tops)
    ]


def _unit_maps(
    model: nn.Module, inputs: torch.Tensor, units: Sequence[Unit], method: str
) -> list[torch.Tensor]:
    """Each unit's map on one image, at the default layer (the last one before the unit's):
    channels of one layer from one explanation (one map per channel), other units one by
    one."""
    layers = {unit.layer for unit in units}
    if len(layers) == 1 and all(unit.channel is not None for unit in units):
        joined = Unit(units[0].layer, channel=[unit.channels[0] for unit in units])
        return list(explain(model, inputs, method=method, target=joined).heatmaps)
    return [explain(model, inputs, method=method, target=unit).heatmaps[0] for unit in units]


def _photo_box(
    field: ReceptiveField,
    location: Sequence[int],
    input_size: Sequence[int],
    photo_size: tuple[int, int],
) -> tuple[int, int, int, int]:
    """``(left, top, right, bottom)`` on the photo of the field of grid ``location`` of a
    preprocessed input of ``input_size`` (the photo resized)."""
    (top, bottom), (left, right) = field.box(location, input_size)
    scale_y, scale_x = photo_size[1] / input_size[0], photo_size[0] / input_size[1]
    return (
        math.floor(left * scale_x),
        math.floor(top * scale_y),
        max(math.ceil(right * scale_x), math.floor(left * scale_x) + 1),
        max(math.ceil(bottom * scale_y), math.floor(top * scale_y) + 1),
    )


def example_grid(maps: ExampleMaps, title: str, *, tile: int = TILE) -> Image.Image:
    """One unit's crops (top row) and their maps (bottom row), best first, each captioned
    with its value, under ``title``."""
    count = max(len(maps.crops), 1)
    width = _GAP + count * (tile + _GAP)
    height = _GAP + _TITLE + _GAP + _CAPTION + 2 * (tile + _GAP)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((_GAP, _GAP), title, fill="black", font=ImageFont.load_default(_TITLE))
    caption_font = ImageFont.load_default(_CAPTION)
    top = _GAP + _TITLE + _GAP
    for number, (crop, mapped, value) in enumerate(
        zip(maps.crops, maps.overlays, maps.values, strict=True)
    ):
        left = _GAP + number * (tile + _GAP)
        draw.text((left, top), f"{value:.3g}", fill="black", font=caption_font)
        canvas.paste(crop.resize((tile, tile)), (left, top + _CAPTION))
        canvas.paste(mapped.resize((tile, tile)), (left, top + _CAPTION + tile + _GAP))
    return canvas
