"""An exact shortcut for the backward pass through the dense heads of torchvision's RetinaNet,
FCOS and SSD.

Their heads score every anchor of every level (thousands), and a plain backward pass goes
through the head at all of them, although a detection's score uses one anchor (its class
scores, and its box with ``with_box``). :class:`DenseRows` cuts the graph at the head's outputs
during the forward pass (they become leaves that require grad), so the gradient of a score
reaches them through the post-processing only. The anchors with a non-zero gradient are then
replayed: the head runs again on a crop of their level around each one's location, from the
recorded features, whose graph leads back to the target layer, and the crop's outputs at that
location, weighted by the leaves' gradient, are differentiated.

Why the crop is exact: the heads run each level on its own, and where they hold only
convolutions of stride 1 with "same" padding, batch norms (in eval mode) and pointwise
activations, an output location depends on the input within the head's receptive radius
``r`` (the sum of ``(k - 1) / 2 * dilation`` along the longest path) and on nothing else. A crop
of radius ``r`` around the location, clipped at the level's borders, gives that output the same
inputs, and at a clipped border the convolutions pad with the same zeros as on the whole map;
so its value, and its gradient with respect to the features, are the plain ones (the chain
rule: the leaves' gradient times the Jacobian of those outputs). A head with a normalisation
over the whole map (FCOS's GroupNorm) makes every location depend on all of its level: it is
replayed on the whole level of each used anchor, which is exact too, and saves the other levels.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from camviz.core.heldpasses import torchvision_classes, torchvision_detectors
from camviz.core.modelstate import HookSet
from camviz.core.roiheads import AutocastState, autocast_state, replayed_precision

# Modules that act on each location alone (batch norm in eval mode, as camviz runs models).
_POINTWISE = (
    nn.BatchNorm2d,
    nn.ReLU,
    nn.ReLU6,
    nn.Hardswish,
    nn.SiLU,
    nn.Identity,
    nn.Dropout,
)
# Normalisations over the whole map: a location depends on its whole level.
_WHOLE_MAP = (nn.GroupNorm,)
# torchvision's dense heads, by the module that defines each.
_HEADS = {
    "retinanet": "RetinaNetHead",
    "fcos": "FCOSHead",
    "ssd": "SSDHead",
    "ssdlite": "SSDLiteHead",
}


class _UnknownReachError(Exception):
    """A head holds a module whose reach over the map is not known."""


class DenseRows:
    """Gradients through a dense head for the anchors a score depends on only.

    Use :meth:`cut` around the forward pass, then :meth:`gradients` in place of
    ``torch.autograd.grad(score, inputs)``.

    Attributes:
        radius: The head's receptive radius on its input (``None``: a location depends on
            its whole level, and the level is replayed).
    """

    def __init__(self, head: nn.Module, anchors: Sequence[int], radius: int | None) -> None:
        self.head = head
        self.anchors = list(anchors)  # per level, per location
        self.radius = radius
        self._features: list[torch.Tensor] | None = None
        self._leaves: dict[str, torch.Tensor] | None = None
        self._autocast: AutocastState = None

    @classmethod
    def of(cls, model: nn.Module, taps: Sequence[str]) -> DenseRows | None:
        """The shortcut for a model with one torchvision RetinaNet, FCOS or SSD whose head is
        torchvision's and holds no target spot; ``None`` otherwise."""
        found = [
            (name, detector)
            for name, detector in torchvision_detectors(model)
            if _is_dense_head(getattr(detector, "head", None))
        ]
        if len(found) != 1:
            return None
        name, detector = found[0]
        prefix = f"{name}.head" if name else "head"
        if any(tap == prefix or tap.startswith(f"{prefix}.") for tap in taps):
            return None
        head = cast(nn.Module, detector.head)
        try:
            radius = _radius(head, top=True)
        except _UnknownReachError:
            return None
        anchors = cast(Any, detector.anchor_generator).num_anchors_per_location()
        return cls(head, anchors, radius)

    @contextmanager
    def cut(self) -> Iterator[None]:
        """Record the head's input levels and make its outputs leaves, for one pass."""

        def on_head(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            features = list(args[0])
            counts = self._level_counts(features)
            if counts is None or any(value.shape[1] != sum(counts) for value in output.values()):
                return None  # outputs not laid out by anchors: the graph stays whole
            self._features = features
            self._autocast = autocast_state(features[0].device if features else None)
            self._leaves = {
                key: value.detach().requires_grad_(value.requires_grad)
                for key, value in output.items()
            }
            return dict(self._leaves)

        with HookSet() as hooks:
            hooks.add(self.head.register_forward_hook(on_head))
            yield

    def gradients(
        self, score: torch.Tensor, inputs: Sequence[torch.Tensor], retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        """``torch.autograd.grad(score, inputs)``, through the anchors that ``score`` uses."""
        leaves, features = self._leaves, self._features
        counts = None if features is None else self._level_counts(features)
        if (
            leaves is None
            or features is None
            or counts is None
            or not all(leaf.requires_grad for leaf in leaves.values())
        ):  # the head did not run with a graph, or was not cut
            return torch.autograd.grad(score, inputs, retain_graph=retain_graph, allow_unused=True)
        keys = list(leaves)
        grads = torch.autograd.grad(
            score, [leaves[key] for key in keys], retain_graph=True, allow_unused=True
        )
        weights = {
            key: torch.zeros_like(leaves[key]) if grad is None else grad
            for key, grad in zip(keys, grads, strict=True)
        }
        used = torch.stack([weight.ne(0).flatten(2).any(2) for weight in weights.values()])
        anchors = used.any(0).nonzero()  # (image, anchor) pairs
        if not len(anchors):
            return tuple(None for _ in inputs)
        outputs, grad_outputs = [], []
        with torch.enable_grad(), replayed_precision(self._autocast):
            for image, level, y, x in self._locations(anchors, features, counts):
                replayed, start, stop = self._replay(features, image, level, y, x)
                first = (
                    sum(counts[:level])
                    + (y * features[level].shape[-1] + x) * (self.anchors[level])
                )
                for key in keys:
                    weight = weights[key][image, first : first + stop - start]
                    if weight.any():  # a branch the score does not read is not walked back
                        outputs.append(replayed[key][0, start:stop])
                        grad_outputs.append(weight.to(replayed[key].dtype))
        return torch.autograd.grad(
            outputs, inputs, grad_outputs, retain_graph=retain_graph, allow_unused=True
        )

    def _level_counts(self, features: Sequence[torch.Tensor]) -> list[int] | None:
        """The number of anchors of each level, or ``None`` if the levels and the anchors
        per location do not pair up."""
        if len(features) != len(self.anchors):
            return None
        return [
            level.shape[-2] * level.shape[-1] * count
            for level, count in zip(features, self.anchors, strict=True)
        ]

    def _locations(
        self, anchors: torch.Tensor, features: Sequence[torch.Tensor], counts: Sequence[int]
    ) -> list[tuple[int, int, int, int]]:
        """The ``(image, level, y, x)`` of the used ``(image, anchor)`` pairs, each once."""
        bounds = torch.tensor(counts).cumsum(0).tolist()
        found = set()
        for image, anchor in anchors.tolist():
            level = next(index for index, bound in enumerate(bounds) if anchor < bound)
            location = (anchor - (bounds[level] - counts[level])) // self.anchors[level]
            width = features[level].shape[-1]
            found.add((image, level, location // width, location % width))
        return sorted(found)

    def _replay(
        self, features: Sequence[torch.Tensor], image: int, level: int, y: int, x: int
    ) -> tuple[dict[str, torch.Tensor], int, int]:
        """The head's outputs on the crop of ``level`` around ``(y, x)`` of one image, and
        the rows of its outputs that belong to that location's anchors.

        The other levels are handed a crop of at most 2 x 2 locations (the heads run each
        level on its own; SSD's have a module per level, so every level must be there; a
        GroupNorm needs more than one value per group), whose outputs get no gradient.
        """
        height, width = features[level].shape[-2:]
        reach = max(height, width) if self.radius is None else self.radius
        top, left = max(0, y - reach), max(0, x - reach)
        bottom, right = min(height, y + reach + 1), min(width, x + reach + 1)
        crops = [
            features[index][image : image + 1, :, top:bottom, left:right]
            if index == level
            else features[index][image : image + 1, :, :2, :2].detach()
            for index in range(len(features))
        ]
        replayed = self.head(crops)
        start = (
            sum(
                crop.shape[-2] * crop.shape[-1] * count
                for crop, count in zip(crops[:level], self.anchors, strict=False)
            )
            + ((y - top) * (right - left) + (x - left)) * self.anchors[level]
        )
        return replayed, start, start + self.anchors[level]


def _is_dense_head(head: Any) -> bool:
    """Whether ``head`` is one of torchvision's RetinaNet, FCOS or SSD heads."""
    kinds = torchvision_classes(_HEADS)
    return bool(kinds) and isinstance(head, kinds)


def _radius(module: nn.Module, top: bool = False) -> int | None:
    """The receptive radius of a torchvision dense head (``top``) or one of its parts, on its
    input; ``None`` when a location depends on its whole level.

    The head's children are its branches (classification, regression), which read the same
    input: the largest radius counts. A ``ModuleList`` holds one module per level (SSD's):
    the largest counts. Any other module runs its children in turn: their radii add up (an
    upper bound, which a crop may exceed and stay exact).

    Raises:
        _UnknownReachError: A convolution is strided or not "same"-padded, or a module's reach is
            unknown.
    """
    if isinstance(module, nn.Conv2d):
        kernel, dilation = module.kernel_size, module.dilation
        reach = [(k - 1) * d for k, d in zip(kernel, dilation, strict=True)]
        if (
            any(stride != 1 for stride in module.stride)
            or isinstance(module.padding, str)
            or any(r % 2 or p * 2 != r for r, p in zip(reach, module.padding, strict=True))
        ):
            raise _UnknownReachError(module)
        return max(reach) // 2
    if isinstance(module, _POINTWISE):
        return 0
    if isinstance(module, _WHOLE_MAP):
        return None
    children = [_radius(child) for child in module.children()]
    if not children:
        raise _UnknownReachError(module)
    if any(child is None for child in children):
        return None
    known = [child for child in children if child is not None]
    return max(known) if top or isinstance(module, nn.ModuleList) else sum(known)
