"""Grad-CAM: activations weighted by their spatially averaged gradients."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelWeighted, LayerData, grid_dims
from camviz.cams.registry import register


@register
class GradCAM(ChannelWeighted):
    """Grad-CAM.

    Paper: Selvaraju et al., "Grad-CAM: Visual Explanations from Deep Networks via
    Gradient-based Localization", ICCV 2017.

    Formula, for class score y^c and feature maps A^k of the target layer, over the Z
    locations ij of its grid (1-D, 2-D or 3-D)::

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

    def channel_weights(self, data: LayerData) -> torch.Tensor:
        return data.dy_da.mean(dim=grid_dims(data.dy_da))
