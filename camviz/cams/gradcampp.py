"""Grad-CAM++ and Smooth Grad-CAM++: pixel-wise weighted positive gradients."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelWeighted, LayerData, grid_dims
from camviz.cams.engine import layer_pass
from camviz.cams.noise import SampleNoise
from camviz.cams.registry import register
from camviz.core.errors import CamvizError
from camviz.core.inputs import corner
from camviz.core.targets import CallableTarget


def plusplus_weights(
    activations: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    third: torch.Tensor,
) -> torch.Tensor:
    """The Grad-CAM++ channel weights from the first three derivatives of the score with
    respect to ``A``.

    Args:
        activations: ``A``, ``(N, C, *grid)``.
        first: ``dy/dA`` (or its average over noisy inputs).
        second: ``(dy/dA)^2`` (or the average of the squares).
        third: ``(dy/dA)^3`` (or the average of the cubes).

    Returns:
        The ``(N, C)`` weights ``w_k``.
    """
    dims = grid_dims(activations)
    total = activations.sum(dim=dims, keepdim=True)
    denominator = 2 * second + total * third
    # A zero denominator means a zero gradient there (or an underflow): that pixel adds nothing.
    alpha = torch.where(denominator != 0, second / denominator, 0)
    return (alpha * torch.relu(first)).sum(dim=dims)


@register
class GradCAMPlusPlus(ChannelWeighted):
    """Grad-CAM++.

    Paper: Chattopadhay, Sarkar, Howlader and Balasubramanian, "Grad-CAM++: Generalized
    Gradient-based Visual Explanations for Deep Convolutional Networks", WACV 2018.

    With the score passed through an exponential, the second and third derivatives are powers
    of the first, ``g = dy^c / dA^k_ij`` (equation 19 of the paper)::

        alpha_k^c(i, j) = g^2 / (2 g^2 + sum_ab A^k_ab g^3)
        w_k^c           = sum_ij alpha_k^c(i, j) * ReLU(g)
        L^c             = ReLU( sum_k w_k^c A^k )

    The exponential's factor ``exp(y^c)`` is the same for every pixel of an image, so it
    vanishes in the min-max normalisation and is left out.

    Compared with the peers (``tests/test_methods_gradient.py``): pytorch-grad-cam adds
    ``1e-6`` to the denominator, which lowers ``alpha`` where gradients are small; camviz only
    skips exact zeros, as the formula asks. torchcam 0.5's ``GradCAMpp`` divides a copy made
    by boolean indexing (``alpha[mask].div_``), so its ``alpha`` stays ``g^2`` and its weights
    are ``sum_ij g^2 ReLU(g)``.

    Args:
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "gradcam++"
    paper = (
        "Chattopadhay et al., Grad-CAM++: Generalized Gradient-based Visual Explanations for "
        "Deep Convolutional Networks, WACV 2018"
    )

    def channel_weights(self, data: LayerData) -> torch.Tensor:
        gradients = data.dy_da
        squared = gradients.square()
        return plusplus_weights(data.activations, gradients, squared, squared * gradients)


@register
class SmoothGradCAMPlusPlus(ChannelWeighted):
    """Smooth Grad-CAM++: Grad-CAM++ with derivatives averaged over noisy copies of the input.

    Paper: Omeiza, Speakman, Cintas and Weldermariam, "Smooth Grad-CAM++: An Enhanced Inference
    Level Visualization Technique for Deep Convolutional Neural Network Models", 2019
    (arXiv:1908.01224).

    For ``n`` inputs ``x + eps_t`` with ``eps_t ~ N(0, sigma^2)``, ``sigma = noise *
    (max(x) - min(x))`` per image (SmoothGrad's noise level), and ``g_t = dy^c / dA^k`` at
    the noisy input ``t``::

        D_p             = (1/n) sum_t g_t^p          for p = 1, 2, 3
        alpha_k^c(i, j) = D_2 / (2 D_2 + sum_ab A^k_ab D_3)
        w_k^c           = sum_ij alpha_k^c(i, j) * ReLU(D_1)
        L^c             = ReLU( sum_k w_k^c A^k )

    where ``A`` is the activation of the clean input. With no noise this is Grad-CAM++
    exactly. torchcam points out that the paper prints ``D_1`` in the numerator of ``alpha``,
    which would not reduce to Grad-CAM++; like torchcam, camviz uses ``D_2``. torchcam's
    ``SmoothGradCAMpp`` then multiplies by the ReLU of the *last* noisy gradient instead of
    ``D_1``, and its noise has a fixed standard deviation (0.3) rather than one relative to
    the image's range.

    Args:
        samples: ``n``, the number of noisy copies; each is one batched pass.
        noise: ``sigma`` as a fraction of each image's value range (SmoothGrad suggests
            0.1 to 0.2).
        seed: Seed of the noise, so that the same input always gives the same map; ``None``
            draws the seed from torch's global generator instead. Each image draws its
            noise from its own generator started from this seed
            (:class:`~camviz.cams.noise.SampleNoise`), so an image gets the same map alone
            or at any position in a batch.
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "smooth_gradcam++"
    paper = (
        "Omeiza et al., Smooth Grad-CAM++: An Enhanced Inference Level Visualization "
        "Technique for Deep Convolutional Neural Network Models, arXiv 2019"
    )
    needs = "gradients at n noisy copies of the input"

    def __init__(
        self,
        samples: int = 8,
        noise: float = 0.15,
        seed: int | None = 0,
        *,
        eigen_smooth: bool = False,
    ) -> None:
        super().__init__(eigen_smooth=eigen_smooth)
        if samples < 1 or noise < 0:
            raise CamvizError(
                f"smooth_gradcam++ needs samples >= 1 and noise >= 0, got samples={samples}, "
                f"noise={noise}"
            )
        self.samples = samples
        self.noise = noise
        self.seed = seed

    def channel_weights(self, data: LayerData) -> torch.Tensor:
        inputs = data.inputs
        noise = SampleNoise(inputs.shape[0], self.seed, inputs.device)
        every_sample = torch.arange(inputs.shape[0])
        sizes = data.batch.image_sizes if data.batch is not None else None
        own = (
            inputs if sizes is None else [corner(x, s) for x, s in zip(inputs, sizes, strict=True)]
        )
        span = torch.stack([sample.max() - sample.min() for sample in own])
        sigma = (self.noise * span).view(-1, *[1] * (inputs.dim() - 1))
        moments = data.activations.new_zeros(3, *data.activations.shape)
        assert data.layout is not None  # the engine gives every layer its layout
        for _ in range(self.samples):
            draw = noise.draw(every_sample, inputs.shape[1:], inputs.dtype, sizes)
            # The score function is the explained target itself, so class ids, callables and
            # any output type carry over to the noisy batch unchanged.
            noisy_inputs = inputs + sigma * draw
            batch = data.batch.with_main(noisy_inputs) if data.batch is not None else noisy_inputs
            target = CallableTarget(data.score_fn, data.target_spots)
            noisy = layer_pass(data.model, batch, [data.layer], target)
            gradients = data.layout.to_spatial(noisy.gradients[data.layer][0])
            moments += torch.stack([gradients, gradients.square(), gradients.pow(3)])
        first, second, third = moments / self.samples
        return plusplus_weights(data.activations, first, second, third)
