"""An exact shortcut for the backward pass through torchvision's RoI heads.

Faster, Mask and Keypoint R-CNN score each of their region proposals (150 to 1,000 per
image) with the same per-RoI head: ``box_roi_pool`` (RoI Align on the feature maps), then
``box_head`` and ``box_predictor``, one row per proposal. A detection's score depends on one
row only, but a plain backward pass goes through all of them, and torchvision's RoI Align
backward dominates the cost: Grad-CAM of one detection took 2.3 plain forward passes of
``fasterrcnn_mobilenet_v3_large_320_fpn``.

:class:`RoIRows` cuts the graph at the predictor's outputs during the forward pass (they
become leaves that require grad), so the gradient of a score reaches them cheaply, through
the post-processing only. The rows with a non-zero gradient are then run again through the
pool and the two heads, from the recorded feature maps, which still carry the graph back to
the target layer; the gradient of those rows, weighted by the leaves' gradient, is exactly
the gradient of the score (the chain rule; the rows are independent of each other, and the
proposals are detached by torchvision's region proposal network). The backward pass then
costs a few rows of the heads plus the layers between the target and the pool. Mask and
Keypoint R-CNN's own heads pool the feature maps again for the detected boxes; that path is
not cut, so the gradient of a score that reads masks or keypoints comes through it as in a
plain backward pass, added to the replayed rows'.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

import torch
from torch import nn

from camviz.core.modelstate import HookSet


class RoIRows:
    """Gradients through one ``RoIHeads`` module for the RoIs a score depends on only.

    Use :meth:`cut` around the forward pass, then :meth:`gradients` in place of
    ``torch.autograd.grad(score, inputs)``.
    """

    def __init__(self, heads: nn.Module) -> None:
        self.pool = cast(nn.Module, heads.box_roi_pool)
        self.head = cast(nn.Module, heads.box_head)
        self.predictor = cast(nn.Module, heads.box_predictor)
        self._pooled_from: tuple[Any, list[torch.Tensor], Any] | None = None
        self._leaves: tuple[torch.Tensor, torch.Tensor] | None = None
        self._autocast: AutocastState = None

    @classmethod
    def of(cls, model: nn.Module, taps: Sequence[str]) -> RoIRows | None:
        """The shortcut for a model with one torchvision ``RoIHeads`` that no target spot
        lies in (a tap inside the heads would not be replayed); ``None`` otherwise."""
        detection = sys.modules.get("torchvision.models.detection.roi_heads")
        if detection is None:  # torchvision's detectors were never imported: none here
            return None
        found = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, detection.RoIHeads)
        ]
        if len(found) != 1:
            return None
        name, heads = found[0]
        prefix = f"{name}." if name else ""
        if any(tap == name or tap.startswith(prefix) for tap in taps):
            return None
        return cls(heads)

    @contextmanager
    def cut(self, graph_after: bool = False) -> Iterator[None]:
        """Record the pool's inputs and make the predictor's outputs leaves, for one pass.

        ``graph_after``: the leaves require grad and the post-processing keeps a graph even
        in a pass without one (to tell the rows a score uses, :meth:`used_rows`).
        """

        def on_pool(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            features, proposals, image_shapes = args
            self._pooled_from = (features, list(proposals), image_shapes)
            self._autocast = autocast_state(proposals[0].device if proposals else None)

        def on_predictor(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            logits, regression = output
            if graph_after:
                torch.set_grad_enabled(True)  # undone when the caller's no_grad block ends
            self._leaves = (
                logits.detach().requires_grad_(graph_after or logits.requires_grad),
                regression.detach().requires_grad_(graph_after or regression.requires_grad),
            )
            return self._leaves

        with HookSet() as hooks:
            hooks.add(self.pool.register_forward_hook(on_pool))
            hooks.add(self.predictor.register_forward_hook(on_predictor))
            yield

    def gradients(
        self, score: torch.Tensor, inputs: Sequence[torch.Tensor], retain_graph: bool
    ) -> tuple[torch.Tensor | None, ...]:
        """``torch.autograd.grad(score, inputs)``, through the rows that ``score`` uses."""
        if self._leaves is None or self._pooled_from is None or not self._leaves[0].requires_grad:
            return torch.autograd.grad(
                score, inputs, retain_graph=retain_graph, allow_unused=True
            )  # the heads did not run with a graph: nothing to shorten
        # Also at ``inputs``: what the score reads besides the box rows (a mask or keypoint
        # head pools the feature maps again for the detected boxes, a path the cut leaves).
        weights, rows, beside = self._leaf_gradients(score, inputs)
        if not len(rows):
            return beside
        features, _, image_shapes = self._pooled_from
        subset = self._per_image(rows)
        with torch.enable_grad(), replayed_precision(self._autocast):
            pooled = self.pool(features, subset, image_shapes)
            logits, regression = self.predictor(self.head(pooled))
        through_rows = torch.autograd.grad(
            (logits, regression),
            inputs,
            grad_outputs=(weights[0][rows].to(logits.dtype), weights[1][rows].to(regression.dtype)),
            retain_graph=retain_graph,
            allow_unused=True,
        )
        return tuple(
            one if other is None else other if one is None else one + other
            for one, other in zip(beside, through_rows, strict=True)
        )

    def pooled_proposals(self) -> list[torch.Tensor]:
        """Each image's proposals ``(P_n, 4)`` of the last pass, all of them."""
        assert self._pooled_from is not None  # a pass ran under cut()
        return list(self._pooled_from[1])

    def used_proposals(self, scores: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's proposals ``(P_n, 4)`` whose rows at least one of ``scores`` (of the
        last pass, cut with ``graph_after``) depends on, in the pooled order; a score that
        depends on none (it reads no detection) adds none."""
        used = [self._leaf_gradients(score)[1] for score in scores if score.requires_grad]
        rows = torch.cat(used).unique() if used else torch.zeros(0, dtype=torch.long)
        return self._per_image(rows)

    def _per_image(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each image's proposals ``(P_n, 4)`` at ``rows`` of the pooled order."""
        assert self._pooled_from is not None  # a pass ran under cut()
        subset, start = [], 0
        for boxes in self._pooled_from[1]:
            mine = rows[(rows >= start) & (rows < start + len(boxes))] - start
            subset.append(boxes[mine])
            start += len(boxes)
        return subset

    def _leaf_gradients(
        self, score: torch.Tensor, inputs: Sequence[torch.Tensor] = ()
    ) -> tuple[list[torch.Tensor], torch.Tensor, tuple[torch.Tensor | None, ...]]:
        """The gradient of ``score`` at the two leaves, the rows where it is not zero, and
        its gradient at ``inputs`` by the paths that do not go through the leaves (one
        backward pass for all three)."""
        assert self._leaves is not None  # a pass ran under cut()
        grads = torch.autograd.grad(
            score, (*self._leaves, *inputs), retain_graph=True, allow_unused=True
        )
        count = len(self._leaves)
        weights = [
            torch.zeros_like(leaf) if grad is None else grad
            for leaf, grad in zip(self._leaves, grads[:count], strict=True)
        ]
        used = weights[0].flatten(1).ne(0).any(1) | weights[1].flatten(1).ne(0).any(1)
        return weights, used.nonzero()[:, 0], grads[count:]


AutocastState = tuple[str, torch.dtype] | None


def autocast_state(device: torch.device | None) -> AutocastState:
    """The autocast a pass runs under on ``device``'s type (``None``: none), for a replay."""
    kind = device.type if device is not None else "cpu"
    return (kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None


def replayed_precision(state: AutocastState) -> AbstractContextManager[Any]:
    """The autocast a forward pass ran a replayed part under (:func:`autocast_state`)."""
    if state is None:
        return nullcontext()
    device, dtype = state
    return torch.autocast(device, dtype=dtype)
