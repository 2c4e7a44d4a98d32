"""Transformers: token and channels-last outputs laid out as (N, C, h, w) grids inferred from
the input size, default target layers, and methods that run through them.

Every model is randomly initialised and small (two blocks, inputs of 48x64 or 64x64), so
nothing is downloaded and the file runs in seconds.
"""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn
from torchvision.models.swin_transformer import SwinTransformer
from torchvision.models.vision_transformer import VisionTransformer

import camviz
from camviz.core.errors import CamvizError
from camviz.core.grids import Layout, NoPatchGridError, as_spatial, layout_of, patch_size
from camviz.core.layers import default_target_layer
from camviz.core.lineage import TokenGrid


def _timm_vit() -> nn.Module:
    """ViT with a class token and 4 register tokens, on a non-square 48x64 input (3x4 grid)."""
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=(48, 64),
        depth=2,
        reg_tokens=4,
        num_classes=5,
    )


def _timm_deit() -> nn.Module:
    """DeiT with class and distillation tokens."""
    return timm.create_model(
        "deit_tiny_distilled_patch16_224", pretrained=False, img_size=64, depth=2, num_classes=5
    )


def _timm_swin() -> nn.Module:
    """Swin emitting channels-last (N, H, W, C) maps between stages."""
    return timm.create_model(
        "swin_tiny_patch4_window7_224",
        pretrained=False,
        img_size=64,
        window_size=2,
        depths=(1, 1, 1, 1),
        embed_dim=16,
        num_heads=(1, 1, 1, 1),
        num_classes=5,
    )


def _torchvision_vit() -> nn.Module:
    model = VisionTransformer(
        image_size=64,
        patch_size=16,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=5,
    )
    # torchvision initialises the head to zero, which would make every score 0.
    nn.init.normal_(model.heads.head.weight)
    return model


def _torchvision_swin() -> nn.Module:
    return SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[1, 1],
        num_heads=[1, 1],
        window_size=[2, 2],
        num_classes=5,
    )


