"""Grad-CAM: activations weighted by their spatially averaged gradients."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelMapMethod, LayerData
from camviz.cams.registry import register


@register
class GradCAM(ChannelMapMethod):
    """Grad-CAM.

    Paper: Selvaraju et al., "Grad-CAM: Visual Explanations from Deep Networks via
    Gradient-based Localization", ICCV 2017.

    Formula, for class score y^c and feature maps A^k of the target layer (Z = h * w)::

        alpha_k^c = (1 / Z) * sum_ij dy^c / dA^k_ij
        L^c       = ReLU( sum_k alpha_k^c * A^k )

    The engine applies the ReLU and the per-image min-max normalisation.

    Args:
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "gradcam"
    paper = (
        "Selvaraju et al., Grad-CAM: Visual Explanations from Deep Networks via "
        "Gradient-based Localization, ICCV 2017"
    )

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        return data.dy_da.mean(dim=(2, 3), keepdim=True) * data.activations
