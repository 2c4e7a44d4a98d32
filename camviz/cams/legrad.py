"""LeGrad: gradients of each block's own prediction with respect to its attention map.

No attention matrix needs to exist in the model: the attention of every block is recorded
during one forward pass by :func:`camviz.core.attention.capturing`, fused attention
included, each one handed on as ``P + delta`` with a zero ``delta`` that requires grad, so
that the gradient with respect to ``delta`` is the gradient with respect to the attention
probabilities. The pass goes through the engine's :meth:`~camviz.cams.base.LayerData.run`,
and the block outputs are read with :func:`camviz.core.hooks.edit`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.registry import register
from camviz.core.attention import attention_blocks, capturing
from camviz.core.errors import CamvizError
from camviz.core.grids import layout_of, patch_size
from camviz.core.hooks import edit


@dataclass
class VitParts:
    """What LeGrad needs to know of a vision transformer.

    Attributes:
        blocks: The names of its transformer blocks, in order.
        project: Maps a block's ``(N, T, C)`` tokens to class scores as the paper does: the
            mean token, through the model's final norm and classifier head.
    """

    blocks: list[str]
    project: Callable[[torch.Tensor], torch.Tensor]


def vit_parts(model: nn.Module) -> VitParts | None:
    """The blocks and head of a timm, torchvision or MONAI ``VisionTransformer`` or a
    Hugging Face ``...ForImageClassification`` (ViT, DeiT), else ``None``."""
    modules = dict(model.named_children())
    blocks = modules.get("blocks")
    head = modules.get("head", modules.get("classification_head"))  # timm, MONAI
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and head is not None:
        # timm: norm before token pooling, fc_norm after it; one of them is an Identity.
        norms = [modules[name] for name in ("norm", "fc_norm") if name in modules]
        names = [f"blocks.{index}" for index in range(len(blocks))]
        return VitParts(names, partial(_pooled, [*norms, head]))
    encoder, heads = modules.get("encoder"), modules.get("heads")
    if encoder is not None and heads is not None:
        parts = dict(encoder.named_children())
        layers, norm = parts.get("layers"), parts.get("ln")
        if isinstance(layers, nn.Sequential) and norm is not None:
            names = [f"encoder.layers.{name}" for name, _ in layers.named_children()]
            return VitParts(names, partial(_pooled, [norm, heads]))
    return _hugging_face_parts(modules)


def _hugging_face_parts(modules: dict[str, nn.Module]) -> VitParts | None:
    """A Hugging Face classifier's: a base model with transformer blocks and a final
    ``layernorm``, beside a linear ``classifier`` on its hidden size."""
    classifier = modules.get("classifier")
    for name, base in modules.items():
        norm = getattr(base, "layernorm", None)
        if (
            isinstance(norm, nn.LayerNorm)
            and isinstance(classifier, nn.Linear)
            and classifier.in_features == norm.normalized_shape[-1]
        ):
            names = [f"{name}.{block}" for block in attention_blocks(base)]
            return VitParts(names, partial(_pooled, [norm, classifier])) if names else None
    return None


def _pooled(modules: Sequence[nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """``modules`` applied in turn to the mean token of ``(N, T, C)`` tokens."""
    pooled = tokens.mean(dim=1)
    for module in modules:
        pooled = module(pooled)
    return pooled


@register
class LeGrad(CamMethod):
    """LeGrad: each block's prediction, differentiated with respect to its attention map.

    Paper: Bousselham et al., "LeGrad: An Explainability Method for Vision Transformers via
    Feature Formation Sensitivity", arXiv 2024 (ICCV 2025).

    For block ``l`` with output tokens ``z^l``, attention probabilities ``A^l`` of shape
    ``(heads, queries, keys)`` and the block's own class score ``s^l`` (the model's final
    norm and head applied to the mean token of ``z^l``, as in the authors' code)::

        E^l = (1 / (H * Q)) sum_h sum_q ReLU( ds^l / dA^l )_{h,q,:}     (one value per key)
        L   = (1 / |blocks|) sum_l E^l  over the patch keys, on the patch grid

    The target layer plays no part beyond the engine's first pass; the map has the patch
    grid of the attention keys (class, distillation and register tokens dropped). Works on
    timm's, torchvision's and MONAI's ``VisionTransformer`` and Hugging Face's ViT and DeiT
    classifiers (fused attention included, see the module docstring); other models are
    refused. Costs one forward pass and one backward pass per
    block and rank.

    Compared with torchcam's ``LeGrad`` (torchvision models only): the same formula; with
    ``last=k`` only the last ``k`` blocks are used (the authors' wrapper starts at the
    second-to-last block by default: ``last=2``).

    Args:
        last: Use only the last ``last`` blocks; ``None``: every block.
    """

    name = "legrad"
    paper = (
        "Bousselham et al., LeGrad: An Explainability Method for Vision Transformers via "
        "Feature Formation Sensitivity, ICCV 2025"
    )
    needs = "vision transformers: gradients w.r.t. every block's attention map"
    uses_gradients = False

    def __init__(self, last: int | None = None) -> None:
        if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 1):
            raise CamvizError(f"legrad needs last >= 1 (an int) or None, got {last!r}")
        self.last = last

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return vit_parts(model) is not None

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return self.rank_maps([data])[0]

    def rank_maps(self, ranks: Sequence[LayerData]) -> list[torch.Tensor]:
        data = ranks[0]
        parts = vit_parts(data.model)
        if parts is None:
            raise CamvizError(
                f"legrad explains timm, torchvision, MONAI and Hugging Face vision transformer "
                f"classifiers, not a "
                f"{type(data.model).__name__}; pick another method"
            )
        outputs: dict[str, torch.Tensor] = {}

        def keep(name: str, output: torch.Tensor) -> torch.Tensor:
            outputs[name] = output
            return output

        recorders = {block: partial(keep, block) for block in parts.blocks}
        # Graphs of ordinary tensors, also inside a caller's inference mode.
        with (
            torch.inference_mode(False),
            torch.enable_grad(),
            edit(data.model, recorders),
            capturing(data.model, gradients=True) as capture,
        ):
            data.run(data.inputs)
        deltas = [
            call.delta
            for call in capture.calls
            if call.block in parts.blocks and call.delta is not None
        ]
        if len(deltas) != len(parts.blocks):
            raise CamvizError(
                f"legrad recorded {len(deltas)} attention calls in {len(parts.blocks)} "
                "blocks; it needs one attention per block"
            )
        used = range(len(parts.blocks))[-self.last :] if self.last else range(len(parts.blocks))
        # The keys of a ViT's attention: its class token and patches (the grid from the
        # model's patch stride, as layout="tokens" asks).
        layout = layout_of(
            (1, deltas[0].shape[-1], 1),
            "attention keys",
            data.inputs.shape[-2:],
            patch_size(data.model),
            "tokens",
        )
        maps = []
        for rank in ranks:
            total = torch.zeros(())
            for index in used:
                with torch.inference_mode(False), torch.enable_grad():
                    score = rank.score_fn(parts.project(outputs[parts.blocks[index]])).sum()
                (gradient,) = torch.autograd.grad(score, deltas[index], retain_graph=True)
                total = total + gradient.clamp_min(0).mean(dim=(1, 2))
            patches = total[:, layout.prefix :] / len(used)
            maps.append(patches.unflatten(1, layout.grid))
        return maps
