"""LeGrad on tiny random vision transformers (torchvision's and timm's, fused attention
included): against the paper's formula written out with leaf attention maps, and against
torchcam's LeGrad."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from conftest import conv_net, tiny_vit
from torch import nn

import camviz
from camviz.core.errors import CamvizError

CLASSES = [1, 3]


def timm_vit() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=16,
        num_heads=2,
        num_classes=5,
    ).eval()


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def legrad_map(leaves, outputs, project, last=None) -> torch.Tensor:
    """The paper's map from leaf attention maps (N, H, T, T) and block outputs (N, T, C)."""
    used = range(len(leaves))[-last:] if last else range(len(leaves))
    total = 0
    for index in used:
        score = project(outputs[index].mean(dim=1))[torch.arange(2), torch.tensor(CLASSES)]
        (gradient,) = torch.autograd.grad(score.sum(), leaves[index], retain_graph=True)
        total = total + gradient.clamp_min(0).mean(dim=(1, 2))
    patches = (total / len(used))[:, 1:].view(2, 4, 4)  # drop the class token
    flat = patches.flatten(1)
    low, high = flat.amin(1, keepdim=True), flat.amax(1, keepdim=True)
    return ((flat - low) / (high - low)).view_as(patches)


def torchvision_reference(model: nn.Module, x: torch.Tensor, last=None) -> torch.Tensor:
    """torchvision's ViT written out, with each block's softmax(q k^T / sqrt(d)) a leaf."""
    tokens = model._process_input(x)
    tokens = torch.cat([model.class_token.expand(len(x), -1, -1), tokens], dim=1)
    tokens = tokens + model.encoder.pos_embedding
    leaves, outputs = [], []
    for block in model.encoder.layers:
        attention = block.self_attention
        projected = F.linear(block.ln_1(tokens), attention.in_proj_weight, attention.in_proj_bias)
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in projected.chunk(3, dim=-1))
        leaf = (q @ k.transpose(-2, -1) / 8**0.5).softmax(-1).detach().requires_grad_()
        attended = (leaf @ v).transpose(1, 2).flatten(-2)
        tokens = tokens + attention.out_proj(attended)
        tokens = tokens + block.mlp(block.ln_2(tokens))
        leaves.append(leaf)
        outputs.append(tokens)
    logits = model.heads(model.encoder.ln(tokens)[:, 0])
    torch.testing.assert_close(logits, model(x))  # the written-out forward is the model's
    return legrad_map(leaves, outputs, lambda pooled: model.heads(model.encoder.ln(pooled)), last)


@pytest.mark.parametrize("last", [None, 1])
def test_legrad_equals_the_formula_on_torchvision_vit(inputs, untouched, last):
    model = tiny_vit()
    expected = torchvision_reference(model, inputs, last)
    with untouched(model):
        result = camviz.explain(model, inputs, "legrad", target=CLASSES, last=last)
    assert result.layer_maps.shape == (2, 4, 4)
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=0)


def test_legrad_matches_torchcam(inputs):
    from torchcam.methods import LeGrad

    model = tiny_vit()
    peer_model = copy.deepcopy(model)
    with LeGrad(peer_model, list(peer_model.encoder.layers)) as extractor:
        theirs = extractor(CLASSES, peer_model(inputs))[0]
    ours = camviz.explain(model, inputs, "legrad", target=CLASSES)
    torch.testing.assert_close(ours.layer_maps, theirs, atol=1e-5, rtol=0)


def timm_reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's explicit attention path, its attention dropout's output made a leaf."""
    model = copy.deepcopy(model)
    leaves, outputs, handles = [], [], []

    def to_leaf(module, args, output):
        leaves.append(output.detach().requires_grad_())
        return leaves[-1]

    for block in model.blocks:
        block.attn.fused_attn = False
        handles.append(block.attn.attn_drop.register_forward_hook(to_leaf))
        handles.append(block.register_forward_hook(lambda m, a, out: outputs.append(out)))
    model(x)
    for handle in handles:
        handle.remove()
    return legrad_map(leaves, outputs, lambda pooled: model.head(model.fc_norm(model.norm(pooled))))


def test_legrad_through_timm_fused_attention_equals_the_explicit_formula(inputs, untouched):
    model = timm_vit()
    assert all(block.attn.fused_attn for block in model.blocks)  # F.scaled_dot_product_attention
    expected = timm_reference(model, inputs)
    with untouched(model):
        fused = camviz.explain(model, inputs, "legrad", target=CLASSES)
    torch.testing.assert_close(fused.layer_maps, expected, atol=1e-5, rtol=0)
    # A model built with fused attention off gets the same map, and keeps its flag.
    for block in model.blocks:
        block.attn.fused_attn = False
    explicit = camviz.explain(model, inputs, "legrad", target=CLASSES)
    assert not any(block.attn.fused_attn for block in model.blocks)
    torch.testing.assert_close(explicit.layer_maps, expected, atol=1e-5, rtol=0)


def test_legrad_refuses_models_without_attention_blocks_and_is_left_out_of_their_list():
    model = conv_net(4, classes=2)
    with pytest.raises(CamvizError, match="legrad explains timm, torchvision, MONAI"):
        camviz.explain(model, torch.randn(1, 3, 8, 8), "legrad", layer="0")
    assert "legrad" not in camviz.cams.names(model)
    assert "legrad" in camviz.cams.names(timm_vit())
