"""KPCA-CAM: Eigen-CAM with kernel PCA, the first nonlinear principal component."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.projection import negligible, signed_like, zeroed
from camviz.cams.registry import register
from camviz.core.errors import CamvizError

Kernel = Literal["sigmoid", "rbf", "poly", "linear", "cosine"]
KERNELS = ("sigmoid", "rbf", "poly", "linear", "cosine")

# scikit-learn's KernelPCA defaults, which pytorch-grad-cam's KPCA_CAM keeps.
POLY_DEGREE = 3
COEF0 = 1.0


def kernel_matrix(x: torch.Tensor, kernel: Kernel, gamma: float) -> torch.Tensor:
    """``(N, n, n)`` kernel values between the ``n`` rows of each ``(N, n, C)`` batch item."""
    if kernel == "rbf":
        return torch.exp(-gamma * torch.cdist(x, x).square())
    if kernel == "cosine":
        x = F.normalize(x, dim=-1)
    dot = x @ x.transpose(1, 2)
    if kernel == "sigmoid":
        return torch.tanh(gamma * dot + COEF0)
    if kernel == "poly":
        return (gamma * dot + COEF0) ** POLY_DEGREE
    return dot


@register
class KPCACAM(CamMethod):
    """KPCA-CAM: no gradients, no class; the first kernel principal component of the layer.

    Paper: Karmani, Sivakaran, Prasad, Ali, Yang and Tang, "KPCA-CAM: Visual Explainability
    of Deep Computer Vision Models using Kernel PCA", 2024 (arXiv:2410.00267).

    With the activations of one image as ``n = h * w`` observations ``o_i`` of ``C``
    variables, centred over the locations, a kernel ``k``, its matrix ``K_ij = k(o_i, o_j)``
    centred in feature space, ``K~ = K - 1K - K1 + 1K1`` (``1`` the ``n x n`` matrix of
    ``1/n``), and ``lambda_1, a_1`` its top eigenvalue and unit eigenvector::

        L = ReLU( sqrt(lambda_1) a_1 )          (the projections of the locations)

    signed, like Eigen-CAM, to correlate with the channel sum of the activations (an
    eigenvector's sign is arbitrary; pytorch-grad-cam's ``KPCA_CAM`` takes scikit-learn's,
    which makes the largest entry positive, so its maps may be the inverted ones). Kernels
    as scikit-learn's: ``sigmoid`` ``tanh(gamma <x, y> + 1)``, ``rbf``
    ``exp(-gamma |x - y|^2)``, ``poly`` ``(gamma <x, y> + 1)^3``, ``linear`` ``<x, y>`` (then
    this is Eigen-CAM), ``cosine``.

    As for Eigen-CAM, a map is zero where there is no component but float rounding: when the
    locations' first singular value is negligible next to the activations' norm, or
    ``lambda_1`` next to the trace of ``K`` (before centring; see
    :mod:`camviz.cams.projection`).

    Cost: an ``n x n`` eigendecomposition per image, cubic in ``n``: cheap for a last
    convolutional layer (7 x 7, ``n = 49``), costly for an early one (56 x 56,
    ``n = 3136``).

    Args:
        kernel: The kernel (default ``"sigmoid"``, pytorch-grad-cam's).
        gamma: The kernel's coefficient; ``None``: ``1 / C``, scikit-learn's default.
    """

    name = "kpcacam"
    paper = (
        "Karmani et al., KPCA-CAM: Visual Explainability of Deep Computer Vision Models using "
        "Kernel PCA, arXiv 2024"
    )
    needs = "activations"
    uses_gradients = False

    def __init__(self, kernel: Kernel = "sigmoid", gamma: float | None = None) -> None:
        if kernel not in KERNELS:
            raise CamvizError(f"kpcacam needs kernel= one of {', '.join(KERNELS)}, not {kernel!r}")
        if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float))):
            raise CamvizError(f"kpcacam needs gamma to be a number or None, not {gamma!r}")
        self.kernel = kernel
        self.gamma = gamma

    def layer_map(self, data: LayerData) -> torch.Tensor:
        activations = data.activations
        observations = activations.flatten(2).transpose(1, 2)
        observations = observations.to(torch.promote_types(observations.dtype, torch.float32))
        centred = observations - observations.mean(dim=1, keepdim=True)
        gamma = 1 / activations.shape[1] if self.gamma is None else self.gamma
        gram = kernel_matrix(centred, self.kernel, gamma)
        trace = gram.diagonal(dim1=1, dim2=2).sum(dim=-1)
        gram = (
            gram
            - gram.mean(dim=1, keepdim=True)
            - gram.mean(dim=2, keepdim=True)
            + gram.mean(dim=(1, 2), keepdim=True)
        )
        values, vectors = torch.linalg.eigh(gram)
        projection = vectors[..., -1] * values[..., -1:].clamp_min(0).sqrt()
        flat = negligible(
            torch.linalg.matrix_norm(centred, ord=2),
            torch.linalg.vector_norm(observations, dim=(1, 2)),
        )
        projection = zeroed(projection, flat | negligible(values[..., -1], trace))
        projection = projection.view(activations.shape[0], *activations.shape[2:])
        return signed_like(projection, activations.sum(dim=1))
