"""LayerCAM: every activation weighted by its own positive gradient."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelMapMethod, LayerData
from camviz.cams.registry import register


@register
class LayerCAM(ChannelMapMethod):
    """LayerCAM.

    Paper: Jiang, Zhang, Hou, Cheng and Wei, "LayerCAM: Exploring Hierarchical Class
    Activation Maps for Localization", IEEE Transactions on Image Processing, 2021.

    A weight per location rather than per channel, which keeps the fine detail of shallow
    layers::

        w_k^c(i, j) = ReLU( dy^c / dA^k_ij )
        L^c         = ReLU( sum_k w_k^c(i, j) A^k_ij )

    The paper's ``tanh`` rescaling (its equation 9) is for fusing shallow layers' maps with
    deep ones; camviz fuses normalised maps (``fuse="mean"`` or ``"max"``) instead.

    Args:
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "layercam"
    paper = (
        "Jiang et al., LayerCAM: Exploring Hierarchical Class Activation Maps for "
        "Localization, IEEE TIP 2021"
    )

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        return torch.relu(data.dy_da) * data.activations
