"""Gradient rollout: attention rollout of the attention weighted by its gradient."""

from __future__ import annotations

import torch

from camviz.cams.attentionmethod import (
    AttentionMethod,
    check_discard_ratio,
    discarded,
    weighted_attention,
    with_residual,
)
from camviz.cams.registry import register
from camviz.core.attention import AttentionMaps


@register
class GradientRollout(AttentionMethod):
    """Gradient rollout: the rollout of the gradient-weighted attention, class-specific.

    Papers: Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020 (the
    rollout), with the gradient weighting of Chefer, Gur & Wolf, "Transformer
    Interpretability Beyond Attention Visualization", CVPR 2021.

    For blocks ``l = 1 .. L`` with attention ``A_l`` ``(heads, T, T)`` and the gradient
    ``dA_l = dy / dA_l`` of the explained score::

        Ā_l = mean_h (dA_l * A_l)^+
        Ā_l = Ā_l with its lowest floor(r T^2) entries set to 0    (r: discard_ratio)
        Â_l = (0.5 I + 0.5 Ā_l), each row divided by its sum
        R   = Â_L ... Â_2 Â_1

    The map is the class token's row of ``R`` at the patch tokens. One forward pass and
    one backward pass per rank.

    Args:
        discard_ratio: The share of the lowest weighted attentions dropped, ``[0, 1)``.
    """

    name = "gradient_rollout"
    paper = (
        "Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020, weighted by "
        "gradients as in Chefer et al., CVPR 2021"
    )
    needs = "vision transformers: each block's attention and its gradient"
    attention = "gradients"

    def __init__(self, discard_ratio: float = 0.0) -> None:
        self.discard_ratio = check_discard_ratio(self.name, discard_ratio)

    def factors(self, attention: AttentionMaps) -> list[torch.Tensor]:
        weighted = weighted_attention(attention)
        return with_residual([discarded(matrix, self.discard_ratio) for matrix in weighted])
