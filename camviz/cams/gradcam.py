"""Grad-CAM: activations weighted by their spatially averaged gradients."""

from __future__ import annotations

import torch

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.registry import register


@register
class GradCAM(CamMethod):
    """Grad-CAM.

    Paper: Selvaraju et al., "Grad-CAM: Visual Explanations from Deep Networks via
    Gradient-based Localization", ICCV 2017.

    Formula, for class score y^c and feature maps A^k of the target layer (Z = h * w)::

        alpha_k^c = (1 / Z) * sum_ij dy^c / dA^k_ij
        L^c       = ReLU( sum_k alpha_k^c * A^k )

    The engine applies the ReLU and the per-image min-max normalisation.
    """

    name = "gradcam"
    paper = (
        "Selvaraju et al., Grad-CAM: Visual Explanations from Deep Networks via "
        "Gradient-based Localization, ICCV 2017"
    )

    def layer_map(self, data: LayerData) -> torch.Tensor:
        weights = data.dy_da.mean(dim=(2, 3), keepdim=True)
        return (weights * data.activations).sum(dim=1)
