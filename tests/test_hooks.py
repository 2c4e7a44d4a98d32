"""camviz.capture and camviz.edit: what they record, and that no hook is ever left behind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import camviz
from camviz.core.errors import CamvizError


def hook_count(model: nn.Module) -> int:
    return sum(
        len(module._forward_hooks)
        + len(module._forward_pre_hooks)
        + len(module._backward_hooks)
        + len(module._backward_pre_hooks)
        for module in model.modules()
    )


def test_capture_example_from_the_docs_gives_exact_values(resnet18, small_batch):
    with camviz.capture(resnet18, ["layer4", "fc"], gradients=True) as cap:
        resnet18(small_batch)[:, 3].sum().backward()
    activations = cap.activations["layer4"]
    height, width = activations.shape[-2:]
    # fc(avgpool(A)): d(sum_n y_n3)/dA_nkij = W[3, k] / (h * w), the same for every sample.
    expected_gradient = (resnet18.fc.weight[3] / (height * width)).view(1, -1, 1, 1)
    torch.testing.assert_close(cap.gradients["layer4"], expected_gradient.expand_as(activations))
    torch.testing.assert_close(cap.inputs["fc"], activations.mean(dim=(2, 3)))
    assert hook_count(resnet18) == 0
    resnet18.zero_grad(set_to_none=True)


def test_hooks_are_removed_when_the_block_raises(resnet18, small_batch):
    with pytest.raises(ZeroDivisionError), camviz.capture(resnet18, "layer*", gradients=True):
        resnet18(small_batch)
        _ = 1 / 0
    assert hook_count(resnet18) == 0


def test_each_hook_is_bound_to_its_own_layer(resnet18, small_batch):
    names = [f"layer{i}" for i in range(1, 5)]
    with camviz.capture(resnet18, names) as cap:
        resnet18(small_batch)
    channels = [cap.activations[name].shape[1] for name in names]
    assert channels == [64, 128, 256, 512]
    torch.testing.assert_close(cap.inputs["layer2"], cap.activations["layer1"])


def test_tensor_gradients_are_exact_when_the_output_is_changed_in_place(resnet18, small_batch):
    # layer4.1.bn2's output is overwritten by `out += identity` right after the layer.
    layer = resnet18.layer4[1].bn2
    leaf = {}

    def replace_with_leaf(module, args, output):
        leaf["value"] = output.detach().clone().requires_grad_()
        return leaf["value"].clone()

    handle = layer.register_forward_hook(replace_with_leaf)
    try:
        (expected_gradient,) = torch.autograd.grad(resnet18(small_batch)[:, 1].sum(), leaf["value"])
    finally:
        handle.remove()
    with camviz.capture(resnet18, "layer4.1.bn2", gradients=True) as cap:
        resnet18(small_batch)[:, 1].sum().backward()
    resnet18.zero_grad(set_to_none=True)
    torch.testing.assert_close(cap.activations["layer4.1.bn2"], leaf["value"].detach())
    torch.testing.assert_close(cap.gradients["layer4.1.bn2"], expected_gradient)


def test_full_backward_hook_on_an_inplace_layer_is_explained(resnet18, small_batch):
    with (
        pytest.raises(CamvizError, match="backward='tensor'"),
        camviz.capture(resnet18, "layer4.1.bn2", gradients=True, backward="full"),
    ):
        resnet18(small_batch)
    assert hook_count(resnet18) == 0


def test_full_backward_hook_matches_tensor_hook_where_it_works(resnet18, small_batch):
    results = {}
    for backward in ("tensor", "full"):
        with camviz.capture(resnet18, "avgpool", gradients=True, backward=backward) as cap:
            resnet18(small_batch)[:, 2].sum().backward()
        results[backward] = cap.gradients["avgpool"]
    resnet18.zero_grad(set_to_none=True)
    torch.testing.assert_close(results["full"], results["tensor"])
    expected = resnet18.fc.weight[2].view(1, -1, 1, 1).expand(2, -1, 1, 1)
    torch.testing.assert_close(results["full"], expected)


def test_keep_last_holds_one_value_and_keep_all_is_bounded(resnet18, small_batch):
    with camviz.capture(resnet18, "fc") as cap:
        for _ in range(3):
            resnet18(small_batch)
    assert isinstance(cap.activations["fc"], torch.Tensor)
    with camviz.capture(resnet18, "fc", keep="all", max_calls=2) as cap:
        resnet18(small_batch)
        resnet18(small_batch * 2)
        with pytest.raises(CamvizError, match="max_calls=2"):
            resnet18(small_batch)
    assert len(cap.activations["fc"]) == 2
    assert not torch.equal(cap.activations["fc"][0], cap.activations["fc"][1])
    assert hook_count(resnet18) == 0


def test_missing_record_says_what_to_check(resnet18, small_batch):
    with camviz.capture(resnet18, "fc", gradients=True) as cap, torch.no_grad():
        resnet18(small_batch)
    with pytest.raises(CamvizError, match="backward reached it"):
        cap.gradients["fc"]


def test_unknown_layer_suggests_close_names(resnet18):
    with (
        pytest.raises(CamvizError, match="did you mean 'layer4'"),
        camviz.capture(resnet18, "layer_4"),
    ):
        pass


def test_edit_replaces_the_output_and_comes_off(resnet18, small_batch):
    with camviz.edit(resnet18, {"layer4": torch.zeros_like}), torch.no_grad():
        logits = resnet18(small_batch)
    torch.testing.assert_close(logits, resnet18.fc.bias.detach().expand_as(logits))
    assert hook_count(resnet18) == 0
    with torch.no_grad():
        assert not torch.allclose(resnet18(small_batch), logits)


class Split(nn.Module):
    """A layer with two outputs: ``(2x, 3x)``."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x * 3


class TwoOutputs(nn.Module):
    """``sum(5a + 7b)`` of the split ``(a, b)``, or ``sum(5a)`` without ``use_second``."""

    def __init__(self, use_second: bool = True) -> None:
        super().__init__()
        self.split = Split()
        self.use_second = use_second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.split(x)
        total = first * 5
        if self.use_second:
            total = total + second * 7
        return total.sum()


@pytest.mark.parametrize("backward", ["tensor", "full"])
def test_a_layer_with_two_outputs_gets_one_gradient_per_output_in_both_modes(backward):
    x = torch.ones(2, requires_grad=True)
    model = TwoOutputs()
    with camviz.capture(model, "split", gradients=True, backward=backward) as cap:
        model(x).backward()
    first, second = cap.gradients["split"]
    torch.testing.assert_close(first, torch.full((2,), 5.0))
    torch.testing.assert_close(second, torch.full((2,), 7.0))


@pytest.mark.parametrize("backward", ["tensor", "full"])
def test_an_output_that_backward_does_not_reach_has_no_gradient(backward):
    model = TwoOutputs(use_second=False)
    with camviz.capture(model, "split", gradients=True, backward=backward, keep="all") as cap:
        model(torch.ones(2, requires_grad=True)).backward()
        model(torch.ones(2, requires_grad=True)).backward()
    assert len(cap.gradients["split"]) == 2  # one list per backward pass
    for first, second in cap.gradients["split"]:
        torch.testing.assert_close(first, torch.full((2,), 5.0))
        assert second is None
