"""Read images of any common kind, keep the original for the overlay, and preprocess them.

:func:`load_image` turns a file into an 8-bit RGB :class:`PIL.Image.Image`, whatever its mode:

* **Orientation.** The EXIF orientation tag is applied, so a phone photo comes out the way
  it is shown, and the heatmap lines up with what the user sees.
* **Transparency** (RGBA, LA, palette or RGB with a transparent colour) is composited onto
  white, as such images appear on a page; dropping the alpha channel would show the model
  pixels the user never sees.
* **16-bit and 32-bit** greyscale (``I;16``, ``I``, ``F``) is scaled to 8 bits over its full
  range. Pillow's own ``convert("L")`` clips those values at 255, which turns almost every
  16-bit photo white.
* **CMYK, palette, 1-bit, YCbCr** go through Pillow's conversion, the same one torchvision's
  ``ImageFolder`` loader uses, so the model sees the pixels it was trained on. For the same
  reason embedded ICC profiles are not applied.
* Multi-frame files (GIF, multi-page TIFF) give their first frame.

Image size is checked from the header, before any pixel is decoded, so a 100 000 x 100 000
PNG costs nothing to refuse.

:class:`Preprocess` resizes and normalises an RGB image into the ``(3, H, W)`` tensor a
model takes, and :func:`load_batch` does both for a list of files.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF  # noqa: N812 - the conventional name

from camviz.core.errors import CamvizError, first_line
from camviz.io.files import open_regular

__all__ = [
    "BACKGROUND",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MAX_INPUT_PIXELS",
    "MAX_PIXELS",
    "MAX_SIDE_RATIO",
    "PathLike",
    "Preprocess",
    "check_size",
    "load_batch",
    "load_image",
    "to_rgb",
]

#: Default largest image, in pixels, that :func:`load_image` decodes (64 megapixels is
#: well above any camera photo and about 200 MB of RGB).
MAX_PIXELS = 64_000_000

#: The largest tensor :class:`Preprocess` makes, in pixels, and its most elongated shape
#: (longer side over shorter). The file's size alone says little: a 69-byte 1 x 600 PNG
#: scaled to a shorter side of 224 would be 224 x 134400, gigabytes of activations.
MAX_INPUT_PIXELS = MAX_PIXELS
MAX_SIDE_RATIO = 16

#: ImageNet channel statistics, the default normalisation of torchvision and timm models.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

#: What transparent pixels are composited onto (see the module docstring).
BACKGROUND = (255, 255, 255)

_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_INTERPOLATIONS = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC}

PathLike = str | os.PathLike[str]


def load_image(path: PathLike, *, max_pixels: int | None = MAX_PIXELS) -> Image.Image:
    """Read an image file as an upright 8-bit RGB image.

    Args:
        path: A JPEG, PNG, WebP, BMP, TIFF or any other file Pillow reads.
        max_pixels: Refuse images with more pixels than this (read from the header, before
            decoding); ``None`` leaves only Pillow's own decompression-bomb limit
            (``PIL.Image.MAX_IMAGE_PIXELS``).

    Returns:
        A new RGB image, fully decoded and not tied to the file (which is closed).

    Raises:
        CamvizError: The file is missing, a folder, a FIFO, socket or device, empty, not an
            image, truncated or corrupt, or too large. The message names the file.
    """
    path = Path(path)
    if path.is_dir():
        raise CamvizError(f"{path} is a folder, not an image file; give the path of an image")
    try:
        with open_regular(path) as file:  # a FIFO would block the command forever
            if os.fstat(file.fileno()).st_size == 0:
                raise CamvizError(f"{path} is empty (0 bytes); re-export or re-download it")
            with _warnings_naming(path):
                image = _open(file, path)
                check_size(image, path, max_pixels)
                return to_rgb(ImageOps.exif_transpose(image))
    except FileNotFoundError:
        raise CamvizError(f"image file not found: {path}; check the path") from None
    except PermissionError:
        raise CamvizError(f"cannot read {path}: permission denied; check its permissions") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise CamvizError(_bomb_message(path, error)) from None
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        # Pillow reports damaged data with any of these, depending on the format.
        raise CamvizError(
            f"{path} is truncated or corrupt ({first_line(error)}); re-export or re-download it"
        ) from None


# ``warnings.catch_warnings`` swaps the process's warning filters and handler, and two threads
# inside it at once leave one thread's in place for good (the folder job reads images on
# several threads): images are opened and decoded under it one at a time.
_CATCHING = threading.Lock()


@contextlib.contextmanager
def _warnings_naming(path: Path) -> Iterator[None]:
    """Pillow's warnings about a file (``Corrupt EXIF data``, ``Truncated File Read``) raised
    again with the file's name in front: Pillow's own do not say which file they are about."""
    with _CATCHING, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for warning in caught:
        lines = str(warning.message).strip().splitlines()
        text = lines[0] if lines else warning.category.__name__
        warnings.warn(f"{path}: {text}", warning.category, stacklevel=4)


def _open(file: IO[bytes], path: Path) -> Image.Image:
    """Read the header only; Pillow's decompression-bomb warning becomes an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            return Image.open(file)
        except UnidentifiedImageError:
            raise CamvizError(
                f"{path} is not an image Pillow can read; check the file, or convert it to "
                "PNG or JPEG"
            ) from None


