"""Models with several inputs (a tuple passed positionally, a dict as keywords), the input the
map is laid on, wrapped models, and models without hooks."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import camviz
from camviz.core.errors import CamvizError


class ImageAndTable(nn.Module):
    """An image branch and a table of features, joined after the image's last conv."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 8, 3))
        self.table = nn.Linear(4, 8)
        self.head = nn.Linear(16, 3)

    def forward(self, image: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        pooled = torch.relu(self.features(image)).mean(dim=(2, 3))
        return self.head(torch.cat([pooled, torch.tanh(self.table(table))], dim=1))


class Bound(nn.Module):
    """The hand-written wrapper a user needed before: one sample's table bound to the model."""

    def __init__(self, model: nn.Module, table: torch.Tensor) -> None:
        super().__init__()
        self.model, self.table = model, table

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.model(image, self.table.expand(len(image), -1))


@pytest.fixture
def two_inputs():
    torch.manual_seed(0)
    return ImageAndTable().eval(), torch.randn(2, 3, 12, 12), torch.randn(2, 4)


@pytest.mark.parametrize("method", ["gradcam", "layercam", "eigencam"])
def test_a_two_input_model_gives_the_map_of_a_hand_bound_wrapper(two_inputs, untouched, method):
    model, image, table = two_inputs
    copies = image.clone(), table.clone()
    with untouched(model):
        result = camviz.explain(model, (image, table), method, layer="features.2", target=[0, 2])
    for sample in range(2):
        bound = Bound(model, table[sample : sample + 1]).eval()
        alone = camviz.explain(
            bound,
            image[sample : sample + 1],
            method,
            layer="model.features.2",
            target=[0, 2][sample],
        )
        torch.testing.assert_close(result.heatmaps[sample], alone.heatmaps[0], atol=1e-5, rtol=1e-4)
    assert torch.equal(image, copies[0]) and torch.equal(table, copies[1])


# The hand-bound reference cannot take Ablation-CAM's batch of copies (its table has one
# row) and falls back, with a warning, to full passes; camviz's own two-input run does not.
@pytest.mark.filterwarnings("ignore:ablationcam")
@pytest.mark.parametrize("method", ["ablationcam", "scorecam"])
def test_perturbation_methods_take_the_other_inputs_row_by_row(two_inputs, method):
    """Ablation-CAM and Score-CAM need no expanded copies of the table from the user."""
    model, image, table = two_inputs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the broadcast shortcut holds for several inputs
        result = camviz.explain(model, (image, table), method, layer="features.2", target=1)
    for sample in range(2):
        bound = Bound(model, table[sample : sample + 1]).eval()
        alone = camviz.explain(
            bound, image[sample : sample + 1], method, layer="model.features.2", target=1
        )
        torch.testing.assert_close(result.heatmaps[sample], alone.heatmaps[0], atol=1e-5, rtol=1e-4)


class TwoImages(nn.Module):
    """Two images through their own convs (Hugging Face style keywords)."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Conv2d(3, 4, 3)
        self.right = nn.Conv2d(1, 4, 3)
        self.head = nn.Linear(8, 2)

    def forward(self, pixel_values: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        left = torch.relu(self.left(pixel_values)).mean(dim=(2, 3))
        right = torch.relu(self.right(depth)).mean(dim=(2, 3))
        return self.head(torch.cat([left, right], dim=1))


def test_input_gradient_methods_give_a_map_per_spatial_input_and_map_input_picks_one():
    torch.manual_seed(0)
    model = TwoImages().eval()
    inputs = {"pixel_values": torch.randn(2, 3, 10, 10), "depth": torch.randn(2, 1, 8, 8)}
    leaves = {key: value.clone().requires_grad_() for key, value in inputs.items()}
    score = model(**leaves)[:, 1].sum()
    by_hand = dict(zip(leaves, torch.autograd.grad(score, list(leaves.values())), strict=True))
    result = camviz.explain(model, inputs, "vanilla_gradients", target=1, normalize=False)
    assert set(result.maps_by_input) == {"pixel_values", "depth"}
    for key, gradients in by_hand.items():
        torch.testing.assert_close(result.maps_by_input[key], gradients.abs().amax(1))
    torch.testing.assert_close(result.heatmaps, by_hand["pixel_values"].abs().amax(1))
    on_depth = camviz.explain(
        model, inputs, "vanilla_gradients", target=1, normalize=False, map_input="depth"
    )
    torch.testing.assert_close(on_depth.heatmaps, by_hand["depth"].abs().amax(1))
    assert camviz.explain(
        model, inputs, "gradcam", layer="right", map_input="depth"
    ).heatmaps.shape == (2, 8, 8)


def test_data_parallel_is_looked_through(resnet18, small_batch, untouched):
    wrapped = nn.DataParallel(resnet18)
    expected = camviz.explain(resnet18, small_batch, layer="layer4", target=3).heatmaps
    with untouched(wrapped):
        result = camviz.explain(wrapped, small_batch, layer=resnet18.layer4, target=3)
    torch.testing.assert_close(result.heatmaps, expected)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:FutureWarning")
def test_models_without_hooks_get_one_line(two_inputs):
    model, image, table = two_inputs
    scripted = torch.jit.trace(model, (image, table))
    with pytest.raises(CamvizError, match="TorchScript model has no forward hooks"):
        camviz.explain(scripted, (image, table), layer="features.2")
    exported = torch.export.export(model, (image, table))
    with pytest.raises(CamvizError, match="exported program has no forward hooks"):
        camviz.explain(exported, (image, table), layer="features.2")


@pytest.mark.parametrize(
    ("inputs", "kwargs", "message"),
    [
        ("sizes", {}, r"different batch sizes \(input 0: 2, input 1: 3\)"),
        ("pair", {"map_input": 2}, r"map_input=2 is out of range: there are 2 inputs"),
        ("pair", {"map_input": 1}, r"the map input 1 must be a float \(N, C, L\)"),
        ("pair", {"layer": nn.Conv2d(3, 6, 3)}, "is not a submodule of this model"),
    ],
)
def test_bad_inputs_get_one_line_and_leave_nothing_behind(
    two_inputs, untouched, inputs, kwargs, message
):
    model, image, table = two_inputs
    given = (image, torch.randn(3, 4)) if inputs == "sizes" else (image, table)
    with untouched(model), pytest.raises(CamvizError, match=message) as error:
        camviz.explain(model, given, **{"layer": "features.2", **kwargs})
    assert "\n" not in str(error.value)
