"""The attention probabilities of every transformer block, recorded during a pass, also where
the model runs a fused kernel that returns none.

A fused call (:func:`torch.nn.functional.scaled_dot_product_attention`, and
``F.multi_head_attention_forward``, through which ``nn.MultiheadAttention`` reaches it)
never materialises its attention matrix. :class:`AttentionCapture`, a
:class:`~camviz.core.calls.CallMode`, computes each such call made inside a transformer
block explicitly instead, as ``(P + delta) v`` with ``P = softmax(q k^T * scale + mask)``:
``P`` is recorded, and with ``gradients`` the zero ``delta`` requires grad, so that the
gradient of a score with respect to ``delta`` is its gradient with respect to ``P`` (the
engine's ``A + delta`` tap, ``docs/architecture.md``). The block outputs are those of the
fused call up to float rounding. Attention that a module computes with its own softmax
(timm's ``fused_attn=False``, MONAI's ``SABlock`` without flash attention, Hugging Face's
``eager`` implementation) is switched to the fused call for the pass by
:class:`~camviz.core.modelstate.FusedAttention`, and switched back at its end, errors
included. A block whose attention still escapes (relative position embeddings, a model
with its own attention code) is named in one line.

The blocks are found from the model's structure (:func:`attention_blocks`): the element of
an ``nn.ModuleList`` or ``nn.Sequential`` nearest above each attention module
(``nn.MultiheadAttention``, timm's attention, MONAI's ``SABlock``, a Hugging Face
``...Attention`` with a config). An attention call outside every block (SigLIP's pooling
head) runs as the model wrote it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.calls import CallMode
from camviz.core.errors import CamvizError
from camviz.core.modelstate import FusedAttention, HookSet, changed
from camviz.core.taps import parse

__all__ = ["AttentionCapture", "AttentionMaps", "attention_blocks", "capturing"]

# scaled_dot_product_attention's parameters, in order (a builtin: no inspect.signature).
_SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def _is_attention(module: nn.Module) -> bool:
    """Whether ``module`` is an attention module camviz knows."""
    config = getattr(module, "config", None)
    return (
        isinstance(module, nn.MultiheadAttention)
        or hasattr(module, "fused_attn")  # timm
        or hasattr(module, "use_flash_attention")  # MONAI's SABlock
        or (type(module).__name__.endswith("Attention") and hasattr(config, "sub_configs"))
    )


def attention_blocks(model: nn.Module) -> list[str]:
    """The names of the model's transformer blocks, in module order (see the module
    docstring); empty for a model without attention modules in blocks."""
    modules = dict(model.named_modules())
    containers = {
        name
        for name, module in modules.items()
        if isinstance(module, (nn.ModuleList, nn.Sequential))
    }
    blocks: list[str] = []
    attentions: list[str] = []
    for name, module in modules.items():
        inside = any(name.startswith(f"{outer}.") for outer in attentions)
        if not name or inside or not _is_attention(module):
            continue
        attentions.append(name)
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[: end - 1]) in containers:
                block = ".".join(parts[:end])
                if block not in blocks:
                    blocks.append(block)
                break
    return blocks


@dataclass(frozen=True)
class AttentionCall:
    """One attention call recorded in a block.

    Attributes:
        block: The block that made it.
        probabilities: ``P``, ``(N, H, Q, K)``, detached.
        delta: The zero tensor added to ``P`` (requires grad), or ``None`` without gradients.
    """

    block: str
    probabilities: torch.Tensor
    delta: torch.Tensor | None


class AttentionCapture(CallMode):
    """Computes every attention call inside a block explicitly and records it in ``calls``,
    in call order (see the module docstring); :func:`capturing` enters it."""

    def __init__(self, gradients: bool) -> None:
        super().__init__()
        self.gradients = gradients
        self.calls: list[AttentionCall] = []
        self.ran: list[str] = []
        self._running: list[str] = []

    def enter(self, block: str, *_: Any) -> None:
        """A block's forward pre-hook."""
        self._running.append(block)
        self.ran.append(block)

    def leave(self, block: str, *_: Any) -> None:
        """A block's forward hook."""
        if self._running and self._running[-1] == block:
            self._running.pop()

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._running:
            return func(*args, **kwargs)
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
        tensors; ``P`` recorded."""
        block = self._running[-1]
        if call.get("dropout_p", 0.0) > 0:
            raise CamvizError(
                f"block {block!r} calls attention with dropout p={call['dropout_p']} in eval "
                "mode, so its attention cannot be recorded; build it with attention dropout 0"
            )
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
        delta = None
        if self.gradients:
            torch.set_grad_enabled(True)  # undone when the pass's no_grad block ends
            delta = torch.zeros_like(probabilities, requires_grad=True)
            attended = (probabilities + delta) @ value
        else:
            attended = probabilities @ value
        self.calls.append(AttentionCall(block, probabilities.detach(), delta))
        return attended, probabilities.detach()

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
                f"camviz records the attention of batched nn.MultiheadAttention without bias_k, "
                f"add_zero_attn, static keys or key padding masks, which block "
                f"{self._running[-1]!r} uses; pick a method that does not read attention"
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

    def check(self) -> None:
        """Every block that ran made exactly one attention call that was recorded."""
        made = [call.block for call in self.calls]
        for block in dict.fromkeys(self.ran):
            if made.count(block) != self.ran.count(block):
                raise CamvizError(
                    f"camviz cannot record the attention of block {block!r} (it made "
                    f"{made.count(block)} recorded attention calls in {self.ran.count(block)} "
                    "runs: relative position embeddings or attention code of its own?); pick "
                    "a method that does not read attention"
                )


@contextlib.contextmanager
def capturing(model: nn.Module, gradients: bool) -> Iterator[AttentionCapture]:
    """Record the attention of every block of ``model`` during the block of code (the model
    runs in it; with ``gradients`` each call's ``delta`` requires grad).

    Raises:
        CamvizError: The model has no blocks with attention camviz knows, or a block's
            attention cannot be recorded (checked when the block of code ends).
    """
    blocks = attention_blocks(model)
    if not blocks:
        raise CamvizError(
            f"a {type(model).__name__} has no transformer blocks with attention that camviz "
            "knows (nn.MultiheadAttention, timm's Attention, Hugging Face attention, MONAI's "
            "SABlock); pick a method that does not read attention"
        )
    capture = AttentionCapture(gradients)
    with changed(model, FusedAttention()), HookSet() as hooks:
        for name in blocks:
            module = model.get_submodule(name)
            hooks.add(module.register_forward_pre_hook(partial(capture.enter, name)))
            hooks.add(module.register_forward_hook(partial(capture.leave, name)))
        with capture:
            yield capture
    capture.check()


@dataclass(frozen=True)
class AttentionMaps:
    """The attention a pass recorded, for one target rank.

    Attributes:
        blocks: The block of each call, in call order.
        probabilities: ``P`` of each call, ``(N, H, Q, K)``.
        gradients: ``dy/dP`` of each call for this rank's score, or ``None`` when the pass
            took no gradients.
    """

    blocks: tuple[str, ...]
    probabilities: tuple[torch.Tensor, ...]
    gradients: tuple[torch.Tensor, ...] | None

    def up_to(self, layer: str) -> AttentionMaps:
        """The calls of the blocks beside the one ``layer`` names (or lies in), up to and
        including it: a tower's blocks, the first to the named one.

        Raises:
            CamvizError: ``layer`` is in no block that ran.
        """
        name = parse(layer).name
        ran = list(dict.fromkeys(self.blocks))
        named = [block for block in ran if name == block or name.startswith(f"{block}.")]
        if not named:
            raise CamvizError(
                f"layer {layer!r} is no transformer block; name the last block to include, "
                f"one of {', '.join(map(repr, ran))}"
            )
        last = max(index for index, block in enumerate(self.blocks) if block == named[-1])
        tower = named[-1].rpartition(".")[0]
        kept = [
            index for index in range(last + 1) if self.blocks[index].rpartition(".")[0] == tower
        ]
        return AttentionMaps(
            tuple(self.blocks[index] for index in kept),
            tuple(self.probabilities[index] for index in kept),
            None if self.gradients is None else tuple(self.gradients[index] for index in kept),
        )


def as_maps(
    capture: AttentionCapture, gradients: Sequence[Sequence[torch.Tensor | None]], ranks: int
) -> list[AttentionMaps]:
    """One :class:`AttentionMaps` for each of ``ranks`` ranks from a capture and each rank's
    gradients with respect to its calls' ``delta`` (none: the maps have no gradients)."""
    blocks = tuple(call.block for call in capture.calls)
    probabilities = tuple(call.probabilities.float() for call in capture.calls)
    if not gradients:
        return [AttentionMaps(blocks, probabilities, None)] * ranks
    return [
        AttentionMaps(
            blocks,
            probabilities,
            tuple(
                torch.zeros_like(p) if g is None else g.detach().float()
                for p, g in zip(probabilities, per_call, strict=True)
            ),
        )
        for per_call in gradients
    ]
