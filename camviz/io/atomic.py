"""Files that appear complete or not at all.

Every file camviz writes goes to a hidden temporary name in its folder first and replaces
the real name only when complete: :func:`atomic_write` for code that writes to an open
file, :func:`atomic_path` for writers that open the file themselves (videos). The temporary
names follow one pattern (:func:`temporary_path`), so that a later run can tell them apart
from the user's files and remove those that an interrupted run left behind
(:func:`is_temporary`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal

from camviz.core.errors import CamvizError

# ".NAME.<12 hex>.tmp", with NAME's suffix repeated at the end when the writer needs it.
_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp(\.\w+)?$")


def temporary_path(path: Path, keep_suffix: bool = False) -> Path:
    """A fresh hidden name beside ``path`` for writing it.

    Args:
        path: The file that will be written.
        keep_suffix: End the name with ``path``'s suffix too, for writers that pick the
            format from the name (OpenCV's ``VideoWriter``).
    """
    suffix = path.suffix if keep_suffix else ""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp{suffix}")


def is_temporary(name: str) -> bool:
    """Whether a file name is one that :func:`temporary_path` makes."""
    return _TEMPORARY.match(name) is not None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, keep_suffix: bool = False) -> Iterator[Path]:
    """A hidden temporary path beside ``path`` for a writer that takes a file name.

    For writers that open the file themselves (OpenCV's ``VideoWriter``, ffmpeg): the block
    writes the returned path, which replaces ``path`` (``os.replace``, atomic on one file
    system) only when the block ends without error. On any error the temporary file is
    removed and ``path`` is left as it was. The block must create the file.
    :func:`atomic_write` is this with the file opened for the block.

    Args:
        path: The file to write; missing folders are created.
        keep_suffix: End the temporary name with ``path``'s suffix too, for writers that
            pick the format from the name.

    Yields:
        The temporary path, not yet created.

    Raises:
        CamvizError: The folder cannot be created or written to, or ``path`` is a folder.
    """
    path = Path(path)
    if path.is_dir():
        raise CamvizError(f"{path} is a folder; give a file name inside it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CamvizError(_unwritable(path, error)) from None
    temporary = temporary_path(path, keep_suffix)
    try:
        yield temporary
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    try:
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise CamvizError(_unwritable(path, error)) from None


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: Literal["wb", "w"] = "wb") -> Iterator[IO]:
    """Open ``path`` for writing so that it appears complete or not at all.

    The data goes to a hidden temporary file in the same folder, which replaces ``path``
    (``os.replace``, atomic on one file system) only when the block ends without error.
    On any error the temporary file is removed and ``path`` is left as it was. This guards
    against a crashed or failed writer, not against power loss (there is no fsync).

    Args:
        path: The file to write; missing folders are created.
        mode: ``"wb"`` for bytes, ``"w"`` for UTF-8 text.

    Yields:
        The open temporary file.

    Raises:
        CamvizError: The folder cannot be created or written to, or ``path`` is a folder.

    Example:
        >>> with atomic_write("out/manifest.json", "w") as file:
        ...     json.dump(manifest, file)
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', not {mode!r}")
    with atomic_path(path) as temporary:
        try:
            # os.open with 0o666 lets the umask decide permissions, as for any new file;
            # tempfile would create it readable by the owner only.
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as error:
            raise CamvizError(_unwritable(Path(path), error)) from None
        with os.fdopen(descriptor, mode, encoding="utf-8" if mode == "w" else None) as file:
            yield file


def _unwritable(path: Path, error: OSError) -> str:
    blocking = next((p for p in (path.parent, *path.parent.parents) if p.is_file()), None)
    if blocking is not None:
        return f"cannot write {path}: {blocking} is a file, not a folder; choose another path"
    reason = error.strerror or type(error).__name__
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"cannot write {path} ({reason}); make room, then run the same command again"
    return f"cannot write {path} ({reason}); choose an output folder you can write to"
