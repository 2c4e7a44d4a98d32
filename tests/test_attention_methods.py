"""Attention rollout, gradient rollout, Chefer et al.'s transformer attribution and LeGrad,
against their formulas written out by hand, on tiny random vision transformers of
torchvision, timm (with register tokens), Hugging Face (ViT, CLIP's vision tower, DINOv2,
SigLIP; eager and sdpa) and MONAI, fused attention on and off.

The hand references run each model with its attention computed explicitly and read the
attention tensors the model itself multiplies with its values (a hook on the dropout that
follows the softmax, Hugging Face's ``output_attentions``, or torchvision's forward written
out); their gradients come from ``torch.autograd.grad`` of the explained scores. camviz's
maps must equal them whichever attention the model runs, and the model's attention
settings must come back as they were, also when the pass fails midway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from conftest import tiny_vit
from torch import nn

import camviz
from camviz.core.errors import CamvizError

CLASSES = [1, 3]
GRID = (4, 4)  # 32 px inputs, 8 px patches


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


# --- the formulas, by hand ---------------------------------------------------------------


def discard(matrices: torch.Tensor, ratio: float) -> torch.Tensor:
    flat = matrices.flatten(1).clone()
    count = int(ratio * flat.shape[1])
    flat.scatter_(1, flat.argsort(dim=1)[:, :count], 0.0)
    return flat.view_as(matrices)


def renormalised_residual(matrix: torch.Tensor) -> torch.Tensor:
    mixed = 0.5 * torch.eye(matrix.shape[-1]) + 0.5 * matrix
    return mixed / mixed.sum(dim=-1, keepdim=True)


def hand_rollout(attentions, gradients, fusion="mean", ratio=0.0) -> torch.Tensor:
    rollout = torch.eye(attentions[0].shape[-1])
    for attention in attentions:
        fused = {
            "mean": attention.mean(dim=1),
            "max": attention.max(dim=1).values,
            "min": attention.min(dim=1).values,
        }[fusion]
        rollout = renormalised_residual(discard(fused, ratio)) @ rollout
    return rollout


def hand_gradient_rollout(attentions, gradients, ratio=0.0) -> torch.Tensor:
    rollout = torch.eye(attentions[0].shape[-1])
    for attention, gradient in zip(attentions, gradients, strict=True):
        weighted = (gradient * attention).clamp(min=0).mean(dim=1)
        rollout = renormalised_residual(discard(weighted, ratio)) @ rollout
    return rollout


def hand_chefer(attentions, gradients) -> torch.Tensor:
    relevance = torch.eye(attentions[0].shape[-1])
    for attention, gradient in zip(attentions, gradients, strict=True):
        relevance = relevance + (gradient * attention).clamp(min=0).mean(dim=1) @ relevance
    return relevance


METHODS: dict[str, tuple[Callable[..., torch.Tensor], dict]] = {
    "attention_rollout": (hand_rollout, {}),
    "attention_rollout-max-discard": (
        lambda a, g: hand_rollout(a, g, "max", 0.3),
        {"head_fusion": "max", "discard_ratio": 0.3},
    ),
    "attention_rollout-min": (lambda a, g: hand_rollout(a, g, "min"), {"head_fusion": "min"}),
    "gradient_rollout": (hand_gradient_rollout, {}),
    "gradient_rollout-discard": (
        lambda a, g: hand_gradient_rollout(a, g, 0.2),
        {"discard_ratio": 0.2},
    ),
    "transformer_attribution": (hand_chefer, {}),
}


def patch_map(relevance: torch.Tensor, prefix: int) -> torch.Tensor:
    """The class token's row at the patch tokens, on the grid."""
    return relevance[:, 0, prefix : prefix + 16].reshape(-1, *GRID)


# --- the models, explicit attention read off ----------------------------------------------


def logits_of(output) -> torch.Tensor:
    if isinstance(output, tuple):
        return output[0]
    return getattr(output, "logits", output)


def scores(logits: torch.Tensor) -> torch.Tensor:
    return logits[torch.arange(len(logits)), torch.tensor(CLASSES)].sum()


def torchvision_attention(model: nn.Module, x: torch.Tensor):
    """torchvision's ViT written out: its attention and block outputs, and the logits."""
    tokens = model._process_input(x)
    tokens = torch.cat([model.class_token.expand(len(x), -1, -1), tokens], dim=1)
    tokens = tokens + model.encoder.pos_embedding
    attentions, outputs = [], []
    for block in model.encoder.layers:
        attention = block.self_attention
        projected = F.linear(block.ln_1(tokens), attention.in_proj_weight, attention.in_proj_bias)
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in projected.chunk(3, dim=-1))
        probabilities = (q @ k.transpose(-2, -1) / 8**0.5).softmax(-1)
        tokens = tokens + attention.out_proj((probabilities @ v).transpose(1, 2).flatten(-2))
        tokens = tokens + block.mlp(block.ln_2(tokens))
        attentions.append(probabilities)
        outputs.append(tokens)
    logits = model.heads(model.encoder.ln(tokens)[:, 0])
    torch.testing.assert_close(logits, model(x))  # the written-out forward is the model's
    return attentions, outputs, logits


