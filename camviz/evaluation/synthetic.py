"""A localisation benchmark that needs no download: shapes of known class at known boxes.

Each image shows one *object* - a filled disc, square, triangle or cross, the four
:data:`CLASSES` - on a smooth, noisy background among *distractors*: rings and line
segments in the same colours, which belong to no class. The object's class is the label,
and its exact bounding box and pixel mask are known, so a heatmap's pointing-game accuracy
can be measured without annotating anything (:mod:`camviz.localization`). Colours, sizes
and places are random, so only the object's shape tells its class, and a classifier that
is right must have looked at it.

:func:`make_scenes` draws *scenes* of the same shapes for detection and segmentation: up to
four objects per image, of different classes, each with its box and mask, and a per-pixel
class map.

Everything is drawn with torch from one seeded generator: the same ``seed`` gives the same
images on any machine. :class:`SyntheticCNN` is the small classifier trained on the one-object
images and :class:`SyntheticDetector` a small YOLO-style detector trained on the scenes, both
by ``benchmarks/train_synthetic.py``; their weights ship inside the package
(:data:`SHIPPED_WEIGHTS`, :data:`SHIPPED_DETECTOR`: :func:`load_model`,
:func:`load_detector`), and ``benchmarks/eval_localization.py`` scores every CAM method on the
classifier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.errors import CamvizError

__all__ = [
    "CLASSES",
    "SEGMENTATION_CLASSES",
    "SHIPPED_DETECTOR",
    "SHIPPED_WEIGHTS",
    "TARGET_LAYER",
    "SyntheticCNN",
    "SyntheticDetector",
    "SyntheticScenes",
    "SyntheticSet",
    "load_detector",
    "load_model",
    "make_dataset",
    "make_scenes",
]

#: The object classes, in label order.
CLASSES = ("disc", "square", "triangle", "cross")

#: The classes of :attr:`SyntheticScenes.class_map`: the background, then :data:`CLASSES`.
SEGMENTATION_CLASSES = ("background", *CLASSES)

#: Where the trained weights are in a source checkout of camviz.
SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "synthetic_cnn.pt"
SHIPPED_DETECTOR = SHIPPED_WEIGHTS.with_name("synthetic_detector.pt")

#: The layer whose maps the benchmark explains: the last feature map of either network
#: (16 x 16 in the classifier, 8 x 8 in the detector, at 64 x 64 pixels).
TARGET_LAYER = "features"

_Network = TypeVar("_Network", bound=nn.Module)


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
    images, rows, cols = _canvas(count, size, distractors, generator)
    labels = torch.randint(len(CLASSES), (count,), generator=generator)
    radius = _uniform(generator, 6, 10, count, 1, 1) * size / 64
    margin = radius + 1
    centre_row = margin + _uniform(generator, 0, 1, count, 1, 1) * (size - 2 * margin)
    centre_col = margin + _uniform(generator, 0, 1, count, 1, 1) * (size - 2 * margin)
    masks = _shapes(labels, rows - centre_row, cols - centre_col, radius)
    images = torch.where(masks.unsqueeze(1), _vivid_colours(count, generator), images)
    return SyntheticSet(
        images=images.clamp(0, 1),
        labels=labels,
        boxes=_tight_boxes(masks),
        masks=masks,
    )


@dataclass
class SyntheticScenes:
    """Images with several objects each, of different classes, and where each object is.

    Image ``n`` holds ``K_n`` objects; the per-object fields are lists of ``N`` tensors, one
    per image, in the same object order.

    Attributes:
        images: ``(N, 3, size, size)`` float images in ``[0, 1]``.
        labels: ``N`` tensors ``(K_n,)``: the class of each object (an index into
            :attr:`classes`), all different within an image.
        boxes: ``N`` tensors ``(K_n, 4)``: each object's tight box ``(x0, y0, x1, y1)``,
            half-open, in pixels.
        masks: ``N`` tensors ``(K_n, size, size)``: each object's pixels.
        class_map: ``(N, size, size)`` the class of every pixel for segmentation, an index
            into :data:`SEGMENTATION_CLASSES`: ``0`` background, ``c + 1`` an object of class
            ``c``.
        classes: The object class names.
    """

    images: torch.Tensor
    labels: list[torch.Tensor]
    boxes: list[torch.Tensor]
    masks: list[torch.Tensor]
    class_map: torch.Tensor
    classes: tuple[str, ...] = CLASSES

    def __len__(self) -> int:
        return len(self.images)


def make_scenes(
    count: int,
    *,
    size: int = 64,
    objects: tuple[int, int] = (2, 3),
    distractors: int = 4,
    seed: int = 0,
) -> SyntheticScenes:
    """Draw ``count`` scenes of several objects, deterministically from ``seed``.

    The shapes, colours, background and distractors are those of :func:`make_dataset`. Each
    object sits in its own quadrant of the image (a random one), so objects never touch, and
    the objects of one image are of different classes: Grad-CAM pools its channel weights
    over the whole map, so it tells classes apart but not two instances of one class.

    Args:
        count: Number of images.
        size: Side of the square images, in pixels (at least 32).
        objects: The fewest and most objects per image, at most 4 (one per class and per
            quadrant); each image draws its number uniformly in that range.
        distractors: Rings and segments per image.
        seed: Seed of the one generator that draws everything.

    Returns:
        The :class:`SyntheticScenes`; objects span 12 to 20 pixels at ``size=64`` (in
        proportion otherwise).
    """
    fewest, most = objects
    if count < 1 or size < 32 or distractors < 0 or not 1 <= fewest <= most <= len(CLASSES):
        raise CamvizError(
            f"need count >= 1, size >= 32, distractors >= 0 and 1 <= objects[0] <= objects[1] "
            f"<= {len(CLASSES)}; got {count}, {size}, {distractors}, {objects}"
        )
    generator = torch.Generator().manual_seed(seed)
    images, rows, cols = _canvas(count, size, distractors, generator)
    numbers = torch.randint(fewest, most + 1, (count,), generator=generator)
    # A random order of the classes and of the quadrants per image: object k takes entry k.
    classes = torch.rand(count, len(CLASSES), generator=generator).argsort(dim=1)
    quadrants = torch.rand(count, 4, generator=generator).argsort(dim=1)
    half = size / 2
    every_mask = []
    for k in range(most):
        radius = _uniform(generator, 6, 10, count, 1, 1) * size / 64
        margin = radius + 1
        top = (quadrants[:, k] // 2).view(-1, 1, 1) * half
        left = (quadrants[:, k] % 2).view(-1, 1, 1) * half
        centre_row = top + margin + _uniform(generator, 0, 1, count, 1, 1) * (half - 2 * margin)
        centre_col = left + margin + _uniform(generator, 0, 1, count, 1, 1) * (half - 2 * margin)
        masks = _shapes(classes[:, k], rows - centre_row, cols - centre_col, radius)
        masks &= (k < numbers).view(-1, 1, 1)
        images = torch.where(masks.unsqueeze(1), _vivid_colours(count, generator), images)
        every_mask.append(masks)
    masks = torch.stack(every_mask, dim=1)  # (N, most, size, size); absent objects empty
    class_map = (masks * (classes[:, :most] + 1).view(count, most, 1, 1)).amax(dim=1)
    kept = [int(number) for number in numbers]
    return SyntheticScenes(
        images=images.clamp(0, 1),
        labels=[classes[n, :k] for n, k in enumerate(kept)],
        boxes=[_tight_boxes(masks[n, :k]) for n, k in enumerate(kept)],
        masks=[masks[n, :k] for n, k in enumerate(kept)],
        class_map=class_map,
    )


class SyntheticCNN(nn.Module):
    """Four 3x3 convolutions with BatchNorm and ReLU, two max-pools, global average pooling.

    Takes ``(N, 3, H, W)`` images in ``[0, 1]`` (it normalises them itself); at 64 x 64 the
    last feature map, :data:`TARGET_LAYER`, is 16 x 16. About 33 000 parameters.
    """

    def __init__(self, num_classes: int = len(CLASSES)) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_conv_block(3, 8),
            nn.MaxPool2d(2),
            *_conv_block(8, 16),
            nn.MaxPool2d(2),
            *_conv_block(16, 32),
            *_conv_block(32, 32),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.features((images - 0.5) / 0.25)
        return self.classifier(self.pool(features).flatten(1))


class SyntheticDetector(nn.Module):
    """A one-stage dense detector in the style of YOLO and CenterNet, for :func:`make_scenes`.

    Four 3x3 convolutions with BatchNorm and ReLU and three max-pools make :data:`TARGET_LAYER`
    (``features``), an ``(N, 64, H/8, W/8)`` map of cells 8 pixels wide; a 1x1 convolution,
    ``head``, gives each cell ``4 + classes`` numbers, which :meth:`decode` turns into a box
    ``(cx, cy, w, h)`` in input pixels (centre = the cell's corner + a sigmoid offset, sides =
    8 * exp) and one sigmoid probability per class. The cell that holds an object's centre
    predicts it. ``forward`` returns these raw, pre-NMS predictions, ``(N, cells, 4 +
    classes)`` with cells in raster order, as a YOLO export does: read them with
    :class:`camviz.DenseDetections`. About 33 500 parameters; takes ``(N, 3, H, W)`` images in
    ``[0, 1]``, ``H`` and ``W`` multiples of 8.
    """

    stride = 8

    def __init__(self, num_classes: int = len(CLASSES)) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_conv_block(3, 16),
            nn.MaxPool2d(2),
            *_conv_block(16, 32),
            nn.MaxPool2d(2),
            *_conv_block(32, 32),
            nn.MaxPool2d(2),
            *_conv_block(32, 64),
        )
        self.head = nn.Conv2d(64, 4 + num_classes, 1)

    def cells(self, images: torch.Tensor) -> torch.Tensor:
        """``(N, 4 + classes, H/8, W/8)``: each cell's box and class logits, before decoding."""
        return self.head(self.features((images - 0.5) / 0.25))

    def decode(self, cells: torch.Tensor) -> torch.Tensor:
        """``(N, cells, 4 + classes)``: boxes ``(cx, cy, w, h)`` in pixels, class probabilities."""
        height, width = cells.shape[-2:]
        rows, cols = torch.meshgrid(
            torch.arange(height, device=cells.device),
            torch.arange(width, device=cells.device),
            indexing="ij",
        )
        centre_x = (cols + cells[:, 0].sigmoid()) * self.stride
        centre_y = (rows + cells[:, 1].sigmoid()) * self.stride
        sides = cells[:, 2:4].clamp(max=4).exp() * self.stride
        boxes = torch.stack([centre_x, centre_y, sides[:, 0], sides[:, 1]], dim=1)
        decoded = torch.cat([boxes, cells[:, 4:].sigmoid()], dim=1)
        return decoded.flatten(2).transpose(1, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decode(self.cells(images))

    def loss(
        self, images: torch.Tensor, boxes: list[torch.Tensor], labels: list[torch.Tensor]
    ) -> torch.Tensor:
        """The training loss: binary cross-entropy of every cell's class logits (1 for the
        class of the object centred in that cell, else 0) plus the L1 error of the centre
        offsets and log sides at the cells that hold an object's centre."""
        cells = self.cells(images)
        logits, targets = cells[:, 4:], torch.zeros_like(cells[:, 4:])
        predicted, wanted = [], []
        for n, (image_boxes, image_labels) in enumerate(zip(boxes, labels, strict=True)):
            corners = image_boxes.float() / self.stride
            centres = (corners[:, :2] + corners[:, 2:]) / 2
            col, row = centres.floor().long().unbind(dim=1)
            targets[n, image_labels, row, col] = 1.0
            offsets = cells[n, :2, row, col].T.sigmoid()
            log_sides = cells[n, 2:4, row, col].T
            predicted.append(torch.cat([offsets, log_sides], dim=1))
            sides = corners[:, 2:] - corners[:, :2]
            wanted.append(torch.cat([centres - centres.floor(), sides.log()], dim=1))
        positives = targets.sum().clamp_min(1)
        classification = F.binary_cross_entropy_with_logits(
            logits, targets, pos_weight=torch.tensor(8.0), reduction="sum"
        )
        regression = F.l1_loss(torch.cat(predicted), torch.cat(wanted), reduction="sum")
        return (classification + regression) / positives


def load_model(weights: str | Path | None = SHIPPED_WEIGHTS) -> SyntheticCNN:
    """A :class:`SyntheticCNN` in eval mode, with ``weights`` loaded (``None``: random).

    Raises:
        CamvizError: The weights file is missing or does not fit the network.
    """
    return _with_weights(SyntheticCNN(), weights, "")


def load_detector(weights: str | Path | None = SHIPPED_DETECTOR) -> SyntheticDetector:
    """A :class:`SyntheticDetector` in eval mode, with ``weights`` loaded (``None``: random).

    Raises:
        CamvizError: The weights file is missing or does not fit the network.
    """
    return _with_weights(SyntheticDetector(), weights, " --model detector")


def _with_weights(model: _Network, weights: str | Path | None, script_options: str) -> _Network:
    """``model`` in eval mode with the state dict in ``weights`` (``None``: as it is)."""
    from camviz.io.models import read_state_dict

    if weights is not None:
        try:
            model.load_state_dict(read_state_dict(weights))
        except RuntimeError as error:
            raise CamvizError(
                f"{weights} does not hold {type(model).__name__} weights "
                f"({str(error).splitlines()[0]}); train them with "
                f"benchmarks/train_synthetic.py{script_options}"
            ) from None
    return model.eval()


def _conv_block(inputs: int, outputs: int) -> list[nn.Module]:
    """A 3x3 convolution (padded to keep the size), BatchNorm and ReLU."""
    return [
        nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
        nn.BatchNorm2d(outputs),
        nn.ReLU(inplace=True),
    ]


def _uniform(generator: torch.Generator, low: float, high: float, *shape: int) -> torch.Tensor:
    return low + (high - low) * torch.rand(*shape, generator=generator)


def _canvas(
    count: int, size: int, distractors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` smooth noisy backgrounds with ``distractors`` rings and segments drawn on
    them, and the ``(count, size, size)`` row and column of every pixel centre."""
    scale = size / 64
    rows, cols = torch.meshgrid(
        torch.arange(size, dtype=torch.float32) + 0.5,
        torch.arange(size, dtype=torch.float32) + 0.5,
        indexing="ij",
    )
    rows, cols = rows.expand(count, -1, -1), cols.expand(count, -1, -1)

    coarse = _uniform(generator, 0.25, 0.75, count, 3, 4, 4)
    images = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
    images = images + 0.04 * torch.randn(images.shape, generator=generator)

    for index in range(distractors):
        colour = _vivid_colours(count, generator)
        if index % 2 == 0:
            radius = _uniform(generator, 4, 9, count, 1, 1) * scale
            centre_row, centre_col = (_uniform(generator, 0, size, count, 1, 1) for _ in range(2))
            distance = ((rows - centre_row) ** 2 + (cols - centre_col) ** 2).sqrt()
            drawn = (distance - radius).abs() <= 1.0 * scale
        else:
            start = _uniform(generator, 0, size, count, 2, 1, 1)
            end = _uniform(generator, 0, size, count, 2, 1, 1)
            drawn = _segment(rows, cols, start, end) <= 1.0 * scale
        images = torch.where(drawn.unsqueeze(1), colour, images)
    return images, rows, cols


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
