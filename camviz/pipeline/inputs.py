"""Turn what the user names on the command line into a list of things to explain.

An *input* is one of:

* an image file (any extension: a file named explicitly is always tried);
* a folder, searched recursively for files with an image or video extension (hidden files
  and folders are left out);
* a glob pattern (``"photos/**/*.jpg"``), whose matches are taken like a folder's files;
* a text file of paths (``.txt`` or ``.lst``), one input per line, relative to the list's
  own folder; blank lines and lines starting with ``#`` are ignored;
* a video (``.mp4``, ``.avi``, ``.mov``, ``.mkv``, ``.webm``, ...): every frame, or every
  n-th, becomes its own item; for a video model, every clip of ``clip_len`` frames, one
  starting every ``stride`` frames (and one ending with the video), becomes one (named
  after its first frame);
* a NIfTI volume (``.nii``, ``.nii.gz``), one item named without ``.nii`` or ``.nii.gz``
  (see :mod:`camviz.pipeline.volumes`).

Inputs that cannot be expanded (a missing file, a pattern that matches nothing, a video
OpenCV cannot open, anything that is not a regular file: a FIFO, a socket, a device, or a
link to one, which would block the run when opened) are not errors here: they become items
with a :attr:`Item.reason`, which the run reports and skips like an unreadable image.

Files that camviz itself wrote are never inputs: the caller passes them as ``exclude``
(the files an output folder's manifests list, and those an interrupted run wrote before
their rows, see :mod:`camviz.pipeline.encoders`). The user's own files stay inputs, also
those named like an output (``cat_overlay.png`` beside ``cat.png``), and no output is ever
written over them: the caller passes the names whose outputs would land on them as
``taken``, and those inputs get other names.

Every item has a *key* (its path, plus ``#frame`` for a video frame) that identifies it
across runs, so a resumed run knows what is done; and a *name*, unique in the run, from
which its output files are named (:mod:`camviz.pipeline.naming`). A folder's files keep
their sub-folders in the name (``cat/001``, ``dog/001``), so same-named files in different
class folders do not collide. Names never collide, whatever the inputs are called: two names
that differ only in case (one file on macOS and Windows), an image whose name a video's
frames would also take (``clip_frames/000000.png`` beside ``clip.mp4``), a name that a rank
suffix makes from another (``b_rank1.png`` beside ``b.png``: the one map of the first and the
first of several maps of the second), and a name in ``taken`` get a short hash of their path
added (``x-3f2a9c1b``). A name part too long for the file system once the output suffixes are
added (most allow 255 bytes) is cut and gets a hash of its full text. Bytes of a file name
that are not UTF-8 become U+FFFD in the name, so that every output name is text. The hashes
depend only on the path, so a resumed run gives every input the same name again.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from camviz.core.errors import CamvizError
from camviz.io.files import not_a_regular_file
from camviz.io.volumes import is_volume, volume_stem
from camviz.pipeline.naming import rank_clash
from camviz.pipeline.rows import item_key

#: File extensions taken as videos; everything else is read as an image.
VIDEO_SUFFIXES = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg"})

#: Extensions of text files that list inputs, one per line.
LIST_SUFFIXES = frozenset({".txt", ".lst"})

_GLOB_CHARACTERS = frozenset("*?[")

#: The longest file name, in bytes, that most file systems take (ext4, XFS, Btrfs, APFS...).
NAME_MAX = 255

# Bytes kept free in each part of a name for what the job adds to it: the longest output
# suffix ("_rank99_heatmap.npz"), a video's "_frames", atomic_write's temporary wrapper
# (".NAME.<12 hex>.tmp.mp4") and a collision hash ("-3f2a9c1b").
_NAME_RESERVE = 64


@dataclass(frozen=True)
class Item:
    """One image, or one frame of a video, to explain.

    Attributes:
        path: The file, as the user wrote it (a folder's files joined onto the folder).
        name: Output file stem, unique in the run; may contain ``/`` (sub-folders).
        frame: The frame index for a video frame (a clip's first frame), else ``None``.
        video: For a frame, the output stem of its video (``clip`` for ``clip.mp4``).
        reason: Why this input cannot be read, found while expanding; ``None`` if it can.
        clip_len: For a clip, its number of frames; ``None`` for an image or one frame.
    """

    path: str
    name: str
    frame: int | None = None
    video: str | None = None
    reason: str | None = None
    clip_len: int | None = None

    @property
    def key(self) -> str:
        """What identifies this item across runs (see
        :func:`camviz.pipeline.rows.item_key`)."""
        return item_key(self.path, self.frame)


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
    exclude: Collection[str | os.PathLike[str]] = (),
    taken: Collection[str] = (),
    max_name_bytes: int = NAME_MAX,
    clips: tuple[int, int] | None = None,
) -> list[Item]:
    """The items named by files, folders, globs, path lists and videos, in a stable order.

    The order is that of ``inputs``; a folder's or a glob's files are sorted by path. A
    file named twice is kept once.

    Args:
        inputs: One input or several (see the module docstring).
        every: Take every ``every``-th frame of a video (0, every, 2 * every, ...).
        exclude: Files that are never inputs (those a previous run wrote), wherever they
            are found.
        taken: Case-folded names whose outputs would land on files that are not camviz's;
            inputs of those names get other names.
        max_name_bytes: The file system's longest file name; longer names are shortened.
        clips: ``(clip_len, stride)``: a video gives clips of ``clip_len`` frames, one
            starting every ``stride`` frames (``every`` is then unused), for a video model.

    Raises:
        CamvizError: ``every`` is not a positive integer, or a path list cannot be read.
    """
    if not isinstance(every, int) or every < 1:
        raise CamvizError(f"every must be a positive whole number of frames, not {every!r}")
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    written = {os.path.realpath(path) for path in exclude}
    found: dict[str, _File] = {}
    for source in inputs:
        for file in _expand_one(os.fspath(source), every, lists=True):
            if not written or os.path.realpath(file.path) not in written:
                found.setdefault(os.path.normpath(file.path), file)
    files = list(found.values())
    names = _unique_names(files, max_name_bytes, {name.casefold() for name in taken})
    items = []
    for file, name in zip(files, names, strict=True):
        if file.frames is None:
            items.append(Item(path=file.path, name=name, reason=file.reason))
        elif clips is not None:
            items.extend(_clips(file, name, *clips))
        else:
            items.extend(
                Item(path=file.path, name=f"{name}_frames/{frame:06d}", frame=frame, video=name)
                for frame in file.frames
            )
    return items


def _clips(file: _File, name: str, clip_len: int, stride: int) -> list[Item]:
    """The clips of a video: ``clip_len`` frames from every ``stride``-th frame on, and one
    ending with the video's last frame when those leave frames at its end."""
    assert file.frames is not None  # a video
    count = file.frames.stop
    if count < clip_len:
        reason = (
            f"video {file.path} has {count} frames, fewer than a clip's {clip_len}; pass a "
            "smaller --clip-len"
        )
        return [Item(path=file.path, name=name, reason=reason)]
    starts = list(range(0, count - clip_len + 1, stride))
    if starts[-1] + clip_len < count:  # one more clip, ending with the video, covers its end
        starts.append(count - clip_len)
    return [
        Item(
            path=file.path,
            name=f"{name}_frames/{start:06d}",
            frame=start,
            video=name,
            clip_len=clip_len,
        )
        for start in starts
    ]


def _expand_one(source: str, every: int, lists: bool) -> Iterator[_File]:
    path = Path(source)
    if path.is_dir():
        for file in _walk(path):
            yield _file(str(file), every, _stem(file.relative_to(path)))
    elif path.exists() or path.is_symlink():
        if lists and path.is_file() and path.suffix.lower() in LIST_SUFFIXES:
            for line in _read_list(path):
                yield from _expand_one(line, every, lists=False)
        else:
            yield _file(source, every, _stem(Path(path.name)))
    elif _GLOB_CHARACTERS & set(source):
        matches = sorted(glob.glob(source, recursive=True))
        found = [match for match in matches if Path(match).is_dir() or _is_media(Path(match))]
        if not found:
            reason = f"no image or video matches {source!r}; check the pattern"
            yield _File(source, "unmatched", reason=reason)
        for match in found:
            yield from _expand_one(match, every, lists=False)
    else:
        yield _File(source, path.stem, reason=f"input not found: {source}; check the path")


def _walk(folder: Path) -> Iterator[Path]:
    """Files under ``folder`` with an image or video extension, sorted, without hidden ones.

    Special files (FIFOs, sockets, devices) with such an extension are listed too: they
    are reported as skipped, not silently passed over.
    """
    for root, folders, files in os.walk(folder):
        here = Path(root)
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and _is_media(here / name):
                yield here / name


def _file(path: str, every: int, stem: str) -> _File:
    problem = not_a_regular_file(path)
    if problem is not None:
        return _File(path, stem, reason=problem)
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


def _stem(relative: Path) -> str:
    """The output stem of a file at ``relative`` (sub-folders kept, the extension dropped:
    both of ``.nii.gz``)."""
    name = volume_stem(relative) if is_volume(relative) else relative.stem
    return (relative.parent / name).as_posix()


def _is_media(path: Path) -> bool:
    """Whether ``path`` has an image, video or volume extension (and exists, whatever its
    type)."""
    suffix = path.suffix.lower()
    return (path.exists() or path.is_symlink()) and (
        suffix in VIDEO_SUFFIXES or suffix in _image_suffixes() or is_volume(path)
    )


@functools.cache
def _image_suffixes() -> frozenset[str]:
    """Extensions of every format Pillow can open."""
    Image.init()
    return frozenset(
        suffix
        for suffix, image_format in Image.registered_extensions().items()
        if image_format in Image.OPEN
    )


def _unique_names(
    files: Sequence[_File], max_name_bytes: int, taken: Collection[str] = ()
) -> list[str]:
    """Each file's stem, fitted to the file system, with a hash of its path where names clash
    (or are ``taken``).

    The hash, unlike a counter, does not depend on the order of the inputs or on which
    other files are in the run, so a resumed run with more inputs never gives a new file
    the name (and so the output files) of one already done. A name that clashes even with
    its hash (someone named a file like another's hashed name) gets a longer hash.
    """
    stems = [_fitted(_text(file.stem), max_name_bytes) for file in files]
    videos = [file.frames is not None for file in files]
    digits = [0] * len(files)
    for _ in range(4):
        names = [
            stem if count == 0 else f"{stem}-{_path_hash(file.path)[:count]}"
            for stem, file, count in zip(stems, files, digits, strict=True)
        ]
        clashing = _clashing(names, videos, taken)
        if not clashing:
            return names
        for index in clashing:
            digits[index] = 8 if digits[index] == 0 else 40
    raise CamvizError("cannot give the inputs distinct output names; rename the inputs")


def _clashing(names: Sequence[str], videos: Sequence[bool], taken: Collection[str]) -> set[int]:
    """Positions of names whose outputs would land on another's or on a ``taken`` name's
    (case ignored)."""
    keys = [name.casefold() for name in names]
    counts = Counter(zip(keys, videos, strict=True))
    frame_folders = {key + "_frames/": index for index, key in enumerate(keys) if videos[index]}
    clashing = {index for index, key in enumerate(keys) if counts[key, videos[index]] > 1}
    every = set(keys)
    clashing |= {index for index, key in enumerate(keys) if key in taken or rank_clash(key, every)}
    for index, key in enumerate(keys):
        if videos[index] or "_frames/" not in key:
            continue
        for match in re.finditer("_frames/", key):
            video = frame_folders.get(key[: match.end()])
            if video is not None:
                clashing |= {index, video}
    return clashing


def _text(stem: str) -> str:
    """``stem`` with each byte that is not UTF-8 (a surrogate escape) replaced by U+FFFD."""
    return stem.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _fitted(stem: str, max_name_bytes: int) -> str:
    """``stem`` with each too-long part cut and marked with a hash of its full text."""
    limit = max(16, max_name_bytes - _NAME_RESERVE)
    parts = []
    for part in stem.split("/"):
        encoded = part.encode("utf-8", "surrogateescape")
        if len(encoded) > limit:
            digest = hashlib.sha1(encoded).hexdigest()[:8]
            kept = encoded[: limit - 9].decode("utf-8", "ignore")
            part = f"{kept}-{digest}"
        parts.append(part)
    return "/".join(parts)


def _path_hash(path: str) -> str:
    return hashlib.sha1(os.path.normpath(path).encode("utf-8", "surrogateescape")).hexdigest()
