"""Eigen-CAM and Eigen-Grad-CAM: the first principal component of a layer's feature maps."""

from __future__ import annotations

import torch

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.registry import register


def first_principal_component(features: torch.Tensor) -> torch.Tensor:
    """Each map's projection on its first principal component, signed to follow its strength.

    The ``h * w`` locations of one ``(C, h, w)`` map are the observations and the ``C``
    channels the variables. The projection is ``U[:, 0] * S[0]`` of the SVD of the centred
    ``(h * w, C)`` matrix, for the whole batch in one batched :func:`torch.linalg.svd`.

    An SVD's singular vectors are defined up to sign, so the projection alone may come out
    inverted. It is flipped where it anti-correlates with the channel sum ``sum_k F^k_ij``,
    so the map is positive where the features are strong.

    Args:
        features: ``(N, C, h, w)``.

    Returns:
        ``(N, h, w)`` projections.
    """
    observations = features.flatten(2).transpose(1, 2)
    # The SVD kernels take float32 and float64 only.
    observations = observations.to(torch.promote_types(observations.dtype, torch.float32))
    centred = observations - observations.mean(dim=1, keepdim=True)
    left, singular, _ = torch.linalg.svd(centred, full_matrices=False)
    projection = left[..., 0] * singular[..., :1]
    strength = observations.sum(dim=2)
    agreement = (projection * strength).sum(dim=1, keepdim=True)
    projection = torch.where(agreement < 0, -projection, projection)
    return projection.view(features.shape[0], *features.shape[2:])


@register
class EigenCAM(CamMethod):
    """Eigen-CAM: class-agnostic, no gradients.

    Paper: Muhammad and Yeasin, "Eigen-CAM: Class Activation Map using Principal
    Components", IJCNN 2020.

    With the activations of one image as an ``(h * w, C)`` matrix ``O``, centred over the
    locations, and its SVD ``O = U S V^T``::

        L = ReLU( O v_1 ) = ReLU( U_1 s_1 )         (v_1: first right singular vector)

    with the sign of ``v_1`` chosen so that ``L`` correlates positively with the channel sum of
    the activations. The map does not depend on the target class.

    Compared with pytorch-grad-cam's ``EigenCAM``: the same centring and projection (up to
    float rounding), but pytorch-grad-cam keeps whatever sign its SVD returns, so for some
    images its map is the ReLU of the inverted projection and highlights the weakest regions.
    """

    name = "eigencam"
    paper = (
        "Muhammad and Yeasin, Eigen-CAM: Class Activation Map using Principal Components, "
        "IJCNN 2020"
    )
    needs = "activations"
    uses_gradients = False

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return first_principal_component(data.activations)


@register
class EigenGradCAM(CamMethod):
    """Eigen-Grad-CAM: Eigen-CAM of the gradient-weighted activations, class-discriminative.

    No paper of its own: introduced by pytorch-grad-cam (Gildenblat and contributors, 2021)
    as Eigen-CAM (Muhammad and Yeasin, IJCNN 2020) applied to ``dy^c/dA (*) A``::

        L^c = ReLU( first principal component of  dy^c/dA^k (*) A^k )

    signed to correlate with ``sum_k dy^c/dA^k (*) A^k`` (the HiResCAM map), where
    pytorch-grad-cam keeps the SVD's arbitrary sign.
    """

    name = "eigen_gradcam"
    paper = (
        "No paper; Eigen-CAM (Muhammad and Yeasin, IJCNN 2020) of gradients x activations, "
        "from pytorch-grad-cam"
    )

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return first_principal_component(data.dy_da * data.activations)
