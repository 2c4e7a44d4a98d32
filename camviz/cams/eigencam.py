"""Eigen-CAM and Eigen-Grad-CAM: the first principal component of a layer's feature maps."""

from __future__ import annotations

import torch

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.projection import first_principal_component
from camviz.cams.registry import register
from camviz.core.errors import CamvizError


@register
class EigenCAM(CamMethod):
    """Eigen-CAM: class-agnostic, no gradients.

    Paper: Muhammad and Yeasin, "Eigen-CAM: Class Activation Map using Principal
    Components", IJCNN 2020.

    With the activations of one image as an ``(h * w, C)`` matrix ``O``, centred over the
    locations, and its SVD ``O = U S V^T``::

        L = ReLU( O v_1 ) = ReLU( U_1 s_1 )         (v_1: first right singular vector)

    with the sign of ``v_1`` chosen so that ``L`` correlates positively with the channel sum of
    the activations. The map does not depend on the target class. It is zero when ``s_1`` is
    at most ``1e-5`` times the Frobenius norm of the uncentred activations (float rounding,
    not a component: :mod:`camviz.cams.projection`).

    Compared with pytorch-grad-cam's ``EigenCAM``: the same centring and projection (up to
    float rounding), but pytorch-grad-cam keeps whatever sign its SVD returns, so for some
    images its map is the ReLU of the inverted projection and highlights the weakest regions.

    Args:
        center: Centre ``O`` over the locations before the SVD (default ``True``). The paper
            writes the SVD of ``O`` itself; centring makes it a principal component analysis
            proper, as pytorch-grad-cam does, and the default keeps its maps. Without centring
            ``v_1`` mostly follows the mean activation of each channel, so the map is close
            to a plain channel sum.
    """

    name = "eigencam"
    paper = (
        "Muhammad and Yeasin, Eigen-CAM: Class Activation Map using Principal Components, "
        "IJCNN 2020"
    )
    needs = "activations"
    uses_gradients = False

    def __init__(self, center: bool = True) -> None:
        if not isinstance(center, bool):
            raise CamvizError(f"{self.name} needs center=True or False, not {center!r}")
        self.center = center

    def features(self, data: LayerData) -> torch.Tensor:
        """The ``(N, C, h, w)`` maps whose principal component is taken."""
        return data.activations

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return first_principal_component(self.features(data), center=self.center)


@register
class EigenGradCAM(EigenCAM):
    """Eigen-Grad-CAM: Eigen-CAM of the gradient-weighted activations, class-discriminative.

    No paper of its own: introduced by pytorch-grad-cam (Gildenblat and contributors, 2021)
    as Eigen-CAM (Muhammad and Yeasin, IJCNN 2020) applied to ``dy^c/dA (*) A``::

        L^c = ReLU( first principal component of  dy^c/dA^k (*) A^k )

    signed to correlate with ``sum_k dy^c/dA^k (*) A^k`` (the HiResCAM map), where
    pytorch-grad-cam keeps the SVD's arbitrary sign.

    Args:
        center: As for :class:`EigenCAM` (default ``True``).
    """

    name = "eigen_gradcam"
    paper = (
        "No paper; Eigen-CAM (Muhammad and Yeasin, IJCNN 2020) of gradients x activations, "
        "from pytorch-grad-cam"
    )
    needs = "gradients"
    uses_gradients = True

    def features(self, data: LayerData) -> torch.Tensor:
        return data.dy_da * data.activations
