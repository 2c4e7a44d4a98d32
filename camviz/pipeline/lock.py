"""One job at a time per output folder: a lock file kept fresh by a heartbeat.

Two jobs writing into one folder would delete each other's temporary files at start-up
and redo each other's work, so a job takes the folder first. The lock is the file
:data:`LOCK` in the output folder, created atomically (``O_CREAT | O_EXCL``, which holds on
local file systems and on NFSv3 and later). It says who holds it: host, process id, start
time and a random token. While the job runs, a thread touches the file every
:data:`HEARTBEAT` seconds.

A job that finds a lock takes it over only if the lock is *stale*:

* its holder ran on this machine and that process is gone (a job killed with ``kill -9``
  can be rerun at once), or
* its heartbeat is older than :data:`STALE` seconds (the holder's host may be another
  machine sharing the folder, where its process id means nothing, or the holder hung).

"This machine" is the host name *and* the running kernel's boot id and process-id namespace
(:func:`machine`): nodes of a cluster, containers and the two launchers of a ``torchrun
--nnodes=2`` test may share a host name, and a process id of one means nothing on another,
so a lock of another machine, live or not, is judged by its heartbeat only. A lock without
that field (written by an older camviz) is judged by its host name, as it was.

Otherwise the job stops with a :class:`~camviz.core.errors.CamvizError` saying who holds
the folder, and touches nothing in it. A takeover renames the stale lock away and checks
that it renamed the lock it judged stale, so two jobs that find one stale lock at once
cannot both take it.

Under ``torchrun`` the processes of one job share the folder: the rank-0 process takes the
lock for all of them, on whichever node it runs, and every process learns whether it got it;
no other rank ever reads or touches the lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from camviz.core.errors import CamvizError
from camviz.pipeline import distributed

#: The lock file, in the output folder (hidden, so never taken as an input).
LOCK = ".camviz.lock"

#: Seconds between two touches of the lock by the job that holds it.
HEARTBEAT = 5.0

#: A lock whose heartbeat is older than this, in seconds, is stale.
STALE = 60.0


@contextlib.contextmanager
def locked(out: Path, context: distributed.Context) -> Iterator[None]:
    """Hold the output folder ``out`` for this job while the block runs.

    The folder (and missing parents) is created to hold the lock; folders created here that
    are still empty at the end (the job failed before writing) are removed again.

    Raises:
        CamvizError: Another job holds the folder, or it cannot be created or written.
    """
    holder: _Holder | None = None
    error: CamvizError | None = None
    if context.is_main:
        try:
            holder = _Holder(out)
        except CamvizError as failure:
            error = failure
    if distributed.total(int(error is not None), context):
        if error is not None:
            raise error
        raise CamvizError(f"the output folder {str(out)!r} is in use; see the rank-0 message")
    try:
        yield
    finally:
        if holder is not None:
            holder.release()


class _Holder:
    """This process's hold on one folder: the lock file and its heartbeat thread."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK
        self.created = _make_folders(out)
        self.token = secrets.token_hex(8)
        try:
            self._acquire()
        except BaseException:
            _remove_if_empty(self.created)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="camviz-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat, remove the lock if it is still ours, and empty new folders."""
        self._stop.set()
        self._thread.join()
        if (_read(self.path) or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        _remove_if_empty(self.created)

    def _acquire(self) -> None:
        content = {
            "host": socket.gethostname(),
            "machine": machine(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "token": self.token,
        }
        for _ in range(3):
            try:
                descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as error:
                raise CamvizError(_unwritable(self.path.parent, error)) from None
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                file.write(json.dumps(content) + "\n")
            return
        raise CamvizError(_in_use(self.path, _read(self.path)))

    def _take_over_if_stale(self) -> None:
        """Move a stale lock out of the way; raise if the lock is live."""
        try:
            modified = self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        holder = _read(self.path)
        if not _is_stale(holder, modified):
            raise CamvizError(_in_use(self.path, holder))
        aside = self.path.with_name(f"{LOCK}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another job moved it first
        if _read(aside) != holder:
            # Between reading and renaming, another job took the folder over: put its lock
            # back (without replacing a newer one) and report the folder as in use.
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
            aside.unlink(missing_ok=True)
            raise CamvizError(_in_use(self.path, _read(self.path)))
        aside.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            with contextlib.suppress(OSError):
                os.utime(self.path)


def _is_stale(holder: dict[str, Any] | None, modified: float) -> bool:
    if time.time() - modified > STALE:
        return True
    if holder is None:
        return False  # being written right now, or not ours to judge: wait for the heartbeat
    same_machine = (
        holder.get("host") == socket.gethostname() and holder.get("machine", machine()) == machine()
    )
    if same_machine and isinstance(holder.get("pid"), int):
        return not _process_exists(holder["pid"])
    return False


def machine() -> str:
    """Which running kernel and process-id namespace this process sees: its process ids
    are the ones a lock's ``pid`` names only when this matches (empty where ``/proc`` does
    not tell, then the host name alone decides)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{namespace}"


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def _in_use(path: Path, holder: dict[str, Any] | None) -> str:
    who = (
        f"process {holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}"
        if holder
        else "another process"
    )
    return (
        f"the output folder {str(path.parent)!r} is in use by another camviz run ({who}); "
        f"wait for it to end or pass another --out (a lock not renewed for {STALE:.0f} s is "
        f"taken over)"
    )


def _unwritable(out: Path, error: OSError) -> str:
    reason = error.strerror or type(error).__name__
    return f"cannot write to output folder {str(out)!r} ({reason}); pass --out a writable folder"


def _make_folders(out: Path) -> list[Path]:
    """Create ``out`` and its missing parents; returns those created, deepest first."""
    missing = [folder for folder in (out, *out.parents) if not folder.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CamvizError(_unwritable(out, error)) from None
    return missing


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (the job wrote something), or not ours any more