def check_size(image: Image.Image, path: Path, max_pixels: int | None) -> None:
    """Refuse an image larger than ``max_pixels`` (from its header: nothing is decoded).

    Raises:
        CamvizError: The image has more pixels than ``max_pixels``.
    """
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise CamvizError(
            f"{path} is {width}x{height} ({width * height / 1e6:.1f} megapixels), more than "
            f"the limit of {max_pixels / 1e6:.1f}; downscale it, or pass a larger max_pixels "
            "if you trust the file"
        )


def _bomb_message(path: Path, error: Exception) -> str:
    return (
        f"{path} is larger than Pillow allows ({first_line(error).rstrip('.')}); downscale "
        "it, or raise PIL.Image.MAX_IMAGE_PIXELS if you trust the file"
    )


def to_rgb(image: Image.Image) -> Image.Image:
    """Any Pillow image as a new 8-bit RGB image (see the module docstring for each mode).

    Raises:
        CamvizError: A mode that cannot be turned into RGB.
    """
    if image.mode.startswith("I;16"):
        return _scaled_to_8bit(np.asarray(image), full_scale=65535)
    if image.mode == "I":
        values = np.asarray(image)
        in_16bit_range = values.size == 0 or (values.min() >= 0 and values.max() <= 65535)
        return _scaled_to_8bit(values, full_scale=65535 if in_16bit_range else None)
    if image.mode == "F":
        values = np.asarray(image)
        in_unit_range = values.size == 0 or (values.min() >= 0 and values.max() <= 1)
        return _scaled_to_8bit(values, full_scale=1 if in_unit_range else None)
    try:
        if image.mode in _ALPHA_MODES or "transparency" in image.info:
            background = Image.new("RGBA", image.size, (*BACKGROUND, 255))
            return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
        return image.convert("RGB")
    except ValueError as error:
        raise CamvizError(
            f"cannot convert a {image.mode!r} image to RGB ({error}); convert it to RGB first"
        ) from None


def _scaled_to_8bit(values: np.ndarray, full_scale: float | None) -> Image.Image:
    """Map ``[0, full_scale]`` (or the values' own min..max when None) linearly to 0..255."""
    values = values.astype(np.float64)
    low, high = (0.0, float(full_scale)) if full_scale is not None else _extent(values)
    scaled = (values - low) * (255 / (high - low)) if high > low else np.zeros_like(values)
    grey = np.rint(np.clip(scaled, 0, 255)).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")


def _extent(values: np.ndarray) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    return (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)


