"""The files of a folder job: pictures and maps encoded atomically, each marked as camviz's.

Every picture and map the job writes carries :data:`MARK` (a PNG ``Software`` text chunk, a
JPEG comment, the comment of an ``.npz`` archive, a NIfTI header's ``descrip``), invisible to
image viewers and ``np.load``. A file named like an output that no manifest row lists is
then told apart without guessing: with the mark it is what an interrupted run wrote before
its row (camviz writes it again), without it the user's own file (camviz never replaces it, see
:func:`existing_outputs`). Videos carry no mark; one named like an output counts as camviz's
in a folder that camviz's manifest says it uses.
"""

from __future__ import annotations

import gzip
import os
import struct
import zipfile
import zlib
from collections.abc import Collection
from pathlib import Path

import cv2
import numpy as np
import torch
from PIL import Image, PngImagePlugin

from camviz.io.atomic import atomic_write
from camviz.io.images import PathLike
from camviz.io.pictures import as_rgb
from camviz.io.volumes import Volume, write_volume
from camviz.pipeline.naming import VIDEO_SUFFIX, output_owners

#: What marks a file as written by a camviz folder job.
MARK = "camviz explain"

# How overlays are PNG-encoded (by OpenCV, with libpng): zlib level 1, Huffman coding alone,
# and every row "sub"-filtered (each byte minus the one of the pixel to its left). An overlay
# is a photo, in whose filtered rows LZ77 finds few matches, and trying five filters per row
# (Pillow's and libpng's default) costs more than it saves: a 400x300 overlay encoded in
# 4 ms where Pillow's level 1 took 11 ms, 8% larger. Lossless either way. OpenCV before
# 4.12 has no filter option and uses libpng's choice (the same pixels, a little slower).
_PNG_OPTIONS = [
    cv2.IMWRITE_PNG_COMPRESSION,
    1,
    cv2.IMWRITE_PNG_STRATEGY,
    cv2.IMWRITE_PNG_STRATEGY_HUFFMAN_ONLY,
]
if hasattr(cv2, "IMWRITE_PNG_FILTER"):
    _PNG_OPTIONS += [cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_SUB]

# JPEG quality of panels: at 90 the picture is indistinguishable from the PNG's.
_PANEL_QUALITY = 90

# A PNG file: its signature, then the IHDR chunk (4 bytes length, 4 type, 13 data, 4 CRC).
_PNG_HEADER = 8 + 4 + 4 + 13 + 4


def _png_info() -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", MARK)
    return info


def save_png(image: Image.Image, path: Path) -> None:
    """Write an RGB picture (an overlay, a montage) as a PNG, atomically and marked."""
    pixels = cv2.cvtColor(np.asarray(as_rgb(image)), cv2.COLOR_RGB2BGR)  # OpenCV's order
    encoded, png = cv2.imencode(".png", pixels, _PNG_OPTIONS)
    if not encoded:
        raise RuntimeError(f"OpenCV could not encode {path.name} as a PNG")
    data = png.tobytes()
    with atomic_write(path) as file:
        # The mark as a tEXt chunk right after the header, where Pillow's would be.
        file.write(data[:_PNG_HEADER] + _text_chunk("Software", MARK) + data[_PNG_HEADER:])


def _text_chunk(keyword: str, text: str) -> bytes:
    """A PNG tEXt chunk: length, type, ``keyword``, a zero byte, ``text``, and the CRC."""
    body = b"tEXt" + keyword.encode("latin-1") + b"\0" + text.encode("latin-1")
    return struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))


def save_jpeg(image: Image.Image, path: Path) -> None:
    """Write a panel as a JPEG, atomically and marked."""
    with atomic_write(path) as file:
        image.save(file, format="JPEG", quality=_PANEL_QUALITY, comment=MARK)


def save_heatmap(heatmap: torch.Tensor, path: PathLike) -> Path:
    """Write a ``(H, W)`` map in ``[0, 1]``, atomically, as ``.npz`` or 16-bit ``.png``.

    ``.npz`` keeps the float32 values under the key ``heatmap`` (``np.load(path)["heatmap"]``);
    ``.png`` stores ``round(value * 65535)`` as 16-bit grey, 1/65535 apart from the values.
    """
    path = Path(path)
    values = heatmap.detach().to("cpu", torch.float32).numpy()
    with atomic_write(path) as file:
        if path.suffix == ".npz":
            # What np.savez_compressed writes, with the mark as the archive's comment.
            with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_DEFLATED) as archive:
                archive.comment = MARK.encode()
                with archive.open("heatmap.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, values, allow_pickle=False)
        else:
            levels = np.rint(np.clip(values, 0, 1) * 65535).astype(np.uint16)
            Image.fromarray(levels).save(file, format="PNG", pnginfo=_png_info())
    return path


def save_volume_heatmap(heatmap: torch.Tensor, like: Volume, path: Path) -> None:
    """Write a volume's map as a float32 NIfTI with the scan's geometry, atomically and
    marked (see :func:`camviz.io.volumes.write_volume`)."""
    write_volume(path, heatmap.detach().to("cpu", torch.float32).numpy(), like, MARK)


# Where a NIfTI-1 header keeps its description, and how long it is.
_DESCRIPTION = slice(148, 228)


def is_marked(path: Path) -> bool:
    """Whether ``path`` carries :data:`MARK` (an unreadable file does not)."""
    try:
        if path.suffix == ".npz":
            with zipfile.ZipFile(path) as archive:
                return archive.comment == MARK.encode()
        if path.name.endswith(".nii.gz"):
            with gzip.open(path) as file:
                return file.read(348)[_DESCRIPTION].rstrip(b"\0") == MARK.encode()
        with Image.open(path) as image:
            found = image.info.get("Software") or image.info.get("comment")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, Image.DecompressionBombError):
        return False
    return found in (MARK, MARK.encode())


def existing_outputs(
    out: Path, listed: Collection[Path], folder_used: bool
) -> tuple[set[Path], set[str]]:
    """The files in ``out`` named like outputs that no row lists, sorted by whose they are.

    Args:
        out: The output folder.
        listed: The files that the folder's manifests list (camviz's, known).
        folder_used: Whether camviz's manifest is in ``out`` (it has run there).

    Returns:
        The files camviz wrote (an interrupted run's, to be written again and never
        explained), and the case-folded names of the inputs whose outputs would land on the
        user's files (they are given other names, see :mod:`camviz.pipeline.inputs`).
    """
    if not out.is_dir():
        return set(), set()
    known = {os.path.normpath(path) for path in listed}
    ours: set[Path] = set()
    taken: set[str] = set()
    for folder, folders, names in os.walk(out):
        folders[:] = [name for name in folders if not name.startswith(".")]
        for name in names:
            path = Path(folder, name)
            owners = output_owners(path.relative_to(out).as_posix())
            if not owners or name.startswith(".") or os.path.normpath(path) in known:
                continue
            if is_marked(path) or (folder_used and path.suffix == VIDEO_SUFFIX):
                ours.add(path)
            else:
                taken |= {owner.casefold() for owner in owners}
    return ours, taken
