"""A torchvision detector's passes on copies of one image, with what its plain pass chose held.

Ablation-CAM hands the layers after its target a batch of ablated copies of one image's layer
output. A torchvision detector's own forward pass does not take such a batch: its transform
sizes each image it is given, its anchors and post-processing loop over the images the
transform made, and an R-CNN's region proposal network proposes anew for every copy.
:class:`HeldDetector` makes the detector's forward pass take it, with hooks that hold for the
passes on ``R`` copies of one image:

* the transform runs on the first copy only (the copies are of one image, so their resized
  tensors are the same) and reports that image's size ``R`` times, so that the anchors and the
  post-processing see ``R`` images;
* the backbone's levels that the ablation did not reach (one row) are expanded to ``R`` rows;
* an R-CNN's proposals are those of the plain pass that the explained scores use (their RoI
  rows, :meth:`camviz.core.roiheads.RoIRows.used_proposals`; all of them for a score that may
  read masks or keypoints): the region proposal network runs on one location of one row (a
  module's call cannot be skipped by a hook) and its answer is replaced by them, so the RoI
  heads score those rows only;
* when the model is the R-CNN itself and the scores are :class:`~camviz.Detection`'s, the box
  predictor's rows of all copies are scored at once (:mod:`camviz.core.heldscores`) and the
  RoI heads' own call gets no proposal: torchvision's post-processing, which loops over the
  copies as images, and the mask and keypoint heads, which no such score reads, do not run.

With the proposals held, a pass on copies is the whole network's pass on each copy with the
same proposals, which a test checks channel by channel.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from camviz.core.detection import DetectionScore
from camviz.core.heldscores import HeldRows, copy_scores, reads_output
from camviz.core.modelstate import HookSet
from camviz.core.roiheads import RoIRows
from camviz.core.taps import parse

# torchvision's detector classes, by the module that defines each.
_DETECTORS = {
    "generalized_rcnn": "GeneralizedRCNN",
    "retinanet": "RetinaNet",
    "fcos": "FCOS",
    "ssd": "SSD",
}


def torchvision_classes(where: Mapping[str, str]) -> tuple[type, ...]:
    """Torchvision's detection classes named in ``where`` (module in
    ``torchvision.models.detection`` -> class name) that are loaded: a model can hold one
    only if its module was imported, so nothing is imported here."""
    found = (
        getattr(sys.modules.get(f"torchvision.models.detection.{module}"), name, None)
        for module, name in where.items()
    )
    return tuple(kind for kind in found if isinstance(kind, type))


def torchvision_detectors(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every torchvision detector in ``model`` (itself included)."""
    kinds = torchvision_classes(_DETECTORS)
    if not kinds:
        return []
    return [
        (name, cast(nn.Module, module))
        for name, module in model.named_modules()
        if isinstance(module, kinds)
    ]