@dataclass(frozen=True)
class Preprocess:
    """Resize and normalise an RGB image into the ``(C, H, W)`` float tensor a model takes
    (``C = 3``, or 1 for a model of grey images: the image is then converted to grey).

    A tensor of more than :data:`MAX_INPUT_PIXELS` pixels, or with one side more than
    :data:`MAX_SIDE_RATIO` times the other, is refused before it is made (a
    :class:`~camviz.core.errors.CamvizError`; the folder job makes it a failed row).

    There is no centre crop: the whole image is explained, so the heatmap maps back onto
    the original exactly (:func:`camviz.render.overlay` stretches it to the original size).

    Resizing uses ``torchvision.transforms.v2.functional.resize`` on the Pillow image, which
    resizes with Pillow - the same pixels that torchvision's and timm's evaluation
    transforms produce, so the model sees what it saw during validation.

    Attributes:
        size: The shorter side (``"shorter"``) or both sides (``"square"``), in pixels.
        mean: Per-channel mean subtracted after scaling to ``[0, 1]``: one value per
            channel, or one for all.
        std: Per-channel standard deviation divided by (as ``mean``).
        resize: ``"shorter"`` keeps the aspect ratio; ``"square"`` squashes the image to
            ``size x size``, for models that need a fixed size (most ViTs); ``"none"`` keeps
            the image's own size (detectors, which resize inside; ``size`` is then unused).
        interpolation: ``"bilinear"`` or ``"bicubic"`` (timm models often use bicubic).
        max_size: With ``"shorter"``, the most the longer side may have; a very wide image
            is then scaled so that its longer side is ``max_size``.
        multiple_of: Round each side to the nearest multiple of this (e.g. 32, for CNNs
            whose feature maps should tile the input exactly).
        channels: 3 for RGB, 1 for grey (Pillow's ``"L"`` conversion).

    Example:
        >>> Preprocess(size=224).output_size(width=640, height=480)
        (224, 299)
    """

    size: int = 224
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    resize: Literal["shorter", "square", "none"] = "shorter"
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    max_size: int | None = None
    multiple_of: int = 1
    channels: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise CamvizError(f"size must be a positive number of pixels, not {self.size!r}")
        if self.channels not in (1, 3):
            raise CamvizError(f"channels must be 3 (RGB) or 1 (grey), not {self.channels!r}")
        for name in ("mean", "std"):
            values = tuple(float(value) for value in getattr(self, name))
            if len(values) == 1:
                values *= self.channels
            if len(values) != self.channels:
                raise CamvizError(
                    f"{name} must have one value for all channels or one per channel "
                    f"({self.channels}), got {len(values)}"
                )
            object.__setattr__(self, name, values)  # lists become hashable tuples
        if min(self.std) <= 0:
            raise CamvizError(f"std values must be positive, got {self.std}")
        if self.resize not in ("shorter", "square", "none"):
            raise CamvizError(f"resize must be 'shorter', 'square' or 'none', not {self.resize!r}")
        if self.interpolation not in _INTERPOLATIONS:
            raise CamvizError(
                f"interpolation must be one of {', '.join(_INTERPOLATIONS)}, "
                f"not {self.interpolation!r}"
            )
        if self.max_size is not None and self.max_size < self.size:
            raise CamvizError(
                f"max_size ({self.max_size}) must be at least size ({self.size}), or None"
            )
        if not isinstance(self.multiple_of, int) or self.multiple_of < 1:
            raise CamvizError(f"multiple_of must be a positive integer, not {self.multiple_of!r}")

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """The ``(H, W)`` of the tensor made from a ``width`` x ``height`` image."""
        if self.resize == "square":
            new_height = new_width = float(self.size)
        elif self.resize == "none":
            new_height, new_width = float(height), float(width)
        else:
            scale = self.size / min(width, height)
            if self.max_size is not None and max(width, height) * scale > self.max_size:
                scale = self.max_size / max(width, height)
            new_height, new_width = height * scale, width * scale
        return self._rounded(new_height), self._rounded(new_width)

    def _rounded(self, length: float) -> int:
        step = self.multiple_of
        return max(step, math.floor(length / step + 0.5) * step)

    def __call__(self, image: Image.Image | torch.Tensor) -> torch.Tensor:
        """The normalised ``(C, H, W)`` float32 tensor for ``image``: a PIL image (any mode),
        or ``(3, H, W)`` uint8 RGB pixels on any device (JPEGs decoded on a GPU), resized
        there with torch's antialiased resize, within a level of Pillow's."""
        if isinstance(image, torch.Tensor):
            if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3:
                raise CamvizError(
                    f"Preprocess takes (3, H, W) uint8 RGB pixels, not a {image.dtype} tensor "
                    f"of shape {tuple(image.shape)}"
                )
            pixels: Image.Image | torch.Tensor = image
            height, width = image.shape[1:]
        elif isinstance(image, Image.Image):
            pixels = image if image.mode == "RGB" else to_rgb(image)
            if self.channels == 1:
                pixels = pixels.convert("L")
            width, height = pixels.size
        else:
            raise CamvizError(
                f"Preprocess takes a PIL image, not {type(image).__name__}; read files with "
                "camviz.images.load_image"
            )
        size = self.output_size(width, height)
        _check_input_size(size, (height, width))
        resized = TF.resize(
            pixels,
            list(size),
            interpolation=_INTERPOLATIONS[self.interpolation],
            antialias=True,
        )
        if isinstance(resized, Image.Image):
            resized = TF.pil_to_tensor(resized)
        elif self.channels == 1:
            resized = TF.rgb_to_grayscale(resized)
        scaled = TF.to_dtype(resized, torch.float32, scale=True)
        return TF.normalize(scaled, list(self.mean), list(self.std))


