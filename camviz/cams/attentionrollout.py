"""Attention rollout: the attention of every block multiplied through, the residual added."""

from __future__ import annotations

from typing import Literal

import torch

from camviz.cams.attentionmethod import (
    AttentionMethod,
    check_discard_ratio,
    discarded,
    with_residual,
)
from camviz.cams.registry import register
from camviz.core.attention import AttentionMaps
from camviz.core.errors import CamvizError

_FUSIONS = ("mean", "max", "min")


@register
class AttentionRollout(AttentionMethod):
    """Attention rollout.

    Paper: Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020.

    For blocks ``l = 1 .. L`` (``L``: the block ``layer=`` names) with attention
    probabilities ``A_l`` of shape ``(heads, T, T)``::

        Ā_l = fuse_h A_l                         (mean, max or min over the heads)
        Ā_l = Ā_l with its lowest floor(r T^2) entries set to 0    (r: discard_ratio)
        Â_l = (0.5 I + 0.5 Ā_l), each row divided by its sum
        R   = Â_L ... Â_2 Â_1

    The map is the class token's row of ``R`` at the patch tokens (without a class token,
    the mean of its rows; see :mod:`camviz.cams.attentionmethod`). One forward pass, no
    gradient: the map does not depend on the target.

    Args:
        head_fusion: ``"mean"``, ``"max"`` or ``"min"`` over the heads.
        discard_ratio: The share of the lowest attentions dropped in each block, ``[0, 1)``.
    """

    name = "attention_rollout"
    paper = "Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020"

    def __init__(
        self, head_fusion: Literal["mean", "max", "min"] = "mean", discard_ratio: float = 0.0
    ) -> None:
        if head_fusion not in _FUSIONS:
            raise CamvizError(
                f"attention_rollout needs head_fusion one of {', '.join(_FUSIONS)}, "
                f"got {head_fusion!r}"
            )
        self.head_fusion = head_fusion
        self.discard_ratio = check_discard_ratio(self.name, discard_ratio)

    def factors(self, attention: AttentionMaps) -> list[torch.Tensor]:
        fused = [
            _fused(probabilities, self.head_fusion) for probabilities in attention.probabilities
        ]
        return with_residual([discarded(matrix, self.discard_ratio) for matrix in fused])


def _fused(probabilities: torch.Tensor, fusion: str) -> torch.Tensor:
    """``(N, T, T)``: the ``(N, H, T, T)`` attention's mean, maximum or minimum over the heads."""
    if fusion == "max":
        return probabilities.amax(dim=1)
    if fusion == "min":
        return probabilities.amin(dim=1)
    return probabilities.mean(dim=1)
