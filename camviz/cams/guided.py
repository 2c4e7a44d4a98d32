"""Maps from gradients with respect to the input: vanilla gradients, Guided Backprop, Guided
Grad-CAM.

These methods need ``dy/dx``, so each runs its own forward and backward pass from a copy of
the input that requires grad. Only that copy receives a gradient (:func:`torch.autograd.grad`
with explicit inputs): no parameter's ``.grad`` is written, and the model is not changed.

Guided Backprop changes the backward pass of every activation. Rather than swapping modules
in the model, a :class:`~torch.overrides.TorchFunctionMode` intercepts the calls themselves
for the duration of one forward pass, which covers ``nn.ReLU`` (in place or not),
``F.relu``, ``torch.relu``, ``Tensor.relu`` and their in-place forms, ReLU6 (``nn.ReLU6``,
``F.relu6``, ``F.hardtanh`` with ``min_val=0``), and the smooth activations of today's
vision models: GELU (ViT, ConvNeXt, Swin), SiLU (EfficientNet), Hardswish (MobileNetV3),
Mish, ELU and LeakyReLU, as modules or ``F.`` functions. The mode is a context manager, so
it is gone when the pass ends, also on errors.

The guided rule for an activation ``y = f(x)`` is ``dL/dx = ReLU(dL/dy) * f'(x) * 1[x > 0]``:
only positive gradients pass, and only where the unit's input is positive. For ReLU
(``f'(x) = 1[x > 0]``) that is exactly Springenberg et al.'s rule; for the smooth
activations it is its natural extension (camviz's, not the paper's), and without it Guided
Backprop on a model without ReLUs would silently equal vanilla gradients.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, ClassVar

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.cams.base import CamMethod, InputMapMethod, LayerData, with_spots
from camviz.cams.gradcam import GradCAM
from camviz.cams.registry import register
from camviz.core.calls import CallMode
from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs, Key
from camviz.core.targets import ScoreFn


def forward_from_inputs(
    model: nn.Module,
    inputs: torch.Tensor | Inputs,
    score: ScoreFn,
    during_forward: AbstractContextManager[Any] | None = None,
    keys: Sequence[Key] | None = None,
    spots: Sequence[str] = (),
) -> tuple[dict[Key, torch.Tensor], torch.Tensor]:
    """Run the model on copies of its inputs that require grad, with grad enabled.

    Args:
        model: The network, in the mode wanted (eval for explanations).
        inputs: An ``(N, C, *spatial)`` batch, or several inputs (:mod:`camviz.core.inputs`).
        score: Maps the model's output to the ``(N,)`` explained scores.
        during_forward: A context entered for the model's forward pass only, not for the
            score (the guided ReLUs, FullGrad's bias taps).
        keys: The inputs to copy (by position or name); by default the map input.
        spots: The spots the target reads (a ``Unit``'s layer): ``score`` gets the output
            with what this pass handed on there (:func:`~camviz.cams.base.with_spots`).

    Returns:
        ``(leaves, total)``: the copies by key, to differentiate with respect to, and the
        sum of the ``(N,)`` explained scores with its graph. Samples do not interact in eval
        mode, so the gradient of the sum holds each sample's own gradient.

    Raises:
        CamvizError: The score does not depend on the inputs.
    """
    batch = inputs if isinstance(inputs, Inputs) else Inputs((inputs,), {}, 0, len(inputs))
    # A caller's inference mode would stop the graph as no_grad does not (as in layer_pass);
    # an input made under it is an inference tensor, which can only lead a graph as a copy.
    with torch.inference_mode(False), torch.enable_grad():
        leaves = {
            key: (batch[key].clone() if batch[key].is_inference() else batch[key].detach())
            for key in keys or [batch.key]
        }
        for leaf in leaves.values():
            leaf.requires_grad_()
        with during_forward or nullcontext():
            output = with_spots(model, spots, partial(batch.replaced(leaves), model))
        total = score(output).sum()
    if not total.requires_grad:
        raise CamvizError(
            "the explained score does not depend on the input; pick a target computed from "
            "the model's output"
        )
    return leaves, total


def input_gradients(
    model: nn.Module,
    inputs: torch.Tensor | Inputs,
    score: ScoreFn,
    *,
    guided: bool = False,
    spots: Sequence[str] = (),
) -> torch.Tensor:
    """``dy/dx`` of the map input for each sample, ``(N, C, *spatial)``, in one batched
    backward pass (:func:`all_input_gradients` for every input).

    Args:
        model: The network, in the mode wanted (eval for explanations).
        inputs: An ``(N, C, *spatial)`` batch, or several inputs.
        score: Maps the model's output to the ``(N,)`` explained scores.
        guided: Back-propagate through the model's rectifiers as Guided Backprop does.
        spots: The spots the target reads (see :func:`forward_from_inputs`).
    """
    relus = guided_relus() if guided else None
    leaves, total = forward_from_inputs(model, inputs, score, relus, spots=spots)
    (gradients,) = torch.autograd.grad(total, list(leaves.values()))
    return gradients


def all_input_gradients(
    model: nn.Module,
    inputs: Inputs,
    score: ScoreFn,
    *,
    guided: bool = False,
    spots: Sequence[str] = (),
) -> dict[Key, torch.Tensor]:
    """``dy/dx`` of every input with spatial axes, by key, from one backward pass (``spots``:
    see :func:`forward_from_inputs`)."""
    keys = inputs.spatial_keys()
    leaves, total = forward_from_inputs(
        model, inputs, score, guided_relus() if guided else None, keys, spots
    )
    gradients = torch.autograd.grad(total, list(leaves.values()), allow_unused=True)
    return {
        key: torch.zeros_like(leaves[key]) if gradient is None else gradient
        for key, gradient in zip(keys, gradients, strict=True)
    }


def saliency(gradients: torch.Tensor) -> torch.Tensor:
    """The ``(N, *spatial)`` map ``max_c |g_c|`` of ``(N, C, *spatial)`` input gradients."""
    return gradients.abs().amax(dim=1)


class InputGradientMethod(InputMapMethod):
    """A method whose map is ``max_c |g_c|`` of an input gradient: it gives a map for every
    input with spatial axes (:meth:`input_maps`); the map input's is its layer map."""

    guided: ClassVar[bool] = False
    needs = "input gradients"
    input_resolution = True
    pixel_level = True
    uses_gradients = False

    def input_maps(self, data: LayerData) -> dict[Key, torch.Tensor]:
        """``{input position or name: (N, *spatial) map}`` for every spatial input."""
        batch = data.batch or Inputs((data.inputs,), {}, 0, len(data.inputs))
        gradients = all_input_gradients(
            data.model, batch, data.score_fn, guided=self.guided, spots=data.target_spots
        )
        return {key: saliency(gradient) for key, gradient in gradients.items()}

    def layer_map(self, data: LayerData) -> torch.Tensor:
        inputs = data.batch or data.inputs
        gradients = input_gradients(
            data.model, inputs, data.score_fn, guided=self.guided, spots=data.target_spots
        )
        return saliency(gradients)


class _GuidedActivation(torch.autograd.Function):
    """``f(x)`` whose backward is ``ReLU(dy) * f'(x) * 1[x > 0]`` (Guided Backprop)."""

    @staticmethod
    def forward(
        ctx: Any,
        inputs: torch.Tensor,
        function: Callable[[torch.Tensor], torch.Tensor],
        inplace: bool,
    ) -> torch.Tensor:
        with torch.enable_grad():
            leaf = inputs.detach().requires_grad_()
            outputs = function(leaf)
            # f is element-wise: the vector-Jacobian product with ones is f'(x).
            (slope,) = torch.autograd.grad(outputs, leaf, torch.ones_like(outputs))
        ctx.save_for_backward(slope * (inputs > 0))
        if inplace:
            ctx.mark_dirty(inputs)
            return inputs.copy_(outputs.detach())
        return outputs.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (gate,) = ctx.saved_tensors
        return grad_output.clamp_min(0) * gate, None, None


# ReLUs called as C functions or tensor methods, and whether each works in place.
_RELU_CALLS = {
    torch.relu: False,
    torch.relu_: True,
    torch.Tensor.relu: False,
    torch.Tensor.relu_: True,
}
# Activations written as Python functions with keyword arguments (and ``inplace``).
_FUNCTIONAL = {
    function: inspect.signature(function)
    for function in (F.relu, F.relu6, F.hardtanh, F.silu, F.hardswish, F.mish, F.elu, F.leaky_relu)
}


def _as_activation(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], bool] | None:
    """``(input, f, inplace)`` if ``func(*args, **kwargs)`` is a guided activation's call."""
    if func in _RELU_CALLS:
        return args[0], torch.relu, _RELU_CALLS[func]
    if func is F.gelu:  # a C function without a signature: gelu(input, approximate=...)
        return args[0], partial(F.gelu, *args[1:], **kwargs), False
    if func not in _FUNCTIONAL:
        return None
    bound = _FUNCTIONAL[func].bind(*args, **kwargs)
    bound.apply_defaults()
    call = dict(bound.arguments)
    if func is F.hardtanh and call["min_val"] != 0:
        return None  # a hardtanh that is not a rectifier back-propagates as usual
    inputs, inplace = call.pop("input"), call.pop("inplace")
    return inputs, partial(func, **call), inplace


class _GuidedActivations(CallMode):
    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        activation = _as_activation(func, args, kwargs)
        if activation is None:
            return func(*args, **kwargs)
        return _GuidedActivation.apply(*activation)


def guided_relus() -> CallMode:
    """A context manager inside which every ReLU, ReLU6 and smooth activation (GELU, SiLU,
    Hardswish, Mish, ELU, LeakyReLU) back-propagates as in Guided Backprop:
    ``dx = ReLU(dy) * f'(x) * 1[x > 0]`` (the module docstring says why). Forward values
    are unchanged.

    Example:
        >>> with guided_relus():
        ...     score = model(x.requires_grad_())[:, 3].sum()
        >>> (guided,) = torch.autograd.grad(score, x)
    """
    return _GuidedActivations()


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
    # Raw input gradients in bf16: correlation with the fp32 map 0.81 on EfficientNet-Lite0
    # (benchmarks/bench_precision.py), so it stays fp32.
    reduced_precision = False


@register
class GuidedBackprop(InputGradientMethod):
    """Guided Backprop.

    Paper: Springenberg, Dosovitskiy, Brox and Riedmiller, "Striving for Simplicity: The All
    Convolutional Net", ICLR workshop 2015.

    The input gradient with every rectifier's backward replaced by::

        dL/dx = ReLU(dL/dy) * 1[x > 0]          (y = ReLU(x); for ReLU6 also 1[x < 6])

    shown as ``max_c |g_c|`` at the input's resolution. The target layer plays no part.
    Smooth activations (GELU, SiLU, Hardswish, Mish, ELU, LeakyReLU) follow the same rule,
    ``dL/dx = ReLU(dL/dy) * f'(x) * 1[x > 0]`` (camviz's extension; see the module
    docstring), so ViTs, EfficientNets and ConvNeXts get guided maps, not vanilla gradients.
    Activations written otherwise (``clamp``, ``torch.where``, ``x * sigmoid(x)``) are
    back-propagated as usual.

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
    input_resolution = True
    pixel_level = True

    def layer_map(self, data: LayerData) -> torch.Tensor:
        cam = data.on_input(torch.relu(GradCAM().layer_map(data)))
        guided = input_gradients(
            data.model,
            data.batch or data.inputs,
            data.score_fn,
            guided=True,
            spots=data.target_spots,
        )
        return saliency(guided) * cam
