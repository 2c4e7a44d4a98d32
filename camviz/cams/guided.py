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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn
from torch.overrides import TorchFunctionMode

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.gradcam import GradCAM
from camviz.cams.registry import register
from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs, Key
from camviz.core.maps import upsample
from camviz.core.targets import ScoreFn


def forward_from_inputs(
    model: nn.Module,
    inputs: torch.Tensor | Inputs,
    score: ScoreFn,
    during_forward: AbstractContextManager[Any] | None = None,
    keys: Sequence[Key] | None = None,
) -> tuple[dict[Key, torch.Tensor], torch.Tensor]:
    """Run the model on copies of its inputs that require grad, with grad enabled.

    Args:
        model: The network, in the mode wanted (eval for explanations).
        inputs: An ``(N, C, *spatial)`` batch, or several inputs (:mod:`camviz.core.inputs`).
        score: Maps the model's output to the ``(N,)`` explained scores.
        during_forward: A context entered for the model's forward pass only, not for the
            score (the guided ReLUs, FullGrad's bias taps).
        keys: The inputs to copy (by position or name); by default the map input.

    Returns:
        ``(leaves, total)``: the copies by key, to differentiate with respect to, and the
        sum of the ``(N,)`` explained scores with its graph. Samples do not interact in eval
        mode, so the gradient of the sum holds each sample's own gradient.

    Raises:
        CamvizError: The score does not depend on the inputs.
    """
    batch = inputs if isinstance(inputs, Inputs) else Inputs((inputs,), {}, 0, len(inputs))
    leaves = {key: batch[key].detach().requires_grad_() for key in keys or [batch.key]}
    with torch.enable_grad():
        with during_forward or nullcontext():
            output = batch.replaced(leaves)(model)
        total = score(output).sum()
    if not total.requires_grad:
        raise CamvizError(
            "the explained score does not depend on the input; pick a target computed from "
            "the model's output"
        )
    return leaves, total


def input_gradients(
    model: nn.Module, inputs: torch.Tensor | Inputs, score: ScoreFn, *, guided: bool = False
) -> torch.Tensor:
    """``dy/dx`` of the map input for each sample, ``(N, C, *spatial)``, in one batched
    backward pass (:func:`all_input_gradients` for every input).

    Args:
        model: The network, in the mode wanted (eval for explanations).
        inputs: An ``(N, C, *spatial)`` batch, or several inputs.
        score: Maps the model's output to the ``(N,)`` explained scores.
        guided: Back-propagate through the model's rectifiers as Guided Backprop does.
    """
    leaves, total = forward_from_inputs(model, inputs, score, guided_relus() if guided else None)
    (gradients,) = torch.autograd.grad(total, list(leaves.values()))
    return gradients


def all_input_gradients(
    model: nn.Module, inputs: Inputs, score: ScoreFn, *, guided: bool = False
) -> dict[Key, torch.Tensor]:
    """``dy/dx`` of every input with spatial axes, by key, from one backward pass."""
    keys = inputs.spatial_keys()
    leaves, total = forward_from_inputs(
        model, inputs, score, guided_relus() if guided else None, keys
    )
    gradients = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    return {
        key: torch.zeros_like(leaves[key]) if gradient is None else gradient
        for key, gradient in zip(keys, gradients, strict=True)
    }


def saliency(gradients: torch.Tensor) -> torch.Tensor:
    """The ``(N, *spatial)`` map ``max_c |g_c|`` of ``(N, C, *spatial)`` input gradients."""
    return gradients.abs().amax(dim=1)


class InputGradientMethod(CamMethod):
    """A method whose map is ``max_c |g_c|`` of an input gradient: it gives a map for every
    input with spatial axes (:meth:`input_maps`); the map input's is its layer map."""

    guided: ClassVar[bool] = False
    needs = "input gradients"
    uses_gradients = False

    def input_maps(self, data: LayerData) -> dict[Key, torch.Tensor]:
        """``{input position or name: (N, *spatial) map}`` for every spatial input."""
        batch = data.batch or Inputs((data.inputs,), {}, 0, len(data.inputs))
        gradients = all_input_gradients(data.model, batch, data.score, guided=self.guided)
        return {key: saliency(gradient) for key, gradient in gradients.items()}

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return saliency(
            input_gradients(data.model, data.batch or data.inputs, data.score, guided=self.guided)
        )


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
class VanillaGradients(InputGradientMethod):
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


@register
class GuidedBackprop(InputGradientMethod):
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
    guided = True


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

    def layer_map(self, data: LayerData) -> torch.Tensor:
        cam = upsample(torch.relu(GradCAM().layer_map(data)), data.inputs.shape[2:])
        guided = input_gradients(data.model, data.batch or data.inputs, data.score, guided=True)
        return saliency(guided) * cam
