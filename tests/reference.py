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
