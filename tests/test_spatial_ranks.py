"""Signals (N, C, L) and volumes or clips (N, C, D, H, W): the formula by hand, a peer's 3-D
Grad-CAM, every method against its 2-D self, and layouts told from what produced them."""

from __future__ import annotations

import pytest
import torch
from conftest import conv_net
from reference import leaf_activations_and_gradients
from torch import nn

import camviz
from camviz.cams.registry import get, names
from camviz.core.errors import CamvizError


class Block(nn.Module):
    """A custom block (a kind camviz does not know): its output's layout comes from its conv."""

    def __init__(self, conv: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.conv, self.norm, self.act = conv, norm, nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


def twin_models() -> dict[int, nn.Module]:
    """One small CNN as a 2-D model and its exact 1-D and 3-D twins.

    The 2-D model runs on images of height 1 (kernels ``(1, k)``), the 3-D twin on volumes
    of depth and height 1 (kernels ``(1, 1, k)``), with the same weights. So every method
    must give the 1-D model's maps on them: the same numbers, with one or two axes more.
    """
    convs = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
    norms = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
    pools = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}
    models = {}
    for rank in (1, 2, 3):
        ones = (1,) * (rank - 1)
        models[rank] = nn.Sequential(
            Block(convs[rank](2, 6, (*ones, 3), padding=(0,) * (rank - 1) + (1,)), norms[rank](6)),
            Block(convs[rank](6, 8, (*ones, 3), stride=(*ones, 2)), norms[rank](8)),
            pools[rank](1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, value in models[1].state_dict().items():
            if value.is_floating_point():
                value.copy_(
                    torch.rand_like(value) + 0.5 if "var" in name else torch.randn_like(value)
                )
        for rank in (2, 3):
            for mine, theirs in zip(
                models[rank].state_dict().values(), models[1].state_dict().values(), strict=True
            ):
                mine.copy_(theirs.view(mine.shape))
    return {rank: model.eval() for rank, model in models.items()}


@pytest.fixture(scope="module")
def twins() -> dict[int, nn.Module]:
    return twin_models()


@pytest.fixture(scope="module")
def signal() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 2, 16)


def as_rank(signal: torch.Tensor, rank: int) -> torch.Tensor:
    return {1: signal, 2: signal.unsqueeze(2), 3: signal.unsqueeze(2).unsqueeze(2)}[rank]


METHOD_OPTIONS = {"sscam": {"num_samples": 2, "seed": 0}, "smooth_gradcam++": {"samples": 2}}


# Methods defined only for images (SESS slides square windows) or for one kind of model
# (LeGrad: vision transformers) say so in one line; test_methods_elsewhere checks that.
GENERAL = [name for name in names() if get(name).spatial_ranks == (1, 2, 3) and name != "legrad"]


@pytest.mark.parametrize("method", GENERAL)
def test_every_method_gives_the_2d_maps_on_1d_signals_and_3d_volumes(twins, signal, method):
    options = METHOD_OPTIONS.get(method, {})
    maps = {}
    for rank, model in twins.items():
        result = camviz.explain(
            model,
            as_rank(signal, rank),
            method,
            layer="1",
            target=2,
            relu=False,
            normalize=False,
            **options,
        )
        maps[rank] = result
    flat = {rank: result.heatmaps.reshape(2, 16) for rank, result in maps.items()}
    torch.testing.assert_close(flat[2], flat[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(flat[3], flat[1], atol=1e-5, rtol=1e-4)
    assert maps[1].heatmaps.shape == (2, 16) and maps[3].heatmaps.shape == (2, 1, 1, 16)
    layer_maps = {rank: result.layer_maps.reshape(2, -1) for rank, result in maps.items()}
    torch.testing.assert_close(layer_maps[2], layer_maps[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(layer_maps[3], layer_maps[1], atol=1e-5, rtol=1e-4)
    assert bool(flat[1].abs().amax(1).gt(1e-3).all()), "a map with no evidence proves nothing"


@pytest.mark.parametrize("method", sorted(set(names()) - set(GENERAL)))
def test_methods_defined_elsewhere_say_so_in_one_line(twins, signal, method):
    with pytest.raises(CamvizError) as error:
        camviz.explain(twins[1], signal, method, layer="1")
    assert "\n" not in str(error.value) and method in str(error.value)


def hand_gradcam(model, inputs, layer, classes, relu=True):
    activations, gradients = leaf_activations_and_gradients(model, inputs, layer, classes)
    dims = tuple(range(2, activations.dim()))
    weights = gradients.mean(dim=dims, keepdim=True)
    cam = (weights * activations).sum(1)
    return torch.relu(cam) if relu else cam, weights.flatten(1)


@pytest.mark.parametrize("rank", [1, 3])
def test_gradcam_in_1d_and_3d_equals_the_formula_from_autograd(rank):
    model = conv_net(5, 7, classes=4, stride=(1, 2), padding=(1, 0), rank=rank, seed=rank)
    inputs = torch.randn(2, 3, *([20] if rank == 1 else [6, 8, 10]))
    result = camviz.explain(model, inputs, layer="2", target=[1, 3])
    expected, _ = hand_gradcam(model, inputs, "2", [1, 3])
    peak = expected.flatten(1).amax(1).view(-1, *[1] * rank)
    low = expected.flatten(1).amin(1).view(-1, *[1] * rank)
    torch.testing.assert_close(
        result.layer_maps, (expected - low) / (peak - low), atol=1e-5, rtol=0
    )
    assert result.heatmaps.shape == (2, *inputs.shape[2:])
    assert result.layers == ["2"]
    # The default layer is the last map of the input's rank: the ReLU after the second conv.
    assert camviz.explain(model, inputs).layers == ["3"]


def test_3d_gradcam_matches_pytorch_grad_cam():
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model = conv_net(8, 8, padding=1, rank=3)
    # A layer at the input's resolution: no resizing, whose filters differ (scipy's cubic
    # spline zoom there, trilinear here), so the maps are compared as the methods compute them.
    inputs = torch.randn(2, 3, 4, 12, 12)
    with GradCAM(model=model, target_layers=[model[3]]) as peer:
        theirs = torch.from_numpy(peer(inputs, targets=[ClassifierOutputTarget(2)] * 2))
    ours = camviz.explain(model, inputs, layer="3", target=2).heatmaps
    for mine, peer_map in zip(ours, theirs, strict=True):
        correlation = torch.corrcoef(torch.stack([mine.flatten(), peer_map.flatten().float()]))[
            0, 1
        ]
        assert correlation >= 0.99


def test_a_1d_convolution_output_is_a_signal_map_not_a_grid_of_channels():
    """(N, C, L) from a Conv1d used to be read as (N, T, C) tokens: a 1 x C grid of channels."""
    model = conv_net(64, classes=2, in_channels=1, kernel=5, padding=2, rank=1)
    inputs = torch.randn(3, 1, 50)
    result = camviz.explain(model, inputs, layer="1", target=0, relu=False, normalize=False)
    expected, _ = hand_gradcam(model, inputs, "1", [0, 0, 0], relu=False)
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=1e-5)
    assert result.heatmaps.shape == (3, 50)


def test_a_tensor_is_a_batch_except_one_image_for_an_image_model(resnet18):
    signal_model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    signal_model(torch.zeros(1, 3, 16))
    three_signals = torch.randn(3, 3, 16)
    signals = camviz.explain(signal_model.eval(), three_signals, layer="1", target=0)
    assert signals.heatmaps.shape == (3, 16)
    alone = camviz.explain(signal_model, three_signals[1:2], layer="1", target=0)
    torch.testing.assert_close(signals.heatmaps[1:2], alone.heatmaps)  # sample 1 of 3
    one_image = torch.randn(3, 32, 32)
    image = camviz.explain(resnet18, one_image, layer="layer4", relu=False, target=2)
    as_batch = camviz.explain(resnet18, one_image[None], layer="layer4", relu=False, target=2)
    assert image.heatmaps.shape == (1, 32, 32)
    torch.testing.assert_close(image.heatmaps, as_batch.heatmaps)


def test_ssdlite_head_is_refused_in_one_line_naming_layout():
    """SSDlite's classification head emits (N, anchors, classes): no map, and no tokens."""
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    torch.manual_seed(0)
    detector = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3)

    class HeadLogits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = detector.backbone, detector.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(list(self.backbone(x).values()))["cls_logits"]

    model = HeadLogits().eval()
    with pytest.raises(CamvizError, match=r"pass layout=") as error:
        camviz.explain(
            model,
            torch.randn(1, 3, 64, 64),
            layer="head.classification_head",
            target=lambda out: out[..., 1].amax(1),
        )
    assert "\n" not in str(error.value)


def test_coat_default_layer_reaches_the_patches():
    """CoaT's head reads only the class token after ``norm4``: the default is the input of
    its last (factorised) attention instead, and the map equals Grad-CAM by hand."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("coat_lite_tiny", pretrained=False, num_classes=5, img_size=64).eval()
    inputs = torch.randn(2, 3, 64, 64)
    result = camviz.explain(model, inputs, target=1, relu=False, normalize=False)
    assert result.layers == ["serial_blocks4.1.norm1"]
    activations, gradients = leaf_activations_and_gradients(model, inputs, result.layers[0], [1, 1])
    # 5 tokens: the class token, then the 2 x 2 patches of a 64 px input at stride 32.
    activations, gradients = (
        t[:, 1:].reshape(2, 2, 2, -1).permute(0, 3, 1, 2) for t in (activations, gradients)
    )
    expected = (gradients.mean(dim=(2, 3), keepdim=True) * activations).sum(1)
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-6, rtol=1e-4)
    assert bool(expected.abs().flatten(1).amax(1).gt(1e-4).all())


class ClassTokenHead(nn.Module):
    """A stand-in with CoaT's structure minus attention: the head reads only the class token,
    so nothing reaches the patch tokens at the last token layer."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(x), -1, -1), tokens + self.cls], dim=1)
        return self.head(self.norm(tokens)[:, 0])


def test_a_default_layer_with_all_zero_maps_is_reported_in_one_line(untouched):
    model = ClassTokenHead().eval()
    with untouched(model), pytest.raises(CamvizError, match="score does not depend on any layer"):
        camviz.explain(model, torch.randn(2, 3, 32, 32))
    with pytest.raises(CamvizError, match="a head that reads only a class token"):
        camviz.explain(model, torch.randn(2, 3, 32, 32))  # tokens: the class-token hint