class HeldDetector:
    """Hooks that make one torchvision detector take ``R`` copies of one image (see the module
    docstring): :meth:`hold` on the plain pass of the image, then :meth:`passes` around each
    pass on copies."""

    def __init__(self, detector: nn.Module, whole: bool = False) -> None:
        self.detector = detector
        self.whole = whole  # the model is the detector: its output is the detector's
        heads = getattr(detector, "roi_heads", None)
        self.rows = None if heads is None else RoIRows(heads)
        self.proposals: dict[int, list[torch.Tensor]] = {}  # per sample held

    @classmethod
    def of(cls, model: nn.Module, layer: str) -> HeldDetector | None:
        """The hooks for a model with one torchvision detector whose backbone holds the
        layer spot ``layer``; ``None`` otherwise."""
        found = torchvision_detectors(model)
        if len(found) != 1:
            return None
        name, detector = found[0]
        backbone = f"{name}.backbone" if name else "backbone"
        spot = parse(layer).name
        if spot != backbone and not spot.startswith(f"{backbone}."):
            return None
        return cls(detector, whole=not name)

    def hold(
        self, sample: int, run: Callable[[], Sequence[torch.Tensor]], fns: Sequence[object] = ()
    ) -> bool:
        """Run the plain pass of image ``sample`` alone (``run`` gives the explained scores of
        its output) and keep an R-CNN's proposals that those scores use, once per sample;
        whether there are any. ``fns`` are the score functions: one that is not a
        :class:`~camviz.Detection`'s read from the output as it is (:func:`reads_output`) may
        read masks or keypoints, whose heads take the detections of every proposal (RoI Align
        tells no proposal's gradient), so with such heads every proposal is kept."""
        if self.rows is None:
            return True
        if sample not in self.proposals:
            with self.rows.cut(graph_after=True), torch.no_grad():
                scores = run()
            heads: Any = self.detector.roi_heads
            other_heads = heads.has_mask() or heads.has_keypoint()
            if other_heads and not all(map(reads_output, fns)):
                self.proposals[sample] = self.rows.pooled_proposals()
            else:
                self.proposals[sample] = self.rows.used_proposals(scores)
        return any(len(boxes) for boxes in self.proposals[sample])

    @contextmanager
    def passes(self, sample: int, scores: Sequence[object] = ()) -> Iterator[HeldPass]:
        """The hooks for passes on copies of image ``sample`` (given as ``R`` images). The
        :class:`HeldPass` it gives scores the copies from an R-CNN's box predictor rows when
        ``scores`` (the explained score functions) allow it; otherwise the output is scored
        as usual."""
        copies = 1
        fns = cast(list[DetectionScore], list(scores)) if self._scorable(scores) else []
        held = HeldPass(sample, fns)
        original: list[tuple[int, int]] = []

        def first_only(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            nonlocal copies
            images, *rest = args
            copies = len(images)
            original[:] = [tuple(images[0].shape[-2:])]
            return (images[:1], *rest)

        def sized_per_copy(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            images, targets = output
            return type(images)(images.tensors, list(images.image_sizes) * copies), targets

        with HookSet() as hooks:
            transform = cast(nn.Module, self.detector.transform)
            hooks.add(transform.register_forward_pre_hook(first_only))
            hooks.add(transform.register_forward_hook(sized_per_copy))
            hooks.add(
                cast(nn.Module, self.detector.backbone).register_forward_hook(
                    lambda module, args, output: _expanded(output, copies)
                )
            )
            if self.rows is not None:
                proposals = self.proposals[sample]
                self._held_proposals(hooks, proposals, lambda: copies)
                if held.fns:
                    heads = cast(nn.Module, self.detector.roi_heads)
                    scoring = held.scoring(heads, transform, original)
                    hooks.add(heads.register_forward_pre_hook(scoring))
            yield held

    def _scorable(self, scores: Sequence[object]) -> bool:
        """Whether copies can be scored from the box predictor's rows (:mod:`heldscores`):
        the model is a torchvision R-CNN with its own forward, RoI heads and transform, and
        the scores are :class:`~camviz.Detection`'s, read from its output as it is."""
        if not scores or self.rows is None or not self.whole or self.detector.training:
            return False
        kinds = torchvision_classes(
            {
                "generalized_rcnn": "GeneralizedRCNN",
                "roi_heads": "RoIHeads",
                "transform": "GeneralizedRCNNTransform",
            }
        )
        if len(kinds) != 3:
            return False
        rcnn, heads, transform = kinds
        return (
            getattr(type(self.detector), "forward", None) is getattr(rcnn, "forward", None)
            and type(self.detector.roi_heads) is heads
            and type(self.detector.transform) is transform
            and all(reads_output(fn) for fn in scores)
        )

    def _held_proposals(
        self, hooks: HookSet, proposals: list[torch.Tensor], copies: Callable[[], int]
    ) -> None:
        """Hooks that run the region proposal network on one location of one row (its
        answer is not used) and answer ``proposals`` for every copy."""

        def one_location(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            images, features, *rest = args
            single = type(images)(images.tensors, list(images.image_sizes)[:1])
            return (single, {key: level[:1, :, :1, :1] for key, level in features.items()}, *rest)

        def held(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            _, losses = output
            return list(proposals) * copies(), losses

        rpn = cast(nn.Module, self.detector.rpn)
        hooks.add(rpn.register_forward_pre_hook(one_location))
        hooks.add(rpn.register_forward_hook(held))


def _expanded(output: Any, copies: int) -> Any:
    """The backbone's output with every one-row level expanded to ``copies`` rows (a view)."""
    if isinstance(output, torch.Tensor):
        return output.expand(copies, *output.shape[1:]) if len(output) == 1 else output
    if isinstance(output, Mapping):
        return cast(Any, type(output))(
            (key, _expanded(level, copies)) for key, level in output.items()
        )
    return output


class HeldPass:
    """One pass on copies of image ``sample``: the R-CNN's box predictor rows when they are
    scored at once (``fns``, the explained objects' scores; none: the output is scored)."""

    def __init__(self, sample: int, fns: list[DetectionScore]) -> None:
        self.sample = sample
        self.fns = fns
        self.rows: HeldRows | None = None

    def scoring(
        self, heads: nn.Module, transform: nn.Module, original: list[tuple[int, int]]
    ) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...]]:
        """A pre-hook for the RoI heads: score every copy's rows through the pool, the box
        head and the predictor, keep them, and hand the heads' own call one image with no
        proposal."""

        def scored(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            features, proposals, sizes, *rest = args
            pooled = _pooled(cast(nn.Module, heads.box_roi_pool), features, proposals[0], sizes)
            logits, regression = cast(nn.Module, heads.box_predictor)(
                cast(nn.Module, heads.box_head)(pooled)
            )
            self.rows = HeldRows(
                heads, transform, logits, regression, proposals[0], sizes[0], original[0]
            )
            one = {key: level[:1] for key, level in features.items()}
            return (one, [proposals[0][:0]], list(sizes)[:1], *rest)

        return scored

    def scores(self) -> torch.Tensor | None:
        """``(K, R)``: each explained object's score in each copy, or ``None`` when the
        copies were not scored here."""
        if self.rows is None:
            return None
        return torch.stack([copy_scores(self.rows, fn, self.sample) for fn in self.fns])


def _pooled(
    pool: nn.Module,
    features: Mapping[str, torch.Tensor],
    proposals: torch.Tensor,
    sizes: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """``(R * P, C, h, w)``: the RoI pool of ``P`` proposals from each of ``R`` copies' levels,
    copy by copy. The copies are folded into the channels of one image, ``(1, R * C, H, W)``
    (RoI Align pools each channel on its own, at the same points), so that the pool's Python,
    which loops over its images, runs once."""
    copies, channels = next(iter(features.values())).shape[:2]
    folded = {key: level.reshape(1, -1, *level.shape[2:]) for key, level in features.items()}
    pooled = pool(folded, [proposals], list(sizes)[:1])
    return pooled.unflatten(1, (copies, channels)).transpose(0, 1).flatten(0, 1)
