"""Where a layer's grid lies on each input: the one rule that lays a grid map on the input.

Most models see the map input as it is given, so a layer's grid covers the whole input and
a map is laid on it by (bi/tri)linear upsampling to the input's size (:class:`Stretch`).

Torchvision's detectors (Faster/Mask/Keypoint R-CNN, RetinaNet, FCOS, SSD, SSDlite) do not.
Their ``GeneralizedRCNNTransform`` resizes each image (keeping its aspect ratio for the
R-CNNs, RetinaNet and FCOS; stretching it to a fixed size for SSD), then pads the batch with
zeros to one size (multiples of ``size_divisible``, 32 for the R-CNNs). Their backbone's
grids cover that padded tensor, in which image ``n`` fills the top-left corner of its
resized size. A map is laid back on image ``n`` (:class:`Letterbox`) by upsampling it to
the padded size, cropping that corner and resizing the crop to the image's own size.

Ultralytics' YOLO models see each photo *letterboxed*: scaled to fit a square, aspect ratio
kept, and padded on both sides with grey. camviz runs that step inside the model, as a
:class:`CentredLetterbox` module (so that the map input is the photo itself); the image then
lies centred in the padded square, at the offsets the module records.

A vision-language model's image processor resizes, pads or crops the photo before its
vision tower sees it; :class:`Window` lays a map on the photo through that geometry, given
as the window of the photo (in its pixels) that the processed image covers.

Which rule applies is recorded during a forward pass (:func:`recording`): a forward hook on
every ``GeneralizedRCNNTransform`` and every :class:`CentredLetterbox` in the model (found
by type, so a detector inside a wrapper is found too) reads the padded size and the resized
sizes (and offsets) from what it returns. The images the detector is given are taken to be
the map input's samples (a wrapper that resizes them first is read as a stretch, and so is
Hugging Face's DETR-style resize without padding, the :class:`AspectResize` module).

A batch of images of different sizes (a list given to a detector, see
:mod:`camviz.core.inputs`) is a zero-padded canvas: sample ``n`` fills its top-left corner
of ``image_sizes[n]``. A map laid on such a canvas repeats its edge values outside the
sample's own extent, so per-map statistics over the canvas (the min and max that normalise
a map) are those over the image alone; the engine crops each map to its image.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.maps import upsample
from camviz.core.modelstate import HookSet

Size = tuple[int, ...]


class Placement:
    """How the grid maps of one forward pass lie on its map input."""

    def lay(
        self,
        maps: torch.Tensor,
        samples: torch.Tensor | None = None,
        size: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Lay ``(R, *grid)`` maps on the map input.

        Args:
            maps: One map per row, at a layer's grid.
            samples: ``(R,)`` the sample each row belongs to; ``None``: row ``r`` is sample
                ``r``.
            size: Resize the laid maps to this spatial size (the plain input, for a pass on
                a rescaled copy of it); ``None``: the map input's own size.

        Returns:
            ``(R, *spatial)`` maps on the map input (or at ``size``).
        """
        raise NotImplementedError


@dataclass(frozen=True)
class Stretch(Placement):
    """The grid covers the whole input: upsample to the input's size.

    Attributes:
        canvas: The map input's spatial size.
    """

    canvas: Size

    def lay(
        self,
        maps: torch.Tensor,
        samples: torch.Tensor | None = None,
        size: Sequence[int] | None = None,
    ) -> torch.Tensor:
        return upsample(maps, self.canvas if size is None else size)


@dataclass(frozen=True)
class Letterbox(Placement):
    """A detector's grid: it covers the padded batch, each image resized in its corner (or,
    with ``offsets``, at its offset).

    Attributes:
        padded: ``(Hp, Wp)``, the padded batch the detector's backbone ran on.
        resized: ``(h_n, w_n)`` of each sample inside it.
        original: ``(H_n, W_n)`` of each sample on the map input.
        canvas: The map input's spatial size (the largest image of a list).
        offsets: ``(top_n, left_n)`` of each sample in the padded batch; ``None``: the
            top-left corner (torchvision's detectors).
    """

    padded: Size
    resized: tuple[Size, ...]
    original: tuple[Size, ...]
    canvas: Size
    offsets: tuple[Size, ...] | None = None

    def lay(
        self,
        maps: torch.Tensor,
        samples: torch.Tensor | None = None,
        size: Sequence[int] | None = None,
    ) -> torch.Tensor:
        indices = range(len(maps)) if samples is None else samples.tolist()
        offsets = self.offsets or ((0, 0),) * len(self.resized)
        geometry = [(self.resized[n], self.original[n], offsets[n]) for n in indices]
        laid = maps.new_empty(len(maps), *self.canvas)
        for shape in dict.fromkeys(geometry):
            (height, width), image_size, (top, left) = shape
            rows = [row for row, seen in enumerate(geometry) if seen == shape]
            index = torch.tensor(rows, device=maps.device)
            upsampled = upsample(maps[index], self.padded)
            crop = upsampled[:, top : top + height, left : left + width]
            image = upsample(crop, image_size)
            # Edge values outside the image keep per-map statistics those of the image.
            pad = (0, self.canvas[1] - image_size[1], 0, self.canvas[0] - image_size[0])
            laid[index] = F.pad(image.unsqueeze(1), pad, mode="replicate")[:, 0]
        return laid if size is None else upsample(laid, size)


