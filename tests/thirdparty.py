"""Models of third-party libraries (Hugging Face transformers, Ultralytics, MONAI), built
from tiny configs with random weights, and a Grad-CAM written out by hand to check camviz on
them.

Every builder is cached, so one test session builds each model once (camviz hands a model
back as it came, so tests may share it); nothing is downloaded. Ultralytics runs offline,
with its settings in a temporary folder: the environment is set here, before it is imported.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

os.environ["YOLO_OFFLINE"] = "1"
os.environ["YOLO_AUTOINSTALL"] = "False"
os.environ.setdefault("YOLO_CONFIG_DIR", tempfile.mkdtemp(prefix="camviz-ultralytics-"))
os.environ.setdefault("YOLO_VERBOSE", "False")

Grid = Callable[[torch.Tensor], torch.Tensor]
Score = Callable[[Any], torch.Tensor]


# --- A Grad-CAM by hand ----------------------------------------------------------------------


def channels_first(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def tokens(prefix: int, grid: Sequence[int]) -> Grid:
    """``(N, T, C)`` tokens whose ``prefix`` leading ones are not patches, and whose next
    ``prod(grid)`` tokens are the patches in row-major order, as ``(N, C, *grid)``."""
    count = 1
    for extent in grid:
        count *= extent

    def to_grid(tensor: torch.Tensor) -> torch.Tensor:
        patches = tensor[:, prefix : prefix + count]
        return patches.reshape(tensor.shape[0], *grid, tensor.shape[-1]).movedim(-1, 1)

    return to_grid


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)


def hand_gradcam(
    model: nn.Module,
    inputs: Any,
    layer: str,
    score: Score,
    grid: Grid = channels_first,
    *,
    element: int | None = None,
    at_input: bool = False,
) -> list[torch.Tensor]:
    """Grad-CAM's raw maps ``sum_c mean(dy/dA_c) A_c`` at ``layer``, one ``(N, *grid)``
    tensor per tapped map, written with ``torch.autograd`` alone.

    The layer's output (its element ``element`` of a tuple; with ``at_input``, the maps of
    the list it takes as its first input) is replaced by leaf copies, so the gradient is that
    of the explained score ``score(output)`` (one value per sample) with respect to them.
    """
    module = model.get_submodule(layer)
    leaves: list[torch.Tensor] = []

    def leaf(tensor: torch.Tensor) -> torch.Tensor:
        copied = tensor.detach().clone().requires_grad_()
        leaves.append(copied)
        return copied

    def on_output(module: nn.Module, args: Any, output: Any) -> Any:
        if element is None:
            return leaf(output)
        items = list(output)
        items[element] = leaf(items[element])
        return type(output)(items)

    def on_input(module: nn.Module, args: tuple[Any, ...]) -> Any:
        first = args[0]
        if isinstance(first, (list, tuple)):
            return (type(first)(leaf(value) for value in first), *args[1:])
        return (leaf(first), *args[1:])

    handle = (
        module.register_forward_pre_hook(on_input)
        if at_input
        else module.register_forward_hook(on_output)
    )
    try:
        with torch.enable_grad():
            scores = score(call(model, inputs))
            gradients = torch.autograd.grad(scores.sum(), leaves, allow_unused=True)
    finally:
        handle.remove()
    maps = []
    for activation, gradient in zip(leaves, gradients, strict=True):
        gradient = torch.zeros_like(activation) if gradient is None else gradient
        values, slopes = grid(activation.detach()), grid(gradient)
        weights = slopes.flatten(2).mean(-1)
        maps.append(torch.einsum("nc,nc...->n...", weights, values))
    return maps


def assert_close_to_hand(ours: torch.Tensor, hand: torch.Tensor) -> None:
    """``max |ours - hand| <= 1e-4 * max |hand|``, on maps that are not all zero."""
    scale = hand.abs().max()
    assert scale > 0, "the hand Grad-CAM is all zero: the test would prove nothing"
    assert ours.shape == hand.shape
    assert (ours - hand).abs().max() <= 1e-4 * scale


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def class_logit(class_id: int, key: str = "logits") -> Score:
    """The score ``output[key][:, class_id]`` of a Hugging Face classifier."""
    return lambda output: output[key][:, class_id]


# --- Hugging Face transformers ---------------------------------------------------------------


def _hf_layers() -> dict[str, Any]:
    return {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}


@functools.cache
def hf_vit() -> nn.Module:
    """ViT, 32 px inputs in 8 px patches (a 4 x 4 grid after the class token)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        **_hf_layers(), num_hidden_layers=2, image_size=32, patch_size=8, num_labels=5
    )
    return ViTForImageClassification(config).eval()


