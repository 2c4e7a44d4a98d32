"""camviz.features and the capture it is built on: values, untraceable models, memory, CLI."""

from __future__ import annotations

import os
import weakref

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

import camviz.cli
from camviz.core.errors import CamvizError
from camviz.core.hooks import capture
from camviz.debug.extraction import features
from camviz.io.images import load_image
from camviz.io.models import load
from camviz.io.render import channel_grid


def classic_4x4_model() -> nn.Sequential:
    """Conv 1 -> 2 channels with 3x3 kernels of ones and of twos, no bias, then 2x2 max-pool."""
    conv = nn.Conv2d(1, 2, kernel_size=3, bias=False)
    with torch.no_grad():
        conv.weight[0].fill_(1.0)
        conv.weight[1].fill_(2.0)
    return nn.Sequential(conv, nn.MaxPool2d(2)).eval()


def test_classic_4x4_example_captures_9_and_18(untouched):
    # A 4x4 input of ones and no padding: each of the 2x2 output cells sums nine ones, so
    # the conv gives 9 (kernel of ones) and 18 (kernel of twos) everywhere; max-pooling
    # the 2x2 map gives [[9]] and [[18]].
    model = classic_4x4_model()
    ones = torch.ones(1, 1, 4, 4)
    with untouched(model), capture(model, ["0", "1"]) as record:
        model(ones)
    expected_conv = torch.stack([torch.full((2, 2), 9.0), torch.full((2, 2), 18.0)])[None]
    assert torch.equal(record.activations["0"], expected_conv)
    assert torch.equal(record.activations["1"], torch.tensor([[[[9.0]], [[18.0]]]]))
    assert torch.equal(record.inputs["1"], expected_conv)
    with untouched(model):
        maps = features(model, ones, ["0", "1"])
    assert torch.equal(maps["0"], expected_conv)
    assert torch.equal(maps["1"], torch.tensor([[[[9.0]], [[18.0]]]]))


def test_features_equal_torchvisions_extractor_on_a_traceable_model(resnet18, untouched):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with untouched(resnet18):
        maps = features(resnet18, x, ["layer*.0.conv1", "fc"])
    assert list(maps) == [f"layer{i}.0.conv1" for i in range(1, 5)] + ["fc"]
    extractor = create_feature_extractor(resnet18, return_nodes=list(maps))
    with torch.no_grad():
        expected = extractor(x)
    for name, value in maps.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0)


