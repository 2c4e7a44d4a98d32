"""camviz on models of other libraries: Hugging Face transformers, Ultralytics YOLO, MONAI.

Every model is built from a tiny config with random weights (:mod:`tests.thirdparty`). For
each family the test states the layer that ``layer=None`` must pick, and the map there is
checked against a Grad-CAM written out by hand with ``torch.autograd`` at that layer (raw
maps: ``relu=False, normalize=False``), with the layout of the layer's output written out by
hand too (which tokens are patches, on which grid).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import thirdparty as tp
import torch
from torch import nn

import camviz

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _yolo_prediction(output: Any) -> torch.Tensor:
    """Ultralytics' ``(N, 4 + classes [+ mask coefficients], anchors)`` predictions."""
    first = output[0]
    return first[0] if isinstance(first, (tuple, list)) else first


def _best_detection(classes: int) -> tp.Score:
    """The class score of the best-scoring anchor, chosen on the detached output: the
    object that ``Detection(0)`` explains when every anchor passes the threshold."""

    def score(output: Any) -> torch.Tensor:
        scores = _yolo_prediction(output)[:, 4 : 4 + classes]
        best = scores.detach().amax(1)
        anchors = best.argmax(1)
        labels = scores.detach()[torch.arange(len(anchors)), :, anchors].argmax(1)
        return scores[torch.arange(len(anchors)), labels, anchors]

    return score


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def _best_query(output: Any) -> torch.Tensor:
    """The best class probability of the best query of a DETR-style output (softmax over the
    classes and "no object", which is then dropped): what ``Detection(0)`` explains."""
    probabilities = output.logits.softmax(-1)[..., :-1]
    best = probabilities.detach().amax(-1)
    queries = best.argmax(1)
    rows = torch.arange(len(queries))
    return probabilities[rows, queries].amax(-1)


def _region(class_id: int, mask: torch.Tensor) -> tp.Score:
    return lambda output: (_logits(output)[:, class_id] * mask).flatten(1).sum(1)


def _segformer_mask() -> torch.Tensor:
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[2:5, 3:7] = True
    return mask


def _unet_mask() -> torch.Tensor:
    mask = torch.zeros(16, 16, 16, dtype=torch.bool)
    mask[4:9, 4:12, 2:8] = True
    return mask


@dataclass(frozen=True)
class Case:
    """One family: its model and inputs, its default layer (a spot at the layer's input for a
    head that takes a list of levels: ``at_input``), the explained score written by hand, and
    the layer's output as ``(N, C, *grid)`` written by hand."""

    model: Callable[[], nn.Module]
    inputs: Callable[[], Any]
    layer: str
    score: tp.Score
    target: Any
    grid: tp.Grid = tp.channels_first
    options: dict[str, Any] = field(default_factory=dict)
    at_input: bool = False


_REFERENCE = torch.randn(16, generator=torch.Generator().manual_seed(5))
_CLIP_OPTIONS = {"output_key": "logits_per_image"}
_YOLO_TARGET = camviz.Detection(0, adapter=camviz.DenseDetections(score_threshold=0.0))

