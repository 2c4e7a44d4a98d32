"""JPEG decoding on the GPU for the folder job, where torchvision offers it (nvjpeg).

When the model runs on CUDA and the preprocessing is a :class:`~camviz.io.images.Preprocess`
(which also takes pixel tensors), DataLoader workers only *read* the bytes of each JPEG
(:func:`encoded_jpeg`), and the main process decodes a whole batch of them on the GPU at
once (:func:`decode`, ``torchvision.io.decode_jpeg(list, device="cuda")``), then resizes
and normalises them there. Everything else takes the CPU path of
:func:`camviz.io.images.load_image` (Pillow), which :func:`decoder` names:

* any other device (a CPU run decodes with Pillow in its workers, in parallel), and a
  torchvision without nvjpeg (:func:`nvjpeg_decodes` tries it once per device);
* other formats (PNG, WebP, ...), video frames, and a custom preprocessing callable that
  takes PIL images only;
* JPEGs whose pixels nvjpeg would not give as :func:`~camviz.io.images.load_image` does:
  CMYK / YCCK files (Pillow's conversion differs), and files with an EXIF orientation
  other than upright (nvjpeg does not apply it; torchvision rotates on the CPU only);
* a file nvjpeg refuses when decoding (a corrupt or exotic one): :func:`decode` gives
  ``None`` for it and the caller reads it with Pillow, which also words the error.

Size limits are checked from the header in the worker, as :func:`load_image` does. The CPU
decoder of the same function (``device="cpu"``) gives the pixels Pillow gives, bit for bit
(both are libjpeg-turbo), which the tests check; nvjpeg's IDCT may differ from it by a
level here and there.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from PIL import Image, UnidentifiedImageError

from camviz.io.images import PathLike, Preprocess, check_size

Decoder = Literal["device", "pillow"]

#: The EXIF tag of the orientation; 1 (or no tag) is upright.
_ORIENTATION = 0x0112

# Pillow modes of JPEGs that nvjpeg decodes to load_image's pixels (greyscale is repeated
# into three channels by both).
_DEVICE_MODES = frozenset({"RGB", "L"})


def device_decodes(device: torch.device | None, preprocess: Callable[..., torch.Tensor]) -> bool:
    """Whether a run on ``device`` with ``preprocess`` decodes its JPEGs on the device."""
    return (
        device is not None
        and device.type == "cuda"
        and isinstance(preprocess, Preprocess)
        and nvjpeg_decodes(device)
    )


@functools.cache
def nvjpeg_decodes(device: torch.device) -> bool:
    """Whether torchvision decodes JPEGs on ``device``: tried once on a one-pixel JPEG, since
    a torchvision built without nvjpeg still has the function and fails only when called."""
    if not torch.cuda.is_available():
        return False  # (torchvision would print a C++ trace before raising)
    pixel = io.BytesIO()
    Image.new("RGB", (1, 1)).save(pixel, format="JPEG")
    encoded = torch.frombuffer(bytearray(pixel.getvalue()), dtype=torch.uint8)
    try:
        return decode([encoded], device)[0] is not None
    except (RuntimeError, AssertionError, ValueError):  # no CUDA, no nvjpeg, no such device
        return False


def decoder(path: PathLike, on_device: bool) -> Decoder:
    """Which decoder reads the image file ``path`` in a run where ``on_device`` is
    :func:`device_decodes` (see the module docstring); only the header is read."""
    if not on_device:
        return "pillow"
    try:
        with Image.open(path) as image:
            upright = image.getexif().get(_ORIENTATION, 1) == 1
            if image.format == "JPEG" and image.mode in _DEVICE_MODES and upright:
                return "device"
    except (OSError, SyntaxError, ValueError, UnidentifiedImageError):
        pass  # Pillow's reading names the problem
    return "pillow"


def encoded_jpeg(path: PathLike, max_pixels: int | None) -> torch.Tensor:
    """The bytes of a JPEG file as a 1-D uint8 tensor, its size checked from the header.

    Raises:
        CamvizError: The image is larger than ``max_pixels``.
    """
    path = Path(path)
    with Image.open(path) as image:
        check_size(image, path, max_pixels)
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def decode(encoded: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """JPEG bytes to ``(3, H, W)`` uint8 RGB pixels on ``device``, in one batched call; an
    image the decoder refuses gives ``None`` (read it with Pillow instead)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its decoders in favour of TorchCodec, which camviz
        # does not depend on; the call is the same.
        warnings.simplefilter("ignore")
        try:
            return list(decode_jpeg(list(encoded), mode=ImageReadMode.RGB, device=device))
        except RuntimeError:
            pass  # one bad file fails the batch: decode one by one to find it
        decoded: list[torch.Tensor | None] = []
        for data in encoded:
            try:
                decoded.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                decoded.append(None)
        return decoded
