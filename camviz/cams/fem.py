"""FEM: where each channel stands out from its own mean, weighted by that mean."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelMapMethod, LayerData, grid_dims
from camviz.cams.registry import register
from camviz.core.errors import CamvizError


@register
class FEM(ChannelMapMethod):
    """FEM (Feature Explanation Method): no gradients, no class; a k-sigma rule per channel.

    Paper: Fuad, Martin, Giot, Bourqui, Benois-Pineau and Zemmari, "Features understanding
    in 3D CNNs for actions recognition in video", IPTA 2020.

    With ``mu_k`` and ``sigma_k`` the mean and (population) standard deviation of channel
    ``k`` over the grid, each channel becomes a binary mask of where it is unusually strong,
    and the masks are summed weighted by the channel means::

        B^k_ij = 1[ A^k_ij > mu_k + k_sigma * sigma_k ]
        L      = ReLU( sum_k mu_k B^k )

    as the paper, the authors' code and Xplique compute it. The map does not depend on the
    target class. pytorch-grad-cam's ``FEM``, which cites this paper, computes another
    formula (the activations weighted by the share of each mask): that is :class:`FEMPgc`.

    Args:
        k_sigma: How many standard deviations above its mean a location must be to count
            (default 2, the paper's).
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
            raise CamvizError(f"{self.name} needs k_sigma to be a number, not {k_sigma!r}")
        self.k_sigma = float(k_sigma)

    def masks(self, activations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, B)``: each channel's mean over the grid (kept as a grid of one) and its
        binary mask, in the activations' dtype."""
        std, mean = torch.std_mean(
            activations, dim=grid_dims(activations), correction=0, keepdim=True
        )
        return mean, (activations > mean + self.k_sigma * std).to(activations.dtype)

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        mean, masks = self.masks(data.activations)
        return mean * masks


@register
class FEMPgc(FEM):
    """FEM as pytorch-grad-cam computes it: the activations weighted by the share of their mask.

    No paper: pytorch-grad-cam's ``FEM`` (Gildenblat and contributors), which cites Fuad et
    al. (IPTA 2020) but weighs each channel's activations, not its binary mask, by the share
    of locations in the mask::

        w_k = (1 / (h w)) sum_ij B^k_ij          (B^k as for :class:`FEM`)
        L   = ReLU( sum_k w_k A^k )

    Use it to reproduce pytorch-grad-cam's maps, :class:`FEM` for the paper's (the README
    says how far apart they are).

    Args:
        k_sigma: As for :class:`FEM` (default 2, pytorch-grad-cam's ``k``).
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "fem_pgc"
    paper = (
        "No paper; FEM as pytorch-grad-cam computes it: the activations weighted by the share "
        "of each channel's mask"
    )

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        activations = data.activations
        _, masks = self.masks(activations)
        return masks.mean(dim=grid_dims(activations), keepdim=True) * activations