CASES = {
    "hf_vit": Case(
        tp.hf_vit,
        lambda: tp.images(32, 32, count=2),
        "vit.layers.1.layernorm_before",
        tp.class_logit(1),
        1,
        tp.tokens(1, (4, 4)),
    ),
    "hf_deit": Case(
        tp.hf_deit,
        lambda: tp.images(32, 32),
        "deit.layers.1.layernorm_before",
        tp.class_logit(1),
        1,
        tp.tokens(2, (4, 4)),
    ),
    "hf_dinov2_registers": Case(
        tp.hf_dinov2_registers,
        lambda: tp.images(32, 48),
        "dinov2_with_registers.layernorm",  # its head reads the mean of the patch tokens too
        tp.class_logit(1),
        1,
        tp.tokens(5, (4, 6)),
    ),
    "hf_clip": Case(
        tp.hf_clip,
        tp.text_and_images,
        "vision_model.encoder.layers.1.layer_norm1",
        tp.class_logit(1, "logits_per_image"),
        1,
        tp.tokens(1, (4, 4)),
        _CLIP_OPTIONS,
    ),
    "hf_clip_similarity": Case(
        tp.hf_clip,
        tp.text_and_images,
        "vision_model.encoder.layers.1.layer_norm1",
        lambda output: torch.cosine_similarity(output.image_embeds, _REFERENCE, dim=-1),
        camviz.Similarity(_REFERENCE),  # found in the output's image_embeds
        tp.tokens(1, (4, 4)),
    ),
    "hf_siglip": Case(
        tp.hf_siglip,
        tp.text_and_images,
        "vision_model.post_layernorm",
        tp.class_logit(1, "logits_per_image"),
        1,
        tp.tokens(0, (4, 4)),
        _CLIP_OPTIONS,
    ),
    "hf_swin": Case(
        tp.hf_swin,
        lambda: tp.images(32, 32),
        "swin.layernorm",
        tp.class_logit(1),
        1,
        tp.tokens(0, (4, 4)),
    ),
    "hf_convnext": Case(
        tp.hf_convnext,
        lambda: tp.images(64, 96),
        "convnext.encoder.stages.3",
        tp.class_logit(1),
        1,
    ),
    "hf_segformer": Case(
        tp.hf_segformer,
        lambda: tp.images(32, 32),
        "decode_head",  # at its input: the encoder's two levels
        _region(1, _segformer_mask()),
        # The mask at the input's 32 x 32 px, in 4 x 4 blocks: nearest gives the 8 x 8 back.
        camviz.Region(1, _segformer_mask().repeat_interleave(4, 0).repeat_interleave(4, 1)),
        at_input=True,
    ),
    "monai_densenet121_3d": Case(
        tp.monai_densenet,
        lambda: tp.images(64, 64, 64, channels=1),
        "class_layers.relu",
        lambda output: output[:, 1],
        1,
    ),
    "monai_unet_3d": Case(
        tp.monai_unet,
        lambda: tp.images(16, 16, 16, channels=1),
        "model.1",  # the decoder's last map before the final up-convolution to the logits
        _region(1, _unet_mask()),
        camviz.Region(1, _unet_mask()),
    ),
    "monai_vit_3d": Case(
        tp.monai_vit,
        lambda: tp.images(16, 16, 16, channels=1),
        "blocks.1.norm1",
        lambda output: output[0][:, 1],
        1,
        tp.tokens(1, (2, 2, 2)),
    ),
    "hf_detr": Case(
        tp.hf_detr,
        lambda: {"pixel_values": tp.images(64, 64)},
        "model.encoder.layers.0",  # the flattened 8 x 8 map; the decoder's queries are none
        _best_query,
        camviz.Detection(0, adapter=camviz.SetPredictions()),
        tp.tokens(0, (8, 8)),
    ),
    "hf_yolos": Case(
        tp.hf_yolos,
        lambda: {"pixel_values": tp.images(32, 48)},
        "vit.encoder.layer.1.layernorm_before",
        _best_query,
        camviz.Detection(0, adapter=camviz.SetPredictions()),
        tp.tokens(1, (4, 6)),  # a class token, 4 x 6 patches, then 5 detection tokens
    ),
    **{
        f"{config}_{task}": Case(
            functools.partial(tp.yolo, config, task),
            # 252 anchors at 128 x 96 px: at least 4 times the 4 + 3 + 32 rows of a -seg head.
            functools.partial(tp.images, *((64, 64) if task == "detect" else (128, 96))),
            "model.22" if config == "yolov8n" else "model.23",
            _best_detection(3),
            _YOLO_TARGET,
            at_input=True,
        )
        for config in tp.YOLO_CONFIGS
        for task in ("detect", "segment")
    },
    **{
        f"{config}_classify": Case(
            functools.partial(tp.yolo, config, "classify"),
            lambda: tp.images(64, 64),
            "model.9.conv" if config == "yolov8n" else "model.10.conv",
            lambda output: output[1][:, 1],  # (probabilities, logits): the logits
            1,
        )
        for config in tp.YOLO_CONFIGS
    },
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


def _hand(case: Case, model: nn.Module, inputs: Any) -> list[torch.Tensor]:
    return tp.hand_gradcam(model, inputs, case.layer, case.score, case.grid, at_input=case.at_input)


def test_the_default_layer_is_the_stated_one_and_its_map_the_hand_gradcam(case: Case) -> None:
    model, inputs = case.model(), case.inputs()
    result = camviz.explain(
        model, inputs, target=case.target, relu=False, normalize=False, **case.options
    )
    if case.at_input:  # one map per level, fused
        assert result.layers and all(
            spot.startswith(f"{case.layer}:input[0][") for spot in result.layers
        )
    else:
        assert result.layers == [case.layer]
    hand = _hand(case, model, inputs)
    # Levels of a head's input: each detection uses one level, so compare them together.
    tp.assert_close_to_hand(
        torch.cat([maps.flatten() for maps in result.maps_by_layer.values()]),
        torch.cat([maps.flatten() for maps in hand]),
    )


@pytest.mark.peers
def test_gradcam_agrees_with_monai_gradcam_on_a_3d_densenet() -> None:
    from monai.visualize import GradCAM

    case = CASES["monai_densenet121_3d"]
    model, volumes = case.model(), case.inputs()
    theirs = GradCAM(nn_module=model, target_layers=case.layer)(volumes, class_idx=1)
    model.zero_grad(set_to_none=True)  # MONAI's backward pass fills the parameters' .grad
    ours = camviz.explain(model, volumes, layer=case.layer, target=1)
    # MONAI's default normaliser maps (min, max) to (1, 0), for its colour maps.
    assert tp.correlation(ours.heatmaps, 1 - theirs[:, 0]) >= 0.99


class _Logits(nn.Module):
    """A Hugging Face classifier that returns its logits, as pytorch-grad-cam needs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).logits


@pytest.mark.peers
def test_gradcam_agrees_with_pytorch_grad_cam_and_its_reshape_transform_on_hf_vit() -> None:
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    case = CASES["hf_vit"]
    model, pixels = case.model(), case.inputs()
    wrapped = _Logits(model)
    layer = model.get_submodule(case.layer)
    with GradCAM(model=wrapped, target_layers=[layer], reshape_transform=case.grid) as peer:
        theirs = peer(pixels, targets=[ClassifierOutputTarget(1)] * len(pixels))
    model.zero_grad(set_to_none=True)
    ours = camviz.explain(model, pixels, layer=case.layer, target=1)
    assert tp.correlation(ours.heatmaps, torch.from_numpy(theirs)) >= 0.99


@pytest.mark.parametrize("config", tp.YOLO_CONFIGS)
def test_yolo_still_backpropagates_after_camviz_picked_its_layer(config: str) -> None:
    model = tp.yolo(config)
    images = tp.images(96, 64)  # a size no other test uses: the head caches its anchors here
    picked = camviz.explain(model, images, target=_YOLO_TARGET)  # layer=None: a dry run first
    assert picked.layers[0].startswith(f"{tp.yolo_head(model)}:input")
    images.requires_grad_()
    with torch.enable_grad():
        (gradient,) = torch.autograd.grad(model(images)[0].sum(), images)
    assert gradient.abs().sum() > 0


def test_an_ultralytics_yolo_wrapper_is_explained_through_its_network() -> None:
    tp.yolo("yolov8n")  # Ultralytics imported as camviz imports it
    from ultralytics import YOLO

    wrapper = YOLO("yolov8n.yaml")  # built from the yaml: nothing is downloaded
    wrapper.model = tp.yolo("yolov8n")
    images = tp.images(64, 64)
    layer = "model.22:input"
    theirs = camviz.explain(wrapper.model, images, layer=layer, target=_YOLO_TARGET)
    ours = camviz.explain(wrapper, images, layer=layer, target=_YOLO_TARGET)
    torch.testing.assert_close(ours.heatmaps, theirs.heatmaps)
    assert ours.heatmaps.abs().sum() > 0


def test_a_unit_of_the_yolo_heads_input_as_the_issue_spells_it_is_its_first_level() -> None:
    from camviz.core.targets import parse_unit

    model, images = tp.yolo("yolov8n"), tp.images(64, 64)
    levels: list[torch.Tensor] = []
    hook = model.model[22].register_forward_pre_hook(lambda _, args: levels.extend(args[0]))
    with torch.no_grad():
        model(images)
    hook.remove()
    match = r"holds 3 feature maps; the unit reads the first, 'model.22:input\[0\]\[0\]'"
    with pytest.warns(UserWarning, match=match):
        whole = camviz.explain(model, images, target=parse_unit("unit:model.22:input@0-3"))
    first = camviz.explain(model, images, target=parse_unit("unit:model.22:input[0][0]@0-3"))
    # Explained at the last map before model.15, whose output the first level is (model.14
    # concatenates the upsampled P4 with the backbone's P3).
    assert whole.layers == first.layers == ["model.14"]
    torch.testing.assert_close(whole.heatmaps, first.heatmaps)
    torch.testing.assert_close(whole.scores, levels[0][:, :4].mean((2, 3)).T.reshape(-1))


@pytest.mark.parametrize("config", tp.YOLO_CONFIGS)
@pytest.mark.parametrize("level", [0, 2])
def test_a_unit_inside_a_yolo_heads_branch_is_explained_at_the_level_it_reads(
    config: str, level: int
) -> None:
    model, images = tp.yolo(config), tp.images(64, 64)
    head = tp.yolo_head(model)
    unit = camviz.Unit(f"{head}.cv2.{level}.0", channel=1)
    picked = camviz.explain(model, images, target=unit, relu=False)
    given = model.model[-1].f[level]  # the layer whose output is this level
    assert picked.layers == [f"model.{given}"]
    named = camviz.explain(model, images, layer=f"model.{given}", target=unit, relu=False)
    torch.testing.assert_close(picked.heatmaps, named.heatmaps, rtol=0, atol=0)
    assert picked.heatmaps.abs().amax() > 0
    # Each of the head's other levels gives the unit a map of zeros.
    fused = camviz.explain(
        model, images, layer=f"{head}:input", target=unit, normalize=False, relu=False
    )
    maps = list(fused.maps_by_layer.values())
    assert len(maps) == 3 and maps[level].abs().amax() > 0
    assert all(kept.abs().amax() == 0 for index, kept in enumerate(maps) if index != level)


def test_detr_boxes_are_in_the_input_pixels() -> None:
    model = tp.hf_detr()
    pixels = tp.images(64, 96)
    result = camviz.explain(
        model,
        {"pixel_values": pixels},
        layer="model.input_projection",
        target=camviz.Detection(0, adapter=camviz.SetPredictions()),
    )
    with torch.no_grad():
        output = model(pixel_values=pixels)
    best = output.logits.softmax(-1)[0, :, :-1].amax(-1).argmax()
    cx, cy, w, h = output.pred_boxes[0, best].tolist()
    expected = torch.tensor(
        [[(cx - w / 2) * 96, (cy - h / 2) * 64, (cx + w / 2) * 96, (cy + h / 2) * 64]]
    )
    torch.testing.assert_close(result.boxes, expected)


def test_a_swin_stage_element_the_classifier_never_reads_is_named_in_the_warning() -> None:
    model, pixels = tp.hf_swin(), tp.images(32, 32)
    stage = "swin.encoder.layers.1"  # gives (hidden_states, reshaped_hidden_states, ...)
    with pytest.warns(camviz.ZeroMapWarning) as caught:
        unread = camviz.explain(model, pixels, layer=stage, target=1)
    assert unread.layers == [f"{stage}[1]"]  # the one 4-D element
    (message,) = [str(warning.message) for warning in caught]
    assert "does not depend on" in message and f"try '{stage}[0]'" in message
    assert "relu=False" not in message  # the signed map is zero too
    read = camviz.explain(model, pixels, layer=f"{stage}[0]", target=1, relu=False, normalize=False)
    (hand,) = tp.hand_gradcam(
        model, pixels, stage, tp.class_logit(1), tp.tokens(0, (4, 4)), element=0
    )
    tp.assert_close_to_hand(read.layer_maps, hand)


@pytest.mark.parametrize("name", ["hf_detr", "yolov8n_detect"])
def test_a_detector_explained_as_a_classifier_is_pointed_to_detection(name: str) -> None:
    case = CASES[name]
    with pytest.raises(camviz.CamvizError, match=r"target=camviz\.Detection\(0") as error:
        camviz.explain(
            case.model(),
            case.inputs(),
            layer=case.layer if not case.at_input else f"{case.layer}:input",
        )
    assert "\n" not in str(error.value)


# Named layers whose layout only the call tells -------------------------------------------

NAMED = {
    # HF ConvNeXt's downsampling norm is a ConvNextLayerNorm (an nn.LayerNorm subclass) with
    # data_format="channels_first": its (N, 24, 4, 6) output is channels first, not 24 x 4
    # tokens or a (24, 4) grid of 6 channels.
    "convnext_channels_first_norm": (
        "hf_convnext",
        "convnext.encoder.stages.3.downsampling_layer.0",
    ),
    "segformer_stage": ("hf_segformer", "segformer.stages.1"),
    "detr_input_projection": ("hf_detr", "model.input_projection"),
    "unet_inner_decoder": ("monai_unet_3d", "model.1.submodule"),
}


@pytest.mark.parametrize("name", list(NAMED))
def test_gradcam_at_a_named_layer_equals_the_hand_gradcam(name: str) -> None:
    family, layer = NAMED[name]
    case = CASES[family]
    model, inputs = case.model(), case.inputs()
    result = camviz.explain(
        model, inputs, layer=layer, target=case.target, relu=False, normalize=False
    )
    (hand,) = tp.hand_gradcam(model, inputs, layer, case.score)
    tp.assert_close_to_hand(result.layer_maps, hand)


def test_detr_queries_are_never_laid_on_a_grid() -> None:
    case = CASES["hf_detr"]
    with pytest.raises(camviz.CamvizError) as error:
        camviz.explain(
            case.model(), case.inputs(), layer="model.decoder.layers.0", target=case.target
        )
    message = str(error.value)
    assert "10 tokens that come from no patch embedding" in message and "\n" not in message
    assert "'model.encoder.layers.0'" in message  # the layers whose tokens are patches


def test_tokens_layout_says_where_the_patches_are() -> None:
    case = CASES["hf_yolos"]
    model, inputs = case.model(), case.inputs()
    told = camviz.explain(model, inputs, layer=case.layer, target=case.target)
    given = camviz.explain(
        model,
        inputs,
        layer=case.layer,
        target=case.target,
        layout=camviz.Tokens(patches=slice(1, 25), grid=(4, 6)),
    )
    spelled = camviz.explain(
        model, inputs, layer=case.layer, target=case.target, layout="tokens[1:25]"
    )
    torch.testing.assert_close(given.heatmaps, told.heatmaps)
    torch.testing.assert_close(spelled.heatmaps, told.heatmaps)
    # The trailing detection tokens are not patches: the last 24 tokens give another map.
    wrong = camviz.explain(
        model,
        inputs,
        layer=case.layer,
        target=case.target,
        layout=camviz.Tokens(slice(6, 30), (4, 6)),
    )
    assert tp.correlation(wrong.heatmaps, told.heatmaps) < 0.9