@contextlib.contextmanager
def kept_outputs(modules: list[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """The outputs of ``modules`` during the block, in call order."""
    kept: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda m, i, o: kept.append(o)) for m in modules]
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()


def hooked_attention(model: nn.Module, x: torch.Tensor, blocks, after_softmax: str):
    """The attention of a model whose explicit path hands its softmax to a dropout module."""
    drops = [block.get_submodule(after_softmax) for block in blocks]
    with kept_outputs(drops) as attentions, kept_outputs(list(blocks)) as outputs:
        logits = logits_of(model(x))
    return attentions, outputs, logits


def timm_vit(fused: bool) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=2,
        embed_dim=16,
        num_heads=2,
        num_classes=5,
        reg_tokens=2,
    ).eval()
    for block in model.blocks:
        block.attn.fused_attn = fused
    return model


def hf_vit(implementation: str) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=5,
    )
    model = ViTForImageClassification(config).eval()
    model.config._attn_implementation = implementation
    return model


def monai_vit(flash: bool) -> nn.Module:
    from monai.networks.nets import ViT

    torch.manual_seed(0)
    model = ViT(
        in_channels=3,
        img_size=32,
        patch_size=8,
        hidden_size=16,
        mlp_dim=32,
        num_layers=2,
        num_heads=2,
        spatial_dims=2,
        classification=True,
        num_classes=5,
    ).eval()
    for block in model.blocks:
        block.attn.use_flash_attention = flash
    return model


def timm_reference(x):
    model = timm_vit(fused=False)
    return hooked_attention(model, x, model.blocks, "attn.attn_drop")


def hf_reference(x):
    model = hf_vit("eager")
    with kept_outputs(list(model.vit.layers)) as outputs:
        output = model(pixel_values=x, output_attentions=True)
    return list(output.attentions), outputs, output.logits


def monai_reference(x):
    model = monai_vit(flash=False)
    return hooked_attention(model, x, model.blocks, "attn.drop_weights")


# name -> (build the model to explain in an attention mode, its explicit reference, the
# leading tokens that are no patches: class and register tokens)
MODELS = {
    "torchvision": (lambda mode: tiny_vit(), lambda x: torchvision_attention(tiny_vit(), x), 1),
    "timm": (lambda mode: timm_vit(mode == "fused"), timm_reference, 3),
    "hf": (lambda mode: hf_vit("sdpa" if mode == "fused" else "eager"), hf_reference, 1),
    "monai": (lambda mode: monai_vit(mode == "fused"), monai_reference, 1),
}
CASES = [
    ("torchvision", "fused"),
    *[(name, mode) for name in ("timm", "hf", "monai") for mode in ("fused", "explicit")],
]


_references: dict[str, tuple] = {}


def reference(kind: str, inputs: torch.Tensor) -> tuple:
    """A model kind's attention and its gradients, from its explicit forward (kept)."""
    if kind not in _references:
        attentions, _, logits = MODELS[kind][1](inputs)
        gradients = torch.autograd.grad(scores(logits), attentions)
        _references[kind] = [a.detach() for a in attentions], list(gradients)
    return _references[kind]


def attention_settings(model: nn.Module) -> list:
    """Every attention switch of the model: timm's and MONAI's flags, Hugging Face's
    ``_attn_implementation`` of each config and sub-config."""
    settings = []
    for name, module in model.named_modules():
        for flag in ("fused_attn", "use_flash_attention"):
            if hasattr(module, flag):
                settings.append((name, flag, getattr(module, flag)))
        config = getattr(module, "config", None)
        pending = [config] if config is not None else []
        while pending:
            config = pending.pop()
            settings.append((name, id(config), config._attn_implementation))
            pending += [getattr(config, key) for key in getattr(config, "sub_configs", {})]
    return settings


@pytest.mark.parametrize(("kind", "mode"), CASES)
@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_equals_its_formula_fused_or_not(inputs, kind, mode, method, untouched):
    attentions, gradients = reference(kind, inputs)
    build, _, prefix = MODELS[kind]
    model = build(mode)
    settings = attention_settings(model)
    hand, options = METHODS[method]
    with untouched(model):
        result = camviz.explain(
            model,
            inputs,
            method.split("-")[0],
            target=CLASSES,
            relu=False,
            normalize=False,
            **options,
        )
    assert attention_settings(model) == settings
    expected = patch_map(hand(attentions, gradients), prefix)
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-5, atol=1e-7)


