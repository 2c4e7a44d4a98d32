"""Seg-Eigen-CAM: Eigen-CAM of |gradients| x activations, signed by its larger extreme."""

from __future__ import annotations

import torch

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.projection import principal_projection
from camviz.cams.registry import register


@register
class SegEigenCAM(CamMethod):
    """Seg-Eigen-CAM, for semantic segmentation models (and any other target).

    Paper: Chung and Ying, "Seg-Eigen-CAM: Eigen-Value-Based Visual Explanations for Semantic
    Segmentation Models", Applied Sciences 15(13), 7562, 2025 (doi:10.3390/app15137562);
    as implemented in pytorch-grad-cam 1.5.7 (``pytorch_grad_cam/seg_eigen_cam.py``).

    With ``G = |dy^c/dA| (*) A`` (the paper's equation 10: absolute gradients, so that
    locations count whichever way they push the score) as an ``(h * w, C)`` matrix, centred
    over the locations, and ``p`` its projection on the first principal direction::

        p   = O v_1
        L^c = ReLU( p )    if |max p| >= |min p|,   else ReLU( -p )      (equation 13)

    The sign rule makes the larger extreme of the projection positive; Eigen-Grad-CAM
    instead follows the correlation with the channel sum. As in Eigen-CAM, the map is zero
    when the first singular value is negligible next to ``G``'s norm. Works with a
    :class:`~camviz.core.targets.Region` target on a segmentation output, as the paper
    intends, and with class targets on classifiers.
    """

    name = "segeigencam"
    paper = (
        "Chung and Ying, Seg-Eigen-CAM: Eigen-Value-Based Visual Explanations for Semantic "
        "Segmentation Models, Applied Sciences 2025"
    )

    def layer_map(self, data: LayerData) -> torch.Tensor:
        projection = principal_projection(data.dy_da.abs() * data.activations)
        extremes = projection.flatten(1)
        flip = extremes.amin(dim=1).abs() > extremes.amax(dim=1).abs()
        return torch.where(flip.view(-1, *[1] * (projection.dim() - 1)), -projection, projection)
