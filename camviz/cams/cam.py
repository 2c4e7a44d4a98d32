"""CAM: the classifier's own weights on the feature maps it averages."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.cams.base import ChannelMapMethod, ChannelWeighted, LayerData, grid_dims
from camviz.cams.registry import register
from camviz.core.errors import CamvizError


def find_classifier(model: nn.Module, channels: int) -> tuple[str, nn.Linear]:
    """The classifier ``Linear`` layer that could take the pooled ``channels`` features.

    timm models name theirs (``get_classifier()``); otherwise the last ``nn.Linear`` in
    module order is the classifier of torchvision's CNNs (ResNet's ``fc``, EfficientNet's
    ``classifier.1``).

    Raises:
        CamvizError: There is no such layer, or it takes another number of features.
    """
    named = {module: name for name, module in model.named_modules()}
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier):
        candidates = [get_classifier()]
    else:
        candidates = [module for module in named if isinstance(module, nn.Linear)][-1:]
    if not candidates or not isinstance(candidates[0], nn.Linear):
        raise CamvizError(
            "cam needs a model that ends in global average pooling and one Linear layer, and "
            "this model has no Linear classifier; use gradcam, which is CAM on such models"
        )
    linear = candidates[0]
    if linear.in_features != channels:
        raise CamvizError(
            f"cam needs the target layer to feed the classifier {named.get(linear, 'head')!r} "
            f"through global average pooling, but the layer has {channels} channels and the "
            f"classifier takes {linear.in_features} features; pick the last feature layer, "
            "or use gradcam"
        )
    return named.get(linear, "head"), linear


@register
class CAM(ChannelMapMethod):
    """CAM (class activation mapping): no gradients, the classifier's weights themselves.

    Paper: Zhou, Khosla, Lapedriza, Oliva and Torralba, "Learning Deep Features for
    Discriminative Localization", CVPR 2016.

    For a network that ends in ``y = W GAP(A) + b`` (global average pooling of the target
    layer, then one linear layer)::

        w^c = W[c]                      (for a Contrast target a - b: W[a] - W[b])
        L^c = ReLU( sum_k w^c_k A^k )

    ``w^c`` is computed as ``dy/dp`` of the explained score through the linear layer alone,
    at the pooled features ``p = GAP(A)``, which is ``W[c]`` for a class and the matching
    combination of rows for any target that is linear in the logits.

    The classifier is found by :func:`find_classifier`. Before trusting it, the method checks
    that ``W GAP(A) + b`` reproduces the explained scores of the forward pass; a model with
    anything else between the layer and the classifier (a norm, a second Linear, an
    attention pool, a class token) fails that check with a :class:`CamvizError`.

    On such a model ``dy/dA^k_ij = W[c, k] / (h w)`` at every location, so Grad-CAM's
    weights are ``W[c] / (h w)``: CAM and Grad-CAM give the same normalised map (tested),
    and Grad-CAM is the generalisation to any model. torchcam's ``CAM`` uses the same
    weights; it does not apply the ReLU before normalising.

    Args:
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "cam"
    paper = "Zhou et al., Learning Deep Features for Discriminative Localization, CVPR 2016"
    needs = "activations and the classifier's weights"
    uses_gradients = False

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        activations = data.activations
        name, linear = find_classifier(data.model, activations.shape[1])
        # A caller's inference mode would stop this small graph too (see layer_pass).
        with torch.inference_mode(False), torch.enable_grad():
            pooled = (
                activations.mean(dim=grid_dims(activations))
                .to(linear.weight.dtype)
                .requires_grad_()
            )
            logits = F.linear(pooled, linear.weight.detach(), _detached(linear.bias))
            try:
                scores = data.score_fn(logits)
            except (RuntimeError, IndexError, CamvizError):
                scores = None
            if scores is None or data.scores is None or not _same(scores, data.scores):
                raise CamvizError(
                    f"cam needs the model's output to be {name!r} applied to the global "
                    f"average of layer {data.layer!r}, and it is not (another layer sits "
                    "between them); pick the layer that feeds the pooling, or use gradcam"
                )
            (weights,) = torch.autograd.grad(scores.sum(), pooled)
        return ChannelWeighted.terms(weights.to(activations.dtype), activations)


def _detached(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach()


def _same(predicted: torch.Tensor, recorded: torch.Tensor) -> bool:
    """Whether scores recomputed from the head match the forward pass's, up to rounding."""
    recorded = recorded.to(predicted.dtype)
    scale = max(1.0, float(recorded.abs().max()))
    return torch.allclose(predicted.detach(), recorded, rtol=1e-3, atol=1e-4 * scale)
