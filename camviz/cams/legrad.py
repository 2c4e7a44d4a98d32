"""LeGrad: gradients of each block's own prediction with respect to its attention map.

No attention matrix needs to exist in the model. timm's ``Attention`` calls
:func:`torch.nn.functional.scaled_dot_product_attention`, which fuses softmax and product;
``nn.MultiheadAttention`` (torchvision's ViT, called with ``need_weights=False``) calls
``F.multi_head_attention_forward``, which calls the former. For the duration of one forward
pass a :class:`~torch.overrides.TorchFunctionMode` computes each such call explicitly, the
attention as ``(softmax(q k^T * scale + mask) + delta) v`` with a zero ``delta`` that
requires grad (the engine's trick, :mod:`camviz.cams.recording`): the gradient with respect to
``delta`` is the gradient with respect to the attention probabilities, and the forward values
are those of the fused call up to float rounding. Nothing on the model is changed but one
flag: timm's ``Attention`` modules built with fused attention off (``TIMM_FUSED_ATTN=0``)
compute ``softmax`` themselves, so their ``fused_attn`` is switched on for the pass
(:class:`~camviz.core.modelstate.FusedAttention`) and back off at its end, errors included.
The mode ends with the pass too. The pass itself goes through the engine's
:meth:`~camviz.cams.base.LayerData.run`, and the block outputs are read with
:func:`camviz.core.hooks.edit`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.registry import register
from camviz.core.calls import CallMode
from camviz.core.errors import CamvizError
from camviz.core.grids import layout_of, patch_size
from camviz.core.hooks import edit
from camviz.core.modelstate import FusedAttention, changed

# scaled_dot_product_attention's parameters, in order (a builtin: no inspect.signature).
_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


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
    """The blocks and head of a timm or torchvision ``VisionTransformer``, else ``None``."""
    modules = dict(model.named_children())
    blocks, head = modules.get("blocks"), modules.get("head")
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
    return None


def _pooled(modules: Sequence[nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """``modules`` applied in turn to the mean token of ``(N, T, C)`` tokens."""
    pooled = tokens.mean(dim=1)
    for module in modules:
        pooled = module(pooled)
    return pooled


class _AttentionTaps(CallMode):
    """Computes every attention call explicitly and hands on ``P + delta``; ``deltas`` holds
    one zero tensor per call, in call order.

    Two calls are intercepted: ``scaled_dot_product_attention`` (timm) and
    ``multi_head_attention_forward``, the functional form of ``nn.MultiheadAttention``
    (torchvision), which would otherwise call the former with this mode switched off.
    """

    def __init__(self) -> None:
        super().__init__()
        self.deltas: list[torch.Tensor] = []

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is F.scaled_dot_product_attention:
            call = dict(zip(_SDPA_PARAMETERS, args, strict=False)) | kwargs
            query, key, value = call["query"], call["key"], call["value"]
            if call.get("enable_gqa", False) and key.shape[-3] != query.shape[-3]:
                key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
                value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
            return self.attend(query, key, value, call)[0]
        if func is F.multi_head_attention_forward:
            return self.multi_head(_MHA_SIGNATURE.bind(*args, **kwargs).arguments)
        return func(*args, **kwargs)

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, call: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P + delta) v`` and ``P = softmax(q k^T * scale + mask)``, for ``(N, H, L, d)``
        tensors."""
        if call.get("dropout_p", 0.0) > 0:
            raise CamvizError("legrad needs attention dropout off; put the model in eval mode")
        scale = call.get("scale") or 1 / math.sqrt(query.shape[-1])
        logits = query @ key.transpose(-2, -1) * scale
        mask = call.get("attn_mask")
        if call.get("is_causal", False):
            mask = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, -torch.inf)
        elif mask is not None:
            logits = logits + mask
        probabilities = logits.softmax(dim=-1)
        delta = torch.zeros_like(probabilities, requires_grad=True)
        self.deltas.append(delta)
        return (probabilities + delta) @ value, probabilities.detach()

    def multi_head(self, call: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``nn.MultiheadAttention``'s functional form for batched self-attention inputs
        ``(L, N, E)`` without added key/value biases or padding masks."""
        query, key, value = call["query"], call["key"], call["value"]
        if (
            query.dim() != 3
            or call.get("bias_k") is not None
            or call.get("add_zero_attn", False)
            or call.get("key_padding_mask") is not None
            or call.get("static_k") is not None
        ):
            raise CamvizError(
                "legrad handles batched nn.MultiheadAttention without bias_k, add_zero_attn, "
                "static keys or key padding masks; pick another method for this model"
            )
        if call.get("use_separate_proj_weight", False):
            weights = (call["q_proj_weight"], call["k_proj_weight"], call["v_proj_weight"])
        else:
            weights = call["in_proj_weight"].chunk(3)
        bias = call.get("in_proj_bias")
        biases = bias.chunk(3) if bias is not None else (None, None, None)
        heads = call["num_heads"]

        def split(tokens: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
            projected = F.linear(tokens, weight, bias)  # (L, N, E)
            return projected.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)  # (N, H, L, d)

        q, k, v = (
            split(t, w, b) for t, w, b in zip((query, key, value), weights, biases, strict=True)
        )
        mask = call.get("attn_mask")
        if mask is not None and mask.dim() == 3:
            mask = mask.unflatten(0, (-1, heads))
        if mask is not None and mask.dtype == torch.bool:
            mask = ~mask  # nn.MultiheadAttention masks out True; sdpa keeps True
        attended, probabilities = self.attend(q, k, v, {**call, "attn_mask": mask})
        merged = attended.permute(2, 0, 1, 3).flatten(-2)  # (L, N, E)
        output = F.linear(merged, call["out_proj_weight"], call.get("out_proj_bias"))
        if not call.get("need_weights", True):
            return output, None
        averaged = call.get("average_attn_weights", True)
        return output, probabilities.mean(dim=1) if averaged else probabilities


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
    timm's and torchvision's ``VisionTransformer`` (fused attention included, see the module
    docstring); other models are refused. Costs one forward pass and one backward pass per
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
                f"legrad explains timm and torchvision vision transformers, not a "
                f"{type(data.model).__name__}; pick another method"
            )
        outputs: dict[str, torch.Tensor] = {}

        def keep(name: str, output: torch.Tensor) -> torch.Tensor:
            outputs[name] = output
            return output

        taps = _AttentionTaps()
        recorders = {block: partial(keep, block) for block in parts.blocks}
        # Graphs of ordinary tensors, also inside a caller's inference mode.
        with (
            torch.inference_mode(False),
            torch.enable_grad(),
            edit(data.model, recorders),
            changed(data.model, FusedAttention()),
            taps,
        ):
            data.run(data.inputs)
        if len(taps.deltas) != len(parts.blocks):
            raise CamvizError(
                f"legrad found {len(taps.deltas)} fused attention calls in {len(parts.blocks)} "
                "blocks; it needs one attention per block"
            )
        used = range(len(parts.blocks))[-self.last :] if self.last else range(len(parts.blocks))
        # The keys of a ViT's attention: its class token and patches (the grid from the
        # model's patch stride, as layout="tokens" asks).
        layout = layout_of(
            (1, taps.deltas[0].shape[-1], 1),
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
                (gradient,) = torch.autograd.grad(score, taps.deltas[index], retain_graph=True)
                total = total + gradient.clamp_min(0).mean(dim=(1, 2))
            patches = total[:, layout.prefix :] / len(used)
            maps.append(patches.unflatten(1, layout.grid))
        return maps
