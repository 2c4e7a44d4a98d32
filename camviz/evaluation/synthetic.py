"""A localisation benchmark that needs no download: shapes of known class at known boxes.

Each image shows one *object* - a filled disc, square, triangle or cross, the four
:data:`CLASSES` - on a smooth, noisy background among *distractors*: rings and line
segments in the same colours, which belong to no class. The object's class is the label,
and its exact bounding box and pixel mask are known, so a heatmap's pointing-game accuracy
can be measured without annotating anything (:mod:`camviz.localization`). Colours, sizes
and places are random, so only the object's shape tells its class, and a classifier that
is right must have looked at it.

Everything is drawn with torch from one seeded generator: the same ``seed`` gives the same
images on any machine. :class:`SyntheticCNN` is the small network trained on it by
``benchmarks/train_synthetic.py``; its weights ship inside the package as ``synthetic_cnn.pt`` (see
:data:`SHIPPED_WEIGHTS`), and ``benchmarks/eval_localization.py`` scores every CAM method on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.errors import CamvizError

#: The object classes, in label order.
CLASSES = ("disc", "square", "triangle", "cross")

#: Where the trained weights are in a source checkout of camviz.
SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "synthetic_cnn.pt"

#: The layer whose maps the benchmark explains: the last 16 x 16 feature map.
TARGET_LAYER = "features"


@dataclass
class SyntheticSet:
    """Images with one object each, and where that object is.

    Attributes:
        images: ``(N, 3, size, size)`` float images in ``[0, 1]``.
        labels: ``(N,)`` class of each image's object (an index into :attr:`classes`).
        boxes: ``(N, 4)`` the object's tight box ``(x0, y0, x1, y1)``, half-open, in pixels.
        masks: ``(N, size, size)`` the object's pixels.
        classes: The class names.
    """

    images: torch.Tensor
    labels: torch.Tensor
    boxes: torch.Tensor
    masks: torch.Tensor
    classes: tuple[str, ...] = CLASSES

    def __len__(self) -> int:
        return len(self.labels)


def make_dataset(
    count: int, *, size: int = 64, distractors: int = 4, seed: int = 0
) -> SyntheticSet:
    """Draw ``count`` images, deterministically from ``seed``.

    Args:
        count: Number of images.
        size: Side of the square images, in pixels (at least 32).
        distractors: Rings and segments per image.
        seed: Seed of the one generator that draws everything.

    Returns:
        The :class:`SyntheticSet`; objects span 12 to 20 pixels at ``size=64`` (in
        proportion otherwise), about 5 % of the image.
    """
    if count < 1 or size < 32 or distractors < 0:
        raise CamvizError(
            f"need count >= 1, size >= 32 and distractors >= 0; got {count}, {size}, {distractors}"
        )
    generator = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=generator)

    scale = size / 64
    rows, cols = torch.meshgrid(
        torch.arange(size, dtype=torch.float32) + 0.5,
        torch.arange(size, dtype=torch.float32) + 0.5,
        indexing="ij",
    )
    rows, cols = rows.expand(count, -1, -1), cols.expand(count, -1, -1)

    coarse = uniform(0.25, 0.75, count, 3, 4, 4)
    images = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    images = images + 0.04 * torch.randn(images.shape, generator=generator)

    for index in range(distractors):
        colour = _vivid_colours(count, generator)
        if index % 2 == 0:
            radius = uniform(4, 9, count, 1, 1) * scale
            centre_row, centre_col = (uniform(0, size, count, 1, 1) for _ in range(2))
            distance = ((rows - centre_row) ** 2 + (cols - centre_col) ** 2).sqrt()
            drawn = (distance - radius).abs() <= 1.0 * scale
        else:
            start, end = uniform(0, size, count, 2, 1, 1), uniform(0, size, count, 2, 1, 1)
            drawn = _segment(rows, cols, start, end) <= 1.0 * scale
        images = torch.where(drawn.unsqueeze(1), colour, images)

    labels = torch.randint(len(CLASSES), (count,), generator=generator)
    radius = uniform(6, 10, count, 1, 1) * scale
    margin = radius + 1
    centre_row = margin + uniform(0, 1, count, 1, 1) * (size - 2 * margin)
    centre_col = margin + uniform(0, 1, count, 1, 1) * (size - 2 * margin)
    masks = _shapes(labels, rows - centre_row, cols - centre_col, radius)
    images = torch.where(masks.unsqueeze(1), _vivid_colours(count, generator), images)
    return SyntheticSet(
        images=images.clamp(0, 1),
        labels=labels,
        boxes=_tight_boxes(masks),
        masks=masks,
    )


class SyntheticCNN(nn.Module):
    """Four 3x3 convolutions with BatchNorm and ReLU, two max-pools, global average pooling.

    Takes ``(N, 3, H, W)`` images in ``[0, 1]`` (it normalises them itself); at 64 x 64 the
    last feature map, :data:`TARGET_LAYER`, is 16 x 16. About 33 000 parameters.
    """

    def __init__(self, num_classes: int = len(CLASSES)) -> None:
        super().__init__()

        def block(inputs: int, outputs: int) -> list[nn.Module]:
            return [
                nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
                nn.BatchNorm2d(outputs),
                nn.ReLU(inplace=True),
            ]

        self.features = nn.Sequential(
            *block(3, 8),
            nn.MaxPool2d(2),
            *block(8, 16),
            nn.MaxPool2d(2),
            *block(16, 32),
            *block(32, 32),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.features((images - 0.5) / 0.25)
        return self.classifier(self.pool(features).flatten(1))


def load_model(weights: str | Path | None = SHIPPED_WEIGHTS) -> SyntheticCNN:
    """A :class:`SyntheticCNN` in eval mode, with ``weights`` loaded (``None``: random).

    Raises:
        CamvizError: The weights file is missing or does not fit the network.
    """
    from camviz.io.models import read_state_dict

    model = SyntheticCNN()
    if weights is not None:
        try:
            model.load_state_dict(read_state_dict(weights))
        except RuntimeError as error:
            raise CamvizError(
                f"{weights} does not hold SyntheticCNN weights ({str(error).splitlines()[0]}); "
                "train them with benchmarks/train_synthetic.py"
            ) from None
    return model.eval()


def _vivid_colours(count: int, generator: torch.Generator) -> torch.Tensor:
    """``(count, 3, 1, 1)`` colours whose channels are each near 0 or near 1."""
    high = torch.rand(count, 3, 1, 1, generator=generator) < 0.5
    return torch.where(high, 0.85, 0.05) + 0.1 * torch.rand(count, 3, 1, 1, generator=generator)


def _segment(
    rows: torch.Tensor, cols: torch.Tensor, start: torch.Tensor, end: torch.Tensor
) -> torch.Tensor:
    """Distance of each pixel centre to the segment ``start -> end`` (``(N, 2, 1, 1)`` row, col)."""
    direction_row, direction_col = end[:, 0] - start[:, 0], end[:, 1] - start[:, 1]
    length_squared = (direction_row**2 + direction_col**2).clamp_min(1e-6)
    along = ((rows - start[:, 0]) * direction_row + (cols - start[:, 1]) * direction_col) / (
        length_squared
    )
    along = along.clamp(0, 1)
    nearest_row = start[:, 0] + along * direction_row
    nearest_col = start[:, 1] + along * direction_col
    return ((rows - nearest_row) ** 2 + (cols - nearest_col) ** 2).sqrt()


def _shapes(
    labels: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, radius: torch.Tensor
) -> torch.Tensor:
    """``(N, H, W)`` masks of each label's shape, at offsets ``dy``, ``dx`` from its centre."""
    disc = dx**2 + dy**2 <= radius**2
    side = 0.8 * radius
    square = (dx.abs() <= side) & (dy.abs() <= side)
    # Apex up, base 2 * radius wide at the bottom.
    triangle = (dy.abs() <= radius) & (dx.abs() <= (dy + radius) / 2)
    arm = radius / 3
    cross = ((dx.abs() <= radius) & (dy.abs() <= arm)) | ((dy.abs() <= radius) & (dx.abs() <= arm))
    every_shape = torch.stack([disc, square, triangle, cross], dim=1)
    return every_shape[torch.arange(len(labels)), labels]


def _tight_boxes(masks: torch.Tensor) -> torch.Tensor:
    """``(N, 4)`` half-open ``(x0, y0, x1, y1)`` boxes around each mask's pixels."""
    size = masks.shape[-1]
    positions = torch.arange(size)
    in_rows, in_cols = masks.any(dim=2), masks.any(dim=1)
    y0 = torch.where(in_rows, positions, size).amin(dim=1)
    y1 = torch.where(in_rows, positions, -1).amax(dim=1) + 1
    x0 = torch.where(in_cols, positions, size).amin(dim=1)
    x1 = torch.where(in_cols, positions, -1).amax(dim=1) + 1
    return torch.stack([x0, y0, x1, y1], dim=1)