# name: (builder, input size, layer, leading non-patch tokens (None: channels last), default)
CASES = {
    "timm_vit_registers": (_timm_vit, (48, 64), "blocks.1.norm1", 5, "blocks.1.norm1"),
    "timm_deit_distilled": (_timm_deit, (64, 64), "blocks.0", 2, "blocks.1.norm1"),
    "timm_swin": (_timm_swin, (64, 64), "layers.2", None, "norm"),
    "torchvision_vit": (
        _torchvision_vit,
        (64, 64),
        "encoder.layers.encoder_layer_1.ln_1",
        1,
        "encoder.layers.encoder_layer_1.ln_1",
    ),
    "torchvision_swin": (_torchvision_swin, (64, 64), "features.3", None, "permute"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    builder, size, layer, prefix, default = CASES[request.param]
    torch.manual_seed(0)
    model = builder().eval()
    inputs = torch.randn(2, 3, *size)
    return model, inputs, layer, prefix, default


def layer_output(model: nn.Module, inputs: torch.Tensor, layer: str) -> torch.Tensor:
    with camviz.capture(model, layer) as seen, torch.no_grad():
        model(inputs)
    return seen.activations[layer]


def manual_grid(output: torch.Tensor, prefix: int | None, size, stride: int) -> torch.Tensor:
    """The (N, C, h, w) grid written out for a known layout and stride."""
    height, width = size[0] // stride, size[1] // stride
    if prefix is None:
        return output.permute(0, 3, 1, 2)
    patches = output[:, prefix:]
    assert patches.shape[1] == height * width
    return patches.reshape(output.shape[0], height, width, -1).permute(0, 3, 1, 2)


def test_token_and_channels_last_outputs_become_the_grid_of_a_manual_reshape(case):
    model, inputs, layer, prefix, _ = case
    output = layer_output(model, inputs, layer)
    stride = 16 if prefix is not None else inputs.shape[-1] // output.shape[2]
    expected = manual_grid(output, prefix, inputs.shape[-2:], stride)
    # layout="tokens": the grid inferred from the token count (with or without the
    # patch-size hint); channels-last maps are told from their shape.
    kind = "tokens" if prefix is not None else None
    grid = as_spatial(output, layer, inputs.shape[-2:], patch_size(model), kind=kind)
    assert torch.equal(grid, expected)
    assert torch.equal(as_spatial(output, layer, inputs.shape[-2:], kind=kind), expected)
    # What camviz does unasked: the pass shows where the patches are.
    explained = camviz.explain(model, inputs, layer=layer, target=3, relu=False, normalize=False)
    assert explained.layer_maps.shape[1:] == expected.shape[2:]


def test_default_layer_is_the_last_attention_input_or_the_last_spatial_map(case):
    model, inputs, _, _, default = case
    assert default_target_layer(model, inputs) == default


def test_gradcam_on_transformers_equals_a_manual_reshape_of_activations_and_gradients(
    case, untouched
):
    model, inputs, layer, prefix, _ = case
    saved = {}

    def to_leaf(module, args, output):
        saved["A"] = output.detach().requires_grad_()
        return saved["A"].clone()

    handle = dict(model.named_modules())[layer].register_forward_hook(to_leaf)
    try:
        scores = model(inputs)[:, 3]
        (gradients,) = torch.autograd.grad(scores.sum(), saved["A"])
    finally:
        handle.remove()
    size = inputs.shape[-2:]
    stride = 16 if prefix is not None else size[-1] // saved["A"].shape[2]
    activations = manual_grid(saved["A"].detach(), prefix, size, stride)
    gradients = manual_grid(gradients, prefix, size, stride)
    expected = torch.relu((gradients.mean(dim=(2, 3), keepdim=True) * activations).sum(1))
    expected = expected / expected.flatten(1).amax(1).view(-1, 1, 1)
    with untouched(model):
        result = camviz.explain(model, inputs, layer=layer, target=3)
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-4, atol=1e-5)
    assert result.heatmaps.shape == (2, *size)


def test_ablationcam_through_attention_residuals_equals_ablating_each_channel_in_full():
    """The broadcast shortcut is exact through ``x + attn(norm1(x))`` (x from before the layer)."""
    torch.manual_seed(0)
    model = _timm_deit().eval()
    inputs = torch.randn(1, 3, 64, 64)
    layer = "blocks.1.norm1"
    module = dict(model.named_modules())[layer]
    channels = module.normalized_shape[0]
    expected_scores = []
    with torch.no_grad():
        original = model(inputs)[0, 2]
        for channel in range(channels):

            def zero(mod, args, output, channel=channel):
                output = output.clone()
                output[..., channel] = 0
                return output

            handle = module.register_forward_hook(zero)
            expected_scores.append(model(inputs)[0, 2])
            handle.remove()
    weights = (original - torch.stack(expected_scores)) / original
    activations = manual_grid(layer_output(model, inputs, layer), 2, (64, 64), 16)
    expected = torch.relu(torch.einsum("c,nchw->nhw", weights, activations))
    expected = (expected - expected.amin()) / (expected.amax() - expected.amin())
    result = camviz.explain(model, inputs, "ablationcam", layer=layer, target=2)
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["scorecam", "ablationcam"])
def test_perturbation_methods_leave_transformers_untouched(method, untouched):
    torch.manual_seed(0)
    model = _timm_vit().eval()
    with untouched(model):
        result = camviz.explain(model, torch.randn(1, 3, 48, 64), method, batch_size=64)
    assert result.layers == ["blocks.1.norm1"]
    assert result.layer_maps.shape == (1, 3, 4)
    assert result.layer_maps.amax() == 1


# Layout rules on shapes alone ---------------------------------------------------------------


FIRST, LAST, TOKENS = "channels_first", "channels_last", "tokens"


