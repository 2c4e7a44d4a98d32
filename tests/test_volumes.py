"""NIfTI volumes from the command line, and sliding windows against MONAI.

A scan with a known affine (qform code 1, sform code 2, int16 with a scaling) goes through
``camviz explain`` with a 3-D factory of the user's; the heatmap comes back as a float32
NIfTI with the scan's shape, affine and codes, and its values are those of
``camviz.explain`` on the same volume. Sliding windows are checked against MONAI's
``sliding_window_inference``: the stitched output for each blend, and, on a volume of
2 x 2 x 2 windows, the Grad-CAM map against autograd through it.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import camviz
from camviz.cli import main
from camviz.core.windows import SlidingWindowModel, Windows
from camviz.io.volumes import intensities

nibabel = pytest.importorskip("nibabel")

FACTORY = """
import torch
from torch import nn


def segmenter(classes=3):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1), nn.ReLU(),
        nn.Conv3d(4, classes, 1),
    )
"""

AFFINE = np.array([[0.8, 0, 0, -30], [0, 0.9, 0.1, 20], [0, 0, 1.5, 5], [0, 0, 0, 1]])
SHAPE = (16, 16, 12)


def segmenter() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1), nn.ReLU(),
        nn.Conv3d(4, 3, 1),
    ).eval()  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("volumes")
    (path / "nets3d.py").write_text(textwrap.dedent(FACTORY))
    scan = nibabel.Nifti1Image(
        np.random.default_rng(0).integers(0, 1000, SHAPE).astype(np.int16), AFFINE
    )
    scan.set_qform(AFFINE, 1)
    scan.set_sform(AFFINE @ np.diag([1, 1, 1, 1.0]), 2)
    scan.header.set_slope_inter(0.5, 10)
    nibabel.save(scan, path / "scan.nii.gz")
    return path


@pytest.fixture
def cli(capsys):
    def run(*arguments: object) -> tuple[int, str]:
        capsys.readouterr()
        status = main(["explain", *map(str, arguments), "--quiet", "--workers", "0"])
        return status, capsys.readouterr().err

    return run


def one_line_error(error: str, *fragments: str) -> None:
    assert error.startswith("camviz: error: ") and error.count("\n") == 1, error
    for fragment in fragments:
        assert fragment in error, error


def test_a_scan_comes_back_as_a_heatmap_with_its_geometry(cli, folder, tmp_path):
    out = tmp_path / "out"
    model = f"{folder / 'nets3d.py'}:segmenter"
    status, error = cli(folder / "scan.nii.gz", "--model", model, "--out", out)
    assert status == 0, error

    (row,) = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    # The default layer is the one explain picks for the region: the last ReLU, the last map
    # before the 1 x 1 convolution that gives the logits.
    assert row["layers"] == ["3"]
    files = row["explained"][0]["files"]
    assert files == {"heatmap": "scan_heatmap.nii.gz", "montage": "scan_montage.png"}
    scan, heatmap = nibabel.load(folder / "scan.nii.gz"), nibabel.load(out / files["heatmap"])
    assert heatmap.shape == SHAPE and heatmap.get_data_dtype() == np.float32
    np.testing.assert_array_equal(heatmap.affine, scan.affine)
    for read in ("get_qform", "get_sform"):
        (mine, code), (theirs, their_code) = (
            getattr(image.header, read)(coded=True) for image in (heatmap, scan)
        )
        assert code == their_code and code > 0
        np.testing.assert_allclose(mine, theirs, atol=1e-6)

    # The map is camviz.explain's on the scan's values (scaled by the file's slope and
    # intercept; a factory's mean 0 and std 1), the region of the class found most often.
    volume = torch.from_numpy(scan.get_fdata().astype(np.float32))[None, None]
    network = segmenter()
    with torch.no_grad():
        predicted = network(volume).argmax(1)[0]
    chosen = row["explained"][0]["id"]
    assert chosen == int(torch.bincount(predicted.flatten(), minlength=3)[1:].argmax()) + 1
    mask = (predicted == chosen).float()
    expected = camviz.explain(
        network, volume, layer="3", target=lambda out: (out[:, chosen] * mask).sum((1, 2, 3))
    )
    np.testing.assert_allclose(heatmap.get_fdata(), expected.heatmaps[0].numpy(), atol=1e-5)
    assert row["size"] == list(SHAPE) and row["windows"] == 1

    # A rerun finds it done, and its own outputs are no inputs.
    status, error = cli(
        folder / "scan.nii.gz", out, "--model", model, "--out", out, "--task", "volume",
    )  # fmt: skip
    assert status == 0, error
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 1


def test_sliding_windows_stitch_as_monai(folder):
    from monai.inferers import sliding_window_inference

    network, volume = segmenter(), torch.rand(1, 1, *SHAPE)
    for overlap, blend in ((0.25, "gaussian"), (0.5, "constant"), (0.0, "constant")):
        windows = SlidingWindowModel(network, "3", Windows((8, 8, 6), overlap, blend))
        with torch.no_grad():
            expected = sliding_window_inference(volume, (8, 8, 6), 1, network, overlap, blend)
            torch.testing.assert_close(windows(volume), expected, rtol=1e-6, atol=1e-6)


def test_a_map_on_windows_is_autograd_through_monai(folder):
    """2 x 2 x 2 windows: Grad-CAM of the stitched output's region score equals the one made
    by hand from each window's activations and their gradients, taken by autograd through
    MONAI's sliding_window_inference."""
    from monai.data.utils import dense_patch_slices
    from monai.inferers import sliding_window_inference

    network, volume = segmenter(), torch.rand(1, 1, *SHAPE)
    windows = SlidingWindowModel(network, "3", Windows((8, 8, 6), overlap=0.0))
    with torch.no_grad():
        predicted = windows(volume).argmax(1)
    chosen = int(predicted.flatten().mode().values)
    mask = (predicted == chosen).float()

    def score(out: torch.Tensor) -> torch.Tensor:
        return (out[:, chosen] * mask).sum((1, 2, 3))

    ours = camviz.explain(
        windows, volume, layer="stitched", target=score, layout="channels_first",
        relu=False, normalize=False,
    )  # fmt: skip

    recorded = []

    def keep(module: nn.Module, args: object, output: torch.Tensor) -> None:
        output.retain_grad()
        recorded.append(output)

    handle = network[3].register_forward_hook(keep)
    stitched = sliding_window_inference(volume, (8, 8, 6), 1, network, overlap=0.0)
    handle.remove()
    score(stitched).sum().backward()
    activations, gradients = torch.zeros(1, 4, *SHAPE), torch.zeros(1, 4, *SHAPE)
    for window, output in zip(
        dense_patch_slices(SHAPE, (8, 8, 6), (8, 8, 6)), recorded, strict=True
    ):
        activations[(..., *window)] = output.detach()
        gradients[(..., *window)] = output.grad
    assert len(recorded) == 8
    expected = (gradients.mean((2, 3, 4), keepdim=True) * activations).sum(1)
    torch.testing.assert_close(
        ours.heatmaps, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
    )


