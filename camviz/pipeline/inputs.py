"""Turn what the user names on the command line into a list of things to explain.

An *input* is one of:

* an image file (any extension: a file named explicitly is always tried);
* a folder, searched recursively for files with an image or video extension (hidden files
  and folders, and the output folder, are left out);
* a glob pattern (``"photos/**/*.jpg"``), whose matches are taken like a folder's files;
* a text file of paths (``.txt`` or ``.lst``), one input per line, relative to the list's
  own folder; blank lines and lines starting with ``#`` are ignored;
* a video (``.mp4``, ``.avi``, ``.mov``, ``.mkv``, ``.webm``, ...): every frame, or every
  n-th, becomes its own item.

Inputs that cannot be expanded (a missing file, a pattern that matches nothing, a video
OpenCV cannot open) are not errors here: they become items with a :attr:`Item.reason`,
which the run reports and skips like an unreadable image.

Every item has a *key* (its path, plus ``#frame`` for a video frame) that identifies it
across runs, so a resumed run knows what is done; and a *name*, unique in the run, from
which its output files are named. A folder's files keep their sub-folders in the name
(``cat/001``, ``dog/001``), so same-named files in different class folders do not collide;
two inputs that would still share a name get a short hash of their path added
(``x-3f2a9c1b``).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from camviz.core.errors import CamvizError

#: File extensions taken as videos; everything else is read as an image.
VIDEO_SUFFIXES = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg"})

#: Extensions of text files that list inputs, one per line.
LIST_SUFFIXES = frozenset({".txt", ".lst"})

_GLOB_CHARACTERS = frozenset("*?[")


@dataclass(frozen=True)
class Item:
    """One image, or one frame of a video, to explain.

    Attributes:
        path: The file, as the user wrote it (a folder's files joined onto the folder).
        name: Output file stem, unique in the run; may contain ``/`` (sub-folders).
        frame: The frame index for a video frame, else ``None``.
        video: For a frame, the output stem of its video (``clip`` for ``clip.mp4``).
        reason: Why this input cannot be read, found while expanding; ``None`` if it can.
    """

    path: str
    name: str
    frame: int | None = None
    video: str | None = None
    reason: str | None = None

    @property
    def key(self) -> str:
        """What identifies this item across runs (see :func:`item_key`)."""
        return item_key(self.path, self.frame)


def item_key(path: str, frame: int | None) -> str:
    """The path, with ``#N`` added for frame ``N`` of a video."""
    return path if frame is None else f"{path}#{frame}"


@dataclass(frozen=True)
class _File:
    """One file found while expanding, before names are made unique."""

    path: str
    stem: str
    frames: range | None = None  # the frames to explain, for a video
    reason: str | None = None


def expand(
    inputs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    every: int = 1,
    exclude: str | os.PathLike[str] | None = None,
) -> list[Item]:
    """The items named by files, folders, globs, path lists and videos, in a stable order.

    The order is that of ``inputs``; a folder's or a glob's files are sorted by path. A
    file named twice is kept once.

    Args:
        inputs: One input or several (see the module docstring).
        every: Take every ``every``-th frame of a video (0, every, 2 * every, ...).
        exclude: A folder whose files are never inputs (the output folder, which may lie
            inside an input folder).

    Raises:
        CamvizError: ``every`` is not a positive integer, or a path list cannot be read.
    """
    if not isinstance(every, int) or every < 1:
        raise CamvizError(f"every must be a positive whole number of frames, not {every!r}")
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    skipped = Path(exclude).resolve() if exclude is not None else None
    files: dict[str, _File] = {}
    for source in inputs:
        for file in _expand_one(os.fspath(source), every, skipped, lists=True):
            files.setdefault(os.path.normpath(file.path), file)
    items = []
    for file, name in zip(files.values(), _unique_names(list(files.values())), strict=True):
        if file.frames is None:
            items.append(Item(path=file.path, name=name, reason=file.reason))
        else:
            items.extend(
                Item(path=file.path, name=f"{name}_frames/{frame:06d}", frame=frame, video=name)
                for frame in file.frames
            )
    return items


def _expand_one(source: str, every: int, skipped: Path | None, lists: bool) -> Iterator[_File]:
    path = Path(source)
    if path.is_dir():
        for file in _walk(path, skipped):
            yield _file(str(file), every, file.relative_to(path).with_suffix("").as_posix())
    elif path.is_file() or path.is_symlink():
        if lists and path.suffix.lower() in LIST_SUFFIXES:
            for line in _read_list(path):
                yield from _expand_one(line, every, skipped, lists=False)
        else:
            yield _file(source, every, path.stem)
    elif _GLOB_CHARACTERS & set(source):
        matches = sorted(glob.glob(source, recursive=True))
        found = [match for match in matches if Path(match).is_dir() or _is_media(Path(match))]
        if not found:
            reason = f"no image or video matches {source!r}; check the pattern"
            yield _File(source, "unmatched", reason=reason)
        for match in found:
            yield from _expand_one(match, every, skipped, lists=False)
    else:
        yield _File(source, path.stem, reason=f"input not found: {source}; check the path")


def _walk(folder: Path, skipped: Path | None) -> Iterator[Path]:
    """Image and video files under ``folder``, sorted, without hidden ones or ``skipped``."""
    for root, folders, files in os.walk(folder):
        here = Path(root)
        folders[:] = sorted(
            name
            for name in folders
            if not name.startswith(".") and (here / name).resolve() != skipped
        )
        for name in sorted(files):
            if not name.startswith(".") and _is_media(here / name):
                yield here / name


def _file(path: str, every: int, stem: str) -> _File:
    if Path(path).suffix.lower() not in VIDEO_SUFFIXES:
        return _File(path, stem)
    from camviz.io.video import frame_count

    try:
        count = frame_count(path)
    except CamvizError as error:
        return _File(path, stem, reason=str(error))
    if count == 0:
        return _File(path, stem, reason=f"video {path} has no frames; check the file")
    return _File(path, stem, frames=range(0, count, every))


def _read_list(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise CamvizError(
            f"cannot read the path list {path} ({type(error).__name__}); give a UTF-8 text "
            "file with one path per line"
        ) from None
    entries = (line.strip() for line in lines)
    return [
        str(path.parent / entry) if not os.path.isabs(entry) else entry
        for entry in entries
        if entry and not entry.startswith("#")
    ]


def _is_media(path: Path) -> bool:
    suffix = path.suffix.lower()
    return path.is_file() and (suffix in VIDEO_SUFFIXES or suffix in _image_suffixes())


@functools.cache
def _image_suffixes() -> frozenset[str]:
    """Extensions of every format Pillow can open."""
    Image.init()
    return frozenset(
        suffix
        for suffix, image_format in Image.registered_extensions().items()
        if image_format in Image.OPEN
    )


def _unique_names(files: Sequence[_File]) -> list[str]:
    """Each file's stem, with a short hash of its path added where two files share a stem.

    The hash, unlike a counter, does not depend on the order of the inputs or on which
    other files are in the run, so a resumed run with more inputs never gives a new file
    the name (and so the output files) of one already done.
    """
    counts = Counter(file.stem for file in files)
    return [
        file.stem if counts[file.stem] == 1 else f"{file.stem}-{_path_hash(file.path)}"
        for file in files
    ]


def _path_hash(path: str) -> str:
    return hashlib.sha1(os.path.normpath(path).encode()).hexdigest()[:8]
