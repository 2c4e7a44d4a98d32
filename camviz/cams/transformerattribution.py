"""Chefer, Gur & Wolf's generic attention-model explainability (the self-attention rule)."""

from __future__ import annotations

import torch

from camviz.cams.attentionmethod import AttentionMethod, weighted_attention
from camviz.cams.registry import register
from camviz.core.attention import AttentionMaps


@register
class TransformerAttribution(AttentionMethod):
    """Transformer attribution: relevance propagated through the gradient-weighted attention.

    Paper: Chefer, Gur & Wolf, "Generic Attention-model Explainability for Interpreting
    Bi-Modal and Encoder-Decoder Transformers", ICCV 2021.

    For blocks ``l = 1 .. L`` with attention ``A_l`` ``(heads, T, T)`` and the gradient
    ``dA_l = dy / dA_l`` of the explained score, from ``R = I`` (no residual added, no
    renormalisation)::

        Ā_l = mean_h (dA_l * A_l)^+
        R   = R + Ā_l R                          (l = 1 .. L in turn)

    The map is the class token's row of ``R`` at the patch tokens. For a CLIP-like dual
    encoder explained through its image features (a ``TextPrompt`` or ``Similarity``
    target, a callable on ``get_image_features``) the paper's bi-modal rules reduce to this
    self-attention rule on the image encoder's blocks: the towers share no attention. One
    forward pass and one backward pass per rank.
    """

    name = "transformer_attribution"
    paper = (
        "Chefer, Gur & Wolf, Generic Attention-model Explainability for Interpreting "
        "Bi-Modal and Encoder-Decoder Transformers, ICCV 2021"
    )
    needs = "vision transformers: each block's attention and its gradient"
    attention = "gradients"

    def factors(self, attention: AttentionMaps) -> list[torch.Tensor]:
        weighted = weighted_attention(attention)
        eye = torch.eye(weighted[0].shape[-1], device=weighted[0].device)
        return [eye + matrix for matrix in weighted]  # R + A R = (I + A) R
