"""Any layer: submodules, a layer's input (at="input"), and one element of a tuple or dict."""

from __future__ import annotations

import pytest
import torch
from reference import leaf_activations_and_gradients
from torch import nn

import camviz
from camviz.core.errors import CamvizError


@pytest.mark.parametrize("method", ["gradcam", "gradcam++", "ablationcam", "eigencam"])
def test_a_layer_input_equals_the_previous_layer_output(resnet18, small_batch, untouched, method):
    """ResNet's avgpool takes exactly layer4's output."""
    expected = camviz.explain(resnet18, small_batch, method, layer="layer4", target=3)
    with untouched(resnet18):
        result = camviz.explain(
            resnet18, small_batch, method, layer="avgpool", at="input", target=3
        )
    assert result.layers == ["avgpool:input"]
    torch.testing.assert_close(result.heatmaps, expected.heatmaps)
    also = camviz.explain(resnet18, small_batch, method, layer="avgpool:input", target=3)
    torch.testing.assert_close(also.heatmaps, expected.heatmaps)


def test_layers_as_a_list_of_submodules_and_names(resnet18, small_batch):
    result = camviz.explain(resnet18, small_batch, layer=[resnet18.layer3, "layer4"], target=1)
    assert result.layers == ["layer3", "layer4"]


class TwoHeads(nn.Module):
    """A block that returns a tuple and a dict: only one element of each is a feature map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        features = torch.relu(self.conv(x))
        return features.mean(dim=(2, 3)), {"map": features, "doubled": 2 * features}


class TupleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = TwoHeads()
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled, maps = self.block(x)
        return self.head(maps["map"].amax(dim=(2, 3)) + pooled)


def test_one_element_of_a_tuple_or_dict_output(untouched):
    torch.manual_seed(0)
    model = TupleModel().eval()
    inputs = torch.randn(2, 3, 8, 8)
    with untouched(model):
        result = camviz.explain(
            model, inputs, layer="block[1][map]", target=[0, 2], normalize=False
        )
    assert result.layers == ["block[1][map]"]
    # By hand: the element replaced by a leaf inside the returned structure.
    saved = {}

    def to_leaf(module, args, output):
        saved["A"] = output[1]["map"].detach().requires_grad_()
        return output[0], {"map": saved["A"] * 1, "doubled": output[1]["doubled"]}

    handle = model.block.register_forward_hook(to_leaf)
    try:
        score = model(inputs)[torch.arange(2), torch.tensor([0, 2])].sum()
        (gradients,) = torch.autograd.grad(score, saved["A"])
    finally:
        handle.remove()
    cam = torch.relu((gradients.mean(dim=(2, 3), keepdim=True) * saved["A"].detach()).sum(1))
    torch.testing.assert_close(result.heatmaps, cam)
    ablated = camviz.explain(model, inputs, "ablationcam", layer="block[1][map]", target=0)
    assert ablated.heatmaps.shape == (2, 8, 8)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ("block", "gives a tuple with no feature map of the input's rank .* 'name\\[0\\]'"),
        ("block[2]", r"has no element \[2\] in a tuple"),
        ("block[1][maps]", r"has no element \[maps\] in a dict with keys \['map', 'doubled'\]"),
        ("block[0]", r"outputs shape \(2, 5\), not a feature map"),
    ],
)
def test_bad_spots_get_one_line(untouched, layer, message):
    model = TupleModel().eval()
    with untouched(model), pytest.raises(CamvizError, match=message):
        camviz.explain(model, torch.randn(2, 3, 8, 8), layer=layer)


def test_at_input_of_a_linear_head_is_not_a_map(resnet18, small_batch):
    with pytest.raises(
        CamvizError, match=r"'fc:input' outputs shape \(2, 512\), not a feature map"
    ):
        camviz.explain(resnet18, small_batch, layer="fc", at="input")
    with pytest.raises(CamvizError, match="at must be 'output' or 'input'"):
        camviz.explain(resnet18, small_batch, layer="fc", at="inputs")


def test_at_input_of_a_block_whose_input_also_skips_it(resnet18, small_batch):
    """layer4.1's conv1 input is layer4.0's output, but the skip path is not tapped there:
    the gradient is that of the conv1 branch alone (the leaf is only conv1's argument)."""
    saved = {}

    def to_leaf(module, args):
        saved["A"] = args[0].detach().requires_grad_()
        return (saved["A"] * 1,)

    handle = resnet18.layer4[1].conv1.register_forward_pre_hook(to_leaf)
    try:
        score = resnet18(small_batch)[:, 4].sum()
        (gradients,) = torch.autograd.grad(score, saved["A"])
    finally:
        handle.remove()
    expected = (gradients.mean(dim=(2, 3), keepdim=True) * saved["A"].detach()).sum(1)
    result = camviz.explain(
        resnet18,
        small_batch,
        layer="layer4.1.conv1",
        at="input",
        target=4,
        relu=False,
        normalize=False,
    )
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=1e-4)
    plain = leaf_activations_and_gradients(resnet18, small_batch, "layer4.0", [4, 4])[1]
    assert not torch.allclose(plain, gradients)
