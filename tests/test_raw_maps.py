"""Raw maps (relu=False, normalize=False) in the method's own units, signed maps, and the
channel weights of the methods whose map is a weighted sum of channels."""

from __future__ import annotations

import pytest
import torch
from conftest import conv_net
from reference import leaf_activations_and_gradients

import camviz
from camviz.cams.base import ChannelWeighted
from camviz.cams.registry import get, names
from camviz.core.maps import normalize


@pytest.fixture(scope="module")
def recorded(resnet18):
    torch.manual_seed(1)
    inputs = torch.randn(2, 3, 64, 64)
    activations, gradients = leaf_activations_and_gradients(resnet18, inputs, "layer3", [3, 7])
    return inputs, activations, gradients


def test_raw_gradcam_and_its_weights_equal_the_formula(resnet18, recorded):
    inputs, activations, gradients = recorded
    weights = gradients.mean(dim=(2, 3))
    expected = (weights[:, :, None, None] * activations).sum(1)
    result = camviz.explain(
        resnet18, inputs, layer="layer3", target=[3, 7], relu=False, normalize=False
    )
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(result.weights["layer3"], weights, atol=1e-7, rtol=1e-4)
    upsampled = torch.nn.functional.interpolate(expected[:, None], size=(64, 64), mode="bilinear")[
        :, 0
    ]
    torch.testing.assert_close(result.heatmaps, upsampled, atol=1e-6, rtol=1e-4)
    assert bool((result.layer_maps < 0).any()), "a signed map must keep its negative part"


def test_signed_normalised_maps_keep_zero_and_sign(resnet18, recorded):
    inputs, activations, gradients = recorded
    raw = (gradients.mean(dim=(2, 3), keepdim=True) * activations).sum(1)
    result = camviz.explain(resnet18, inputs, layer="layer3", target=[3, 7], relu=False)
    torch.testing.assert_close(result.layer_maps, raw / raw.flatten(1).abs().amax(1).view(-1, 1, 1))


@pytest.mark.parametrize(
    ("method", "formula"),
    [
        ("xgradcam", lambda a, g: ((g * a).sum((2, 3)) / a.sum((2, 3))).nan_to_num()),
        (
            "gradcam++",
            lambda a, g: (
                (g.square() / (2 * g.square() + a.sum((2, 3), keepdim=True) * g.pow(3)) * g.relu())
                .nan_to_num()
                .sum((2, 3))
            ),
        ),
    ],
)
def test_weights_of_gradient_methods_equal_the_paper(resnet18, recorded, method, formula):
    inputs, activations, gradients = recorded
    result = camviz.explain(resnet18, inputs, method, layer="layer3", target=[3, 7])
    torch.testing.assert_close(
        result.weights["layer3"], formula(activations, gradients), atol=1e-7, rtol=1e-4
    )


@pytest.fixture(scope="module")
def tiny():
    model = conv_net(6, 8, classes=6)
    return model, torch.randn(2, 3, 12, 12)


def test_ablationcam_weights_are_the_relative_drops(tiny):
    model, inputs = tiny
    activations = leaf_activations_and_gradients(model, inputs, "2", [5, 5])[0]
    with torch.no_grad():
        scores = model(inputs)[:, 5]
        drops = []
        for channel in range(activations.shape[1]):

            def zero(module, args, output, channel=channel):
                output = output.clone()
                output[:, channel] = 0
                return output

            handle = model[2].register_forward_hook(zero)
            drops.append(model(inputs)[:, 5])
            handle.remove()
    expected = (scores[:, None] - torch.stack(drops, 1)) / scores[:, None]
    result = camviz.explain(
        model, inputs, "ablationcam", layer="2", target=5, normalize=False, relu=False
    )
    torch.testing.assert_close(result.weights["2"], expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        result.layer_maps, (expected[:, :, None, None] * activations).sum(1), atol=1e-4, rtol=1e-4
    )


def test_several_raw_layers_stay_apart(resnet18, recorded):
    inputs = recorded[0]
    both = camviz.explain(
        resnet18, inputs, layer=["layer3", "layer4"], target=2, relu=False, normalize=False
    )
    for layer in ("layer3", "layer4"):
        alone = camviz.explain(resnet18, inputs, layer=layer, target=2, relu=False, normalize=False)
        torch.testing.assert_close(both.maps_by_layer[layer], alone.layer_maps)
        torch.testing.assert_close(both.weights[layer], alone.weights[layer])
    # No fusion of different units: the heatmaps are the first layer's map at the input size.
    first = camviz.explain(resnet18, inputs, layer="layer3", target=2, relu=False, normalize=False)
    torch.testing.assert_close(both.heatmaps, first.heatmaps)


def test_weights_exist_exactly_for_weighted_sum_methods_and_make_their_maps(tiny):
    model, inputs = tiny
    with torch.no_grad():
        activations = model[:4](inputs)  # layer "3", which feeds the pooling (CAM)
    for method in names():
        if not get(method).applies_to(model):
            continue  # LeGrad: vision transformers only
        result = camviz.explain(model, inputs, method, layer="3", target=3)
        weighted = issubclass(get(method), ChannelWeighted)
        assert (result.weights is not None) == weighted, method
        if weighted:
            maps = (result.weights["3"][:, :, None, None] * activations).sum(1)
            torch.testing.assert_close(
                result.layer_maps, normalize(maps.relu()), atol=1e-5, rtol=1e-4
            )