class DataDependent(nn.Module):
    """``if`` on a tensor's value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if hidden.sum() > 0:
            hidden = -hidden
        return self.second(hidden)


def test_features_work_where_fx_tracing_fails(untouched):
    torch.manual_seed(0)
    model = DataDependent().eval()
    with pytest.raises(torch.fx.proxy.TraceError):
        create_feature_extractor(model, return_nodes=["first", "second"])
    x = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0]])
    with untouched(model):
        maps = features(model, x, ["first", "second"], inputs_too=True)
    with torch.no_grad():
        hidden = x @ model.first.weight.T + model.first.bias
        flipped = -hidden if hidden.sum() > 0 else hidden
        output = flipped @ model.second.weight.T + model.second.bias
    torch.testing.assert_close(maps["first"], hidden)
    torch.testing.assert_close(maps["second"], output)
    torch.testing.assert_close(maps.inputs["second"], flipped)
    assert torch.equal(maps.inputs["first"], x)


def test_features_keep_no_graph_and_can_feed_a_trained_probe(resnet18, small_batch):
    maps = features(resnet18, small_batch, "layer4", device="cpu")
    activations = maps["layer4"]
    assert activations.grad_fn is None and not activations.requires_grad
    assert not activations.is_inference()
    assert maps.inputs == {}
    # A linear probe on the features trains with autograd (inference tensors would refuse).
    probe = nn.Linear(activations.shape[1], 3)
    probe(activations.mean(dim=(2, 3))).sum().backward()
    assert probe.weight.grad is not None


def test_features_run_a_training_model_in_eval_mode_and_restore_it(untouched):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)).train()
    x = torch.randn(2, 3, 8, 8)
    with untouched(model):  # running statistics untouched, train flags restored
        maps = features(model, x, ["1", "2"])
    assert model.training and model[1].training
    with torch.no_grad():
        expected = model.eval()(x)
    model.train()
    assert torch.equal(maps["2"], expected)  # dropout off: eval-mode values


def test_features_name_missing_and_unused_layers():
    model = DataDependent()
    with pytest.raises(CamvizError, match="did you mean 'first'"):
        features(model, torch.ones(1, 3), ["frist"])
    model.unused = nn.Linear(3, 3)
    with pytest.raises(CamvizError, match="'unused' did not run"):
        features(model, torch.ones(1, 3), ["first", "unused"])


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_keep_last_capture_does_not_grow_over_1000_calls():
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1))
    x = torch.randn(1, 1, 64, 64)  # each capture is a 256 KiB copy: 1000 would be 250 MiB
    alive = []
    with torch.no_grad(), capture(model, "0", inputs=False) as record:
        for _ in range(10):  # let the allocator reach its steady state first
            model(x)
        before = resident_bytes()
        for _ in range(1000):
            model(x)
            alive.append(weakref.ref(record.activations["0"]))
        after = resident_bytes()
    assert sum(ref() is not None for ref in alive) == 1  # only the last copy is kept
    assert after - before < 32 * 2**20
    assert record.inputs == {}


def test_keep_all_capture_stops_at_its_limit_with_a_clear_message(untouched):
    model = nn.Sequential(nn.Conv2d(1, 2, 3))
    x = torch.randn(1, 1, 8, 8)
    with untouched(model), torch.no_grad(), capture(model, "0", keep="all", max_calls=50) as record:
        for _ in range(50):
            model(x)
        with pytest.raises(CamvizError, match="max_calls=50 in keep='all' mode; raise max_calls"):
            model(x)
    assert len(record.activations["0"]) == 50


def test_features_cli_writes_a_grid_and_a_figure_per_layer(tmp_path, tiny_checkpoint, capsys):
    image = tmp_path / "gradient.png"
    Image.linear_gradient("L").convert("RGB").resize((64, 48)).save(image)
    out = tmp_path / "out"
    arguments = ["features", str(image), "--model", "resnet18", "--weights", tiny_checkpoint]
    arguments += ["--layer", "layer1.0.conv*", "--layer", "layer4", "--input-size", "64"]
    arguments += ["--out", str(out)]
    assert camviz.cli.main([*arguments, "--channels", "4", "--order", "strongest"]) == 0
    layers = ["layer1.0.conv1", "layer1.0.conv2", "layer4"]
    assert sorted(path.name for path in out.iterdir()) == sorted(
        f"{layer}_{kind}.png" for layer in layers for kind in ("grid", "figure")
    )
    printed = capsys.readouterr().out
    assert all(f"{layer}: " in printed for layer in layers)
    # The grid file holds the 4 strongest channels of that layer for that image, as the
    # Python API draws them (save_image rounds [0, 1] floats to bytes), each value drawn as
    # a square block so that every tile is at least 64 pixels on its short side.
    loaded = load("resnet18", weights=tiny_checkpoint, input_size=64)
    maps = features(loaded.model, loaded.preprocess(load_image(image))[None], "layer1.0.conv2")
    activations = maps["layer1.0.conv2"]
    factor = 4  # layer1 maps are 16 x 22 for this 64 x 85 input
    assert activations.shape[-2:] == (16, 22)
    enlarged = activations.repeat_interleave(factor, -2).repeat_interleave(factor, -1)
    expected = channel_grid(enlarged, channels=4, order="strongest")
    assert expected.shape[-2:] == (2 * 64 + 3, 2 * 88 + 3)  # 2 x 2 tiles, 1 px lines
    expected = (expected * 255 + 0.5).clamp(0, 255).to(torch.uint8).permute(1, 2, 0)
    with Image.open(out / "layer1.0.conv2_grid.png") as written:
        assert torch.equal(torch.from_numpy(np.array(written.convert("RGB"))), expected)
    with Image.open(out / "layer4_figure.png") as figure:
        assert figure.width > 100 and figure.height > 100


def test_features_cli_refuses_a_layer_without_channels(tmp_path, tiny_checkpoint, capsys):
    image = tmp_path / "flat.png"
    Image.new("RGB", (32, 32), (200, 10, 10)).save(image)
    arguments = ["features", str(image), "--model", "resnet18", "--weights", tiny_checkpoint]
    status = camviz.cli.main([*arguments, "--layer", "fc", "--out", str(tmp_path / "out")])
    assert status == 1
    assert "layer 'fc' outputs shape (1, 5), not a feature map" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
