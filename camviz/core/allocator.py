"""Keep the memory a model frees for its next pass, instead of handing it back to the kernel.

A forward pass allocates its activations and frees them again, batch after batch. glibc's
``malloc`` (Linux) serves a block of more than 32 MiB with its own ``mmap`` and unmaps it
when freed, and gives the free top of its heap back to the kernel once that exceeds twice
the largest block it has seen. Each later pass then touches new pages, and the kernel
zeroes every one of them in a page fault. On a virtual machine that reports free pages to
its host, as this project's Firecracker VMs do, a fault costs microseconds: the offline
EfficientNet-Lite0 at batch 16 faulted 22,000 pages per image and spent more time in the
kernel than computing. :func:`retain_freed_memory` raises both thresholds (``mallopt``),
so freed blocks stay in the heap and the next pass reuses them.

The ``camviz`` command calls it once at start (the process is camviz's own); a script that
runs camviz, or the model alone, may call it too, or set glibc's variables before Python
starts (``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824``). It cannot
be undone in the process: glibc keeps no way to read the dynamic thresholds back. What it
costs is memory the process keeps instead of returning: up to :data:`KEPT_FREE_BYTES` of
free heap; the peak resident size stays about the same, since the same blocks are reused (a
folder job of the offline model: 1.45 GB against 1.39 GB).
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["freed_memory_retained", "retain_freed_memory"]

#: Blocks up to this size come from the heap (a batch's largest activation fits).
MMAP_THRESHOLD_BYTES = 256 * 2**20
#: Free memory the heap keeps at its top before it gives any back to the kernel.
KEPT_FREE_BYTES = 2**30

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Whether retain_freed_memory made its setting in this process (glibc cannot be asked).
_retained = False

# Variables with which a user sets glibc's allocator themselves: then it is left as they chose.
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def retain_freed_memory() -> bool:
    """Make glibc's ``malloc`` keep freed blocks for reuse (see the module docstring).

    Returns:
        Whether the setting was made: ``False`` where the C library is not glibc (macOS,
        Windows, musl) and where the user set glibc's allocator through its own environment
        variables (``MALLOC_*_`` or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    global _retained
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Setting either one also turns off glibc's dynamic thresholds, which would lower them.
    _retained = _retained or bool(
        mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
        and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    )
    return _retained


def freed_memory_retained() -> bool:
    """Whether :func:`retain_freed_memory` made its setting in this process."""
    return _retained