def test_layer_names_the_last_block_included(inputs):
    model = timm_vit(fused=True)
    attentions, gradients = reference("timm", inputs)
    first = attentions[:1], gradients[:1]
    for method, hand in [
        ("attention_rollout", hand_rollout),
        ("transformer_attribution", hand_chefer),
    ]:
        for layer in ("blocks.0", "blocks.0.mlp.fc2"):
            result = camviz.explain(
                model, inputs, method, layer=layer, target=CLASSES, relu=False, normalize=False
            )
            expected = patch_map(hand(*first), 3)
            torch.testing.assert_close(result.layer_maps, expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(CamvizError, match="'patch_embed' is no transformer block"):
        camviz.explain(model, inputs, "attention_rollout", layer="patch_embed")


def legrad_map(attentions, outputs, project, prefix) -> torch.Tensor:
    total = 0
    for attention, output in zip(attentions, outputs, strict=True):
        (gradient,) = torch.autograd.grad(scores(project(output.mean(dim=1))), attention)
        total = total + gradient.clamp_min(0).mean(dim=(1, 2))
    return (total / len(attentions))[:, prefix:].reshape(-1, *GRID)


@pytest.mark.parametrize(
    ("kind", "mode"), [("hf", "fused"), ("hf", "explicit"), ("monai", "fused")]
)
def test_legrad_on_hugging_face_and_monai_equals_its_formula(inputs, kind, mode, untouched):
    model = MODELS[kind][0](mode)
    settings = attention_settings(model)
    with untouched(model):
        result = camviz.explain(
            model, inputs, "legrad", target=CLASSES, relu=False, normalize=False
        )
    assert attention_settings(model) == settings
    attentions, outputs, _ = MODELS[kind][1](inputs)
    reference = MODELS[kind][0]("explicit")
    if kind == "hf":
        project = lambda pooled: reference.classifier(reference.vit.layernorm(pooled))  # noqa: E731
    else:
        project = lambda pooled: reference.classification_head(reference.norm(pooled))  # noqa: E731
    expected = legrad_map(attentions, outputs, project, 1)
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-5, atol=1e-7)


class ImageFeatures(nn.Module):
    """A CLIP model seen through ``get_image_features``."""

    def __init__(self, clip: nn.Module) -> None:
        super().__init__()
        self.clip = clip

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.clip.get_image_features(pixel_values=pixel_values).pooler_output


def tiny_clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={
            "vocab_size": 50,
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "max_position_embeddings": 8,
        },
        vision_config={
            "image_size": 32,
            "patch_size": 8,
            "hidden_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 32,
        },
        projection_dim=8,
    )
    clip = CLIPModel(config).eval()
    clip.config._attn_implementation = "eager"
    return clip


def test_transformer_attribution_on_clips_vision_tower_equals_the_formula(inputs, untouched):
    clip = tiny_clip()
    text = torch.randn(1, 8, generator=torch.Generator().manual_seed(2))

    def cosine(features: torch.Tensor) -> torch.Tensor:
        return F.cosine_similarity(features, text, dim=-1)

    model = ImageFeatures(clip)
    settings = attention_settings(model)
    with untouched(model):
        result = camviz.explain(
            model, inputs, "transformer_attribution", target=cosine, relu=False, normalize=False
        )
    assert attention_settings(model) == settings
    assert result.layers == ["clip.vision_model.encoder.layers.1"]
    vision = clip.vision_model(pixel_values=inputs, output_attentions=True)
    score = cosine(clip.visual_projection(vision.pooler_output)).sum()
    gradients = torch.autograd.grad(score, vision.attentions)
    attentions = [a.detach() for a in vision.attentions]
    expected = patch_map(hand_chefer(attentions, gradients), 1)
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "build",
    [
        lambda: timm_vit(fused=False),
        lambda: monai_vit(flash=False),
        lambda: ImageFeatures(tiny_clip()),
    ],
)
@pytest.mark.parametrize("method", ["gradient_rollout", "legrad"])
def test_attention_settings_come_back_after_an_error_mid_pass(build, method, inputs, untouched):
    model = build()
    if method == "legrad" and not camviz.cams.get("legrad").applies_to(model):
        method = "attention_rollout"
    settings = attention_settings(model)
    blocks = camviz.core.attention.attention_blocks(model)

    runs = []

    def fail(*_):
        runs.append(1)
        if method != "legrad" or len(runs) > 1:  # LeGrad records attention in its own pass
            raise RuntimeError("mid-pass")

    handle = model.get_submodule(blocks[-1]).register_forward_hook(fail)
    try:
        with untouched(model), pytest.raises(RuntimeError, match="mid-pass"):
            target = lambda y: logits_of(y).sum(-1)  # noqa: E731
            camviz.explain(model, inputs, method, layer=blocks[-1], target=target)
    finally:
        handle.remove()
    assert attention_settings(model) == settings


