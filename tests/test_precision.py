"""precision= and channels_last=: autocast in the model's passes only, float32 maps, the
model and the inputs handed back as they came, and a clear refusal on hardware without it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import camviz
from camviz.core import precision
from camviz.core.errors import CamvizError


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 12, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the model failed")
        return self.head(self.features(x))


@pytest.fixture
def tiny() -> TinyCNN:
    torch.manual_seed(0)
    return TinyCNN().eval()


@pytest.fixture
def batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 16, 16)


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the CPU computes bf16 and fp16 natively (the test machine may not)."""
    monkeypatch.setattr(precision, "native", lambda device, dtype: True)


def _state(model: nn.Module) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    return [(p.dtype, p.stride(), p.data_ptr()) for p in model.parameters()]


def test_bf16_runs_the_model_under_autocast_and_the_maps_in_fp32(tiny, batch, native):
    seen = []
    handle = tiny.features[0].register_forward_hook(
        lambda module, args, output: seen.append(
            (args[0].is_contiguous(memory_format=torch.channels_last), output.dtype)
        )
    )
    try:
        result = camviz.explain(
            tiny, batch, "gradcam", "features.2", 1, precision="bf16", channels_last=True
        )
    finally:
        handle.remove()
    assert seen == [(True, torch.bfloat16)]
    # The scores are bf16 logits (8 bits of mantissa), up-cast; the maps are float32.
    assert torch.equal(result.scores, result.scores.bfloat16().float())
    assert result.heatmaps.dtype == result.layer_maps.dtype == result.output.dtype == torch.float32
    reference = camviz.explain(tiny, batch, "gradcam", "features.2", 1)
    assert not torch.equal(reference.scores, reference.scores.bfloat16().float())
    correlation = torch.corrcoef(
        torch.stack([reference.heatmaps.flatten(), result.heatmaps.flatten()])
    )
    assert correlation[0, 1] > 0.98


def test_bf16_gradcam_equals_the_formula_computed_under_autocast(tiny, batch, native):
    """Grad-CAM from bf16 activations and gradients, by hand: w = mean dy/dA, ReLU(sum w A)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        activations = tiny.features(batch).detach().requires_grad_()
        scores = tiny.head(activations)[:, 3]
    (gradients,) = torch.autograd.grad(scores.sum(), activations)
    weights = gradients.float().mean(dim=(2, 3), keepdim=True)
    maps = torch.relu((weights * activations.detach().float()).sum(1))
    flat = maps.flatten(1)
    expected = (flat - flat.amin(1, keepdim=True)) / (
        flat.amax(1, keepdim=True) - flat.amin(1, keepdim=True)
    )
    result = camviz.explain(tiny, batch, "gradcam", "features.3", 3, precision="bf16")
    torch.testing.assert_close(result.layer_maps.flatten(1), expected, atol=1e-5, rtol=0)


def test_model_and_inputs_come_back_as_they_came_also_on_errors(tiny, batch, native):
    tiny.features[2].weight.requires_grad_(False)
    before = _state(tiny)
    inputs = batch.clone()
    camviz.explain(tiny, inputs, "scorecam", "features.2", 0, precision="bf16", channels_last=True)
    with pytest.raises(CamvizError):
        camviz.explain(
            tiny, inputs, "gradcam", "features.2", 99, precision="bf16", channels_last=True
        )
    tiny.fail = True
    with pytest.raises(RuntimeError, match="the model failed"):
        camviz.explain(
            tiny, inputs, "gradcam", "features.2", 0, precision="bf16", channels_last=True
        )
    assert _state(tiny) == before
    assert [p.requires_grad for p in tiny.parameters()] == [True, True, False, True, True, True]
    assert not tiny._forward_pre_hooks and not tiny._forward_hooks
    assert not torch.is_autocast_enabled("cpu")  # a failed pass left no autocast open
    assert inputs.is_contiguous() and torch.equal(inputs, batch)


def test_float64_model_keeps_float64(tiny, batch, native):
    single = camviz.explain(tiny, batch, "gradcam", "features.2", 0)
    model = tiny.double()
    result = camviz.explain(model, batch.double(), "gradcam", "features.2", 0, precision="bf16")
    assert result.layer_maps.dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in model.parameters())
    # Autocast leaves float64 alone: the float64 maps, not bf16 ones (correlation 0.98 above).
    plain = camviz.explain(model, batch.double(), "gradcam", "features.2", 0)
    torch.testing.assert_close(result.layer_maps, plain.layer_maps, atol=0, rtol=0)
    torch.testing.assert_close(result.layer_maps.float(), single.layer_maps, atol=1e-5, rtol=0)
    torch.testing.assert_close(result.scores.float(), single.scores, atol=1e-5, rtol=1e-5)


def test_scorecam_scores_under_bf16_and_ablationcam_stays_fp32(tiny, batch, native):
    for method in ("scorecam", "ablationcam"):
        reference = camviz.explain(tiny, batch, method, "features.2", 2)
        reduced = camviz.explain(tiny, batch, method, "features.2", 2, precision="bf16")
        correlation = torch.corrcoef(
            torch.stack([reference.heatmaps.flatten(), reduced.heatmaps.flatten()])
        )
        assert correlation[0, 1] > 0.98, method
    # Ablation-CAM's (y - y_k) / y is not resolved by bf16 scores: it scores in fp32.
    torch.testing.assert_close(reduced.heatmaps, reference.heatmaps, atol=1e-6, rtol=0)
    assert not torch.equal(reduced.scores, reduced.scores.bfloat16().float())


def test_precision_the_hardware_lacks_is_refused_in_one_line(tiny, batch, monkeypatch):
    monkeypatch.setattr(precision, "native", lambda device, dtype: False)
    monkeypatch.delenv(precision.EMULATED_VARIABLE, raising=False)
    with pytest.raises(CamvizError, match="not computed natively") as error:
        camviz.explain(tiny, batch, "gradcam", "features.2", precision="fp16")
    assert "\n" not in str(error.value) and "fp32" in str(error.value)
    with pytest.raises(CamvizError, match="fp32, bf16, fp16"):
        camviz.explain(tiny, batch, "gradcam", "features.2", precision="fp8")
    monkeypatch.setenv(precision.EMULATED_VARIABLE, "1")
    with pytest.warns(UserWarning, match="running it anyway"):
        result = camviz.explain(tiny, batch, "gradcam", "features.2", precision="bf16")
    assert torch.equal(result.scores, result.scores.bfloat16().float())


def test_cli_refuses_an_emulated_precision_in_one_line_and_writes_nothing(
    tmp_path, cat_path, tiny_checkpoint, monkeypatch, capsys
):
    from camviz.cli import main

    monkeypatch.setattr(precision, "native", lambda device, dtype: False)
    monkeypatch.delenv(precision.EMULATED_VARIABLE, raising=False)
    out = tmp_path / "out"
    model = ["--model", "resnet18", "--weights", tiny_checkpoint]
    status = main(["explain", str(cat_path), *model, "--precision", "bf16", "--out", str(out)])
    error = capsys.readouterr().err
    assert status == 1 and error.count("\n") == 1 and "bf16 is not computed natively" in error
    assert not out.exists()
