"""Contrasts: why one target rather than another, ``y_a - alpha * y_b``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.targets.classes import ClassIds, ClassScore, TopK, nearest_classes
from camviz.core.targets.protocol import Change, Context, Resolved, ScoreFn, TargetObject

if TYPE_CHECKING:
    from camviz.core.inputs import Inputs
    from camviz.core.modelstate import ModelChange
    from camviz.core.targets.convert import Target


@dataclass(frozen=True)
class Nearest(TargetObject):
    """The ``k`` classes whose scores are closest to the explained class's, as ``Contrast.b``.

    Found per sample from the forward pass: ``|y_j - y_a|`` smallest over ``j != a`` (the
    reference classes of Finer-CAM, Zhang et al. 2025). As a target of its own, the ``k``
    classes nearest to each sample's predicted class, one map per rank.
    """

    k: int = 1
    picks_classes = True

    def resolve(self, output: Any, context: Context) -> Resolved:
        predicted = TopK(1).resolve(output, context)
        (score,) = predicted.scores
        assert isinstance(score, ClassScore)  # what a class target resolves to
        ids = self.reference_classes(score.read.every_class(output, None), score.ids)
        return Resolved(tuple(score.for_classes(ids[:, rank]) for rank in range(self.k)), ids)

    def follow(self, change: Change) -> TargetObject:
        return ClassIds(change.plain.class_ids)

    def reference_classes(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``(N, k)``: the classes scored nearest to ``ids``, as the reference of a contrast."""
        return nearest_classes(scores, ids, self.k)


@dataclass(frozen=True)
class Contrast(TargetObject):
    """Why ``a`` rather than ``b``: the score ``y_a - alpha * y_b``.

    The map shows the evidence for ``a`` that is not evidence for ``b`` (Grad-CAM's
    counterfactual use, Selvaraju et al. 2017, Sec. 5). ``a`` is any target: a class id, one
    id per sample, ``None`` for each sample's top class, a top-k target (``"top3"``: one
    contrast per rank), a :class:`~camviz.core.targets.Region`, a callable... ``b`` is
    either classes compared with ``a``'s, scored as ``a`` scores its class (its logit, or
    for a region its logits over the same region): a class id, one id per sample, ``T`` ids
    per sample (an ``(N, T)`` tensor or list of lists: their scores are averaged), a top-k
    target, or :class:`Nearest` for the ``k`` classes scored closest to ``a``; or any other
    target (a callable, a :class:`~camviz.core.targets.Region`, ...), scored on its own, with
    one rank or as many as ``a``. ``alpha`` scales the reference (Finer-CAM's comparison
    strength; ``1`` is the plain difference).
    """

    a: Target
    b: Target
    alpha: float = 1.0

    @property
    def cannot_move(self) -> str | None:  # type: ignore[override]
        return _first(self.a).cannot_move or (
            None if _is_reference(self.b) else _first(self.b).cannot_move
        )

    def model_changes(self, model: nn.Module) -> tuple[ModelChange, ...]:
        # Both sides score the same call of the model; a change they share is made once.
        changes = _first(self.a).model_changes(model) + _first(self.b).model_changes(model)
        return tuple(dict.fromkeys(changes))

    def prepare(self, model: nn.Module, inputs: Inputs) -> Contrast:
        """Both sides ready for the passes (a text prompt embeds its texts); ``b`` given as
        classes stays as it is."""
        b = self.b if _is_reference(self.b) else _first(self.b).prepare(model, inputs)
        return Contrast(_first(self.a).prepare(model, inputs), b, self.alpha)

    def resolve(self, output: Any, context: Context) -> Resolved:
        first = _first(self.a).resolve(output, context)
        if _is_reference(self.b):
            seconds = self._reference_scores(first, output)
        else:
            seconds = _ranked(_first(self.b).resolve(output, context), len(first.scores))
        return Resolved(
            tuple(
                Difference(score, second, self.alpha)
                for score, second in zip(first.scores, seconds, strict=True)
            ),
            first.class_ids,
            first.reasons,
            first.boxes,
        )

    def _reference_scores(self, first: Resolved, output: Any) -> Sequence[ScoreFn]:
        """The score of ``b``'s classes for each rank of ``a``, scored as ``a`` scores."""
        reference = self.b if isinstance(self.b, Nearest) else _first(self.b)
        assert isinstance(reference, (ClassIds, TopK, Nearest))  # what _is_reference lets in
        seconds: list[ScoreFn] = []
        for score in first.scores:
            if not isinstance(score, ClassScore):
                raise CamvizError(
                    "Contrast(a, b) with b given as classes needs an a that scores classes (a "
                    "class id, top-k or a Region); give b as a target of its own"
                )
            ids = score.ids
            others = reference.reference_classes(score.read.every_class(output, None), ids)
            if bool((ids.unsqueeze(1) == others).any()):
                raise CamvizError("Contrast(a, b) needs two different classes; got a class in both")
            seconds.append(score.for_classes(others))
        return seconds

    def follow(self, change: Change) -> TargetObject:
        plain = change.plain
        parts = [score for score in plain.scores if isinstance(score, Difference)]
        first = Resolved(tuple(s.first for s in parts), plain.class_ids, plain.reasons, plain.boxes)
        a = _first(self.a).follow(Change(first, change.factors, change.flip_width))
        if _is_reference(self.b):
            return Contrast(a, self.b, self.alpha)  # b's classes are found again near a's
        second = Resolved(tuple(s.second for s in parts))
        b = _first(self.b).follow(Change(second, change.factors, change.flip_width))
        return Contrast(a, b, self.alpha)

    def nearest_contrast(self, k: int, alpha: float) -> TargetObject | None:
        return self


@dataclass(frozen=True, eq=False)
class Difference:
    """``first - weight * second``."""

    first: ScoreFn
    second: ScoreFn
    weight: float = 1.0

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        return self.first(output, samples) - self.weight * self.second(output, samples)


def _first(target: Target) -> TargetObject:
    """A side of a contrast as a target object (``None``: the top class)."""
    from camviz.core.targets.convert import as_target

    return TopK(1) if target is None else as_target(target)


def _is_reference(target: Target) -> bool:
    """Whether ``b`` names classes to compare with ``a``'s (rather than a target of its own)."""
    return isinstance(target, Nearest) or isinstance(_first(target), (ClassIds, TopK))


def _ranked(resolved: Resolved, ranks: int) -> Sequence[ScoreFn]:
    """``b``'s score for each of ``a``'s ranks: its one score for all, or one each."""
    if len(resolved.scores) == 1:
        return resolved.scores * ranks
    if len(resolved.scores) != ranks:
        raise CamvizError(
            f"Contrast(a, b): b gives {len(resolved.scores)} scores for a's {ranks} ranks; "
            "give b one rank or as many as a"
        )
    return resolved.scores