def test_attention_that_cannot_be_recorded_is_named_in_one_line(inputs):
    model = monai_vit(flash=False)
    # A relative position embedding keeps MONAI's explicit softmax, which camviz cannot see.
    model.blocks[1].attn.rel_positional_embedding = nn.Identity()
    model.blocks[1].attn.rel_positional_embedding.forward = lambda x, att, q: att  # type: ignore[method-assign]
    with pytest.raises(
        CamvizError, match=r"cannot record the attention of block 'blocks.1'"
    ) as error:
        camviz.explain(model, inputs, "attention_rollout", target=CLASSES)
    assert "\n" not in str(error.value)
    assert model.blocks[0].attn.use_flash_attention is False
    with pytest.raises(CamvizError, match="no transformer blocks with attention"):
        camviz.explain(
            nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), inputs, "attention_rollout", layer="0"
        )


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from transformers import ViTImageProcessor

    folder = tmp_path_factory.mktemp("hf-vit")
    hf_vit("sdpa").save_pretrained(folder)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def test_the_cli_explains_and_compares_with_the_attention_methods(
    hf_folder, cat_path, tmp_path, monkeypatch
):
    from camviz.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = ["--model", f"hf:{hf_folder}"]
    out = tmp_path / "maps"
    arguments = ["--method", "gradient_rollout", "--heatmap", "npz", "--out", str(out)]
    assert main(["explain", str(cat_path), *source, *arguments]) == 0
    (saved,) = out.glob("*.npz")
    loaded = camviz.load_model(f"hf:{hf_folder}")
    x = loaded.preprocess(camviz.load_image(cat_path)).unsqueeze(0)
    expected = camviz.explain(loaded.model, x, "gradient_rollout").heatmaps
    with np.load(saved) as maps:
        written = torch.from_numpy(next(iter(maps.values())))
    torch.testing.assert_close(written, expected[0], rtol=1e-5, atol=1e-6)
    methods = "attention_rollout,transformer_attribution"
    compared = ["--methods", methods, "--steps", "2", "--out", str(tmp_path / "compare")]
    assert main(["compare", str(cat_path), *source, *compared]) == 0
    report = (tmp_path / "compare" / "report.html").read_text()
    assert "attention_rollout" in report and "transformer_attribution" in report


def test_wrappers_hand_their_base_the_attention(inputs):
    """Finer-CAM over transformer attribution is transformer attribution of its contrast."""
    model = tiny_vit()
    wrapped = camviz.explain(model, inputs, "finercam", base="transformer_attribution", target=2)
    contrast = camviz.Contrast(2, camviz.Nearest(3), alpha=0.6)
    plain = camviz.explain(model, inputs, "transformer_attribution", target=contrast)
    torch.testing.assert_close(wrapped.layer_maps, plain.layer_maps)
    assert wrapped.layers == plain.layers == ["encoder.layers.encoder_layer_1"]


def hf_vision_tower(kind: str) -> nn.Module:
    import transformers

    config, model = {
        "dinov2": (transformers.Dinov2Config, transformers.Dinov2Model),
        "siglip": (transformers.SiglipVisionConfig, transformers.SiglipVisionModel),
    }[kind]
    torch.manual_seed(0)
    sizes = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
    return model(config(image_size=32, patch_size=8, intermediate_size=32, **sizes)).eval()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["dinov2", "siglip"])
def test_transformer_attribution_on_dinov2_and_siglip_equals_the_formula(
    kind, implementation, inputs, untouched
):
    """DINOv2 reads its class token's row; SigLIP, without one, the mean of the rows."""
    model = hf_vision_tower(kind)

    def first_feature(output) -> torch.Tensor:
        return output.pooler_output[:, 0]

    model.config._attn_implementation = "eager"
    output = model(pixel_values=inputs, output_attentions=True)
    gradients = torch.autograd.grad(first_feature(output).sum(), output.attentions)
    relevance = hand_chefer([a.detach() for a in output.attentions], gradients)
    rows = relevance[:, 0, 1:] if kind == "dinov2" else relevance.mean(dim=1)
    model.config._attn_implementation = implementation
    settings = attention_settings(model)
    with untouched(model):
        result = camviz.explain(
            model,
            inputs,
            "transformer_attribution",
            target=first_feature,
            relu=False,
            normalize=False,
        )
    assert attention_settings(model) == settings
    torch.testing.assert_close(result.layer_maps, rows.reshape(-1, *GRID), rtol=1e-5, atol=1e-7)
