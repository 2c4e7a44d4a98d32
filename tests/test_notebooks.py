"""Every notebook in ``notebooks/`` runs top to bottom on a fresh kernel, as a reader would run
it, and shows what it promises: no error, no warning, at least one picture, and the facts
listed for it below. The notebooks are also saved with their outputs, so that GitHub shows
the pictures without running anything.

A new notebook is found and checked without editing this file; list facts for it in
``FACTS`` where a number or name in its output is worth pinning.
"""

from __future__ import annotations

import asyncio
import os
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from conftest import CORES, ROOT
from nbclient import NotebookClient

from camviz.cams import names

pytestmark = pytest.mark.notebooks
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# Text that a notebook's outputs must contain, by file name.
FACTS: dict[str, list[str]] = {
    "01_quickstart.ipynb": ["Egyptian cat: p=", "espresso: p=", "1 Egyptian cat"],
    # Every registered method has its row in the timing table: it ran.
    "02_methods.ipynb": [f"| `{method}` | `" for method in names()],
    "03_features_and_debugging.ipynb": [
        "layer 'blocks.4.0.conv_pw' (Conv2d) is the first to output NaN/Inf",
        "3 steps recorded",
        "tensor([ 5., -6.])",  # d(c)/d(a) = z
        "(0, False)",  # no hook left, still in eval mode
    ],
    "04_evaluation.ipynb": [
        "explaining Egyptian cat",
        "gradcam: passes",
        "edges: flagged: model-independent",
        "random map: pointing game",
        "report.html",
    ],
    "05_any_model.ipynb": [
        "pulse at 27 - map peaks at 28",
        "cube centre [9, 6, 4] - map peak [9, 6, 4]",
        "Grad-CAM and Ablation-CAM agree: 0.99",
        "cosine similarity 0.927",
    ],
    "06_detection_segmentation_video.ipynb": [
        "square: p=1.00, box [14, 45, 28, 59], map peak in it: True",
        "pointing game over 38 objects: 0.97 (a random map: 0.11)",
        "explanations with an all-zero map (no positive evidence): 1",
        "cross: predicted region IoU 0.44 with the truth, map peak on it: True",
        "default layers ['backbone[0]', 'backbone[1]', 'backbone[pool]']",
        "maps [(160, 240), (160, 240), (200, 160), (200, 160)] of images [0, 0, 1, 1]",
        "equal to the formula: True",
    ],
    "07_models_from_everywhere.ipynb": [
        "classification ['cat', 'dog', 'coffee'] | default layer",
        "embedding | cosine with the prompt",
        "equal to the cosine of get_image_features and get_text_features: True",
        "3 boxes, 3 maps | layer network.model.6:input",
        "boxes on the photo: True",
        "heatmap (32, 32, 32) float32 | affine kept: True | codes 1 2",
        "map peak in the ball: True",
        "explained 1 of 1 inputs -> WORK/cli-vit/manifest.json",
        "explained 1 of 1 inputs -> WORK/cli-clip/manifest.json",
        "explained 1 of 1 inputs -> WORK/cli-yolo/manifest.json",
        "explained 1 of 1 inputs -> WORK/cli-scan/manifest.json",
        "did you mean `yolo:WORK/tiny-yolo.pt`",
    ],
    "08_transformers.ipynb": [
        "fused attention after the five passes: [True, True, True, True]",
        "attention_rollout: fused and explicit maps equal: True",
        "gradient_rollout: fused and explicit maps equal: True",
        "transformer_attribution: fused and explicit maps equal: True",
        "fused attention still as it was set: [False, False, False, False]",
        "layer: vision_model.encoder.layers.1.layer_norm1",
        "at the photo's size: True",
    ],
    "09_training.ipynb": [
        "the share of the map on the shape rose: True",
        "steps explained: [0, 10, 19, 20, 30, 38]",
        "probe 0 image logged at steps [0, 10, 19, 20, 30, 38]",
    ],
    "10_units.ipynb": [
        "150 photos",
        "optimised images above every photo: 4 of 4",
        "explained at blocks.2",
    ],
}


def code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def outputs(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [output for cell in code_cells(notebook) for output in cell.outputs]


def shown_text(notebook: nbformat.NotebookNode) -> str:
    """Everything printed or displayed as text (streams, plain text and Markdown results)."""
    parts = []
    for output in outputs(notebook):
        data = output.get("data", {})
        parts += [output.get("text", ""), data.get("text/plain", ""), data.get("text/markdown", "")]
    return "\n".join(parts)


def pictures(notebook: nbformat.NotebookNode) -> int:
    return sum("image/png" in output.get("data", {}) for output in outputs(notebook))


def saved_seconds(path: Path) -> float:
    """How long the notebook's cells took when it was last run and saved (nbclient records
    each cell's start and end)."""
    total = 0.0
    for cell in code_cells(nbformat.read(path, as_version=4)):
        timing = cell.metadata.get("execution", {})
        start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if start and end:
            total += (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    return total


async def execute_all(paths: list[Path]) -> dict[str, nbformat.NotebookNode]:
    """Run every notebook in its own folder on a fresh kernel, as many at once as there are
    cores, each kernel importing camviz from this checkout."""
    at_once = max(1, min(len(paths), CORES))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(max(1, CORES // at_once)),
    }
    slots = asyncio.Semaphore(at_once)

    async def execute(path: Path) -> nbformat.NotebookNode:
        notebook = nbformat.read(path, as_version=4)
        client = NotebookClient(
            notebook,
            timeout=900,  # a generous bound per cell: a loaded 2-core machine is slow, not stuck
            kernel_name="python3",
            allow_errors=True,  # an error becomes an output, which the tests report
            resources={"metadata": {"path": str(path.parent)}},
        )
        async with slots:
            await client.async_execute(env=env)
        return notebook

    # The longest first (by the cell times saved in each notebook), so that none starts last.
    longest_first = sorted(paths, key=saved_seconds, reverse=True)
    executed = await asyncio.gather(*(execute(path) for path in longest_first))
    return {path.name: notebook for path, notebook in zip(longest_first, executed, strict=True)}


@pytest.fixture(scope="session")
def executed() -> dict[str, nbformat.NotebookNode]:
    """Every notebook, executed once for all the tests below."""
    return asyncio.run(execute_all(NOTEBOOKS))


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) >= 4
    assert set(FACTS) <= {path.name for path in NOTEBOOKS}


@pytest.mark.parametrize("name", [path.name for path in NOTEBOOKS])
def test_notebook_runs_without_errors_or_warnings_and_shows_pictures(executed, name):
    notebook = executed[name]
    errors = [
        f"cell {index}: {output.ename}: {output.evalue}"
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert not errors, errors
    assert all(cell.execution_count is not None for cell in code_cells(notebook))
    warnings = [output.text for output in outputs(notebook) if output.get("name") == "stderr"]
    assert not warnings, warnings
    assert pictures(notebook) >= 1
    text = shown_text(notebook)
    missing = [fact for fact in FACTS.get(name, []) if fact not in text]
    assert not missing, missing


@pytest.mark.parametrize("name", [path.name for path in NOTEBOOKS])
def test_notebook_is_saved_with_its_outputs(name):
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    counts = [cell.execution_count for cell in code_cells(notebook)]
    assert counts == list(range(1, len(counts) + 1)), "run it top to bottom, then save it"
    assert pictures(notebook) >= 1
    assert not [
        output
        for output in outputs(notebook)
        if output.output_type == "error" or output.get("name") == "stderr"
    ]
