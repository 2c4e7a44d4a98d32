"""Every Python block of the README runs as written.

The blocks of one section run in order in one namespace (a block may use what an earlier
block of its section defined); each section starts afresh. They run in a temporary folder
holding a copy of ``assets/``, so the README's relative paths work and nothing is written
into the repository.
"""

from __future__ import annotations

import re
import shutil

import pytest
from conftest import ASSETS, ROOT

BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks_by_section() -> dict[str, list[str]]:
    """``{"## heading": [code of each python block, in order]}`` for sections that have any."""
    sections: dict[str, list[str]] = {}
    for part in re.split(r"^(?=## )", (ROOT / "README.md").read_text(), flags=re.MULTILINE):
        blocks = BLOCK.findall(part)
        if blocks:
            sections[part.splitlines()[0]] = blocks
    return sections


SECTIONS = python_blocks_by_section()


def test_the_readme_has_python_blocks():
    assert sum(len(blocks) for blocks in SECTIONS.values()) >= 2


@pytest.mark.parametrize("section", list(SECTIONS))
def test_readme_blocks_run_as_written(section, tmp_path, monkeypatch):
    shutil.copytree(ASSETS, tmp_path / "assets")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for number, block in enumerate(SECTIONS[section], start=1):
        exec(compile(block, f"README.md, {section}, block {number}", "exec"), namespace)
