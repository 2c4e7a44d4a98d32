"""FEM: channels weighted by how much of their map stands out from their own mean."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelMapMethod, LayerData, grid_dims
from camviz.cams.registry import register
from camviz.core.errors import CamvizError


@register
class FEM(ChannelMapMethod):
    """FEM (Feature Explanation Method): no gradients, no class; a k-sigma rule per channel.

    Paper: Fuad, Martin, Giot, Bourqui, Benois-Pineau and Zemmari, "Features understanding
    in 3D CNNs for actions recognition in video", IPTA 2020 (the reference that
    pytorch-grad-cam's ``FEM`` cites).

    With ``mu_k`` and ``sigma_k`` the mean and (population) standard deviation of channel
    ``k`` over the grid::

        w_k = (1 / (h w)) sum_ij 1[ A^k_ij > mu_k + k_sigma * sigma_k ]
        L   = ReLU( sum_k w_k A^k )

    ``w_k`` is the share of locations where channel ``k`` is unusually strong: channels
    that fire in a few places weigh more than channels that are flat. The map does not
    depend on the target class. The same formula as pytorch-grad-cam's ``FEM(k=2)``.

    Args:
        k_sigma: How many standard deviations above its mean a location must be to count
            (default 2, pytorch-grad-cam's ``k``).
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "fem"
    paper = (
        "Fuad et al., Features understanding in 3D CNNs for actions recognition in video, IPTA 2020"
    )
    needs = "activations"
    uses_gradients = False

    def __init__(self, k_sigma: float = 2.0, *, eigen_smooth: bool = False) -> None:
        super().__init__(eigen_smooth=eigen_smooth)
        if isinstance(k_sigma, bool) or not isinstance(k_sigma, (int, float)):
            raise CamvizError(f"fem needs k_sigma to be a number, not {k_sigma!r}")
        self.k_sigma = float(k_sigma)

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        activations = data.activations
        std, mean = torch.std_mean(
            activations, dim=grid_dims(activations), correction=0, keepdim=True
        )
        strong = activations > mean + self.k_sigma * std
        return (
            strong.to(activations.dtype).mean(dim=grid_dims(activations), keepdim=True)
            * activations
        )
