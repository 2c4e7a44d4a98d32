"""Grad-CAM through camviz.explain: the paper's numbers, a peer's numbers, awkward models,
and a model handed back exactly as it came."""

from __future__ import annotations

import pytest
import torch
from reference import leaf_activations_and_gradients
from torch import nn

import camviz
from camviz.core.errors import CamvizError


class ConvPoolLinear(nn.Module):
    """features (1x1 conv, identity weights) -> global average pool -> linear head."""

    def __init__(self, head: torch.Tensor) -> None:
        super().__init__()
        self.features = nn.Conv2d(2, 2, 1, bias=False)
        self.head = nn.Linear(2, head.shape[0], bias=False)
        with torch.no_grad():
            self.features.weight.copy_(torch.eye(2).view(2, 2, 1, 1))
            self.head.weight.copy_(head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def reference_gradcam(model: nn.Module, inputs: torch.Tensor, layer: str, classes) -> torch.Tensor:
    """Grad-CAM written out independently: the layer output replaced by a leaf tensor."""
    activations, gradients = leaf_activations_and_gradients(model, inputs, layer, classes)
    cam = torch.relu((gradients.mean(dim=(2, 3), keepdim=True) * activations).sum(1))
    low = cam.flatten(1).amin(1).view(-1, 1, 1)
    high = cam.flatten(1).amax(1).view(-1, 1, 1)
    return (cam - low) / (high - low)


def test_gradcam_equals_the_formula_computed_by_hand():
    # A0, A1 are the two channels; head row 0 = [1, -1], so alpha = [1/4, -1/4] (Z = 4) and
    # L = ReLU(A0/4 - A1/4) = ReLU([[1, -1], [0, 2]]) = [[1, 0], [0, 2]] -> /2 after min-max.
    inputs = torch.tensor([[[[4.0, 0.0], [2.0, 8.0]], [[0.0, 4.0], [2.0, 0.0]]]])
    model = ConvPoolLinear(torch.tensor([[1.0, -1.0], [0.5, 2.0]]))
    result = camviz.explain(model, inputs, layer="features", target=0)
    expected = torch.tensor([[[0.5, 0.0], [0.0, 1.0]]])
    torch.testing.assert_close(result.layer_maps, expected)
    torch.testing.assert_close(result.heatmaps, expected)
    torch.testing.assert_close(result.scores, torch.tensor([0.25 * 14 - 0.25 * 6]))
    assert result.targets.tolist() == [0]


def test_all_zero_map_stays_zero_never_nan():
    model = ConvPoolLinear(torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    result = camviz.explain(model, torch.rand(3, 2, 4, 4), layer="features", target=0)
    assert torch.equal(result.heatmaps, torch.zeros(3, 4, 4))


@pytest.mark.parametrize("layer", ["layer4", "layer3.1.conv2", "layer4.1.bn2"])
def test_gradcam_matches_an_independent_implementation(resnet18, small_batch, layer):
    result = camviz.explain(resnet18, small_batch, layer=layer, target=[3, 7])
    expected = reference_gradcam(resnet18, small_batch, layer, [3, 7])
    torch.testing.assert_close(result.layer_maps, expected)


@pytest.mark.peers
def test_gradcam_matches_pytorch_grad_cam(resnet18, small_batch):
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    with GradCAM(model=resnet18, target_layers=[resnet18.layer4]) as peer:
        theirs = peer(small_batch, targets=[ClassifierOutputTarget(3), ClassifierOutputTarget(7)])
    resnet18.zero_grad(set_to_none=True)
    ours = camviz.explain(resnet18, small_batch, layer="layer4", target=[3, 7])
    # pytorch-grad-cam divides by (max + 1e-7) and resizes with OpenCV's bilinear filter, which
    # samples pixel centres like align_corners=False: agreement to about 1e-4.
    torch.testing.assert_close(ours.heatmaps, torch.from_numpy(theirs), atol=2e-4, rtol=0)


def test_no_graph_is_kept_below_the_target_layer(resnet18, small_batch):
    with camviz.capture(resnet18, "layer4") as cap, torch.no_grad():
        resnet18(small_batch)
    layer4_numel = cap.activations["layer4"].numel()
    parameter_storage = {parameter.data_ptr() for parameter in resnet18.parameters()}
    saved_sizes = []

    def pack(tensor):
        if tensor.data_ptr() not in parameter_storage:
            saved_sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        camviz.explain(resnet18, small_batch, layer="layer4")
    # Only avgpool and fc (after layer4) may save tensors; conv layers below would save
    # inputs of 2 * 64 * 16 * 16 elements and more.
    assert saved_sizes and max(saved_sizes) <= layer4_numel


def test_top_k_gives_one_map_per_rank(resnet18, small_batch):
    result = camviz.explain(resnet18, small_batch, layer="layer4", target="top3")
    with torch.no_grad():
        top = resnet18(small_batch).topk(3).indices
    assert result.targets.tolist() == top.flatten().tolist()
    assert result.samples.tolist() == [0, 0, 0, 1, 1, 1]
    for rank in range(3):
        expected = reference_gradcam(resnet18, small_batch, "layer4", top[:, rank].tolist())
        torch.testing.assert_close(result.layer_maps[rank::3], expected)


def test_callable_target(resnet18, small_batch):
    def contrast(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, 2] - logits[:, 5]

    result = camviz.explain(resnet18, small_batch, layer="layer4", target=contrast)
    weights = (resnet18.fc.weight[2] - resnet18.fc.weight[5]).view(1, -1, 1, 1)
    with camviz.capture(resnet18, "layer4") as cap, torch.no_grad():
        resnet18(small_batch)
    cam = torch.relu((weights * cap.activations["layer4"]).sum(1))
    low, high = cam.flatten(1).aminmax(dim=1)
    expected = (cam - low.view(-1, 1, 1)) / (high - low).view(-1, 1, 1)
    torch.testing.assert_close(result.layer_maps, expected)
    assert result.targets.tolist() == [-1, -1]


def test_awkward_calling_conditions_give_the_same_map_and_restore_the_model(small_batch, untouched):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    expected = camviz.explain(model.eval(), small_batch, layer="layer4.1.bn2", target=1).heatmaps
    model.train()  # train mode would update BatchNorm's running statistics
    model.layer2.eval()  # a mixed-mode model must come back mixed
    for parameter in model.layer1.parameters():
        parameter.requires_grad_(False)
    grad = model.fc.weight.grad = torch.ones_like(model.fc.weight)
    with untouched(model), torch.no_grad():
        result = camviz.explain(model, small_batch, layer="layer4.1.bn2", target=1)
    assert torch.is_grad_enabled()
    assert model.fc.weight.grad is grad
    torch.testing.assert_close(result.heatmaps, expected)


def test_inference_mode_inputs_and_callers_work(resnet18, small_batch):
    expected = camviz.explain(resnet18, small_batch, layer="layer4").heatmaps
    with torch.inference_mode():
        inputs = small_batch.clone()
        inside = camviz.explain(resnet18, inputs, layer="layer4").heatmaps
        assert torch.is_inference_mode_enabled()
    outside = camviz.explain(resnet18, inputs, layer="layer4").heatmaps
    torch.testing.assert_close(inside, expected)
    torch.testing.assert_close(outside, expected)


def test_default_layer_is_the_last_spatial_one(resnet18, small_batch):
    assert camviz.explain(resnet18, small_batch).layers == ["layer4"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": [1, 2, 3]}, "3 target classes for a batch of 2"),
        ({"target": 10}, r"class id 10 is out of range: the model has 10 classes \(0..9\)"),
        ({"target": "best"}, "unknown target 'best'"),
        ({"layer": "layer5"}, "no layer named 'layer5'"),
        ({"layer": "fc"}, r"outputs shape \(2, 10\), not a feature map"),
        ({"method": "gradcam+++"}, "unknown CAM method"),
    ],
)
def test_bad_arguments_raise_one_clear_error(resnet18, small_batch, kwargs, message, untouched):
    with untouched(resnet18), pytest.raises(CamvizError, match=message):
        camviz.explain(resnet18, small_batch, **kwargs)