@pytest.mark.parametrize(
    ("shape", "size", "patch", "kind", "expected"),
    [
        ((2, 512, 7, 7), (224, 224), None, None, Layout(FIRST, (7, 7))),
        ((2, 7, 7, 768), (224, 224), None, None, Layout(LAST, (7, 7))),
        ((2, 56, 56, 96), (224, 224), None, None, Layout(LAST, (56, 56))),
        ((2, 8, 8, 8), (64, 64), None, FIRST, Layout(FIRST, (8, 8))),  # settled by the module
        ((2, 8, 8, 8), (64, 64), None, LAST, Layout(LAST, (8, 8))),
        ((2, 3, 6, 8), (96, 128), None, FIRST, Layout(FIRST, (6, 8))),
        ((2, 197, 768), (224, 224), 16, TOKENS, Layout("tokens", (14, 14), 1)),
        ((2, 197, 768), (224, 224), None, TOKENS, Layout("tokens", (14, 14), 1)),
        ((2, 261, 384), (224, 224), 14, TOKENS, Layout("tokens", (16, 16), 5)),  # DINOv2 + 4 reg
        ((2, 12 + 1, 192), (48, 64), 16, TOKENS, Layout("tokens", (3, 4), 1)),
        ((2, 49, 768), (224, 224), 4, TOKENS, Layout("tokens", (7, 7), 0)),  # Swin, stride 32
        ((2, 50, 8), None, None, TOKENS, Layout("tokens", (7, 7), 1)),
        # 1-D and 3-D grids: signals, volumes, clips and their transformers.
        ((2, 16, 25), (100,), None, FIRST, Layout(FIRST, (25,))),
        ((2, 26, 16), (100,), 4, TOKENS, Layout("tokens", (25,), 1)),
        ((2, 64, 2, 7, 7), (8, 112, 112), None, FIRST, Layout(FIRST, (2, 7, 7))),
        ((2, 2, 7, 7, 64), (8, 112, 112), None, None, Layout(LAST, (2, 7, 7))),
        ((2, 1 + 4 * 49, 96), (8, 112, 112), (2, 16, 16), TOKENS, Layout("tokens", (4, 7, 7), 1)),
    ],
)
def test_layouts_follow_the_producing_module_and_the_input_size(shape, size, patch, kind, expected):
    # Token grids from the token count only under an explicit layout="tokens" (TOKENS).
    assert layout_of(shape, "layer", size, patch, kind) == expected


def test_tokens_of_a_channels_last_module_need_the_patches_the_pass_shows():
    with pytest.raises(NoPatchGridError, match=r"197 tokens that come from no patch embedding"):
        layout_of((2, 197, 768), "blocks.11.norm1", (224, 224), 16, LAST)
    told = layout_of((2, 197, 768), "blocks.11.norm1", (224, 224), 16, LAST, TokenGrid(1, (14, 14)))
    assert told == Layout("tokens", (14, 14), 1)


@pytest.mark.parametrize(
    ("shape", "size"),
    [
        ((2, 8, 8, 8), (64, 64)),  # channels first or last: both fit a square input
        ((2, 16, 25), (100,)),  # a 1-D map (N, C, L) or tokens (N, T, C)
        ((2, 197, 768), (224, 224)),  # tokens only if something says so (no patch embedding)
    ],
)
def test_a_layout_that_only_the_shape_could_tell_is_refused_naming_layout(shape, size):
    with pytest.raises(CamvizError, match="pass layout="):
        layout_of(shape, "layer", size)


def test_outputs_that_are_not_maps_or_token_grids_are_refused():
    with pytest.raises(CamvizError, match=r"outputs shape \(2, 10\), not a feature map"):
        layout_of((2, 10), "fc", (64, 64))
    with pytest.raises(CamvizError, match="do not form a patch grid"):
        layout_of((2, 3, 8), "odd", (64, 64), 16, "tokens")


def test_a_layer_that_folds_windows_into_the_batch_is_refused():
    torch.manual_seed(0)
    model = _timm_swin().eval()
    with pytest.raises(CamvizError, match=r"outputs a batch of \d+ for 1 inputs"):
        camviz.explain(model, torch.randn(1, 3, 64, 64), layer="layers.0.blocks.0.attn")


def test_pooled_tokens_without_a_patch_stride_are_refused_not_read_as_a_wrong_grid():
    # MViT's last stage: 1 + 8 x 7 x 7 tokens of a 16 x 224 x 224 clip, its tokens pooled so
    # no stride of the input gives that grid; the largest uniform grid, 1 x 18 x 18, would
    # leave 69 "extra" tokens.
    with pytest.raises(CamvizError, match="393 tokens, which do not form a patch grid"):
        layout_of((1, 393, 768), "blocks.15.norm1", (16, 224, 224), None, "tokens")
    # A ViT without a recognisable patch embedding still gets its grid and class token.
    vit = layout_of((1, 197, 64), "blocks.11", (224, 224), None, "tokens")
    assert (vit.grid, vit.prefix) == ((14, 14), 1)
