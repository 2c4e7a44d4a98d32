"""ShapleyCAM: Grad-CAM's weights with a second-order correction from the Hessian."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelMapMethod, LayerData, grid_dims
from camviz.cams.registry import register


@register
class ShapleyCAM(ChannelMapMethod):
    """ShapleyCAM: channel weights from the gradient and a Hessian-vector product.

    Paper: Cai, "CAMs as Shapley Value-based Explainers", 2025 (arXiv:2501.06261); as in
    pytorch-grad-cam 1.5.7's ``ShapleyCAM``.

    With ``g = dy^c/dA`` and ``H A`` the Hessian of ``y^c`` with respect to ``A`` applied to
    ``A`` (both ``(C, h, w)``; the paper reads CAM weights as the channels' Shapley values and
    derives these from a second-order Taylor expansion of the score, where Grad-CAM's are the
    first-order ones)::

        w_k^c = (1 / (h w)) sum_ij ( g - 1/2 H A )^k_ij
        L^c   = ReLU( sum_k w_k^c A^k )

    The engine provides ``H A`` from the same forward pass (see
    :mod:`camviz.cams.recording`): one backward pass with ``create_graph=True`` through the
    layers after the target, then a second one. Where those layers are piecewise linear in
    ``A`` (ReLU, max-pooling, batch norm in eval mode, linear layers) ``H A`` is zero and
    ShapleyCAM is Grad-CAM exactly; it differs after smooth activations (SiLU, GELU) or with
    a softmax in the target. The paper explains the softmax probability minus the rest
    (pytorch-grad-cam's ``ClassifierOutputReST``); camviz explains the target given, logits
    by default, as for every method.

    Args:
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "shapleycam"
    paper = "Cai, CAMs as Shapley Value-based Explainers, arXiv 2025"
    needs = "gradients and Hessian-vector products"
    uses_hessian = True

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        assert data.hessian_products is not None  # uses_hessian: the engine records them
        weights = (data.dy_da - 0.5 * data.hessian_products).mean(
            dim=grid_dims(data.dy_da), keepdim=True
        )
        return weights * data.activations