def _check_input_size(size: tuple[int, int], original: tuple[int, int]) -> None:
    """Refuse a preprocessed ``(H, W)`` ``size`` (of an ``original`` ``(H, W)`` image) larger
    than :data:`MAX_INPUT_PIXELS` or more elongated than :data:`MAX_SIDE_RATIO`.

    Raises:
        CamvizError: What the sizes are and what to do, in one line.
    """
    height, width = size
    image = f"an image of {original[1]}x{original[0]} pixels"
    if max(size) > MAX_SIDE_RATIO * min(size):
        raise CamvizError(
            f"{image} would preprocess to {width}x{height}, more elongated than "
            f"{MAX_SIDE_RATIO}:1; crop it to a less elongated part, or pad it"
        )
    if width * height > MAX_INPUT_PIXELS:
        raise CamvizError(
            f"{image} would preprocess to {width}x{height} ({width * height / 1e6:.1f} "
            f"megapixels), more than the limit of {MAX_INPUT_PIXELS / 1e6:.0f}; use a smaller "
            "input size, or downscale it"
        )


def load_batch(
    paths: PathLike | Iterable[PathLike],
    preprocess: Callable[[Image.Image], torch.Tensor] | None = None,
    *,
    max_pixels: int | None = MAX_PIXELS,
) -> tuple[torch.Tensor, list[Image.Image]]:
    """Read image files into one batch, keeping the originals for the overlays.

    Images of different shapes cannot share a batch. With ``Preprocess(resize="square")``
    every image fits; with ``"shorter"`` only images of one aspect ratio do, and the others
    are refused with a message (explain them one call each instead).

    Args:
        paths: One path or several.
        preprocess: A callable from an RGB PIL image to a ``(3, H, W)`` tensor, such as a
            :class:`Preprocess` or the ``.preprocess`` of :func:`camviz.models.load`;
            ``None`` means ``Preprocess()``.
        max_pixels: Passed to :func:`load_image`.

    Returns:
        ``(batch, originals)``: the ``(N, 3, H, W)`` batch, and the N upright RGB images.

    Raises:
        CamvizError: A file cannot be read, no path is given, or the images preprocess
            to different sizes.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise CamvizError("no image paths given; pass at least one image file")
    preprocess = preprocess if preprocess is not None else Preprocess()
    originals = [load_image(path, max_pixels=max_pixels) for path in paths]
    tensors = [preprocess(image) for image in originals]
    shapes = [tuple(tensor.shape) for tensor in tensors]
    if len(set(shapes)) > 1:
        listed = ", ".join(
            f"{Path(path).name} -> {'x'.join(map(str, shape[-2:]))}"
            for path, shape in list(zip(paths, shapes, strict=True))[:4]
        )
        raise CamvizError(
            f"the images preprocess to different sizes ({listed}{', ...' if len(paths) > 4 else ''}"
            "); use Preprocess(resize='square') to batch them, or load them one at a time"
        )
    return torch.stack(tensors), originals
