"""Principal-component projections of a layer's ``(N, C, h, w)`` maps (Eigen-CAM and kin).

The ``h * w`` locations of one map are the observations and its ``C`` channels the variables.
An SVD's singular vectors are defined only up to sign; each caller picks the sign its method
asks for.
"""

from __future__ import annotations

import torch


def principal_projection(features: torch.Tensor, *, center: bool = True) -> torch.Tensor:
    """Each map's locations projected on its first principal direction, with the SVD's sign.

    The projection is ``O v_1 = U[:, 0] * S[0]`` for the SVD ``O = U S V^T`` of the
    ``(h * w, C)`` observation matrix ``O`` (centred over the locations when ``center``), for
    the whole batch in one batched :func:`torch.linalg.svd`.

    Args:
        features: ``(N, C, h, w)``.
        center: Subtract each channel's mean over the locations first (PCA proper).

    Returns:
        ``(N, h, w)`` projections, in float32 or float64 (the SVD kernels' types).
    """
    observations = features.flatten(2).transpose(1, 2)
    observations = observations.to(torch.promote_types(observations.dtype, torch.float32))
    if center:
        observations = observations - observations.mean(dim=1, keepdim=True)
    left, singular, _ = torch.linalg.svd(observations, full_matrices=False)
    projection = left[..., 0] * singular[..., :1]
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
