"""XGrad-CAM: gradients weighted by each channel's normalised activations."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelWeighted, LayerData, grid_dims
from camviz.cams.registry import register


@register
class XGradCAM(ChannelWeighted):
    """XGrad-CAM (Axiom-based Grad-CAM).

    Paper: Fu et al., "Axiom-based Grad-CAM: Towards Accurate Visualization
    and Explanation of CNNs", BMVC 2020.

    Weights chosen to satisfy the sensitivity and conservation axioms::

        w_k^c = sum_ij ( A^k_ij / sum_ab A^k_ab ) * dy^c / dA^k_ij
        L^c   = ReLU( sum_k w_k^c A^k )

    A channel whose activations sum to zero gets weight zero. pytorch-grad-cam and torchcam
    add ``1e-7`` and ``1e-8`` to that sum instead, which changes the weights of channels with
    small sums slightly.

    Args:
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "xgradcam"
    paper = (
        "Fu et al., Axiom-based Grad-CAM: Towards Accurate Visualization and Explanation of "
        "CNNs, BMVC 2020"
    )

    def channel_weights(self, data: LayerData) -> torch.Tensor:
        activations = data.activations
        total = activations.sum(dim=grid_dims(activations))
        weighted = (data.dy_da * activations).sum(dim=grid_dims(activations))
        return torch.where(total != 0, weighted / total, 0)
