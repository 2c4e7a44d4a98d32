"""FullGrad: input-gradients and the bias-gradients of every layer, added up as maps."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.guided import forward_from_inputs
from camviz.cams.registry import register
from camviz.core.calls import CallMode
from camviz.core.inputs import Inputs
from camviz.core.maps import normalize
from camviz.core.targets import ScoreFn

_BATCH_NORM = inspect.signature(F.batch_norm)


@dataclass
class FullGradients:
    """The full-gradient decomposition of a batch of scores.

    For a network of linear layers and ReLUs, ``y = sum(x * input_gradients)`` plus the sum
    of every bias-gradient, counting the biases of all layers (completeness);
    ``bias_gradients`` holds those of the spatial ones.

    Attributes:
        input_gradients: ``dy/dx`` of the map input, ``(N, C, *spatial)``.
        bias_gradients: ``b (*) dy/dz`` for every biased convolution and batch norm call
            (1-D, 2-D or 3-D, of the input's rank), in call order, where ``z`` is its output
            and ``b`` its per-channel bias broadcast over locations: ``(N, C_l, *grid_l)``.
    """

    input_gradients: torch.Tensor
    bias_gradients: list[torch.Tensor]


def _call_bias(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor | None:
    """The per-channel bias that the call ``func(*args, **kwargs)`` adds, if any.

    A batch norm with running statistics is the affine map ``x * s + (beta - mu * s)`` with
    ``s = gamma / sqrt(var + eps)``; its bias is ``beta - mu * s``. With batch statistics it
    is not affine, and has none.
    """
    if func in (F.conv1d, F.conv2d, F.conv3d):
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return None if bias is None else bias.detach()
    if func is not F.batch_norm:
        return None
    call = _BATCH_NORM.bind(*args, **kwargs)
    call.apply_defaults()
    norm = call.arguments
    if norm["training"] or norm["running_mean"] is None:
        return None
    scale = (norm["running_var"] + norm["eps"]).rsqrt()
    if norm["weight"] is not None:
        scale = scale * norm["weight"].detach()
    shift = norm["bias"].detach() if norm["bias"] is not None else 0
    return shift - norm["running_mean"] * scale


class _BiasTaps(CallMode):
    """Replaces the output ``z`` of each biased call by ``z + delta``, with a zero ``delta``
    that requires grad, so that ``dy/d(delta) = dy/dz`` (the engine's trick, see
    :mod:`camviz.cams.recording`; in-place operations after the call do not disturb it).

    Intercepting the functional calls rather than modules covers ``nn.Conv2d``,
    ``nn.BatchNorm2d`` and every module built on them, such as timm's ``BatchNormAct2d``, whose
    output is already past its activation. Only outputs of the input's rank are tapped.
    """

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.taps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        output = func(*args, **kwargs)
        bias = _call_bias(func, args, kwargs)
        if bias is None or output.dim() != self.rank:
            return output
        delta = torch.zeros_like(output, requires_grad=True)
        self.taps.append((bias, delta))
        return output + delta


def full_gradients(
    model: nn.Module, inputs: torch.Tensor | Inputs, score: ScoreFn, spots: Sequence[str] = ()
) -> FullGradients:
    """The input- and bias-gradients of ``score`` for a batch, in one backward pass.

    Args:
        model: The network, in eval mode (batch norms use their running statistics).
        inputs: An ``(N, C, *spatial)`` batch, or several inputs (the map input's gradient
            is taken).
        score: Maps the model's output to the ``(N,)`` explained scores.
        spots: The spots the target reads (a ``Unit``'s layer), recorded in the pass.
    """
    main = inputs.main if isinstance(inputs, Inputs) else inputs
    recorder = _BiasTaps(main.dim())
    leaves, total = forward_from_inputs(model, inputs, score, recorder, spots=spots)
    deltas = [delta for _, delta in recorder.taps]
    gradients = torch.autograd.grad(total, [*leaves.values(), *deltas], allow_unused=True)
    bias_gradients = [
        bias.view(1, -1, *[1] * (main.dim() - 2)) * gradient
        for (bias, _), gradient in zip(recorder.taps, gradients[1:], strict=True)
        if gradient is not None
    ]
    return FullGradients(input_gradients=gradients[0], bias_gradients=bias_gradients)


def _channel_normalised_sum(maps: torch.Tensor) -> torch.Tensor:
    """``sum_c psi(maps_c)`` with ``psi`` = min-max rescaling of ``|.|``, ``(N, *grid)``."""
    return normalize(maps.abs().flatten(0, 1)).view_as(maps).sum(dim=1)


@register
class FullGrad(CamMethod):
    """FullGrad.

    Paper: Srinivas and Fleuret, "Full-Gradient Representation for Neural-Network
    Visualization", NeurIPS 2019.

    With ``psi`` = absolute value, then min-max rescaling, then bilinear upsampling to the
    input, applied to each channel ``c`` of the input term and of each layer ``l`` with a
    bias ``b_l`` (convolutions, and batch norms in eval mode, of the input's rank)::

        S(x) = sum_c psi( dy/dx (*) x )_c + sum_l sum_c psi( b_l,c * dy/dz_l,c )

    at the input's resolution. The target layer plays no part. The per-channel rescaling is
    the paper's equation and pytorch-grad-cam's ``FullGrad``; the authors' released code
    rescales each layer as a whole before summing its channels. pytorch-grad-cam only finds
    biases in modules of type exactly ``nn.Conv2d`` or ``nn.BatchNorm2d``, and divides by
    ``max + 1e-7``, which shrinks channels whose values are all tiny.
    """

    name = "fullgrad"
    paper = (
        "Srinivas and Fleuret, Full-Gradient Representation for Neural-Network "
        "Visualization, NeurIPS 2019"
    )
    needs = "input gradients and bias-gradients of all layers"
    input_resolution = True
    # Sums of many small bias-gradient terms: under bf16 the map's correlation with the fp32
    # map fell to 0.93 on a ResNet-50 (benchmarks/bench_precision.py), so it stays fp32.
    reduced_precision = False
    uses_gradients = False

    def layer_map(self, data: LayerData) -> torch.Tensor:
        decomposition = full_gradients(
            data.model, data.batch or data.inputs, data.score_fn, data.target_spots
        )
        total = _channel_normalised_sum(data.inputs * decomposition.input_gradients)
        for bias_gradient in decomposition.bias_gradients:
            # Upsampling is linear, so summing the channels first gives the same map, cheaper.
            total = total + data.on_input(_channel_normalised_sum(bias_gradient))
        return total
