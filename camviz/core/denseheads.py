"""An exact shortcut for the backward pass through the dense heads of torchvision's RetinaNet,
FCOS and SSD.

Their heads score every anchor of every level (thousands), and a plain backward pass goes
through the head at all of them, although a detection's score uses one anchor (its class
scores, and its box with ``with_box``). :class:`DenseRows` cuts the graph at the head's outputs
during the forward pass (they become leaves that require grad), so the gradient of a score
reaches them through the post-processing only. The anchors with a non-zero gradient are then
replayed, from the recorded features, whose graph leads back to the target layer: only the
branches (classification, regression) whose outputs the score reads, once per level for all
the anchors of that level (of every image), each on the crop of its level around its location;
the crops' outputs at those locations, weighted by the leaves' gradient, are differentiated.

Why the crop is exact: the heads run each level on its own, and where they hold only
convolutions of stride 1 with "same" padding, batch norms (in eval mode) and pointwise
activations, an output location depends on the input within the branch's receptive radius
``r`` (the sum of ``(k - 1) / 2 * dilation`` along its layers) and on nothing else. The crop is
the ``2r + 1`` square around the location, zero where it lies outside the level, and each
convolution runs on it without padding (:class:`_ValidConvolutions`), its input first set to
zero outside the level, which is what the padding of the whole map puts there: the crop
narrows by ``k - 1`` at each layer, so each computes only what the location needs, and the last
gives that location alone, with the plain value (the chain rule: its gradient with respect to
the features is the leaves' gradient times the Jacobian of those outputs). A head with a
normalisation over the whole map (FCOS's GroupNorm) makes every location depend on all of its
level: the level is replayed whole, once for all the anchors of each image on it, which is
exact too, and saves the other levels.

What each score still walks back densely is torchvision's post-processing, from the detection
to the head's outputs at every anchor. During the cut pass :class:`_IndexedMasks` makes its
boolean-mask selections by index, the same elements with a cheaper backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import groupby
from typing import Any, cast

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.calls import CallMode
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
# The branch (child module) that gives each of a head's outputs, and the output's place in
# what the branch returns (None: the branch returns it alone); FCOS's regression branch also
# gives the centre-ness.
_OUTPUTS: dict[str, tuple[str, int | None]] = {
    "cls_logits": ("classification_head", None),
    "bbox_regression": ("regression_head", None),
}
_FCOS_OUTPUTS: dict[str, tuple[str, int | None]] = {
    "cls_logits": ("classification_head", None),
    "bbox_regression": ("regression_head", 0),
    "bbox_ctrness": ("regression_head", 1),
}
# F.conv2d's arguments, and the defaults of those after the weight.
_CONV_ARGUMENTS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
# (image, y, x) of a used location on one level.
Location = tuple[int, int, int]


class _UnknownReachError(Exception):
    """A head holds a module whose reach over the map is not known."""


@dataclass
class _Branch:
    """One branch of a dense head: the outputs it gives (their place in what it returns),
    its receptive radius on each level (``None``: the whole level), and whether it holds a
    module per level (SSD's), so that the levels before the replayed one must be handed too."""

    module: nn.Module
    outputs: dict[str, int | None]
    radii: list[int | None]
    per_level: bool


class DenseRows:
    """Gradients through a dense head for the anchors a score depends on only.

    Use :meth:`cut` around the forward pass, then :meth:`gradients` in place of
    ``torch.autograd.grad(score, inputs)``.

    Attributes:
        radius: The head's largest receptive radius on its input (``None``: a location
            depends on its whole level, and the level is replayed).
    """

    def __init__(self, head: nn.Module, anchors: Sequence[int], branches: list[_Branch]) -> None:
        self.head = head
        self.anchors = list(anchors)  # per level, per location
        self.branches = branches
        radii = [radius for branch in branches for radius in branch.radii]
        self.radius = None if None in radii else max(cast(list[int], radii))
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
        anchors = cast(Any, detector.anchor_generator).num_anchors_per_location()
        outputs = _FCOS_OUTPUTS if type(head).__name__ == "FCOSHead" else _OUTPUTS
        branches: dict[str, _Branch] = {}
        try:
            for key, (child, place) in outputs.items():
                if child not in branches:
                    module = cast(nn.Module, getattr(head, child))
                    radii = [_radius(module, level) for level in range(len(anchors))]
                    per_level = any(isinstance(part, nn.ModuleList) for part in module.modules())
                    branches[child] = _Branch(module, {}, radii, per_level)
                branches[child].outputs[key] = place
        except _UnknownReachError:
            return None
        return cls(head, anchors, list(branches.values()))

    @contextmanager
    def cut(self) -> Iterator[None]:
        """Record the head's input levels and make its outputs leaves, for one pass."""
        known = {key for branch in self.branches for key in branch.outputs}

        def on_head(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            features = list(args[0])
            counts = self._level_counts(features)
            if (
                counts is None
                or set(output) != known
                or any(value.shape[1] != sum(counts) for value in output.values())
            ):  # outputs not laid out by anchors, or not all replayed: the graph stays whole
                return None
            self._features = features
            self._autocast = autocast_state(features[0].device if features else None)
            self._leaves = {
                key: value.detach().requires_grad_(value.requires_grad)
                for key, value in output.items()
            }
            return dict(self._leaves)

        with HookSet() as hooks, _IndexedMasks():
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
        weights = {key: grad for key, grad in zip(keys, grads, strict=True) if grad is not None}
        # An anchor is used where its gradient has a non-zero (or NaN) value: one pass over
        # each leaf's gradient (a reduction of the magnitudes, the cheapest that tells).
        used = (
            torch.stack([weight.flatten(2).abs().amax(2) for weight in weights.values()]).amax(0)
            != 0
            if weights
            else None
        )
        if used is None or not used.any():
            return tuple(None for _ in inputs)
        outputs, grad_outputs = [], []
        with torch.enable_grad(), replayed_precision(self._autocast):
            for level, group in self._locations(used.nonzero(), features, counts):
                for branch in self.branches:
                    rows = self._weights(branch, weights, level, group, features, counts)
                    if not rows:
                        continue  # a branch the score does not read is not replayed
                    replayed = self._replayed(branch, features, level, group)
                    for key, weight in rows.items():
                        outputs.append(replayed[key])
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
    ) -> list[tuple[int, list[Location]]]:
        """The used ``(image, anchor)`` pairs as each level's ``(image, y, x)``, each once."""
        bounds = torch.tensor(counts).cumsum(0).tolist()
        found = set()
        for image, anchor in anchors.tolist():
            level = next(index for index, bound in enumerate(bounds) if anchor < bound)
            location = (anchor - (bounds[level] - counts[level])) // self.anchors[level]
            width = features[level].shape[-1]
            found.add((level, image, location // width, location % width))
        return [
            (level, [place[1:] for place in places])
            for level, places in groupby(sorted(found), key=lambda place: place[0])
        ]

    def _weights(
        self,
        branch: _Branch,
        weights: dict[str, torch.Tensor],
        level: int,
        group: Sequence[Location],
        features: Sequence[torch.Tensor],
        counts: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        """``(L, A, K)``: the leaves' gradient at the anchors of each location of ``group``,
        for each output of ``branch`` that the score reads there."""
        width, count = features[level].shape[-1], self.anchors[level]
        firsts = [sum(counts[:level]) + (y * width + x) * count for _, y, x in group]
        rows = {}
        for key in branch.outputs:
            if key in weights:
                weight = torch.stack(
                    [
                        weights[key][image, first : first + count]
                        for (image, _, _), first in zip(group, firsts, strict=True)
                    ]
                )
                if weight.any():
                    rows[key] = weight
        return rows

    def _replayed(
        self,
        branch: _Branch,
        features: Sequence[torch.Tensor],
        level: int,
        group: Sequence[Location],
    ) -> dict[str, torch.Tensor]:
        """``(L, A, K)``: each output of ``branch`` at the anchors of each location of
        ``group`` on ``level``, replayed from ``features``: on the narrowing crops where the
        branch's radius is known and it gives one location per crop, else on the level."""
        radius = branch.radii[level]
        if radius is not None and (not branch.per_level or None not in branch.radii[:level]):
            try:
                return self._on_crops(branch, features, level, group, radius)
            except _UnknownReachError:
                pass
        return self._on_level(branch, features, level, group)

    def _on_crops(
        self,
        branch: _Branch,
        features: Sequence[torch.Tensor],
        level: int,
        group: Sequence[Location],
        radius: int,
    ) -> dict[str, torch.Tensor]:
        """The replay on one ``2r + 1`` crop per location, by valid convolutions.

        Raises:
            _UnknownReachError: The branch did not give one location per crop and level.
        """
        crops = torch.cat([_crop(features[level][image], y, x, radius) for image, y, x in group])
        levels = [crops]
        if branch.per_level:  # the levels before get zero crops of their own radius
            sizes = [2 * cast(int, radius) + 1 for radius in branch.radii[:level]]
            levels = [
                features[index]
                .new_zeros(())
                .expand(len(group), features[index].shape[1], size, size)
                for index, size in enumerate(sizes)
            ] + levels
        height, width = features[level].shape[-2:]
        with _ValidConvolutions(group, height, width):
            given = _as_tuple(branch.module(levels))
        rows = sum(self.anchors[level - len(levels) + 1 : level + 1])
        if any(output.shape[1] != rows for output in given):
            raise _UnknownReachError(branch.module)
        return {
            key: given[place or 0][:, rows - self.anchors[level] :]
            for key, place in branch.outputs.items()
        }

    def _on_level(
        self,
        branch: _Branch,
        features: Sequence[torch.Tensor],
        level: int,
        group: Sequence[Location],
    ) -> dict[str, torch.Tensor]:
        """The replay on the whole level, once for each image of ``group``. A branch with a
        module per level is handed the levels before as 2 x 2 crops (a GroupNorm needs more
        than one value per group), whose outputs get no gradient."""
        images = sorted({image for image, _, _ in group})
        before_level = range(level) if branch.per_level else range(0)
        levels = [features[index][images, :, :2, :2].detach() for index in before_level]
        levels.append(features[level][images])
        given = _as_tuple(branch.module(levels))
        before = sum(
            crop.shape[-2] * crop.shape[-1] * count
            for crop, count in zip(levels[:-1], self.anchors, strict=False)
        )
        width, count = features[level].shape[-1], self.anchors[level]
        starts = [before + (y * width + x) * count for _, y, x in group]
        return {
            key: torch.stack(
                [
                    given[place or 0][images.index(image), start : start + count]
                    for (image, _, _), start in zip(group, starts, strict=True)
                ]
            )
            for key, place in branch.outputs.items()
        }


class _IndexedMasks(CallMode):
    """Indexing a tensor that requires grad by a one-dimensional boolean mask, done by the
    mask's indices (``index_select``; a copy where the mask keeps everything): the same
    elements, but the backward pass of each score no longer searches the mask again and
    scatters into it (torchvision's post-processing selects the anchors above its threshold
    so, and each object's gradient went through that for every anchor)."""

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is torch.Tensor.__getitem__ and not kwargs and len(args) == 2:
            tensor, index = args
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.requires_grad
                and isinstance(index, torch.Tensor)
                and index.dtype == torch.bool
                and index.dim() == 1
                and index.shape[0] == tensor.shape[0]
            ):
                if bool(index.all()):
                    return tensor.clone()
                return tensor.index_select(0, index.nonzero()[:, 0])
        return func(*args, **kwargs)


def _as_tuple(output: Any) -> tuple[torch.Tensor, ...]:
    return tuple(output) if isinstance(output, (tuple, list)) else (output,)


def _crop(level: torch.Tensor, y: int, x: int, radius: int) -> torch.Tensor:
    """``(1, C, 2r + 1, 2r + 1)``: the square of ``level`` (``(C, H, W)``) around ``(y, x)``,
    zero outside it."""
    height, width = level.shape[-2:]
    top, left = max(0, y - radius), max(0, x - radius)
    bottom, right = min(height, y + radius + 1), min(width, x + radius + 1)
    pad = (left - (x - radius), x + radius + 1 - right, top - (y - radius), y + radius + 1 - bottom)
    return F.pad(level[:, top:bottom, left:right], pad)[None]


class _ValidConvolutions(CallMode):
    """Runs the "same"-padded, stride-1 convolutions of a branch on crops centred on
    ``locations`` (``(image, y, x)``, one crop per row, on a level ``height`` x ``width``) as
    valid ones: each input is first set to zero where it lies outside the level (what the
    padding of the whole level puts there), then convolved without padding, so the crop
    narrows around its centre by ``k - 1``.

    Raises:
        _UnknownReachError: A convolution is strided or not "same"-padded.
    """

    def __init__(self, locations: Sequence[Location], height: int, width: int) -> None:
        super().__init__()
        centres = torch.tensor([(y, x) for _, y, x in locations])
        self.centres, self.height, self.width = centres, height, width
        self.masks: dict[tuple[int, int], torch.Tensor] = {}

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func is not F.conv2d:
            return func(*args, **kwargs)
        given: dict[str, Any] = dict(_CONV_DEFAULTS)
        given.update(zip(_CONV_ARGUMENTS, args, strict=False))
        given.update(kwargs)
        inputs, weight = given.pop("input"), given["weight"]
        pairs = zip(
            _pair(given["padding"]), _pair(given["dilation"]), weight.shape[-2:], strict=True
        )
        if _pair(given["stride"]) != (1, 1) or any(
            not isinstance(pad, int) or 2 * pad != (k - 1) * d for pad, d, k in pairs
        ):
            raise _UnknownReachError(func)
        given["padding"] = 0
        return func(inputs * self._inside(inputs), **given)

    def _inside(self, inputs: torch.Tensor) -> torch.Tensor:
        """``(L, 1, h, w)``: 1 where a crop's ``h`` x ``w`` square lies inside the level."""
        size = (inputs.shape[-2], inputs.shape[-1])
        if size not in self.masks:
            rows = self.centres[:, :1] + torch.arange(size[0]) - (size[0] - 1) // 2
            columns = self.centres[:, 1:] + torch.arange(size[1]) - (size[1] - 1) // 2
            inside = ((rows >= 0) & (rows < self.height))[:, None, :, None] & (
                (columns >= 0) & (columns < self.width)
            )[:, None, None, :]
            self.masks[size] = inside.to(inputs.device)
        return self.masks[size].to(inputs.dtype)


def _pair(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def _is_dense_head(head: Any) -> bool:
    """Whether ``head`` is one of torchvision's RetinaNet, FCOS or SSD heads."""
    kinds = torchvision_classes(_HEADS)
    return bool(kinds) and isinstance(head, kinds)


def _radius(module: nn.Module, level: int | None = None) -> int | None:
    """The receptive radius of one branch of a torchvision dense head, or of one of its parts,
    on its input at ``level``; ``None`` when a location depends on its whole level.

    A ``ModuleList`` holds one module per level (SSD's): the one of ``level`` counts (without a
    level, the largest). Any other module runs its children in turn: their radii add up (an
    upper bound; a crop it makes too large gives more than one location, and the replay then
    takes the whole level).

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
            or module.padding_mode != "zeros"
            or any(r % 2 or p * 2 != r for r, p in zip(reach, module.padding, strict=True))
        ):
            raise _UnknownReachError(module)
        return max(reach) // 2
    if isinstance(module, _POINTWISE):
        return 0
    if isinstance(module, _WHOLE_MAP):
        return None
    children = list(module.children())
    if isinstance(module, nn.ModuleList) and level is not None and len(children) > level:
        children = children[level : level + 1]
    radii = [_radius(child, level) for child in children]
    if not radii:
        raise _UnknownReachError(module)
    if any(radius is None for radius in radii):
        return None
    known = [radius for radius in radii if radius is not None]
    return max(known) if isinstance(module, nn.ModuleList) else sum(known)
