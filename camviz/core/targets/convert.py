"""What a user may pass as ``target=``, and the one conversion to a :class:`TargetObject`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

from camviz.core.targets.callables import CallableTarget
from camviz.core.targets.classes import ClassIds, Predicted, parse_top
from camviz.core.targets.protocol import Context, ScoreFn, TargetObject

Target: TypeAlias = (
    int
    | str
    | Sequence[int]
    | Sequence[Sequence[int]]
    | torch.Tensor
    | TargetObject
    | ScoreFn
    | None
)


def as_target(value: Target) -> TargetObject:
    """The target object for what a user passes as ``target=``.

    ``None`` is each sample's predicted class (or the output itself, for one number per
    sample); ``"topK"`` the ``K`` best classes; an int, a sequence or a tensor of ints given
    classes; a callable a :class:`~camviz.core.targets.callables.CallableTarget`; a target
    object stays as it is. Values that fit none of these are refused when resolved, with
    what a target must be.
    """
    if isinstance(value, TargetObject):
        return value
    if value is None:
        return Predicted()
    if isinstance(value, str):
        return parse_top(value)
    if callable(value) and not isinstance(value, torch.Tensor):
        return CallableTarget(value)
    return ClassIds(value)


def score_fns(
    target: Target, output: Any, output_key: str | int | None = None
) -> tuple[list[ScoreFn], torch.Tensor | None]:
    """One score function per rank, and the class ids they select.

    Args:
        target: What to explain (see :mod:`camviz.core.targets`).
        output: The model's output for the batch, to resolve top-k and check the target.
        output_key: Where the scores are in a tuple or dict output (see
            :func:`~camviz.core.targets.as_logits`).

    Returns:
        ``(fns, ids)``: ``fns[k](output, samples=None)`` gives the scores explained at rank
        ``k``, one per output row; ``ids`` is the ``(N, K)`` explained class ids (the class
        of a :class:`~camviz.core.targets.Region`, ``a``'s of a
        :class:`~camviz.core.targets.Contrast`), or ``None`` for a callable.

    Raises:
        CamvizError: The target does not fit the output.
    """
    resolved = as_target(target).resolve(output, Context(output_key))
    return list(resolved.scores), resolved.class_ids


def class_name(categories: Sequence[str] | None, class_id: int) -> str:
    """The name of class ``class_id``: from ``categories``, or ``"class 7"``.

    ``-1`` stands for a target that is not a class (a callable, a region, a contrast).
    """
    if class_id < 0:
        return "custom target"
    if categories is not None and class_id < len(categories):
        return categories[class_id]
    return f"class {class_id}"
