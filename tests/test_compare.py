"""The comparison report: its numbers are the metrics' numbers, its CSV says the same, and a
real headless browser (Debian's chromium) shows every image without a console message."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torchvision.utils import save_image

import camviz
from camviz.cli import main
from camviz.evaluation.metrics import confidence, deletion, insertion
from camviz.evaluation.report import compare, write_report
from camviz.evaluation.synthetic import CLASSES, TARGET_LAYER, load_model, make_dataset
from camviz.io.images import Preprocess, load_image
from camviz.io.models import LoadedModel

STEPS = 5


@pytest.fixture(scope="module")
def synthetic_model() -> LoadedModel:
    return LoadedModel(
        model=load_model(),
        preprocess=Preprocess(size=32, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)),
        categories=list(CLASSES),
        name="synthetic_cnn",
        default_layer=TARGET_LAYER,
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory, synthetic_model):
    """Every registered method on two synthetic 32 px images, written to a folder."""
    folder = tmp_path_factory.mktemp("compare")
    data = make_dataset(2, size=32, seed=99)
    paths = []
    for index, image in enumerate(data.images):
        paths.append(folder / f"shape{index}.png")
        save_image(image, paths[-1])
    methods = camviz.cams.names(synthetic_model.model)
    comparison = compare(paths, synthetic_model, methods, steps=STEPS, batch_size=7)
    written = write_report(comparison, folder / "out")
    return comparison, written, paths


def test_every_cell_holds_the_metrics_of_its_map(report, synthetic_model):
    comparison, _, paths = report
    assert comparison.methods == camviz.cams.names(synthetic_model.model)
    assert "legrad" in camviz.cams.names() and "legrad" not in comparison.methods
    assert len(comparison.cells) == 2 * len(comparison.methods)
    model = synthetic_model.model
    for image_index, path in enumerate(paths):
        inputs = synthetic_model.preprocess(load_image(path)).unsqueeze(0)
        for method_index in (0, len(comparison.methods) - 1):
            cell = comparison.cell(image_index, method_index)
            assert cell.class_id == int(model(inputs).argmax())
            heatmap = camviz.explain(
                model, inputs, cell.method, TARGET_LAYER, cell.class_id
            ).heatmaps
            deleted = deletion(model, inputs, heatmap, cell.class_id, steps=STEPS)
            inserted = insertion(model, inputs, heatmap, cell.class_id, steps=STEPS)
            kept = confidence(model, inputs, heatmap, cell.class_id)
            assert cell.deletion_auc == pytest.approx(deleted.auc.item(), abs=1e-5)
            assert cell.insertion_auc == pytest.approx(inserted.auc.item(), abs=1e-5)
            assert cell.deletion == pytest.approx(deleted.scores[0].tolist(), abs=1e-5)
            assert cell.drop == pytest.approx(100 * kept.drop.item(), abs=1e-3)
            assert len(cell.fractions) == STEPS + 1 and cell.seconds > 0


def test_the_csv_files_hold_the_same_numbers(report):
    comparison, written, _ = report
    with open(written["metrics"], newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(row["image"], row["method"]) for row in rows] == [
        (cell.image, cell.method) for cell in comparison.cells
    ]
    for row, cell in zip(rows, comparison.cells, strict=True):
        assert float(row["deletion_auc"]) == pytest.approx(cell.deletion_auc)
        assert float(row["drop"]) == pytest.approx(cell.drop)
    with open(written["summary"], newline="") as file:
        summary = list(csv.DictReader(file))
    assert [row["method"] for row in summary] == comparison.methods
    assert sum(float(row["win_rate"]) for row in summary) == pytest.approx(100)
    first = comparison.methods[0]
    mean_deletion = sum(c.deletion_auc for c in comparison.cells if c.method == first) / 2
    assert float(summary[0]["deletion_auc"]) == pytest.approx(mean_deletion)


def test_the_page_is_self_contained(report):
    comparison, written, _ = report
    page = written["report"].read_text(encoding="utf-8")
    assert page.count("<img ") == 2 * (len(comparison.methods) + 1)
    assert page.count("<svg ") == 2 * len(comparison.methods)
    sources = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert sources and all(source.startswith("data:image/png;base64,") for source in sources)
    assert "http://" not in page and "https://" not in page
    assert len(page) < 10_000 * len(comparison.cells)  # 32 x 32 thumbnails: a few kB each


def chromium() -> str:
    """Chromium's path; without it the test skips, or fails where CAMVIZ_REQUIRE_BROWSER=1
    (CI sets it, so that the browser tests cannot silently stop running)."""
    path = shutil.which("chromium")
    if path is None:
        missing = (
            "chromium is not installed, and the HTML report is checked in a real headless "
            "browser; install it with `apt-get install -y chromium` (Debian)"
        )
        if os.environ.get("CAMVIZ_REQUIRE_BROWSER") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    return path


def open_in_browser(page: Path, profile: Path) -> tuple[str, str]:
    """The DOM after the load event, and the browser's log (console messages included)."""
    completed = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    return completed.stdout, completed.stderr


@pytest.mark.browser
def test_a_headless_browser_shows_every_image_without_console_messages(report, tmp_path):
    comparison, written, _ = report
    dom, log = open_in_browser(written["report"], tmp_path / "profile")
    images = 2 * (len(comparison.methods) + 1)
    assert f'data-images-shown="{images}"' in dom
    assert 'data-images-broken="0"' in dom
    console = [line for line in log.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    assert console == []


@pytest.mark.browser
def test_clicking_a_column_header_sorts_the_summary(report, tmp_path):
    comparison, written, _ = report
    probe = """<script>
window.addEventListener("load", () => {
  const header = document.querySelectorAll("table.sortable th")[1];
  const methods = () => Array.from(
    header.closest("table").tBodies[0].rows, (row) => row.cells[0].textContent).join(",");
  header.click();
  document.body.dataset.ascending = methods();
  header.click();
  document.body.dataset.descending = methods();
});
</script></body>"""
    page = tmp_path / "probe.html"
    page.write_text(written["report"].read_text().replace("</body>", probe), encoding="utf-8")
    dom, log = open_in_browser(page, tmp_path / "profile")
    rows = comparison.summary()
    ascending = sorted(rows, key=lambda row: row["deletion_auc"])
    descending = sorted(ascending, key=lambda row: row["deletion_auc"], reverse=True)
    assert f'data-ascending="{",".join(row["method"] for row in ascending)}"' in dom
    assert f'data-descending="{",".join(row["method"] for row in descending)}"' in dom
    assert ":CONSOLE" not in log


def test_the_command_line(tmp_path, cat_path, tiny_checkpoint, capsys):
    out = tmp_path / "out"
    common = ["--model", "resnet18", "--weights", tiny_checkpoint, "--input-size", "64"]
    common += ["--out", str(out)]
    status = main(["compare", str(cat_path), *common, "--methods", "gradcam", "--steps", "3"])
    assert status == 0
    assert sorted(path.name for path in out.iterdir()) == [
        "metrics.csv",
        "report.html",
        "summary.csv",
    ]
    printed = capsys.readouterr().out
    assert "| gradcam |" in printed and "report.html" in printed
    with open(out / "metrics.csv", newline="") as file:
        assert [row["method"] for row in csv.DictReader(file)] == ["gradcam"]

    assert main(["compare", str(cat_path), *common, "--methods", "gradcam,nope"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("camviz: error: unknown CAM method 'nope'") and "\n" not in error
