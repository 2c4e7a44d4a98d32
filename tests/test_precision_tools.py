"""precision= and channels_last= in the tools that run a model once (features, inspect,
find_first_nonfinite, layer_shapes) and in every subcommand that runs a model."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import conv_net
from torch import nn

import camviz
from camviz.cli import build_parser, main
from camviz.core import precision
from camviz.core.errors import CamvizError
from camviz.core.layers import layer_shapes

LAYERS = ["0", "2", "5"]


@pytest.fixture
def tiny() -> nn.Sequential:
    return conv_net(8, 12, classes=5, padding=1)


@pytest.fixture
def batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 16, 16)


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU (any CPU) only emulates bf16, and the user asked to run it anyway."""
    monkeypatch.setattr(precision, "native", lambda device, dtype: False)
    monkeypatch.setenv(precision.EMULATED_VARIABLE, "1")


def test_channels_last_features_and_statistics_equal_the_contiguous_ones(tiny, batch, untouched):
    inputs = batch.clone()
    with untouched(tiny):
        plain = camviz.features(tiny, inputs, LAYERS)
        last = camviz.features(tiny, inputs, LAYERS, channels_last=True)
        plain_table = camviz.inspect(tiny, inputs, backward=True)
        last_table = camviz.inspect(tiny, inputs, backward=True, channels_last=True)
        shapes = layer_shapes(tiny, inputs, channels_last=True)
    assert last["0"].is_contiguous(memory_format=torch.channels_last)  # computed so
    for name in LAYERS:
        torch.testing.assert_close(last[name], plain[name], atol=1e-5, rtol=0)
    for got, want in zip(last_table, plain_table, strict=True):
        assert (got.name, got.shape) == (want.name, want.shape)
        values = [got.mean, got.std, got.min, got.max, got.grad_norm]
        expected = [want.mean, want.std, want.min, want.max, want.grad_norm]
        assert values == pytest.approx(expected, abs=1e-5)
    assert shapes == layer_shapes(tiny, inputs)
    # The caller's batch and the model's parameters keep their dtype and memory format.
    assert inputs.is_contiguous() and inputs.dtype == torch.float32 and torch.equal(inputs, batch)
    assert all(p.is_contiguous() and p.dtype == torch.float32 for p in tiny.parameters())
    assert not tiny._forward_pre_hooks and not tiny._forward_hooks


def test_bf16_features_run_under_autocast_come_back_float32_and_correlate(
    tiny, batch, emulated, untouched
):
    with untouched(tiny), pytest.warns(UserWarning, match="running it anyway"):
        reduced = camviz.features(tiny, batch, LAYERS, precision="bf16", channels_last=True)
    plain = camviz.features(tiny, batch, LAYERS)
    for name in LAYERS:
        value = reduced[name]
        assert value.dtype == torch.float32
        # Computed in bf16 (8 bits of mantissa), then up-cast: exactly bf16 values.
        assert torch.equal(value, value.bfloat16().float())
        assert not torch.equal(plain[name], plain[name].bfloat16().float())
        correlation = torch.corrcoef(torch.stack([plain[name].flatten(), value.flatten()]))
        assert correlation[0, 1] >= 0.98, name
    assert not torch.is_autocast_enabled("cpu")


def test_bf16_inspect_tabulates_the_bf16_pass(tiny, batch, emulated):
    with pytest.warns(UserWarning):
        reduced = camviz.inspect(tiny, batch, layers=LAYERS, precision="bf16")
    plain = camviz.inspect(tiny, batch, layers=LAYERS)
    expected = camviz.features(tiny, batch, LAYERS)
    for got, want in zip(reduced, plain, strict=True):
        # bf16 keeps about 3 significant digits: the statistics agree to about 1%.
        assert got.mean == pytest.approx(want.mean, abs=1e-2 * want.std)
        assert got.std == pytest.approx(want.std, rel=1e-2)
        assert got.max == pytest.approx(want.max, rel=1e-2)
        # The largest value of a bf16 output is itself a bf16 number; the fp32 one is not.
        assert got.max == float(torch.tensor(got.max).bfloat16())
        assert want.max == pytest.approx(float(expected[want.name].max()), rel=1e-6)


def test_refused_precision_is_one_line_before_any_pass(tiny, batch, monkeypatch):
    monkeypatch.setattr(precision, "native", lambda device, dtype: False)
    monkeypatch.delenv(precision.EMULATED_VARIABLE, raising=False)
    calls = []
    tiny.register_forward_hook(lambda *args: calls.append(1))
    runs = [
        lambda: camviz.features(tiny, batch, LAYERS, precision="bf16"),
        lambda: camviz.inspect(tiny, batch, precision="fp16"),
        lambda: camviz.find_first_nonfinite(tiny, batch, precision="bf16"),
        lambda: layer_shapes(tiny, batch, precision="bf16"),
    ]
    for run in runs:
        with pytest.raises(CamvizError, match="not computed natively") as error:
            run()
        assert "\n" not in str(error.value)
    assert calls == []
    with pytest.raises(CamvizError, match="fp32, bf16, fp16"):
        camviz.features(tiny, batch, LAYERS, precision="fp8")  # type: ignore[arg-type]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_that_runs_a_model_takes_precision_and_channels_last():
    options = {
        name: {flag for action in sub._actions for flag in action.option_strings}
        for name, sub in _subcommands().items()
    }
    running = {name for name, flags in options.items() if "--model" in flags}
    assert running == {
        "explain",
        "compare",
        "features",
        "inspect",
        "layers",
        "app",
        "units",
        "visualize",
    }
    for name in running:
        assert {"--precision", "--channels-last"} <= options[name], name


@pytest.mark.parametrize(
    "command",
    [
        ["features", "{cat}", "--layer", "layer1.0.conv1", "--out", "{out}"],
        ["inspect", "{cat}", "--csv", "{out}/table.csv"],
        ["layers", "--size", "32"],
        ["units", "{cat}", "--layer", "layer1", "--out", "{out}"],
        ["visualize", "--target", "unit:layer1@0", "--steps", "1", "--out", "{out}"],
    ],
)
def test_cli_refuses_an_emulated_precision_in_one_line(
    command, tmp_path, cat_path, tiny_checkpoint, monkeypatch, capsys
):
    monkeypatch.setattr(precision, "native", lambda device, dtype: False)
    monkeypatch.delenv(precision.EMULATED_VARIABLE, raising=False)
    out = tmp_path / "out"
    args = [part.format(cat=cat_path, out=out) for part in command]
    model = ["--model", "resnet18", "--weights", tiny_checkpoint]
    status = main([*args, *model, "--precision", "bf16"])
    captured = capsys.readouterr()
    assert status == 1 and captured.out == ""
    assert captured.err.count("\n") == 1 and "bf16 is not computed natively" in captured.err
    assert "Traceback" not in captured.err and not out.exists()


def test_cli_runs_emulated_bf16_and_channels_last_when_asked(tiny_checkpoint, emulated, capsys):
    model = ["--model", "resnet18", "--weights", tiny_checkpoint, "--size", "32"]
    assert main(["layers", *model]) == 0
    plain = capsys.readouterr().out
    with pytest.warns(UserWarning, match="running it anyway"):
        assert main(["layers", *model, "--precision", "bf16", "--channels-last"]) == 0
    assert capsys.readouterr().out == plain and "layer4.1.conv2" in plain