@functools.cache
def hf_deit() -> nn.Module:
    """DeiT with class and distillation tokens, 32 px inputs in 8 px patches."""
    from transformers import DeiTConfig, DeiTForImageClassificationWithTeacher

    torch.manual_seed(0)
    config = DeiTConfig(
        **_hf_layers(), num_hidden_layers=2, image_size=32, patch_size=8, num_labels=5
    )
    return DeiTForImageClassificationWithTeacher(config).eval()


@functools.cache
def hf_dinov2_registers() -> nn.Module:
    """DINOv2 with a class token and 4 registers; takes 32 x 48 inputs (a 4 x 6 grid)."""
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersForImageClassification

    torch.manual_seed(0)
    config = Dinov2WithRegistersConfig(
        hidden_size=32,
        num_attention_heads=2,
        mlp_ratio=2,
        num_hidden_layers=2,
        image_size=32,
        patch_size=8,
        num_register_tokens=4,
        num_labels=5,
    )
    return Dinov2WithRegistersForImageClassification(config).eval()


def _text_config() -> dict[str, Any]:
    return {
        **_hf_layers(),
        "vocab_size": 50,
        "num_hidden_layers": 1,
        "max_position_embeddings": 16,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 1,
    }


def _vision_config() -> dict[str, Any]:
    return {**_hf_layers(), "num_hidden_layers": 2, "image_size": 32, "patch_size": 8}


@functools.cache
def hf_clip() -> nn.Module:
    """CLIP with a 1-layer text tower and a 2-layer vision tower on 32 px images."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=_text_config(), vision_config=_vision_config(), projection_dim=16
    )
    return CLIPModel(config).eval()


@functools.cache
def hf_siglip() -> nn.Module:
    """SigLIP (no class token: an attention-pooling head) on 32 px images."""
    from transformers import SiglipConfig, SiglipModel

    torch.manual_seed(0)
    config = SiglipConfig(text_config=_text_config(), vision_config=_vision_config())
    return SiglipModel(config).eval()


def text_and_images(images: int = 2, size: int = 32) -> dict[str, torch.Tensor]:
    """A two-tower model's inputs, ``input_ids`` first as its processor gives them: one
    caption per image."""
    generator = torch.Generator().manual_seed(1)
    return {
        "input_ids": torch.randint(0, 50, (images, 5), generator=generator),
        "pixel_values": torch.randn(images, 3, size, size, generator=generator),
    }


@functools.cache
def hf_swin() -> nn.Module:
    """Swin with two stages on 32 px inputs: 8 x 8 patches, then 4 x 4 after merging."""
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    config = SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[1, 1],
        window_size=2,
        num_labels=5,
    )
    return SwinForImageClassification(config).eval()


@functools.cache
def hf_convnext() -> nn.Module:
    """ConvNeXt with four one-block stages; its downsampling layers start with a
    channels-first ``ConvNextLayerNorm`` (an ``nn.LayerNorm`` subclass)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    config = ConvNextConfig(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_labels=5)
    return ConvNextForImageClassification(config).eval()


