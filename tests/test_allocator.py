"""Freed memory kept for the next pass: after :func:`retain_freed_memory` (which the ``camviz``
command calls), a block as large as a batch's activations is served again from the heap
without page faults; without it glibc unmaps the block and every page faults again. Each
case runs in a fresh interpreter: the setting cannot be undone in a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's allocator is Linux's"
)

PAGES = 16384  # the 64 MiB block below, in pages of 4 KiB

# Prints the page faults of the last five of 20 allocations of a 64 MiB tensor, after
# ``setup`` ran. The first ones fault their pages in whatever the setting: glibc grows its
# heap until a freed block fits a new one with its alignment (six to nine blocks here).
FAULTS = """
import resource, sys, torch
{setup}
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(PAGES * 1024)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(sum([faults() for _ in range(20)][-5:]))
"""

SETUPS = {
    "glibc's defaults": "",
    "retain_freed_memory": (
        "from camviz.core.allocator import retain_freed_memory\nassert retain_freed_memory()"
    ),
    "the camviz command": (
        "import contextlib, io, camviz.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert camviz.cli.main(['methods']) == 0"
    ),
}


def last_faults(setup: str) -> int:
    script = FAULTS.format(setup=setup).replace("PAGES", str(PAGES))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.split()[-1])


def test_freed_blocks_are_reused_without_faults() -> None:
    faults = {name: last_faults(setup) for name, setup in SETUPS.items()}
    # glibc unmaps a 64 MiB block when it is freed: its pages fault in again (or its huge
    # pages, where transparent huge pages are always on).
    assert faults["glibc's defaults"] >= 5 * PAGES // 512, faults
    for name in ("retain_freed_memory", "the camviz command"):
        assert faults[name] * 10 < faults["glibc's defaults"], faults


def test_the_users_own_allocator_settings_are_left_alone() -> None:
    script = "from camviz.core.allocator import retain_freed_memory\nprint(retain_freed_memory())"
    for variable, value in (
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env={**os.environ, variable: value},
            check=True,
        )
        assert done.stdout.split() == ["False"], variable
