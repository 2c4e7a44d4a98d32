"""``camviz units``, ``camviz visualize``, ``camviz features --order weight`` and
``--target unit:...`` run for real, against the Python API's numbers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import camviz
from camviz.cli import main
from camviz.core.targets.unit import Unit
from camviz.io.images import load_image
from camviz.io.models import load
from camviz.io.output import save
from camviz.io.pictures import channel_grid


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.fixture(scope="module")
def few_photos(real_photos, tmp_path_factory) -> Path:
    """Eight of the real photos, in a folder of their own."""
    folder = tmp_path_factory.mktemp("few")
    for path in sorted(real_photos.iterdir())[::38]:
        shutil.copy(path, folder / path.name)
    return folder


def test_units_ranks_the_photos_as_the_api_does_and_resumes(
    few_photos, tiny_checkpoint, tmp_path, capsys
):
    out = tmp_path / "units"
    command = ["units", str(few_photos), "--model", "resnet18", "--weights", tiny_checkpoint]
    command += ["--layer", "layer1", "--channels", "0-1", "--k", "3", "--input-size", "64"]
    command += ["--out", str(out)]
    assert main(command) == 0
    assert "2 channels of layer1" in capsys.readouterr().out
    results = json.loads((out / "units.json").read_text())
    loaded = load("resnet18", weights=tiny_checkpoint, input_size=64)
    tops = camviz.top_examples(loaded, few_photos, Unit("layer1", channel=[0, 1]), k=3)
    for entry, top in zip(results["channels"], tops, strict=True):
        assert [e["file"] for e in entry["examples"]] == [e.path for e in top.examples]
        assert [e["value"] for e in entry["examples"]] == pytest.approx(
            [e.value for e in top.examples], rel=1e-5
        )
        assert (out / entry["image"]).is_file()
    # conv1 7x7/2, max-pool 3x3/2, four 3x3 convs: 1 + 6 + 2*2 + 4*(2*4) = 43 px every 4 px
    # (the skip connections add in place and see less than the convolutions do).
    field = results["receptive_field"]
    assert (field["how"], field["size"], field["stride"]) == ("analytic", [43, 43], [4.0, 4.0])
    page = (out / "index.html").read_text()
    assert all(f'id="channel-{c}"' in page for c in (0, 1))
    rows = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {row["status"] for row in rows} == {"ok"}
    drawn = (out / "channel_0001.png").stat().st_mtime_ns
    assert main(command) == 0  # everything done: the same results, nothing drawn again
    assert json.loads((out / "units.json").read_text()) == results
    assert (out / "channel_0001.png").stat().st_mtime_ns == drawn


def test_units_refuses_a_channel_the_layer_lacks_in_one_line(
    few_photos, tiny_checkpoint, tmp_path, capsys
):
    command = ["units", str(few_photos), "--model", "resnet18", "--weights", tiny_checkpoint]
    command += ["--layer", "layer1", "--channels", "64", "--out", str(tmp_path / "u")]
    assert main(command) == 1
    error = capsys.readouterr().err.strip()
    assert (
        error == "camviz: error: channel 64 is out of range: layer 'layer1' has 64 channels (0..63)"
    )
    assert not (tmp_path / "u" / "units.json").exists()


def test_visualize_writes_what_visualize_unit_returns(tiny_checkpoint, tmp_path):
    out = tmp_path / "vis"
    command = ["visualize", "--model", "resnet18", "--weights", tiny_checkpoint]
    command += ["--target", "unit:layer1@0-1", "--target", "3", "--size", "32", "--steps", "3"]
    assert main([*command, "--out", str(out)]) == 0
    loaded = load("resnet18", weights=tiny_checkpoint)
    for name, target in (("layer1_1", Unit("layer1", channel=1)), ("class_3", 3)):
        image = camviz.visualize_unit(loaded, target, size=32, steps=3)
        assert np.array_equal(
            pixels(out / f"{name}.png"), pixels(save(image[0], tmp_path / "api.png"))
        )
    assert (out / "layer1_0.png").is_file()
    unreadable = ["visualize", "--target", "unit:layer1", "--out", str(tmp_path / "none")]
    assert main(unreadable) == 1
    assert not (tmp_path / "none").exists()


def test_features_order_weight_draws_the_channels_the_class_weighs_most(
    cat_path, tiny_mobilenet, tmp_path
):
    out = tmp_path / "features"
    command = ["features", str(cat_path), "--model", "mobilenet_v3_small"]
    command += ["--weights", tiny_mobilenet, "--layer", "features.3", "--channels", "4"]
    command += ["--input-size", "64", "--order", "weight", "--tile", "1"]
    assert main([*command, "--out", str(out)]) == 0
    loaded = load("mobilenet_v3_small", weights=tiny_mobilenet, input_size=64)
    inputs = loaded.preprocess(load_image(cat_path)).unsqueeze(0)
    explained = camviz.explain(loaded.model, inputs, layer="features.3")
    with torch.no_grad():
        activations = camviz.features(loaded.model, inputs, ["features.3"])["features.3"]
    weights = explained.weights["features.3"][0]
    expected = channel_grid(activations, channels=4, order="weight", weights=weights)
    assert np.array_equal(
        pixels(out / "features.3_grid.png"), pixels(save(expected, tmp_path / "g.png"))
    )
    assert not np.array_equal(
        pixels(out / "features.3_grid.png"),
        pixels(save(channel_grid(activations, channels=4), tmp_path / "f.png")),
    )


def test_explain_a_channel_from_the_command_line_at_the_layer_before_it(
    cat_path, tiny_checkpoint, tmp_path
):
    out = tmp_path / "explained"
    command = ["explain", str(cat_path), "--model", "resnet18", "--weights", tiny_checkpoint]
    command += ["--target", "unit:layer2@3", "--heatmap", "npz", "--no-panel", "--out", str(out)]
    assert main([*command, "--input-size", "64"]) == 0
    loaded = load("resnet18", weights=tiny_checkpoint, input_size=64)
    inputs = loaded.preprocess(load_image(cat_path)).unsqueeze(0)
    expected = camviz.explain(
        loaded.model, inputs, layer="layer1", target=Unit("layer2", channel=3)
    )
    (heatmap,) = out.glob("*_heatmap.npz")
    written = np.load(heatmap)["heatmap"]
    np.testing.assert_allclose(written, expected.heatmaps[0].numpy(), rtol=1e-5, atol=1e-6)