@functools.cache
def hf_segformer() -> nn.Module:
    """Segformer with two encoder stages (strides 4 and 8) and 3 classes."""
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    torch.manual_seed(0)
    config = SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
        decoder_hidden_size=32,
        num_labels=3,
    )
    return SegformerForSemanticSegmentation(config).eval()


@functools.cache
def hf_detr() -> nn.Module:
    """DETR on a tiny ResNet built from its config (no timm backbone, nothing downloaded):
    10 object queries, 4 classes and "no object"."""
    from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

    torch.manual_seed(0)
    backbone = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        out_features=["stage2"],
    )
    config = DetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone_config=backbone,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_queries=10,
        num_labels=4,
    )
    return DetrForObjectDetection(config).eval()


@functools.cache
def hf_yolos() -> nn.Module:
    """YOLOS on 32 x 48 inputs: a class token, 4 x 6 patches, then 5 detection tokens."""
    from transformers import YolosConfig, YolosForObjectDetection

    torch.manual_seed(0)
    config = YolosConfig(
        **_hf_layers(),
        num_hidden_layers=2,
        image_size=[32, 48],
        patch_size=8,
        num_detection_tokens=5,
        num_labels=4,
        use_mid_position_embeddings=False,
    )
    return YolosForObjectDetection(config).eval()


def images(*size: int, count: int = 1, channels: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(count, channels, *size, generator=torch.Generator().manual_seed(seed))


# --- Ultralytics -----------------------------------------------------------------------------

YOLO_CONFIGS = ("yolov8n", "yolo11n")


@functools.cache
def yolo(config: str, task: str = "detect") -> nn.Module:
    """An Ultralytics model from its yaml (``"yolov8n"``, ``"yolo11n"``; task ``"detect"``,
    ``"segment"`` or ``"classify"``), scaled to an eighth of the width, 3 classes."""
    from ultralytics.nn.tasks import (
        ClassificationModel,
        DetectionModel,
        SegmentationModel,
        yaml_model_load,
    )

    suffix = {"detect": "", "segment": "-seg", "classify": "-cls"}[task]
    built = {"detect": DetectionModel, "segment": SegmentationModel}
    cfg = yaml_model_load(f"{config}{suffix}.yaml")
    cfg["scales"] = {"n": [0.33, 0.125, 1024]}
    torch.manual_seed(0)
    model = built.get(task, ClassificationModel)(cfg, nc=3, verbose=False)
    return model.eval()


def yolo_head(model: nn.Module) -> str:
    """The name of an Ultralytics model's last module (its ``Detect``, ``Segment`` or
    ``Classify`` head)."""
    return f"model.{len(model.model) - 1}"


# --- MONAI -----------------------------------------------------------------------------------


@functools.cache
def monai_densenet() -> nn.Module:
    """MONAI's 3-D DenseNet121 on one-channel volumes, with 8 initial features."""
    from monai.networks.nets import DenseNet121

    torch.manual_seed(0)
    model = DenseNet121(
        spatial_dims=3, in_channels=1, out_channels=2, init_features=8, growth_rate=4
    )
    return model.eval()


@functools.cache
def monai_unet() -> nn.Module:
    """MONAI's 3-D UNet, two classes, three levels."""
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    model = UNet(
        spatial_dims=3,
        in_channels=1,
        out_channels=2,
        channels=(4, 8, 16),
        strides=(2, 2),
        num_res_units=1,
    )
    return model.eval()


@functools.cache
def monai_vit() -> nn.Module:
    """MONAI's 3-D ViT classifier on 16^3 volumes in 8^3 patches (a 2 x 2 x 2 grid after
    its class token); its attention is MONAI's ``SABlock`` (a fused qkv projection)."""
    from monai.networks.nets import ViT

    torch.manual_seed(0)
    model = ViT(
        in_channels=1,
        img_size=(16, 16, 16),
        patch_size=(8, 8, 8),
        hidden_size=32,
        mlp_dim=64,
        num_layers=2,
        num_heads=2,
        classification=True,
        num_classes=2,
    )
    return model.eval()