def test_windows_from_the_command_line(cli, folder, tmp_path):
    out = tmp_path / "out"
    model = f"{folder / 'nets3d.py'}:segmenter"
    status, error = cli(
        folder / "scan.nii.gz", "--model", model, "--out", out,
        "--roi-size", "8,8,6", "--overlap", "0.5", "--blend", "gaussian", "--percentile", "1,99",
    )  # fmt: skip
    assert status == 0, error
    (row,) = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert row["windows"] == 3 * 3 * 3
    assert row["layers"] == ["3"]  # found on a window, as explain finds it on the volume
    settings = json.loads((out / "manifest.json").read_text())["settings"]
    assert settings["volumes"] == {
        "percentile": [1.0, 99.0], "roi_size": [8, 8, 6], "overlap": 0.5, "blend": "gaussian"
    }  # fmt: skip


def test_intensity_windows():
    data = np.array([[[-2000.0, -1000.0, 0.0, 400.0, 1000.0]]])
    expected = np.clip((data + 1000) / 1400, 0, 1)
    np.testing.assert_allclose(intensities(data, window=(-1000, 400)).numpy(), expected)
    low, high = np.percentile(data, (10, 90))
    np.testing.assert_allclose(
        intensities(data, percentile=(10, 90)).numpy(), np.clip((data - low) / (high - low), 0, 1)
    )


def test_bad_volumes_are_one_line(cli, folder, tmp_path):
    model = f"{folder / 'nets3d.py'}:segmenter"
    fake = tmp_path / "fake.nii.gz"
    fake.write_bytes(b"not a scan")
    status, error = cli(fake, "--model", model, "--layer", "3", "--out", tmp_path / "a")
    assert status == 1
    one_line_error(error, "fake.nii.gz is not a NIfTI volume")

    series = tmp_path / "series.nii.gz"
    nibabel.save(nibabel.Nifti1Image(np.zeros((4, 4, 4, 3), np.float32), AFFINE), series)
    status, error = cli(series, "--model", model, "--layer", "3", "--out", tmp_path / "b")
    assert status == 1
    one_line_error(error, "4-D array", "3-D scans")

    status, error = cli(
        folder / "scan.nii.gz", "--model", model, "--layer", "3", "--out", tmp_path / "c",
        "--memory-budget", "1KiB",
    )  # fmt: skip
    assert status == 1
    one_line_error(error, "more than the memory budget", "--roi-size")

    status, error = cli(
        folder / "scan.nii.gz", "--model", model, "--layer", "3", "--out", tmp_path / "d",
        "--window", "0,1", "--percentile", "1,99",
    )  # fmt: skip
    assert status == 1
    one_line_error(error, "--window or --percentile, not both")
    assert not any((tmp_path / name).exists() for name in "abcd")
