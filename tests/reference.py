"""Independent reference computations that several test modules compare camviz against."""

from __future__ import annotations

import torch
from torch import nn


def leaf_activations_and_gradients(
    model: nn.Module, inputs: torch.Tensor, layer: str, classes: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` and ``dy/dA`` at ``layer``, with the layer's output replaced by a leaf copy.

    Written without camviz: the rest of the network sees a clone of the leaf, so in-place
    operations after the layer cannot touch ``A``, and the gradient is exact.
    """
    saved = {}

    def to_leaf(module, args, output):
        saved["A"] = output.detach().clone().requires_grad_()
        return saved["A"].clone()

    handle = dict(model.named_modules())[layer].register_forward_hook(to_leaf)
    try:
        logits = model(inputs)
        score = logits[torch.arange(len(classes)), torch.as_tensor(classes)].sum()
        (gradients,) = torch.autograd.grad(score, saved["A"])
    finally:
        handle.remove()
    return saved["A"].detach(), gradients


def principal_projection(features: torch.Tensor) -> torch.Tensor:
    """Each ``(C, h, w)`` map's locations projected on the top eigenvector of the channels'
    covariance (eigh, not SVD), signed to correlate with the channel sum; ``(N, h, w)``."""
    observations = features.double().flatten(2).transpose(1, 2)
    centred = observations - observations.mean(1, keepdim=True)
    _, vectors = torch.linalg.eigh(centred.transpose(1, 2) @ centred)
    projection = (centred @ vectors[..., -1:]).squeeze(-1)
    sign = torch.sign((projection * observations.sum(-1)).sum(-1, keepdim=True))
    return (projection * sign).view(features.shape[0], *features.shape[2:]).float()


def min_max(maps: torch.Tensor) -> torch.Tensor:
    """Each ``(h, w)`` map of ``(M, h, w)`` scaled to ``[0, 1]``; a constant map becomes zeros
    (camviz's convention for a map with no evidence)."""
    low = maps.flatten(1).amin(1).view(-1, 1, 1)
    span = maps.flatten(1).amax(1).view(-1, 1, 1) - low
    return torch.where(span > 0, (maps - low) / span, 0)
