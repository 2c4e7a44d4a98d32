"""HiResCAM and Grad-CAM element-wise: gradients times activations, location by location."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelMapMethod, LayerData
from camviz.cams.registry import register


@register
class HiResCAM(ChannelMapMethod):
    """HiResCAM.

    Paper: Draelos and Carin, "Use HiResCAM instead of Grad-CAM for faithful explanations of
    convolutional neural networks", 2020 (arXiv:2011.08891).

    Grad-CAM without the spatial averaging of the gradients::

        L^c = ReLU( sum_k dy^c / dA^k  (*)  A^k )       ((*): element-wise product)

    For a model that ends in global average pooling and a linear layer, this is exactly the
    contribution of each location to the score (up to the bias).

    Args:
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "hirescam"
    paper = (
        "Draelos and Carin, Use HiResCAM instead of Grad-CAM for faithful explanations of "
        "convolutional neural networks, arXiv 2020"
    )

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        return data.dy_da * data.activations


@register
class GradCAMElementWise(ChannelMapMethod):
    """Grad-CAM element-wise: HiResCAM with the ReLU taken per channel before the sum.

    No paper: a variant introduced by pytorch-grad-cam (Gildenblat and contributors, 2021,
    ``GradCAMElementWise``), kept because its users know it::

        L^c = ReLU( sum_k ReLU( dy^c / dA^k  (*)  A^k ) )

    The outer ReLU changes nothing; the inner one drops the channels that speak against the
    class at each location instead of letting them cancel the others.

    Args:
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``);
            the principal component of the ``ReLU( dy^c / dA^k (*) A^k )`` terms, as in
            pytorch-grad-cam.
    """

    name = "gradcam_elementwise"
    paper = "No paper; introduced by pytorch-grad-cam (Gildenblat and contributors, 2021)"

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        return torch.relu(data.dy_da * data.activations)
