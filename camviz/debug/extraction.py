"""Intermediate feature maps by layer name, from any model that runs.

``camviz.features(model, x, ["layer1", "layer4"])`` returns what those layers emitted in one
forward pass. Unlike torchvision's ``create_feature_extractor``, which traces the model with
``torch.fx`` and fails on data-dependent control flow (``if x.sum() > 0:``), this only attaches
forward hooks (:func:`camviz.core.hooks.capture`) and runs the model as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.hooks import capture
from camviz.core.inputs import call_model
from camviz.core.layers import Layer
from camviz.core.modelstate import eval_mode, no_grad
from camviz.core.precision import Precision, at_least_fp32, model_precision


class Features(dict):
    """``{layer name: output}`` in the order the layers were named.

    Attributes:
        inputs: ``{layer name: input}`` (the first positional input, or the tuple of them
            when a layer takes several); filled only with ``inputs_too=True``.
    """

    def __init__(self, outputs: Mapping[str, Any], inputs: Mapping[str, Any]) -> None:
        super().__init__(outputs)
        self.inputs = dict(inputs)


def features(
    model: nn.Module,
    inputs: Any,
    layers: Layer | Iterable[Layer],
    *,
    device: torch.device | str | None = None,
    inputs_too: bool = False,
    precision: Precision = "fp32",
    channels_last: bool = False,
) -> Features:
    """Run the model once and return the outputs of named layers.

    The pass runs under ``torch.no_grad()``, so no autograd graph is kept, and with every
    module in eval mode (a BatchNorm in train mode would otherwise update its running
    statistics); the model comes back with its own flags and no hooks. The outputs are
    ordinary tensors, never inference tensors (also when called inside
    ``torch.inference_mode()``), so they can feed a probe that is trained with autograd.

    Args:
        model: Any ``nn.Module``; it need not be traceable by ``torch.fx``.
        inputs: What the model is called with: a tensor, a tuple of positional tensors or a
            dict of keyword tensors. Tensors are moved to the model's device.
        layers: Names as in ``model.named_modules()``; patterns like ``"layer*.0.conv1"``.
        device: Where the returned tensors live: ``None`` keeps them where they were
            computed (the model's device), ``"cpu"`` moves them off the accelerator.
        inputs_too: Also return what went into each layer, in ``result.inputs``.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the pass runs under
            ``torch.autocast`` to that dtype and the outputs come back as float32; refused
            on hardware that only emulates it (see :mod:`camviz.core.precision`).
        channels_last: Hand the model a channels-last copy of its input; outputs keep the
            memory format the layers computed them in. The model and ``inputs`` are not
            modified.

    Returns:
        A :class:`Features` dict ``{layer name: output}``. A layer that runs several times
        in one pass (a shared module) gives the output of its last call.

    Raises:
        CamvizError: A name matches no layer, or a named layer did not run.

    Example:
        >>> maps = camviz.features(model, x, ["layer*.0.conv1"], device="cpu")
        >>> {name: tuple(value.shape) for name, value in maps.items()}
    """
    with (
        model_precision(model, precision, channels_last),
        capture(model, layers, inputs=inputs_too, device=device) as record,
        eval_mode(model),
        no_grad(),
    ):
        call_model(model, inputs)
    missing = [name for name in record.layers if name not in record.activations]
    if missing:
        raise CamvizError(
            f"layer(s) {', '.join(map(repr, missing))} did not run in the forward pass; "
            "name layers that the model uses (`camviz inspect --model NAME` lists them)"
        )
    outputs = {name: record.activations[name] for name in record.layers}
    inputs_of = {name: record.inputs[name] for name in record.layers} if inputs_too else {}
    if precision != "fp32":  # autocast layers emit bf16 / fp16; callers get float32
        outputs, inputs_of = at_least_fp32(outputs), at_least_fp32(inputs_of)
    return Features(outputs, inputs_of)
