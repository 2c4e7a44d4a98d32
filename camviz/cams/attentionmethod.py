"""What the methods that read attention share: the blocks a map uses, and its patch grid.

The engine's pass records every transformer block's attention probabilities ``A`` (and,
for the gradient-weighted methods, each rank's ``dA = dy/dA``), fused attention included
(:mod:`camviz.core.attention`). ``layer=`` names the last block included (default: the
model's last block, :meth:`AttentionMethod.default_layer`); the blocks before it in the
same tower (its siblings: a CLIP model's vision blocks, not its text blocks) are the
others. A method turns each block's matrices into one ``(N, T, T)`` factor ``M_l``
(:meth:`AttentionMethod.factors`); their product ``R = M_L ... M_1`` is the relevance
matrix between tokens. The map is the class token's row of ``R`` (without a class token,
the mean of its rows) at the patch tokens, on their grid. Which tokens are patches is told
by the pass, as for Grad-CAM on tokens (:mod:`camviz.core.lineage`): class, distillation and
register tokens are dropped. The rows of ``R`` at other positions (a causal language
model's, one per generated token: :mod:`camviz.cams.generation`) come from
:meth:`AttentionMethod.relevance` with ``queries``, row vectors times one factor at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import torch
from torch import nn

from camviz.cams.base import CamMethod, LayerData
from camviz.core.attention import AttentionMaps, attention_blocks
from camviz.core.defaults import require_sample
from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs


class AttentionMethod(CamMethod):
    """A method whose map is a relevance matrix between tokens built from every block's
    attention; subclasses implement :meth:`relevance`."""

    needs = "vision transformers: each block's attention"
    uses_gradients = False
    spatial_ranks: ClassVar[tuple[int, ...]] = (2, 3)
    attention: Literal["probabilities", "gradients"] | None = "probabilities"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return bool(attention_blocks(model))

    def default_layer(self, model: nn.Module, batch: Inputs) -> str | None:
        blocks = attention_blocks(model)
        if not blocks:
            return None  # the pass's capture says why in one line
        require_sample(batch)
        return blocks[-1]

    def factors(self, attention: AttentionMaps) -> list[torch.Tensor]:
        """The ``(N, T, T)`` factor ``M_l`` of each block, first block first: the relevance
        matrix is their product ``M_L ... M_1``."""
        raise NotImplementedError

    def relevance(
        self, attention: AttentionMaps, queries: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The ``(N, T, T)`` relevance matrix ``R = M_L ... M_1`` of the blocks' attention, or
        with ``queries`` (``(N, Q, T)``, weights over the query tokens: a one-hot row picks
        one position's row) ``queries @ R``, ``(N, Q, T)``, multiplied from the left: ``Q T^2``
        operations per block rather than ``T^3``."""
        rows = queries
        for factor in reversed(self.factors(attention)):
            rows = factor if rows is None else rows @ factor
        assert rows is not None  # a pass records at least one block (core.attention)
        return rows

    def layer_map(self, data: LayerData) -> torch.Tensor:
        if data.attention is None:
            raise CamvizError(
                f"{self.name} needs the attention recorded in camviz's own pass; explain with "
                "it directly (camviz.explain), not through another method"
            )
        attention = data.attention.up_to(data.layer)
        if self.attention == "gradients" and attention.gradients is None:
            raise CamvizError(f"{self.name} found no gradients of the attention in the pass")
        return self.on_grid(data, self.relevance(attention))

    def on_grid(self, data: LayerData, relevance: torch.Tensor) -> torch.Tensor:
        """The class token's row of ``relevance`` (or its rows' mean) at the patch tokens,
        ``(N, *grid)``."""
        layout = data.layout
        patches = 0 if layout is None else math.prod(layout.grid)
        tokens = relevance.shape[-1]
        if layout is None or layout.kind != "tokens" or layout.prefix + patches > tokens:
            raise CamvizError(
                f"{self.name} needs layer= a transformer block whose output holds the tokens its "
                f"attention reads; layer {data.layer!r} does not"
            )
        # timm's cls_token is None without a class token: the leading tokens are registers.
        has_class_token = layout.prefix > 0 and getattr(data.model, "cls_token", True) is not None
        rows = relevance[:, 0] if has_class_token else relevance.mean(dim=1)
        return rows[:, layout.prefix : layout.prefix + patches].unflatten(1, layout.grid)


def weighted_attention(attention: AttentionMaps) -> list[torch.Tensor]:
    """``mean_h (dA * A)^+`` of each block, ``(N, T, T)``: the attention weighted by its
    gradient, positive part, averaged over the heads."""
    assert attention.gradients is not None  # checked by AttentionMethod.layer_map
    return [
        (gradient * probabilities).clamp_min(0).mean(dim=1)
        for probabilities, gradient in zip(
            attention.probabilities, attention.gradients, strict=True
        )
    ]


def discarded(matrices: torch.Tensor, ratio: float) -> torch.Tensor:
    """``(N, T, T)`` matrices with the lowest ``floor(ratio * T * T)`` entries of each set
    to zero."""
    flat = matrices.flatten(1)
    count = int(ratio * flat.shape[1])
    if not count:
        return matrices
    lowest = flat.topk(count, dim=1, largest=False).indices
    return flat.scatter(1, lowest, 0.0).view_as(matrices)


def with_residual(matrices: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``norm(0.5 I + 0.5 A_l)`` of each ``(N, T, T)`` matrix, rows renormalised to sum to
    one (Abnar & Zuidema's residual): the factors of a rollout."""
    eye = torch.eye(matrices[0].shape[-1], device=matrices[0].device)
    mixed = [0.5 * eye + 0.5 * matrix for matrix in matrices]
    return [matrix / matrix.sum(dim=-1, keepdim=True) for matrix in mixed]


def check_discard_ratio(name: str, ratio: float) -> float:
    """``ratio`` if it is a number in ``[0, 1)``."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise CamvizError(f"{name} needs 0 <= discard_ratio < 1, got {ratio!r}")
    return float(ratio)
