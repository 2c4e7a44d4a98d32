"""A folder of real photos made offline: crops and flips of the photos that scikit-image and
scikit-learn ship.

Top-activating examples and feature visualisations are judged against real photos, and two
shipped test images are too few for "the unit's best images". scikit-image ships
sixteen photographs (an astronaut, a cat, coffee, a rocket, coins, a camera man, the moon,
textures of brick, grass and gravel, a retina, a Hubble field, ...) and scikit-learn two
more (a Chinese temple and a flower); :func:`photo_folder` cuts each into crops at several
scales and places, flipped left to right every other time, so that the folder holds
hundreds of different real pictures without a download. Both libraries are the ``test``
extra (``pip install scikit-image scikit-learn``).
"""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from camviz.core.errors import CamvizError
from camviz.io.atomic import atomic_write

__all__ = ["photo_folder", "shipped_photos"]

# The photographs among the data files of scikit-image (not its drawings, masks or test
# patterns) and scikit-learn, by package and path.
_PHOTO_FILES = {
    "skimage": [
        f"data/{name}"
        for name in (
            "astronaut.png", "brick.png", "camera.png", "cell.png", "chelsea.png",
            "clock_motion.png", "coffee.png", "coins.png", "grass.png", "gravel.png",
            "hubble_deep_field.jpg", "ihc.png", "moon.png", "motorcycle_left.png",
            "retina.jpg", "rocket.jpg",
        )
    ],
    "sklearn": ["datasets/images/china.jpg", "datasets/images/flower.jpg"],
}  # fmt: skip

# Crop sides, as fractions of a photo's shorter side.
_SMALLEST_CROP, _LARGEST_CROP = 0.3, 0.95


def shipped_photos() -> dict[str, Image.Image]:
    """``{name: RGB image}``: the photographs scikit-image and scikit-learn ship.

    The files are read where the packages keep them, without importing the packages
    (importing scikit-learn takes seconds).

    Raises:
        CamvizError: One of the two libraries is not installed, or lacks a file.
    """
    photos = {}
    for package, files in _PHOTO_FILES.items():
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise CamvizError(
                f"the photo folder needs scikit-image and scikit-learn ({package} is missing); "
                "pip install scikit-image scikit-learn"
            )
        root = Path(spec.origin).parent
        for file in files:
            try:
                with Image.open(root / file) as photo:
                    photos[Path(file).stem] = photo.convert("RGB")
            except OSError as error:
                raise CamvizError(
                    f"cannot read {file} of {package} ({error}); reinstall it"
                ) from None
    return photos


def photo_folder(
    folder: str | os.PathLike[str], count: int = 300, size: int = 128, seed: int = 0
) -> list[Path]:
    """Write ``count`` square ``size``-pixel JPEG crops of the shipped photos into ``folder``.

    Photo ``i`` is a crop of photo ``i mod P`` (``P`` photos), of a random side between 30
    and 95% of the photo's shorter side at a random place, mirrored when ``i // P`` is odd;
    the same ``seed`` writes the same files. Files that exist are written again.

    Returns:
        The files, in order (``astronaut_000.jpg``, ``brick_001.jpg``, ...).

    Raises:
        CamvizError: ``count`` or ``size`` is not positive, or a library is missing.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise CamvizError(f"count must be a positive whole number, not {count!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 8:
        raise CamvizError(f"size must be at least 8 pixels, not {size!r}")
    photos = sorted(shipped_photos().items())
    random = np.random.default_rng(seed)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for number in range(count):
        name, photo = photos[number % len(photos)]
        width, height = photo.size
        side = int(min(height, width) * random.uniform(_SMALLEST_CROP, _LARGEST_CROP))
        top = int(random.integers(0, height - side + 1))
        left = int(random.integers(0, width - side + 1))
        crop = photo.resize(
            (size, size), Image.Resampling.BICUBIC, (left, top, left + side, top + side)
        )
        if (number // len(photos)) % 2:
            crop = ImageOps.mirror(crop)
        encoded = io.BytesIO()
        crop.save(encoded, "JPEG", quality=90)
        path = out / f"{name}_{number:03d}.jpg"
        with atomic_write(path, "wb") as file:
            file.write(encoded.getvalue())
        paths.append(path)
    return paths
