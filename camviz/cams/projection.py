"""Principal-component projections of a layer's ``(N, C, h, w)`` maps (Eigen-CAM and kin).

The ``h * w`` locations of one map are the observations and its ``C`` channels the variables.
An SVD's singular vectors are defined only up to sign; each caller picks the sign its method
asks for.

A map whose locations barely differ has no principal direction: on spatially constant
features the centred matrix holds float rounding alone (singular values of 1e-7 of the
activations' norm in float32), and its "component" is noise that normalisation would stretch
to a full-contrast heatmap. Such a map is zero instead (and the engine's zero-map warning
says so): when the first singular value is at most :data:`NEGLIGIBLE` times the Frobenius
norm of the uncentred features, or that norm is zero.
"""

from __future__ import annotations

import torch

#: A spread at most this share of the features' own size is float rounding, not structure
#: (float32 rounding is about 1e-7 relative; a real pattern is orders of magnitude above).
NEGLIGIBLE = 1e-5


def negligible(spread: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(N,)`` whether each sample's ``spread`` (a singular value or eigenvalue) is at most
    :data:`NEGLIGIBLE` times its ``scale`` (the size of what was decomposed, uncentred);
    also true where both are zero."""
    return spread <= NEGLIGIBLE * scale.abs()


def zeroed(maps: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """``(N, *grid)`` ``maps`` with the maps of the samples where ``empty`` (``(N,)``) is true
    set to zero."""
    return torch.where(empty.view(-1, *[1] * (maps.dim() - 1)), 0, maps)


def principal_projection(features: torch.Tensor, *, center: bool = True) -> torch.Tensor:
    """Each map's locations projected on its first principal direction, with the SVD's sign.

    The projection is ``O v_1 = U[:, 0] * S[0]`` for the SVD ``O = U S V^T`` of the
    ``(h * w, C)`` observation matrix ``O`` (centred over the locations when ``center``), for
    the whole batch in one batched :func:`torch.linalg.svd`.

    Args:
        features: ``(N, C, h, w)``.
        center: Subtract each channel's mean over the locations first (PCA proper).

    Returns:
        ``(N, h, w)`` projections, in float32 or float64 (the SVD kernels' types); zero for
        a sample whose first singular value is negligible (see the module docstring).
    """
    observations = features.flatten(2).transpose(1, 2)
    observations = observations.to(torch.promote_types(observations.dtype, torch.float32))
    scale = torch.linalg.vector_norm(observations, dim=(1, 2))
    if center:
        observations = observations - observations.mean(dim=1, keepdim=True)
    left, singular, _ = torch.linalg.svd(observations, full_matrices=False)
    projection = left[..., 0] * singular[..., :1]
    projection = zeroed(projection, negligible(singular[..., 0], scale))
    return projection.view(features.shape[0], *features.shape[2:])


def signed_like(projection: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``projection`` (``(N, h, w)``), negated for each map that anti-correlates with
    ``reference`` (same shape), so that both are large in the same places."""
    agreement = (projection * reference.to(projection.dtype)).flatten(1).sum(dim=1)
    flip = agreement.view(-1, *[1] * (projection.dim() - 1)) < 0  # any grid rank
    return torch.where(flip, -projection, projection)


def first_principal_component(features: torch.Tensor, *, center: bool = True) -> torch.Tensor:
    """:func:`principal_projection`, signed to follow the strength of the features.

    The projection is flipped where it anti-correlates with the channel sum
    ``sum_k F^k_ij``, so the map is positive where the features are strong.

    Args:
        features: ``(N, C, h, w)``.
        center: See :func:`principal_projection`.

    Returns:
        ``(N, h, w)`` projections.
    """
    return signed_like(principal_projection(features, center=center), features.sum(dim=1))
