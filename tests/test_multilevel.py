"""Multi-level layers (a dict or list of feature maps, as an FPN returns) and the default
target layer of each torchvision family, with random weights and tiny inputs."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.layers import default_target_layer

# Hand references, written without camviz ---------------------------------------------------


def gradcam(activations: torch.Tensor, gradients: torch.Tensor) -> torch.Tensor:
    """Grad-CAM of ``(N, C, h, w)``: ReLU of the channels weighted by their mean gradient."""
    return torch.relu((gradients.mean(dim=(2, 3), keepdim=True) * activations).sum(1))


def min_max(maps: torch.Tensor) -> torch.Tensor:
    low = maps.amin(dim=(1, 2), keepdim=True)
    span = maps.amax(dim=(1, 2), keepdim=True) - low
    return torch.where(span > 0, (maps - low) / span.clamp_min(1e-30), torch.zeros_like(maps))


def fused(maps: list[torch.Tensor], size: tuple[int, int]) -> torch.Tensor:
    """Each level's normalised map, bilinearly resized to the input, averaged, normalised."""
    resized = [
        F.interpolate(min_max(m)[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
        for m in maps
    ]
    return min_max(torch.stack(resized).mean(0))


def levels_and_gradients(
    model: nn.Module, backbone: nn.Module, inputs: torch.Tensor, score
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Each level of ``backbone``'s dict output replaced by a leaf, and ``d score / d level``
    (zeros for a level that the score does not use)."""
    leaves: dict[str, torch.Tensor] = {}

    def to_leaves(module, args, output):
        for key, value in output.items():
            leaves[key] = value.detach().clone().requires_grad_()
        return OrderedDict((key, leaf.clone()) for key, leaf in leaves.items())

    handle = backbone.register_forward_hook(to_leaves)
    try:
        total = score(model(inputs)).sum()
        grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    finally:
        handle.remove()
    gradients = {
        key: torch.zeros_like(leaf) if grad is None else grad
        for (key, leaf), grad in zip(leaves.items(), grads, strict=True)
    }
    return {key: leaf.detach() for key, leaf in leaves.items()}, gradients


# A tiny two-level network ------------------------------------------------------------------


class Pyramid(nn.Module):
    """Three levels at strides 1, 2 and 4, as an OrderedDict (string keys) or a list."""

    def __init__(self, as_list: bool) -> None:
        super().__init__()
        self.as_list = as_list
        self.fine = nn.Conv2d(3, 4, 3, padding=1)
        self.coarse = nn.Conv2d(4, 5, 3, stride=2, padding=1)
        self.unused = nn.Conv2d(5, 3, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor] | list[torch.Tensor]:
        fine = torch.relu(self.fine(x))
        coarse = torch.relu(self.coarse(fine))
        levels = [fine, coarse, self.unused(coarse), coarse.mean(dim=(2, 3))]
        return levels if self.as_list else OrderedDict(zip("0123", levels, strict=True))


class TwoLevelNet(nn.Module):
    """A head on the first two levels; the third and the pooled vector are not maps it uses."""

    def __init__(self, as_list: bool = False) -> None:
        super().__init__()
        self.backbone = Pyramid(as_list)
        self.head_fine = nn.Linear(4, 3)
        self.head_coarse = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        levels = list(self.backbone(x).values()) if not self.backbone.as_list else self.backbone(x)
        return self.head_fine(levels[0].amax(dim=(2, 3))) + self.head_coarse(levels[1].mean((2, 3)))


@pytest.fixture
def pyramid_inputs() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(2, 3, 12, 12)


@pytest.mark.parametrize("as_list", [False, True], ids=["ordereddict", "list"])
def test_levels_of_a_dict_or_list_output_equal_the_hand_formula(as_list, pyramid_inputs, untouched):
    torch.manual_seed(0)
    model = TwoLevelNet(as_list).eval()
    classes = torch.tensor([2, 0])
    with untouched(model):
        result = camviz.explain(model, pyramid_inputs, layer="backbone", target=[2, 0])
    assert result.layers == ["backbone[0]", "backbone[1]", "backbone[2]"]  # not the vector

    saved: dict[str, torch.Tensor] = {}

    def to_leaves(module, args, output):
        values = output if as_list else list(output.values())
        for index, value in enumerate(values[:3]):
            saved[str(index)] = value.detach().clone().requires_grad_()
        leaves = [saved[str(index)].clone() for index in range(3)] + values[3:]
        return leaves if as_list else OrderedDict(zip("0123", leaves, strict=True))

    handle = model.backbone.register_forward_hook(to_leaves)
    try:
        score = model(pyramid_inputs)[torch.arange(2), classes].sum()
        grads = torch.autograd.grad(score, list(saved.values()), allow_unused=True)
    finally:
        handle.remove()
    maps = [
        gradcam(saved[key].detach(), torch.zeros_like(saved[key]) if grad is None else grad)
        for key, grad in zip(saved, grads, strict=True)
    ]
    assert maps[0].any() and maps[1].any()
    assert not maps[2].any()  # a level the head does not read: no gradient, a zero map
    for key, expected in zip(result.layers, maps, strict=True):
        torch.testing.assert_close(result.maps_by_layer[key], min_max(expected), atol=1e-5, rtol=0)
    torch.testing.assert_close(result.heatmaps, fused(maps, (12, 12)), atol=1e-4, rtol=0)
    torch.testing.assert_close(result.layer_maps, result.maps_by_layer["backbone[0]"])


@pytest.mark.filterwarnings("ignore:ablationcam. the layers after")  # the other levels
@pytest.mark.parametrize("method", ["gradcam", "eigencam", "ablationcam", "scorecam"])
def test_a_container_layer_is_its_element_spots(method, pyramid_inputs):
    """Expanding the dict equals naming its levels, for gradient, activation and perturbation
    methods (which run their own passes on the element spots); '0' is found as [0]."""
    torch.manual_seed(0)
    model = TwoLevelNet().eval()
    whole = camviz.explain(model, pyramid_inputs, method, layer="backbone", target=1)
    named = camviz.explain(
        model, pyramid_inputs, method, layer=["backbone[0]", "backbone['1']"], target=1
    )
    assert named.layers == ["backbone[0]", "backbone[1]"]
    for key in named.layers:
        torch.testing.assert_close(whole.maps_by_layer[key], named.maps_by_layer[key])


def test_layout_can_name_a_container_or_one_of_its_levels(pyramid_inputs):
    torch.manual_seed(0)
    model = TwoLevelNet().eval()
    plain = camviz.explain(model, pyramid_inputs, layer="backbone", target=1)
    for layout in ("channels_first", {"backbone": "nchw"}, {"backbone[1]": "channels_first"}):
        given = camviz.explain(model, pyramid_inputs, layer="backbone", target=1, layout=layout)
        torch.testing.assert_close(given.heatmaps, plain.heatmaps)
    with pytest.raises(CamvizError, match="layout= names \\['head'\\], which are not target"):
        camviz.explain(model, pyramid_inputs, layer="backbone", layout={"head": "nchw"})


class PooledPyramid(nn.Module):
    """Two levels; the second made by a function (no module says its layout) and shaped
    (N, 4, 4, 4) for an 8 x 8 input, which the shape alone cannot tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
        fine = self.conv(x)
        return OrderedDict([("0", fine), ("pool", F.max_pool2d(fine, 1, 2))])


class PooledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = PooledPyramid()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = [level.amax(dim=(2, 3)) for level in self.backbone(x).values()]
        return self.head(torch.cat(pooled, 1))


def test_a_level_no_module_made_is_read_like_its_siblings():
    """The 'pool' level is channels first like level '0' (made by a convolution); alone it
    needs layout=."""
    torch.manual_seed(0)
    model = PooledNet().eval()
    inputs = torch.randn(2, 3, 8, 8)
    result = camviz.explain(model, inputs, layer="backbone", target=1)
    assert result.maps_by_layer["backbone[pool]"].shape == (2, 4, 4)
    given = camviz.explain(model, inputs, layer="backbone", target=1, layout="channels_first")
    torch.testing.assert_close(result.heatmaps, given.heatmaps)
    with pytest.raises(CamvizError, match="cannot tell how layer 'backbone\\[pool\\]' lays out"):
        camviz.explain(PooledNet().eval(), inputs, layer="backbone[pool]", target=1)


class NoMapsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Pooling()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x)["mean"])


class _Pooling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.conv(x)
        return {"mean": features.mean(dim=(2, 3)), "flat": features.flatten(1)}


def test_a_dict_without_feature_maps_is_one_line(untouched):
    model = NoMapsNet().eval()
    with untouched(model), pytest.raises(CamvizError) as error:
        camviz.explain(model, torch.randn(2, 3, 8, 8), layer="block")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("layer 'block' gives a dict with no feature map of the input's")
    assert "'name[key]'" in message


# torchvision detectors ---------------------------------------------------------------------


# Few proposals, small images: the box head then costs little.
SMALL_RCNN = {"max_size": 128, "rpn_pre_nms_top_n_test": 50, "rpn_post_nms_top_n_test": 20}


def top_scores(output: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The sum of each image's three best detection scores (a target for any detector)."""
    return torch.stack([detections["scores"][:3].sum() for detections in output])


def test_faster_rcnn_fpn_levels_equal_the_hand_formula(untouched):
    from torchvision.models import detection

    torch.manual_seed(0)
    model = detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0, **SMALL_RCNN, min_size=128
    ).eval()
    inputs = torch.rand(1, 3, 128, 128)
    with untouched(model):
        result = camviz.explain(model, inputs, layer="backbone", target=top_scores)
    levels, gradients = levels_and_gradients(model, model.backbone, inputs, top_scores)
    assert list(levels) == ["0", "1", "pool"]
    assert result.layers == ["backbone[0]", "backbone[1]", "backbone[pool]"]
    maps = [gradcam(levels[key], gradients[key]) for key in levels]
    assert any(m.any() for m in maps)
    for key, expected in zip(result.layers, maps, strict=True):
        torch.testing.assert_close(result.maps_by_layer[key], min_max(expected), atol=1e-4, rtol=0)
    torch.testing.assert_close(result.heatmaps, fused(maps, (128, 128)), atol=1e-4, rtol=0)
    torch.testing.assert_close(result.scores, top_scores(result.output))


def _rcnn() -> nn.Module:
    from torchvision.models import detection

    return detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0, **SMALL_RCNN
    )


