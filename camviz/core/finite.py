"""Where NaN and Inf first appear in a forward pass.

A NaN or Inf in a model's activations or scores turns every map into zeros (min-max
normalisation of NaN gives nothing), which looks like "no evidence". The engine therefore
checks what it recorded and, when something is not finite, names the first layer whose
output holds NaN or Inf with :func:`first_nonfinite_layer`, one extra forward pass.
:func:`camviz.find_first_nonfinite` (in :mod:`camviz.debug.layerstats`) gives the full
diagnosis, with statistics of that layer's input and parameters.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from camviz.core.hooks import tensors_in
from camviz.core.modelstate import HookSet, no_grad


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN and no Inf (integer tensors always do)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    return bool(torch.isfinite(tensor).all())


def first_nonfinite_layer(model: nn.Module, inputs: torch.Tensor) -> str | None:
    """The first layer, in the order layers finish, whose output holds a NaN or an Inf.

    Containers finish after their children, so the layer named is the innermost one where
    the values went bad. One forward pass under ``torch.no_grad()``, in the model's current
    train/eval mode; ``None`` when every output is finite.
    """
    flags: list[tuple[str, torch.Tensor]] = []

    def record(name: str, module: nn.Module, args: Any, output: Any) -> None:
        bad = [
            ~torch.isfinite(tensor).all()
            for tensor in tensors_in(output)
            if tensor.is_floating_point() or tensor.is_complex()
        ]
        if bad:
            flags.append((name, torch.stack([flag.to(bad[0].device) for flag in bad]).any()))

    with HookSet() as hooks, no_grad():
        for name, module in model.named_modules():
            if name:
                hooks.add(module.register_forward_hook(partial(record, name)))
        model(inputs)
    if not flags:
        return None
    device = flags[0][1].device
    # One transfer for all layers, not one device sync per layer.
    found = torch.stack([flag.to(device) for _, flag in flags]).nonzero()
    return flags[int(found[0])][0] if len(found) else None
