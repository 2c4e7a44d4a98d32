"""Maps from gradients with respect to the input: vanilla gradients, Guided Backprop, Guided
Grad-CAM.

These methods need ``dy/dx``, so each runs its own forward and backward pass from a copy of
the input that requires grad. Only that copy receives a gradient (:func:`torch.autograd.grad`
with explicit inputs): no parameter's ``.grad`` is written, and the model is not changed.

Guided Backprop changes the backward pass of every rectifier. Rather than swapping modules
in the model, a :class:`~torch.overrides.TorchFunctionMode` intercepts the calls themselves
for the duration of one forward pass, which covers ``nn.ReLU`` (in place or not),
``F.relu``, ``torch.relu``, ``Tensor.relu`` and their in-place forms, and ReLU6
(``nn.ReLU6``, ``F.relu6``, ``F.hardtanh`` with ``min_val=0``). The mode is a context
manager, so it is gone when the pass ends, also on errors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn
from torch.overrides import TorchFunctionMode

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.gradcam import GradCAM
from camviz.cams.registry import register
from camviz.core.errors import CamvizError
from camviz.core.maps import upsample
from camviz.core.targets import ScoreFn


def forward_from_inputs(
    model: nn.Module,
    inputs: torch.Tensor,
    score: ScoreFn,
    during_forward: AbstractContextManager[Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model on a copy of ``inputs`` that requires grad, with grad enabled.

    Args:
        model: The network, in the mode wanted (eval for explanations).
        inputs: ``(N, C, H, W)`` batch.
        score: Maps the model's output to the ``(N,)`` explained scores.
        during_forward: A context entered for the model's forward pass only, not for the
            score (the guided ReLUs, FullGrad's bias taps).

    Returns:
        ``(leaf, total)``: the copy, to differentiate with respect to, and the sum of the
        ``(N,)`` explained scores with its graph. Samples do not interact in eval mode, so
        the gradient of the sum holds each sample's own gradient.

    Raises:
        CamvizError: The score does not depend on the input.
    """
    leaf = inputs.detach().requires_grad_()
    with torch.enable_grad():
        with during_forward or nullcontext():
            output = model(leaf)
        total = score(output).sum()
    if not total.requires_grad:
        raise CamvizError(
            "the explained score does not depend on the input; pick a target computed from "
            "the model's output"
        )
    return leaf, total


def input_gradients(
    model: nn.Module, inputs: torch.Tensor, score: ScoreFn, *, guided: bool = False
) -> torch.Tensor:
    """``dy/dx`` for each sample, ``(N, C, H, W)``, in one batched backward pass.

    Args:
        model: The network, in the mode wanted (eval for explanations).
        inputs: ``(N, C, H, W)`` batch.
        score: Maps the model's output to the ``(N,)`` explained scores.
        guided: Back-propagate through the model's rectifiers as Guided Backprop does.
    """
    leaf, total = forward_from_inputs(model, inputs, score, guided_relus() if guided else None)
    (gradients,) = torch.autograd.grad(total, leaf)
    return gradients


def saliency(gradients: torch.Tensor) -> torch.Tensor:
    """The ``(N, H, W)`` map ``max_c |g_c|`` of ``(N, C, H, W)`` input gradients."""
    return gradients.abs().amax(dim=1)


class _GuidedRectifier(torch.autograd.Function):
    """``clamp(x, low, high)`` whose backward passes only positive gradients."""

    @staticmethod
    def forward(
        ctx: Any, inputs: torch.Tensor, low: float, high: float | None, inplace: bool
    ) -> torch.Tensor:
        if inplace:
            ctx.mark_dirty(inputs)
            outputs = inputs.clamp_(low, high)
        else:
            outputs = inputs.clamp(low, high)
        ctx.save_for_backward(outputs)
        ctx.low, ctx.high = low, high
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (outputs,) = ctx.saved_tensors
        # Where the unit is flat (clamped), its own derivative is zero, as in plain backprop.
        passes = outputs > ctx.low
        if ctx.high is not None:
            passes &= outputs < ctx.high
        return grad_output.clamp_min(0) * passes, None, None, None


# ReLUs called as C functions or tensor methods, and whether each works in place.
_RELU_CALLS = {
    torch.relu: False,
    torch.relu_: True,
    torch.Tensor.relu: False,
    torch.Tensor.relu_: True,
}
# Rectifiers written as Python functions with keyword arguments.
_FUNCTIONAL = {function: inspect.signature(function) for function in (F.relu, F.relu6, F.hardtanh)}