@dataclass(frozen=True)
class Window(Placement):
    """The grid covers a window of the input given in the input's pixels, which may reach
    beyond it (a processor that padded the image) or cover part of it (one that cropped):
    the map is resized onto the window, and the input's pixels outside it, which the model
    never saw, are zero.

    Attributes:
        top, left: The window's corner on the input, in pixels (fractions allowed).
        height, width: Its extent, in pixels.
        canvas: The input's ``(H, W)``.
    """

    top: float
    left: float
    height: float
    width: float
    canvas: Size

    def lay(
        self,
        maps: torch.Tensor,
        samples: torch.Tensor | None = None,
        size: Sequence[int] | None = None,
    ) -> torch.Tensor:
        rows, columns = self.canvas
        # Where each pixel centre falls in the window, 0 to 1 across it; grid_sample's
        # coordinates run from -1 to 1 over the map's outer cell edges (align_corners=False),
        # as F.interpolate's, so a window over the whole input is exactly Stretch.
        down = (
            torch.arange(rows, device=maps.device, dtype=maps.dtype) + 0.5 - self.top
        ) / self.height
        across = (
            torch.arange(columns, device=maps.device, dtype=maps.dtype) + 0.5 - self.left
        ) / self.width
        grid = torch.stack(torch.meshgrid(2 * across - 1, 2 * down - 1, indexing="xy"), dim=-1)
        laid = F.grid_sample(
            maps.unsqueeze(1),
            grid.expand(len(maps), rows, columns, 2),
            mode="bilinear",
            padding_mode="border",
            align_corners=False,
        )[:, 0]
        inside = ((down >= 0) & (down <= 1))[:, None] & ((across >= 0) & (across <= 1))[None, :]
        laid = laid * inside
        return laid if size is None else upsample(laid, size)


def _transform_type() -> type | None:
    """Torchvision's ``GeneralizedRCNNTransform``, if torchvision's detection models are
    loaded (no model can hold one otherwise, so nothing is imported here)."""
    module = sys.modules.get("torchvision.models.detection.transform")
    found = getattr(module, "GeneralizedRCNNTransform", None)
    return found if isinstance(found, type) else None


def detector_transforms(model: nn.Module) -> list[nn.Module]:
    """The model's ``GeneralizedRCNNTransform`` modules (torchvision's detectors have one)."""
    kind = _transform_type()
    return (
        [] if kind is None else [module for module in model.modules() if isinstance(module, kind)]
    )


def letterboxes(model: nn.Module) -> list[CentredLetterbox]:
    """The model's :class:`CentredLetterbox` modules."""
    return [module for module in model.modules() if isinstance(module, CentredLetterbox)]


class CentredLetterbox(nn.Module):
    """Ultralytics' letterbox as a module: each image of an ``(N, C, H, W)`` batch scaled to
    fit ``size x size`` (aspect ratio kept, bilinear as OpenCV's ``INTER_LINEAR``), then
    padded with ``fill`` on both sides, the odd pixel after the image (Ultralytics'
    ``LetterBox(auto=False, center=True)``, its prediction default).

    Args:
        size: The side of the padded square, in pixels.
        fill: The padding value, in the model's input scale (Ultralytics pads with 114 of
            255).
    """

    def __init__(self, size: int, fill: float = 114 / 255) -> None:
        super().__init__()
        self.size = size
        self.fill = fill

    def geometry(self, height: int, width: int) -> tuple[Size, Size]:
        """``((h, w), (top, left))``: an ``height x width`` image's size in the square and
        where it starts, rounded as Ultralytics rounds them."""
        scale = min(self.size / height, self.size / width)
        resized = (max(round(height * scale), 1), max(round(width * scale), 1))
        top, left = (round((self.size - extent) / 2 - 0.1) for extent in resized)
        return resized, (top, left)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        (height, width), (top, left) = self.geometry(*images.shape[-2:])
        if (height, width) != tuple(images.shape[-2:]):
            images = F.interpolate(images, size=(height, width), mode="bilinear")
        bottom, right = self.size - height - top, self.size - width - left
        return F.pad(images, (left, right, top, bottom), value=self.fill)


