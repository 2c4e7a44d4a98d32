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

import numpy as np
import torch
from isal import isal_zlib
from PIL import Image, PngImagePlugin

from camviz.io.atomic import atomic_write
from camviz.io.images import PathLike
from camviz.io.pictures import as_rgb
from camviz.io.volumes import Volume, write_volume
from camviz.pipeline.naming import VIDEO_SUFFIX, output_owners

#: What marks a file as written by a camviz folder job.
MARK = "camviz explain"

# How overlays are PNG-encoded: every row "sub"-filtered (each byte minus the one of the
# pixel to its left), then deflated by ISA-L at its level 1. An overlay is a photo, in whose
# filtered rows LZ77 finds few matches, so trying five filters per row (Pillow's and
# libpng's default) costs more than it saves, and ISA-L's fast deflate makes a file as small
# as zlib's Huffman coding alone in a third of the time: a 400x300 overlay in 1.9 ms and
# 193 KiB, against 5.3 ms and 190 KiB with OpenCV's libpng at zlib level 1, Huffman only,
# and 11 ms with Pillow's level 1. On a CPU each of those milliseconds is the model's.
_SUB_FILTER = 1
_ISAL_LEVEL = 1
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# JPEG quality of panels: at 90 the picture is indistinguishable from the PNG's.
_PANEL_QUALITY = 90


def _png_info() -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", MARK)
    return info


def save_png(image: Image.Image, path: Path) -> None:
    """Write an RGB picture (an overlay, a montage) as a PNG, atomically and marked."""
    with atomic_write(path) as file:
        file.write(png_bytes(np.asarray(as_rgb(image))))


def png_bytes(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``(H, W, 3)`` uint8 ``pixels``, marked (comment above)."""
    height, width, _ = pixels.shape
    rows = pixels.reshape(height, width * 3)
    filtered = np.empty((height, 1 + width * 3), np.uint8)
    filtered[:, 0] = _SUB_FILTER
    filtered[:, 1:4] = rows[:, :3]
    np.subtract(rows[:, 3:], rows[:, :-3], out=filtered[:, 4:])  # modulo 256, as PNG's Sub
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"".join(
        (
            _PNG_SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"tEXt", b"Software\0" + MARK.encode("latin-1")),
            _chunk(b"IDAT", isal_zlib.compress(filtered.data, _ISAL_LEVEL)),
            _chunk(b"IEND", b""),
        )
    )


def _chunk(kind: bytes, body: bytes) -> bytes:
    """A PNG chunk: the length of ``body``, ``kind``, ``body``, and the CRC of the two."""
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


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