def _as_rectifier(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, float, float | None, bool] | None:
    """``(input, low, high, inplace)`` if ``func(*args, **kwargs)`` is a rectifier call."""
    if func in _RELU_CALLS:
        return args[0], 0.0, None, _RELU_CALLS[func]
    if func not in _FUNCTIONAL:
        return None
    bound = _FUNCTIONAL[func].bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    if func is F.relu:
        return call["input"], 0.0, None, call["inplace"]
    if func is F.relu6:
        return call["input"], 0.0, 6.0, call["inplace"]
    if call["min_val"] == 0:
        return call["input"], 0.0, call["max_val"], call["inplace"]
    return None


class _GuidedReLUs(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        rectifier = _as_rectifier(func, args, kwargs)
        if rectifier is None:
            return func(*args, **kwargs)
        return _GuidedRectifier.apply(*rectifier)


def guided_relus() -> TorchFunctionMode:
    """A context manager inside which every ReLU and ReLU6 back-propagates as in Guided
    Backprop: ``dx = ReLU(dy) * 1[the unit is not clamped]``. Forward values are unchanged.

    Example:
        >>> with guided_relus():
        ...     score = model(x.requires_grad_())[:, 3].sum()
        >>> (guided,) = torch.autograd.grad(score, x)
    """
    return _GuidedReLUs()


@register
class VanillaGradients(CamMethod):
    """Vanilla gradients (image-specific class saliency).

    Paper: Simonyan, Vedaldi and Zisserman, "Deep Inside Convolutional Networks: Visualising
    Image Classification Models and Saliency Maps", ICLR workshop 2014.

    ``M_ij = max_c | dy^c / dx_cij |``, at the input's resolution. The target layer plays no
    part.
    """

    name = "vanilla_gradients"
    paper = (
        "Simonyan et al., Deep Inside Convolutional Networks: Visualising Image "
        "Classification Models and Saliency Maps, ICLR workshop 2014"
    )
    needs = "input gradients"
    pixel_level = True
    # Raw input gradients in bf16: correlation with the fp32 map 0.81 on EfficientNet-Lite0
    # (benchmarks/bench_precision.py), so it stays fp32.
    reduced_precision = False
    uses_gradients = False

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return saliency(input_gradients(data.model, data.inputs, data.score))


@register
class GuidedBackprop(CamMethod):
    """Guided Backprop.

    Paper: Springenberg, Dosovitskiy, Brox and Riedmiller, "Striving for Simplicity: The All
    Convolutional Net", ICLR workshop 2015.

    The input gradient with every rectifier's backward replaced by::

        dL/dx = ReLU(dL/dy) * 1[x > 0]          (y = ReLU(x); for ReLU6 also 1[x < 6])

    shown as ``max_c |g_c|`` at the input's resolution. The target layer plays no part.
    Rectifiers written otherwise (``clamp``, ``torch.where``) are back-propagated as usual.

    Compared with pytorch-grad-cam's ``GuidedBackpropReLUModel``: the same gradients on
    models built from ``nn.ReLU`` modules; pytorch-grad-cam replaces those modules (and
    puts back ``nn.ReLU()`` without ``inplace``), misses functional ReLUs and ReLU6, and takes
    one image at a time.
    """

    name = "guided_backprop"
    paper = (
        "Springenberg et al., Striving for Simplicity: The All Convolutional Net, "
        "ICLR workshop 2015"
    )
    needs = "input gradients through guided ReLUs"
    pixel_level = True
    uses_gradients = False

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return saliency(input_gradients(data.model, data.inputs, data.score, guided=True))


@register
class GuidedGradCAM(CamMethod):
    """Guided Grad-CAM: Guided Backprop masked by the upsampled Grad-CAM map.

    Paper: Selvaraju et al., "Grad-CAM: Visual Explanations from Deep Networks via
    Gradient-based Localization", ICCV 2017.

    With ``G`` the guided input gradient and ``L^c`` the Grad-CAM map bilinearly upsampled to
    the input::

        M_ij = max_c | G_cij * L^c_ij | = L^c_ij * max_c |G_cij|

    at the input's resolution.
    """

    name = "guided_gradcam"
    paper = GradCAM.paper
    needs = "gradients, and input gradients through guided ReLUs"
    pixel_level = True

    def layer_map(self, data: LayerData) -> torch.Tensor:
        cam = upsample(torch.relu(GradCAM().layer_map(data)), data.inputs.shape[-2:])
        guided = input_gradients(data.model, data.inputs, data.score, guided=True)
        return saliency(guided) * cam