def _ssdlite() -> nn.Module:
    from torchvision.models import detection

    return detection.ssdlite320_mobilenet_v3_large(
        weights=None, weights_backbone=None, score_thresh=0.0
    )


def _resnet18_fpn() -> nn.Module:
    """RetinaNet's and FCOS's backbone (C3-C5 with P6 and P7) on a ResNet-18: the detectors'
    own classes and structure, a quarter of ResNet-50's cost to build."""
    from torchvision.models import resnet18
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    return _resnet_fpn_extractor(
        resnet18(), 5, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(256, 256)
    )


def _fcos() -> nn.Module:
    from torchvision.models.detection import FCOS

    return FCOS(_resnet18_fpn(), num_classes=3, min_size=64, max_size=64, score_thresh=0.0)


def _retinanet() -> nn.Module:
    from torchvision.models.detection import RetinaNet

    return RetinaNet(_resnet18_fpn(), num_classes=3, min_size=64, max_size=64, score_thresh=0.0)


def _explained_somewhere(result: camviz.cams.engine.Explanation) -> None:
    """A non-empty, finite map with something in it (signed maps: relu=False)."""
    assert result.heatmaps.numel() and bool(result.heatmaps.isfinite().all())
    assert result.heatmaps.abs().amax() == 1


@pytest.mark.parametrize(
    ("build", "levels"),
    [(_rcnn, ["0", "1", "pool"]), (_ssdlite, range(5)), (_fcos, range(3)), (_retinanet, range(3))],
    ids=["fasterrcnn_mobilenet_v3_320_fpn", "ssdlite320", "fcos", "retinanet"],
)
def test_detectors_default_to_their_feature_levels(build, levels, untouched):
    """The FPN (SSD: its extractor's levels), one map per level with more than one location
    (RetinaNet's and FCOS's P6 and P7, SSDlite's last level are 1 x 1 here); levels that no
    explained box was pooled from have zero maps, which is not an error."""
    torch.manual_seed(0)
    model = build().eval()
    inputs = torch.rand(1, 3, 64, 64)
    assert default_target_layer(model, inputs) == "backbone"
    with untouched(model):
        result = camviz.explain(model, inputs, target=camviz.Detection(0))
    assert result.layers == [f"backbone[{level}]" for level in levels]
    assert result.boxes is not None and result.boxes.shape == (1, 4)
    _explained_somewhere(result)


