"""3-D scans in and out: NIfTI volumes (``.nii``, ``.nii.gz``), read and written with nibabel.

A scan is kept in its file's voxel order, ``(I, J, K)``: the model sees it as a
``(1, 1, I, J, K)`` volume, so a map of the volume's shape lies on the scan voxel for voxel,
and written with the scan's affine and its qform and sform codes it overlays the scan in
ITK-SNAP, 3D Slicer or FSLeyes. Only 3-D scans are read (a 4-D series, fMRI or several
echoes, is refused in one line; a trailing axis of one is dropped). DICOM folders are not
read: convert them to NIfTI first (``dcm2niix``).

Intensities are mapped to ``[0, 1]`` before the model, when asked: ``window=(low, high)``
(CT: ``-1000, 400`` for lungs) or ``percentile=(low, high)`` (MR, whose units are arbitrary:
``0.5, 99.5``); values outside are clipped.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from camviz.core.errors import CamvizError, first_line
from camviz.io.atomic import atomic_write

if TYPE_CHECKING:
    from camviz.io.images import PathLike

__all__ = [
    "VOLUME_SUFFIXES",
    "Volume",
    "intensities",
    "is_volume",
    "montage",
    "read_volume",
    "volume_stem",
    "write_volume",
]

#: File name endings of NIfTI volumes.
VOLUME_SUFFIXES = (".nii", ".nii.gz")

# Slices a montage shows, and the least side of each tile in pixels.
_MONTAGE_SLICES = 9
_MONTAGE_TILE = 128
_GAP = 2  # black pixels between tiles


@dataclass(frozen=True)
class Volume:
    """One 3-D scan.

    Attributes:
        data: ``(I, J, K)`` float32 voxel values, in the file's order.
        affine: The ``4 x 4`` voxel-to-world matrix.
        header: The NIfTI header (its qform, sform and their codes are written back).
    """

    data: np.ndarray
    affine: np.ndarray
    header: Any


def is_volume(path: PathLike) -> bool:
    """Whether ``path`` is named like a NIfTI volume."""
    return str(path).lower().endswith(VOLUME_SUFFIXES)


def volume_stem(path: PathLike) -> str:
    """The file's name without ``.nii`` or ``.nii.gz``."""
    name = Path(path).name
    for suffix in sorted(VOLUME_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return Path(path).stem


def _nibabel() -> Any:
    from camviz.io.sources.base import import_extra

    return import_extra("nibabel", "medical", "NIfTI volumes")


def read_volume(path: PathLike) -> Volume:
    """The 3-D scan in the NIfTI file at ``path``.

    Raises:
        CamvizError: The file is missing or not NIfTI, or holds more than one volume.
    """
    nibabel = _nibabel()
    path = Path(path)
    try:
        image = nibabel.load(path)
        data = np.asarray(image.dataobj, dtype=np.float32)
    except FileNotFoundError:
        raise CamvizError(f"volume not found: {path}; check the path") from None
    except Exception as error:  # nibabel and gzip report a foreign file with many types
        raise CamvizError(
            f"{path} is not a NIfTI volume nibabel can read ({type(error).__name__}: "
            f"{first_line(error)}); check the file, or convert it to NIfTI"
        ) from None
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise CamvizError(
            f"{path} holds a {data.ndim}-D array of shape {data.shape}; camviz explains 3-D "
            "scans: split a series into one file per volume (fslsplit, nibabel)"
        )
    return Volume(data, np.asarray(image.affine, dtype=np.float64), image.header)


def intensities(
    data: np.ndarray,
    window: tuple[float, float] | None = None,
    percentile: tuple[float, float] | None = None,
) -> torch.Tensor:
    """The voxel values as a float32 tensor, mapped from ``window`` (or the values at
    ``percentile``) to ``[0, 1]`` and clipped there; unchanged without either.

    Raises:
        CamvizError: Both are given, or a range whose top is not above its bottom.
    """
    values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    if window is not None and percentile is not None:
        raise CamvizError("give --window or --percentile, not both")
    if percentile is not None:
        if not 0 <= percentile[0] < percentile[1] <= 100:
            raise CamvizError(
                f"--percentile must be LOW,HIGH with 0 <= LOW < HIGH <= 100, not {percentile}"
            )
        window = tuple(float(value) for value in np.percentile(data, percentile))  # type: ignore[assignment]
    if window is None:
        return values
    low, high = window
    if not high > low:
        raise CamvizError(
            f"the intensity window must be LOW,HIGH with HIGH above LOW, not {window}"
        )
    return ((values - low) / (high - low)).clamp_(0, 1)


def write_volume(path: PathLike, values: np.ndarray, like: Volume, description: str = "") -> Path:
    """Write ``values`` (the shape of ``like``'s data) as a float32 NIfTI with ``like``'s
    affine, qform and sform (and their codes), gzipped when ``path`` ends with ``.gz``;
    atomically.

    Raises:
        CamvizError: ``values`` has another shape than the scan.
    """
    nibabel = _nibabel()
    path = Path(path)
    values = np.asarray(values, dtype=np.float32)
    if values.shape != like.data.shape:
        raise CamvizError(f"a map of shape {values.shape} does not fit a scan of {like.data.shape}")
    header = like.header.copy()
    header.set_data_dtype(np.float32)
    header.set_slope_inter(1.0, 0.0)  # the values as they are, whatever the scan's scaling
    header["descrip"] = description.encode()[:79]
    image = nibabel.Nifti1Image(values, like.affine, header=header)
    qform, qcode = like.header.get_qform(coded=True)
    sform, scode = like.header.get_sform(coded=True)
    image.set_qform(like.affine if qform is None else qform, int(qcode))
    image.set_sform(like.affine if sform is None else sform, int(scode))
    data = image.to_bytes()
    if path.name.lower().endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    with atomic_write(path) as file:
        file.write(data)
    return path


def montage(
    scan: torch.Tensor,
    heatmap: torch.Tensor,
    draw: Any,
    slices: int = _MONTAGE_SLICES,
) -> Image.Image:
    """A grid of ``slices`` evenly spaced slices along the scan's last axis, each drawn by
    ``draw(grey_image, heatmap_slice)`` (an overlay), shown with the first axis across and
    the second up, as viewers show an axial slice.

    Args:
        scan: ``(I, J, K)`` intensities (any range; each montage is scaled to its own).
        heatmap: ``(I, J, K)`` map in ``[0, 1]``.
        draw: ``(PIL image, (h, w) map) -> PIL image``.
        slices: How many slices (at most the scan's depth).
    """
    depth = scan.shape[-1]
    count = max(1, min(slices, depth))
    chosen = sorted({round((index + 0.5) * depth / count - 0.5) for index in range(count)})
    low, high = float(scan.min()), float(scan.max())
    grey = ((scan - low) / (high - low) if high > low else torch.zeros_like(scan)) * 255
    scale = max(1, -(-_MONTAGE_TILE // min(scan.shape[0], scan.shape[1])))
    tiles = []
    for index in chosen:
        # (I, J) -> rows from the top are J descending, columns are I: transpose and flip.
        picture = grey[:, :, index].T.flip(0).round().to(torch.uint8).numpy()
        image = Image.fromarray(picture).convert("RGB")
        image = image.resize((image.width * scale, image.height * scale), Image.Resampling.NEAREST)
        tiles.append(draw(image, heatmap[:, :, index].T.flip(0)))
    columns = int(np.ceil(np.sqrt(len(tiles))))
    rows = -(-len(tiles) // columns)
    width, height = tiles[0].size[0] + _GAP, tiles[0].size[1] + _GAP
    sheet = Image.new("RGB", (columns * width - _GAP, rows * height - _GAP))
    for position, tile in enumerate(tiles):
        sheet.paste(tile, ((position % columns) * width, (position // columns) * height))
    return sheet
