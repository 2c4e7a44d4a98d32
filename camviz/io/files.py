"""Reading regular files only: a FIFO, socket or device named as an input is refused.

Opening a FIFO for reading blocks until something writes to it, so a FIFO given as an image
would hang the command forever; a device such as ``/dev/zero`` never ends. Everything that
reads a user's file goes through here: :func:`not_a_regular_file` checks a path before a
run lists it, :func:`open_regular` opens one without blocking and checks what it opened
(so a file replaced by a FIFO after the check is refused too).
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from camviz.core.errors import CamvizError

_KINDS = {
    stat.S_ISFIFO: "a FIFO",
    stat.S_ISSOCK: "a socket",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISDIR: "a folder",
}


def not_a_regular_file(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a file (missing, a FIFO, a device...), or ``None``.

    Links are followed; nothing is opened.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"input not found: {path}; check the path"
    except OSError as error:
        return f"cannot read {path} ({error.strerror or type(error).__name__}); check the path"
    return _special(path, mode)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """``path`` opened for reading in binary mode, if it is a regular file.

    Raises:
        CamvizError: ``path`` is a FIFO, socket, device or folder (the message says which).
        OSError: It cannot be opened (missing, no permission), as :func:`open` raises.
    """
    # O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting; it
    # changes nothing for a regular file.
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        problem = _special(path, os.fstat(descriptor).st_mode)
    except BaseException:
        os.close(descriptor)
        raise
    if problem is not None:
        os.close(descriptor)
        raise CamvizError(problem)
    return os.fdopen(descriptor, "rb")


def _special(path: str | os.PathLike[str], mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS.items() if test(mode)), "a special file")
    return f"{path} is not a regular file ({kind}); camviz reads regular files only"
