"""One photo and one map, drawn at any size: the per-pixel work of overlays and panels.

A :class:`Blend` holds a photo's ``(H, W, 3)`` uint8 pixels and an ``(h, w)`` map in
``[0, 1]`` on one device, and gives, for a picture size, the photo resized, the map resized
and coloured, and the two blended, ``round((1 - alpha) * pixel + alpha * colour)``. Each
is made once per size and kept: the folder job draws an overlay at the photo's size and a
panel whose tiles are 400 pixels wide, and for a photo 400 pixels wide the panel's overlay
tile *is* the overlay (``benchmarks/bench_throughput.py --writer`` times each step).

The map is resized with torch (:func:`camviz.core.maps.upsample`, the values every picture
and figure of camviz colours). On the CPU the colours and the blend are OpenCV's
``applyColorMap`` with the table as its look-up table and ``addWeighted`` (about ten times
torch's index and float arithmetic on a 400x300 picture, the same pixels); on a GPU they
are torch's, where the tensors are.
"""

from __future__ import annotations

import numpy as np
import torch
from torchvision.transforms.v2.functional import resize

from camviz.core.maps import upsample
from camviz.io.colormaps import apply

Size = tuple[int, int]  # Pillow's (width, height)

# OpenCV's look-up tables have 256 entries: longer tables are applied with torch.
_LUT_ENTRIES = 256


class Blend:
    """A photo and a map, and what they are drawn into at each size (module docstring).

    Args:
        pixels: The photo, ``(H, W, 3)`` uint8.
        values: The map, ``(h, w)`` float32 in ``[0, 1]``, on the photo's device.
        table: The colour map's ``(N, 3)`` uint8 table (:func:`~camviz.io.colormaps.lookup_table`).
        alpha: The weight of the colours in the blend, in ``[0, 1]``.
    """

    def __init__(
        self, pixels: torch.Tensor, values: torch.Tensor, table: torch.Tensor, alpha: float
    ) -> None:
        self.pixels = pixels
        self.values = values
        self.table = table
        self.alpha = alpha
        self._photos: dict[Size, torch.Tensor] = {}
        self._colours: dict[Size, torch.Tensor] = {}
        self._blended: dict[Size, torch.Tensor] = {}

    @property
    def size(self) -> Size:
        """The photo's own ``(width, height)``."""
        return self.pixels.shape[1], self.pixels.shape[0]

    def photo(self, size: Size) -> torch.Tensor:
        """The photo resized to ``size`` (antialiased bilinear, Pillow's pixels)."""
        if size not in self._photos:
            self._photos[size] = resized_pixels(self.pixels, size)
        return self._photos[size]

    def colours(self, size: Size) -> torch.Tensor:
        """The map resized to ``size`` (bilinear) and coloured, ``(height, width, 3)`` uint8."""
        if size not in self._colours:
            width, height = size
            resized = upsample(self.values.unsqueeze(0), (height, width))[0].clamp(0, 1)
            self._colours[size] = colour(resized, self.table)
        return self._colours[size]

    def blended(self, size: Size) -> torch.Tensor:
        """The photo and the colours at ``size`` blended, ``(height, width, 3)`` uint8."""
        if size not in self._blended:
            self._blended[size] = blend_colours(self.photo(size), self.colours(size), self.alpha)
        return self._blended[size]


def colour(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``(H, W)`` values in ``[0, 1]`` to ``(H, W, 3)`` uint8 colours: colour
    ``min(floor(value * N), N - 1)`` of the ``(N, 3)`` table (matplotlib's rule)."""
    count = table.shape[0]
    if values.device.type != "cpu" or count > _LUT_ENTRIES:
        return apply(values, table)
    import cv2

    index = np.minimum((values.numpy() * count).astype(np.int32), count - 1).astype(np.uint8)
    lut = np.zeros((_LUT_ENTRIES, 1, 3), np.uint8)  # rows past N are never indexed
    lut[:count, 0] = table.numpy()
    return torch.from_numpy(cv2.applyColorMap(index, lut))


def blend(
    pixels: torch.Tensor, values: torch.Tensor, alpha: float, table: torch.Tensor
) -> torch.Tensor:
    """``(H, W, 3)`` uint8 pixels blended with the colours of ``(H, W)`` values in ``[0, 1]``
    (see :func:`blend_colours`)."""
    return blend_colours(pixels, colour(values, table), alpha)


def blend_colours(pixels: torch.Tensor, colours: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(H, W, 3)`` uint8 pixels blended with ``(H, W, 3)`` uint8 colours,
    ``round((1 - alpha) * pixel + alpha * colour)`` (halves to even), on their device."""
    if pixels.device.type == "cpu":
        import cv2

        photo = np.ascontiguousarray(pixels.numpy())  # a resized tile is a permuted view
        blended = cv2.addWeighted(photo, 1 - alpha, colours.numpy(), alpha, 0.0)
        return torch.from_numpy(blended)
    mixed = pixels.float().mul_(1 - alpha).add_(colours.float(), alpha=alpha)
    return mixed.round_().to(torch.uint8)


def resized_pixels(pixels: torch.Tensor, size: Size) -> torch.Tensor:
    """``(H, W, 3)`` uint8 pixels resized (antialiased bilinear, as Pillow's) to Pillow's
    ``(width, height)``, on their device."""
    width, height = size
    if pixels.shape[:2] == (height, width):
        return pixels
    resized = resize(pixels.permute(2, 0, 1), [height, width], antialias=True)
    return resized.permute(1, 2, 0)