class AspectResize(nn.Module):
    """A detector's resize of its images without padding, as Hugging Face's processors of
    DETR-style detectors do it: the shorter side to ``shortest`` pixels unless the longer
    would then pass ``longest`` (then the longer side to ``longest``), or both sides to
    ``fixed``. The grid still covers the whole image, so maps are laid by :class:`Stretch`.

    Attributes:
        shortest: The shorter side (``None`` with ``fixed``).
        longest: The most pixels of the longer side (``None``: no limit).
        fixed: ``(height, width)`` of every image, when the processor squashes to one size.
    """

    def __init__(
        self,
        shortest: int | None = None,
        longest: int | None = None,
        fixed: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if (shortest is None) == (fixed is None):
            raise CamvizError("an AspectResize takes a shorter side or a fixed size, not both")
        self.shortest = shortest
        self.longest = longest
        self.fixed = fixed

    def size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` an image of ``height x width`` is resized to."""
        if self.fixed is not None:
            return self.fixed
        assert self.shortest is not None
        short, long = min(height, width), max(height, width)
        target = self.shortest
        if self.longest is not None and long * target > self.longest * short:
            target = round(self.longest * short / long)  # the longer side at the limit
        if short == target:
            return height, width
        if height <= width:
            return target, int(target * width / height)
        return int(target * height / width), target

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        size = self.size(*images.shape[-2:])
        if size == tuple(images.shape[-2:]):
            return images
        return F.interpolate(images, size=size, mode="bilinear", align_corners=False)


def aspect_resizes(model: nn.Module) -> list[AspectResize]:
    """The model's :class:`AspectResize` modules."""
    return [module for module in model.modules() if isinstance(module, AspectResize)]


def takes_image_lists(model: nn.Module) -> bool:
    """Whether ``model`` is (or holds) a torchvision detector, which takes a list of images."""
    return bool(detector_transforms(model))


class Recorder:
    """What the detector transforms of a model saw during one forward pass."""

    def __init__(self) -> None:
        self.seen: list[tuple[Size, tuple[Size, ...], tuple[Size, ...] | None]] = []

    def hook(self, module: nn.Module, args: Any, output: Any) -> None:
        images = output[0]
        padded = tuple(int(extent) for extent in images.tensors.shape[-2:])
        resized = tuple(tuple(int(e) for e in size) for size in images.image_sizes)
        self.seen.append((padded, resized, None))

    def letterbox_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        assert isinstance(module, CentredLetterbox)
        resized, offset = module.geometry(*args[0].shape[-2:])
        count = len(output)
        self.seen.append((tuple(output.shape[-2:]), (resized,) * count, (offset,) * count))

    def placement(
        self, canvas: Sequence[int], image_sizes: Sequence[Sequence[int]] | None, count: int
    ) -> Placement:
        """The rule of the recorded pass for a map input of spatial size ``canvas`` with
        ``count`` samples (``image_sizes``: each sample's extent in it, for a list).

        Raises:
            CamvizError: The detector ran more than once, saw another number of images than
                there are samples, or did not run for a list of images.
        """
        canvas = tuple(canvas)
        if not self.seen:
            if image_sizes is not None:
                raise CamvizError(
                    "a list of images was given, but the model's detector transform did not "
                    "run; give a batch tensor (N, C, H, W) instead"
                )
            return Stretch(canvas)
        if len(self.seen) > 1:
            raise CamvizError(
                f"the model's detector transform ran {len(self.seen)} times in one forward "
                "pass; camviz cannot tell which one the maps lie on (explain one detector)"
            )
        ((padded, resized, offsets),) = self.seen
        if len(resized) != count:
            raise CamvizError(
                f"the model's detector transform saw {len(resized)} images for {count} "
                "inputs; camviz cannot tell where each map lies (give the detector the batch)"
            )
        original = (
            tuple(tuple(int(e) for e in size) for size in image_sizes)
            if image_sizes is not None
            else (canvas,) * count
        )
        return Letterbox(padded, resized, original, canvas, offsets)


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[Recorder]:
    """Record, during the forward passes in the block, what the model's detector transforms
    saw (nothing for other models); the hooks are removed on exit, errors included."""
    recorder = Recorder()
    with HookSet() as hooks:
        for transform in detector_transforms(model):
            hooks.add(transform.register_forward_hook(recorder.hook))
        for letterbox in letterboxes(model):
            hooks.add(letterbox.register_forward_hook(recorder.letterbox_hook))
        yield recorder