# Segmentation ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large"])
def test_segmentation_models_default_to_the_backbones_last_stage(name, untouched):
    from torchvision.models import segmentation

    torch.manual_seed(0)
    model = getattr(segmentation, name)(weights=None, weights_backbone=None).eval()
    inputs = torch.rand(1, 3, 64, 64)
    assert default_target_layer(model, inputs) == "backbone.16"  # not the 1x1 classifier
    mask = torch.zeros(64, 64, dtype=torch.bool)
    mask[16:48, 16:48] = True
    with untouched(model):
        result = camviz.explain(model, inputs, target=camviz.Region(3, mask))
    assert result.layers == ["backbone.16"]
    assert result.layer_maps.shape == (1, 4, 4)  # stride 16
    _explained_somewhere(result)


class Normalised(nn.Module):
    """A segmentation model with its preprocessing in front, as users wrap them."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.inner((x - 0.5) / 0.25)


def test_a_wrapped_model_gets_its_familys_layer_inside_the_wrapper():
    from torchvision.models import segmentation

    model = Normalised(segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None))
    assert default_target_layer(model.eval(), torch.rand(1, 3, 32, 32)) == "inner.backbone.16"


class TinyDetector(nn.Module):
    """Not a torchvision class: a 4-D batch in, a list of per-image dicts out, as detectors."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.scores = nn.Conv2d(4, 1, 1)

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        return [{"scores": row} for row in self.scores(self.features(images)).flatten(1)]


