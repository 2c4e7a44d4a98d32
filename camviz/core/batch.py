"""What camviz takes as a batch of inputs, where it puts it, and how it calls the model.

Every entry point that runs a model on the caller's tensor (explain, the metrics, the sanity
checks, the comparison report) checks it and moves it here, so that they accept and refuse the
same things with the same words.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from camviz.core.errors import CamvizError


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter or buffer; ``None`` if it has neither."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return None if tensor is None else tensor.device


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)``, ``model(*inputs)`` or ``model(**inputs)``, on the model's device.

    Args:
        model: The network to run.
        inputs: A tensor, a tuple or list of positional arguments, or a dict of keyword
            arguments. Tensors among them are moved to the device of the model's first
            parameter (or buffer); a model with neither takes them as they are.
    """
    device = model_device(model)

    def move(value: Any) -> Any:
        return value.to(device) if isinstance(value, torch.Tensor) and device else value

    if isinstance(inputs, Mapping):
        return model(**{key: move(value) for key, value in inputs.items()})
    if isinstance(inputs, Sequence) and not isinstance(inputs, str):
        return model(*(move(value) for value in inputs))
    return model(move(inputs))


def as_batch(inputs: object, model: nn.Module, *, single: bool = True) -> torch.Tensor:
    """A float ``(N, C, H, W)`` batch on the model's device.

    Args:
        inputs: ``(N, C, H, W)``, or one ``(C, H, W)`` image when ``single`` is true.
        model: The model the batch is for.
        single: Accept one image and make it a batch of one.

    Raises:
        CamvizError: ``inputs`` is not a float tensor of an accepted shape.
    """
    if not isinstance(inputs, torch.Tensor):
        raise CamvizError(
            f"inputs must be a tensor, not {type(inputs).__name__}; preprocess images first "
            "(camviz.load_image, then the model's preprocessing)"
        )
    if single and inputs.dim() == 3:
        inputs = inputs.unsqueeze(0)
    if inputs.dim() != 4 or not inputs.is_floating_point():
        accepted = "batch or one (C, H, W) image" if single else "batch"
        raise CamvizError(
            f"inputs must be a float (N, C, H, W) {accepted}, got {inputs.dtype} of shape "
            f"{tuple(inputs.shape)}"
        )
    device = model_device(model)
    return inputs.detach() if device is None else inputs.detach().to(device)
