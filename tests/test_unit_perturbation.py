"""A unit explained by the methods that re-run the model on perturbed copies: Score-CAM,
SS-CAM and Ablation-CAM of a ``Unit`` against their formulas computed by hand, with the
unit's channel mean, read in each re-run, as the score."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from conftest import conv_net
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.targets import Context
from camviz.core.targets.unit import Unit

LAYER, UNIT_LAYER, CHANNELS = "1", "4", [1, 3]


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return conv_net(4, 6, 5, classes=3).double()


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(3)).double()


def unit_means(model: nn.Module, inputs: torch.Tensor, edit=None) -> torch.Tensor:
    """``(N, K)``: the unit's channel means at ``UNIT_LAYER`` (the layer ``LAYER``'s output
    replaced by ``edit(output)`` first, when given)."""
    with torch.no_grad():
        at_layer = model[: int(LAYER) + 1](inputs)
        if edit is not None:
            at_layer = edit(at_layer)
        unit = model[int(LAYER) + 1 : int(UNIT_LAYER) + 1](at_layer)
    return unit[:, CHANNELS].mean(dim=(2, 3))


def min_max(maps: torch.Tensor) -> torch.Tensor:
    flat = maps.flatten(1)
    low, high = flat.amin(1, keepdim=True), flat.amax(1, keepdim=True)
    return ((flat - low) / (high - low)).view_as(maps)


def hand_scorecam(model, inputs, noise=None) -> torch.Tensor:
    """Score-CAM (Wang et al. 2020) with the unit's channel means as ``y``: masks
    ``s(U(A^k))``, ``alpha = softmax_k y(X * H^k)``; ``noise[draw][n][k]`` makes it SS-CAM
    (the mean over the draws of ``y(X * (H^k + noise))``). Rows: sample-major ranks."""
    activations = model[: int(LAYER) + 1](inputs).detach()
    maps = []
    for n in range(len(inputs)):
        scores = []
        for k, channel in enumerate(activations[n]):
            up = F.interpolate(
                channel[None, None], size=(12, 12), mode="bilinear", align_corners=False
            )[0, 0]
            span = up.max() - up.min()  # a constant channel's mask is zero (camviz's rule)
            mask = (up - up.min()) / span if span > 0 else torch.zeros_like(up)
            draws = [mask] if noise is None else [mask + draw[n][k] for draw in noise]
            scores.append(
                torch.stack([unit_means(model, inputs[n : n + 1] * d)[0] for d in draws]).mean(0)
            )
        alpha = torch.stack(scores).softmax(dim=0)  # (C, K)
        for rank in range(len(CHANNELS)):
            cam = torch.einsum("k,khw->hw", alpha[:, rank], activations[n])
            maps.append(torch.relu(cam))
    return min_max(torch.stack(maps))


def hand_ablationcam(model, inputs) -> torch.Tensor:
    """Ablation-CAM (Desai and Ramaswamy 2020) with the unit's channel means as ``y``:
    ``w_k = (y - y_k) / y``, ``y_k`` with channel ``k`` of the layer zeroed."""
    activations = model[: int(LAYER) + 1](inputs).detach()
    original = unit_means(model, inputs)

    def zeroed(k: int):
        def edit(output: torch.Tensor) -> torch.Tensor:
            output = output.clone()
            output[:, k] = 0
            return output

        return edit

    ablated = torch.stack([unit_means(model, inputs, zeroed(k)) for k in range(4)], dim=-1)
    weights = (original.unsqueeze(-1) - ablated) / original.unsqueeze(-1)  # (N, K, C)
    cams = torch.relu(torch.einsum("nkc,nchw->nkhw", weights, activations))
    return min_max(cams.flatten(0, 1))


def test_scorecam_of_a_unit_equals_its_formula_with_the_units_mean(model, inputs, untouched):
    with untouched(model):
        result = camviz.explain(
            model, inputs, "scorecam", layer=LAYER, target=Unit(UNIT_LAYER, channel=CHANNELS)
        )
    torch.testing.assert_close(
        result.layer_maps, hand_scorecam(model, inputs), rtol=1e-5, atol=1e-9
    )
    torch.testing.assert_close(result.scores, unit_means(model, inputs).flatten())
    # Chunks of 3 masked images split an image's channels: the unit is read per row.
    chunked = camviz.explain(
        model, inputs, "scorecam", LAYER, Unit(UNIT_LAYER, channel=CHANNELS), batch_size=3
    )
    torch.testing.assert_close(chunked.layer_maps, result.layer_maps, rtol=1e-5, atol=1e-9)


def test_ablationcam_reads_the_unit_after_the_ablated_layer(model, inputs, untouched):
    with untouched(model), warnings.catch_warnings():
        warnings.simplefilter("error")  # the broadcast shortcut is taken, the unit read in it
        result = camviz.explain(
            model, inputs, "ablationcam", layer=LAYER, target=Unit(UNIT_LAYER, channel=CHANNELS)
        )
    expected = hand_ablationcam(model, inputs)
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-5, atol=1e-9)


def test_sscam_of_a_unit_equals_its_formula_with_the_same_noise(model, inputs, untouched):
    draws, std = 2, 0.3
    # Each image draws from its own generator seeded alike, draw by draw, channel by channel,
    # in float32 (camviz.cams.noise.SampleNoise).
    generators = [torch.Generator().manual_seed(5) for _ in inputs]
    noise = [
        [[std * torch.randn(12, 12, generator=g).double() for _ in range(4)] for g in generators]
        for _ in range(draws)
    ]
    with untouched(model):
        result = camviz.explain(
            model,
            inputs,
            "sscam",
            layer=LAYER,
            target=Unit(UNIT_LAYER, channel=CHANNELS),
            num_samples=draws,
            std=std,
            seed=5,
        )
    expected = hand_scorecam(model, inputs, noise)
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-5, atol=1e-9)


def test_a_pass_that_did_not_record_the_unit_is_refused_in_one_line(model, inputs):
    unit = Unit(UNIT_LAYER, channel=1)
    with torch.no_grad():
        output, at_unit = model(inputs), model[: int(UNIT_LAYER) + 1](inputs)
        (score,), _ = unit.resolve(output, Context(spots={UNIT_LAYER: at_unit}))
        torch.testing.assert_close(score(output), at_unit[:, 1].mean(dim=(1, 2)))
        with pytest.raises(CamvizError, match="did not record the Unit's layer '4'") as error:
            score(model(inputs))  # another pass: its unit layer was not recorded
    assert "\n" not in str(error.value)
    # CAM reads the classifier's weights, which say nothing of a unit: one line too.
    with pytest.raises(CamvizError, match="cam needs the model's output") as error:
        camviz.explain(model, inputs, "cam", layer="5", target=unit)
    assert "\n" not in str(error.value)


def test_input_gradients_of_a_unit_are_the_autograd_of_its_mean(model, inputs):
    leaves = inputs.clone().requires_grad_()
    (gradients,) = torch.autograd.grad(
        model[: int(UNIT_LAYER) + 1](leaves)[:, 1].mean(dim=(1, 2)).sum(), leaves
    )
    unit = Unit(UNIT_LAYER, channel=1)
    result = camviz.explain(model, inputs, "vanilla_gradients", layer=LAYER, target=unit)
    expected = min_max(gradients.abs().amax(dim=1))
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-5, atol=1e-9)


def test_methods_with_passes_of_their_own_record_the_unit_there_too(model, inputs):
    unit = Unit(UNIT_LAYER, channel=CHANNELS)
    # Smooth Grad-CAM++ without noise is Grad-CAM++ (its noisy passes read the unit).
    plain = camviz.explain(model, inputs, "gradcam++", layer=LAYER, target=unit)
    smooth = camviz.explain(
        model, inputs, "smooth_gradcam++", layer=LAYER, target=unit, samples=2, noise=0.0
    )
    torch.testing.assert_close(smooth.layer_maps, plain.layer_maps, rtol=1e-5, atol=1e-9)
    # SESS over Score-CAM with one window, the whole image, is Score-CAM at the input.
    sess = camviz.explain(
        model, inputs, "sess", layer=LAYER, target=unit, base="scorecam", scales=1, smooth=False
    )
    scorecam = camviz.explain(model, inputs, "scorecam", layer=LAYER, target=unit)
    torch.testing.assert_close(sess.heatmaps, scorecam.heatmaps, rtol=1e-5, atol=1e-7)
