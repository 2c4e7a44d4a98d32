"""Methods that run another method (the *base*) with a changed target or layer fusion:
Finer-CAM and RefineCAM. SESS, which runs its base on image patches, is in
:mod:`camviz.cams.sess`.

Every wrapper takes ``base=`` (a registry name or a method instance) and passes its other
keyword arguments to the base's constructor::

    camviz.explain(model, x, "finercam", base="layercam", alpha=0.6)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.registry import create, register
from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs
from camviz.core.targets import TargetObject


class Wrapper(CamMethod):
    """A method whose maps are those of a base method, computed in a changed setting.

    Args:
        base: The base method: a registry name, or an instance (then without options).
        **options: Passed to the base method's constructor.
    """

    default_base: ClassVar[str]

    def __init__(self, base: str | CamMethod | None = None, **options: Any) -> None:
        if isinstance(base, CamMethod):
            if options:
                raise CamvizError(
                    f"{self.name}: pass options to the base method's constructor, not with an "
                    f"instance (got {', '.join(options)})"
                )
            self.base = base
        else:
            self.base = create(base or self.default_base, **options)
        self.uses_gradients = self.base.uses_gradients
        self.uses_hessian = self.base.uses_hessian
        self.attention = self.base.attention

    def default_layer(self, model: nn.Module, batch: Inputs) -> str | None:
        return self.base.default_layer(model, batch)

    def rank_maps(self, ranks: Sequence[LayerData]) -> list[torch.Tensor]:
        return self.base.rank_maps(ranks)

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return self.base.layer_map(data)


@register
class FinerCAM(Wrapper):
    """Finer-CAM: the base method explaining ``y_c - alpha * mean_t y_{d_t}``.

    Paper: Zhang et al., "Finer-CAM: Spotting the Difference Reveals Finer Details for
    Visual Explanation", CVPR 2025.

    For the explained class ``c`` and the ``T`` reference classes ``d_t`` whose logits are
    closest to ``y_c`` (the most similar classes, which share most of ``c``'s evidence)::

        y~ = y_c - alpha * (1 / T) sum_t y_{d_t}

    and the map is the base method's (Grad-CAM by default) for ``y~``: the evidence for
    ``c`` that is not evidence for its look-alikes. It is camviz's
    :class:`~camviz.core.targets.Contrast` target with ``b = Nearest(references)``; an
    explicit ``Contrast`` target is explained as given, and any other class target chooses
    ``c`` (``None``: each sample's top class). Costs what the base method costs.

    Compared with the peers: torchcam's ``FinerCAM`` is this formula (``gamma=0.6``, 3
    references, Grad-CAM, Grad-CAM++ or LayerCAM as base). pytorch-grad-cam's (the authors'
    code) weighs the references by their softmax probabilities ``p_d``,
    ``sum_t p_t (y_c - alpha y_{d_t}) / sum_t p_t``, and differentiates through ``p_d`` too,
    with ``alpha = 1``; with one reference the three agree.

    Args:
        base: The base method (default ``"gradcam"``).
        alpha: The comparison strength (``0``: the base method alone).
        references: ``T``, the number of nearest classes compared with.
        **options: Passed to the base method.
    """

    name = "finercam"
    paper = (
        "Zhang et al., Finer-CAM: Spotting the Difference Reveals Finer Details for Visual "
        "Explanation, CVPR 2025"
    )
    needs = "what its base method needs (default gradcam), for y_c - alpha * y_nearest"
    default_base = "gradcam"

    def __init__(
        self,
        base: str | CamMethod | None = None,
        alpha: float = 0.6,
        references: int = 3,
        **options: Any,
    ) -> None:
        super().__init__(base, **options)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
            raise CamvizError(f"finercam needs alpha >= 0, got {alpha!r}")
        if isinstance(references, bool) or not isinstance(references, int) or references < 1:
            raise CamvizError(f"finercam needs references >= 1 (an int), got {references!r}")
        self.alpha = float(alpha)
        self.references = references

    def explained_target(self, target: TargetObject) -> TargetObject:
        contrast = target.nearest_contrast(self.references, self.alpha)
        if contrast is None:
            raise CamvizError(
                "finercam compares class scores; give a class target (an id, ids, 'top1'), "
                "or a Contrast"
            )
        return contrast


@register
class RefineCAM(Wrapper):
    """RefineCAM: the base method's maps at several layers, multiplied.

    Paper: Domeniconi et al., "How to Evaluate and Refine your CAM", ICPR 2026
    (arXiv 2605.14641).

    With ``L_l`` the base method's map at target layer ``l`` (after ReLU), ``s`` min-max
    normalisation and ``U`` bilinear upsampling to the input::

        R = s( prod_l U( s(L_l) ) )

    Deep layers say *which* region, early layers say it sharply; the product keeps what all
    of them agree on. Pass the layers as ``layer=["layer2", "layer3", "layer4"]``; with one
    layer it is the base method's map. The base is Grad-CAM++ by default, as in both peers.

    Compared with the peers: pytorch-grad-cam multiplies maps resized to the input (as
    here); torchcam resizes them to the largest layer's grid before multiplying.

    Args:
        base: The base method (default ``"gradcam++"``).
        **options: Passed to the base method.
    """

    name = "refinecam"
    paper = "Domeniconi et al., How to Evaluate and Refine your CAM, ICPR 2026"
    needs = "what its base method needs (default gradcam++), at several layers"
    default_base = "gradcam++"
    fuse = "product"
