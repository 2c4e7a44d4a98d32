"""Class targets: given class ids, the top-k classes, and each sample's predicted class.

Their score is a class's logit (:class:`ClassScore`); a :class:`~camviz.core.targets.Region`
scores a class the same way over a region (its :class:`ClassReader` sums the masked logits),
which lets a :class:`~camviz.core.targets.Contrast` compare classes of either kind.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from camviz.core.errors import CamvizError
from camviz.core.targets.outputs import as_logits, is_per_sample_list
from camviz.core.targets.protocol import Change, Context, Resolved, ScoreFn, TargetObject

if TYPE_CHECKING:
    from camviz.core.targets.convert import Target


class ClassReader(Protocol):
    """How a class score reads a model output: the ``(R, classes)`` scores of every class,
    or ``(R, T)`` those of given classes (``ids``, ``(R, T)``)."""

    @property
    def output_key(self) -> str | int | None: ...

    def every_class(self, output: Any, samples: torch.Tensor | None) -> torch.Tensor: ...

    def of(self, output: Any, samples: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class Logits:
    """A class's score is its logit in the ``(N, classes)`` scores."""

    output_key: str | int | None

    def every_class(self, output: Any, samples: torch.Tensor | None) -> torch.Tensor:
        return as_logits(output, self.output_key)

    def of(self, output: Any, samples: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        return as_logits(output, self.output_key).gather(-1, ids)


@dataclass(frozen=True, eq=False)
class ClassScore:
    """The score of one given class per sample, or the mean score of ``(N, T)`` classes,
    as ``read`` scores a class (its logit, or its logits summed over a region)."""

    read: ClassReader
    ids: torch.Tensor

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        ids = self.ids if samples is None else self.ids[samples]
        ids = ids.unsqueeze(-1) if ids.dim() == 1 else ids  # view(N, -1) fails for N = 0
        return self.read.of(output, samples, ids).mean(dim=-1)

    def for_classes(self, ids: torch.Tensor) -> ClassScore:
        """The same kind of score for other classes (``(N,)`` or ``(N, T)``)."""
        return ClassScore(self.read, ids)


@dataclass(frozen=True)
class ClassIds(TargetObject):
    """Given classes: an int for every sample, one per sample, or ``(N, K)`` per sample and
    rank (see :func:`class_ids`)."""

    ids: Any

    def resolve(self, output: Any, context: Context) -> Resolved:
        return _class_targets(
            class_ids(self.ids, class_scores(output, context.output_key)), context
        )

    def follow(self, change: Change) -> TargetObject:
        return self

    def nearest_contrast(self, k: int, alpha: float) -> TargetObject | None:
        from camviz.core.targets.contrast import Contrast, Nearest

        return Contrast(self, Nearest(k), alpha)

    def reference_classes(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``(N, T)``: these classes, as the reference of a contrast with ``ids``."""
        return class_ids(self.ids, scores)


@dataclass(frozen=True)
class TopK(TargetObject):
    """Explain each sample's ``k`` highest-scoring classes, one map per rank."""

    k: int
    picks_classes = True

    def resolve(self, output: Any, context: Context) -> Resolved:
        logits = class_scores(output, context.output_key)
        _refuse_embedding(logits)
        return _class_targets(class_ids(self, logits), context)

    def follow(self, change: Change) -> TargetObject:
        return ClassIds(change.plain.class_ids)

    def nearest_contrast(self, k: int, alpha: float) -> TargetObject | None:
        from camviz.core.targets.contrast import Contrast, Nearest

        return Contrast(self, Nearest(k), alpha)

    def reference_classes(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``(N, k)``: the top-k classes, as the reference of a contrast with ``ids``."""
        return class_ids(self, scores)


@dataclass(frozen=True)
class Predicted(TopK):
    """Each sample's predicted class (``target=None``), or the output itself when the model
    gives one number per sample."""

    k: int = 1

    def resolve(self, output: Any, context: Context) -> Resolved:
        detector = context.output_key is None and _detection_target(output) is not None
        if not detector and as_logits(output, context.output_key).dim() == 1:
            return Resolved((Scalar(context.output_key),))  # explained as it is
        return super().resolve(output, context)

    def follow(self, change: Change) -> TargetObject:
        return self if change.plain.class_ids is None else ClassIds(change.plain.class_ids)


@dataclass(frozen=True, eq=False)
class Scalar:
    """The output itself, for models that give one number per sample."""

    output_key: str | int | None

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        return as_logits(output, self.output_key)


def _class_targets(ids: torch.Tensor, context: Context) -> Resolved:
    read = Logits(context.output_key)
    return Resolved(tuple(ClassScore(read, ids[:, rank]) for rank in range(ids.shape[1])), ids)


def class_scores(output: Any, output_key: str | int | None) -> torch.Tensor:
    """The ``(N, classes)`` scores in a model output, checked to be that."""
    detection = _detection_target(output) if output_key is None else None
    if detection is not None:
        raise CamvizError(
            "the model is a detector (its output holds boxes), not a classifier; explain one "
            f"of its detections with target={detection}"
        )
    logits = as_logits(output, output_key)
    if logits.dim() != 2:
        raise CamvizError(
            f"class-id targets need (N, classes) scores, but the model output has shape "
            f"{tuple(logits.shape)}; for a detector's raw predictions explain a detection "
            "with target=camviz.Detection(0, adapter=camviz.DenseDetections()), for a "
            "segmentation output use camviz.Region(class_id, mask), or pass a callable target"
        )
    return logits


def _detection_target(output: Any) -> str | None:
    """The :class:`~camviz.core.detection.Detection` target to suggest for a detector's
    output (torchvision's per-image dicts of boxes, or a set-prediction output with
    ``pred_boxes``); ``None`` for other outputs."""
    if is_per_sample_list(output) and all("boxes" in item for item in output):
        return "camviz.Detection(0)"
    if isinstance(output, Mapping) and "pred_boxes" in output:
        return "camviz.Detection(0, adapter=camviz.SetPredictions())"
    return None


def class_ids(target: Target, logits: torch.Tensor) -> torch.Tensor:
    """The class explained for each sample and rank, as an ``(N, K)`` long tensor.

    Args:
        target: ``None``, ``"topK"``, :class:`TopK`, an int, one int per sample, or an
            ``(N, K)`` tensor of ints (see :mod:`camviz.core.targets`).
        logits: ``(N, num_classes)`` model scores.

    Raises:
        CamvizError: A class id is out of range, or there is not one per sample.
    """
    batch, num_classes = logits.shape[0], logits.shape[-1]
    if isinstance(target, str):
        target = parse_top(target)
    if target is None:
        target = TopK(1)
    if isinstance(target, TopK):
        if not 1 <= target.k <= num_classes:
            raise CamvizError(f"top-k needs 1 <= k <= {num_classes}, got k={target.k}")
        return logits.detach().topk(target.k, dim=-1).indices
    if _holds_bool(target):  # torch.as_tensor([0, True]) would read True as class 1
        raise CamvizError(f"a target must be class ids (ints), not {target!r} (it holds a bool)")
    try:
        ids = torch.as_tensor(target, device=logits.device)
    except (TypeError, ValueError, RuntimeError):
        raise CamvizError(f"a target must be class ids (ints), not {target!r}") from None
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() > 2:
        raise CamvizError(f"a target must be class ids (ints), not {target!r}")
    if ids.dim() == 0:
        ids = ids.expand(batch)
    if ids.shape[0] != batch:
        raise CamvizError(
            f"got {ids.shape[0]} target classes for a batch of {batch}; give one per sample, "
            "or a single class for all"
        )
    bad = ids[(ids < 0) | (ids >= num_classes)]
    if bad.numel():
        raise CamvizError(
            f"class id {int(bad[0])} is out of range: the model has {num_classes} classes "
            f"(0..{num_classes - 1})"
        )
    if ids.is_inference():  # made in a caller's inference mode: the gather saves it
        with torch.inference_mode(False):
            ids = ids.clone()
    return ids.long().view(batch, -1)


def _holds_bool(target: Any) -> bool:
    """Whether a target given as Python values is, or holds, a bool (numpy's too)."""
    if isinstance(target, (list, tuple)):
        return any(_holds_bool(item) for item in target)
    return isinstance(target, bool) or type(target).__name__ == "bool_"


def parse_top(text: str) -> TopK:
    """The :class:`TopK` that ``"top3"`` names.

    Raises:
        CamvizError: The text is no ``"topK"``.
    """
    match = re.fullmatch(r"top(\d+)", text.strip().lower())
    if not match:
        raise CamvizError(
            f"unknown target {text!r}; use a class id, 'top1' or 'topK' (e.g. 'top3')"
        )
    return TopK(int(match.group(1)))


def _refuse_embedding(logits: torch.Tensor) -> None:
    """Raise when the output looks like embeddings (rows of unit length with negative
    values), whose largest dimension is no class to explain."""
    if logits.shape[-1] < 2 or not bool((logits < 0).any()):
        return
    norms = logits.detach().float().norm(dim=-1)
    if bool(((norms - 1).abs() < 1e-3).all()):
        raise CamvizError(
            "the model output looks like an embedding (rows of length 1), not class scores; "
            "explain a similarity with target=camviz.Similarity(reference), or give a class "
            "id or a callable target"
        )


def nearest_classes(logits: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """``(N, k)``: for each sample, the ``k`` classes other than ``ids`` whose logits are
    closest to the logit of ``ids``, closest first.

    Raises:
        CamvizError: ``k`` is not between 1 and the number of other classes.
    """
    others = logits.shape[-1] - 1
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= others:
        raise CamvizError(f"Nearest(k) needs 1 <= k <= {others} (the other classes), got {k!r}")
    scores = logits.detach()
    distance = (scores - scores.gather(-1, ids.view(-1, 1))).abs()
    distance.scatter_(-1, ids.view(-1, 1), torch.inf)
    return distance.topk(k, dim=-1, largest=False).indices


def probability_score(score: ScoreFn) -> ScoreFn:
    """The same target scored on class probabilities (a softmax over the class dimension of
    the logits) instead of logits: ``p_c`` for a class, ``p_a - alpha * mean_t p_b_t`` for a
    :class:`~camviz.core.targets.Contrast`, the masked sum of ``p_c`` for a
    :class:`~camviz.core.targets.Region`.

    Raises:
        CamvizError: ``score`` is a callable target, whose logits camviz cannot see.
    """
    from camviz.core.targets.contrast import Difference

    if isinstance(score, Difference):
        first, second = probability_score(score.first), probability_score(score.second)
        return Difference(first, second, score.weight)
    if isinstance(score, ClassScore):
        return _OnProbabilities(score)
    raise CamvizError(
        "scoring class probabilities needs a class-id, top-k, Contrast or Region target, not "
        "a callable; give class ids, or fold the softmax into the callable"
    )


@dataclass(frozen=True, eq=False)
class _OnProbabilities:
    """A class or region score read from the softmax of the logits over their class dim."""

    score: ClassScore

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        probabilities = as_logits(output, self.score.read.output_key).softmax(dim=1)
        return self.score(probabilities, samples)