def test_the_generic_rule_runs_a_detector_on_the_first_image():
    """The dry run hands the model a 4-D batch of one image and reads list-of-dict outputs;
    the last spatial layer is the score map, which is the output reshaped, so the default
    is the layer before it (a user-built detector names its layer)."""
    model = TinyDetector().eval()
    assert default_target_layer(model, torch.rand(3, 3, 8, 8)) == "features"
    result = camviz.explain(
        model, torch.rand(3, 3, 8, 8), layer="features", target=top_scores, relu=False
    )
    _explained_somewhere(result)
    assert result.heatmaps.shape == (3, 8, 8)


class ZeroHead(nn.Module):
    """A 1x1 convolution with zero weights: the output depends on nothing it is given."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, 2, 1)
        nn.init.zeros_(self.conv.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_a_default_multi_level_layer_without_any_gradient_is_an_error():
    """A segmentation model with a backbone of two levels, neither of which the score depends
    on: all maps are zero at a layer camviz chose, so it says so."""
    from torchvision.models.segmentation.fcn import FCN

    class Levels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> OrderedDict[str, torch.Tensor]:
            out = self.conv(x)
            return OrderedDict(out=out, aux=out[:, :2])

    torch.manual_seed(0)
    model = FCN(Levels(), ZeroHead(4)).eval()
    inputs = torch.rand(1, 3, 8, 8)
    assert default_target_layer(model, inputs) == "backbone"
    with pytest.raises(CamvizError) as error:
        camviz.explain(model, inputs, target=lambda out: out["out"][:, 1].mean(dim=(1, 2)))
    assert str(error.value).startswith(
        "all maps are zero: the explained score does not depend on the default layer "
        "'backbone[out]', 'backbone[aux]' at any location"
    )
    assert "class token" not in str(error.value)  # feature maps: no transformer hint
    named = camviz.explain(
        model, inputs, layer="backbone", target=lambda out: out["out"].sum(dim=(1, 2, 3))
    )
    assert not named.heatmaps.any()  # a layer the user named: zero maps are an answer


# Video -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "grid"), [("r3d_18", (1, 2, 2)), ("mc3_18", (4, 2, 2)), ("r2plus1d_18", (1, 2, 2))]
)
def test_video_resnets_default_to_their_last_3d_stage(name, grid, untouched):
    from torchvision.models import video

    torch.manual_seed(0)
    model = getattr(video, name)(num_classes=4).eval()
    clips = torch.rand(1, 3, 4, 32, 32)
    assert default_target_layer(model, clips) == "layer4"
    with untouched(model):
        result = camviz.explain(model, clips, target=1, relu=False)  # random: maybe < 0
    assert result.layer_maps.shape == (1, *grid)  # mc3_18 keeps every frame after layer1
    assert result.heatmaps.shape == (1, 4, 32, 32)
    _explained_somewhere(result)


def test_s3d_defaults_to_its_features():
    """torchvision's S3D pools with a fixed (2, 7, 7) kernel, which needs 16 x 224 x 224 clips;
    an adaptive pool in its place keeps the network before it (and the choice) the same."""
    from torchvision.models import video

    torch.manual_seed(0)
    model = video.s3d(num_classes=4).eval()
    model.avgpool = nn.AdaptiveAvgPool3d(1)
    clips = torch.rand(1, 3, 8, 64, 64)
    assert default_target_layer(model, clips) == "features"
    result = camviz.explain(model, clips, target=0, relu=False)
    assert result.layer_maps.shape == (1, 1, 2, 2)
    _explained_somewhere(result)


def test_swin3d_defaults_to_its_final_norm():
    from torchvision.models import video

    torch.manual_seed(0)
    model = video.swin3d_t(num_classes=4).eval()
    clips = torch.rand(1, 3, 4, 64, 64)
    assert default_target_layer(model, clips) == "norm"
    result = camviz.explain(model, clips, target=2, relu=False)
    assert result.layer_maps.shape == (1, 2, 2, 2)  # channels last (N, T, H, W, C), read so
    _explained_somewhere(result)


def test_classifiers_keep_the_last_spatial_layer(resnet18, small_batch):
    assert default_target_layer(resnet18, small_batch) == "layer4"


def test_factorize_takes_one_map_not_a_dict_of_levels(pyramid_inputs):
    with pytest.raises(CamvizError, match="factorize takes one feature map, but layer 'backbone'"):
        camviz.factorize(TwoLevelNet().eval(), pyramid_inputs, layer="backbone", k=2)
