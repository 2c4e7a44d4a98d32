"""Targets that choose what to explain inside the explaining pass, so that a segmentation or
detection batch costs no forward pass of its own to look at the model's answer first.

Each resolves on the pass's output as :func:`camviz.pipeline.tasks.plan` would choose from
a separate one, and says per sample when there is nothing to explain
(:attr:`camviz.core.targets.Resolved.reasons`); such a sample scores 0 in the graph, so the
pass and the backward run as for the others, and its map is dropped by the job.

* :class:`PredictedRegion`: each sample's region predicted as its class (the class named, or
  its largest one but the background), one batch in one call whatever the classes;
* :class:`DetectedObjects`: each image's objects scored at least ``min_score`` (of the class
  named), at most ``max_objects``, one map each, one batch in one call (an image with fewer
  objects than another has padded ranks, whose maps are dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from camviz.core.detection import Detection, objects
from camviz.core.errors import CamvizError
from camviz.core.targets import (
    Change,
    Context,
    Region,
    Resolved,
    Target,
    TargetObject,
    as_logits,
)
from camviz.core.targets.classes import ClassScore
from camviz.core.targets.region import RegionSums
from camviz.io.models import Task
from camviz.pipeline.tasks import (
    Group,
    TaskOptions,
    class_id,
    kept_detections,
    no_object_reason,
    region_class,
)


@dataclass(frozen=True, eq=False)
class PredictedRegion(TargetObject):
    """Each sample's predicted region of a class: ``Region(c, argmax == c)`` with ``c`` the
    class named (``class_id``) or, when ``None``, the sample's largest class but the
    background.

    Attributes:
        class_id: The class explained in every sample; ``None``: chosen per sample.
        categories: The model's class names (the background's is left out of the choice).
        mask: ``(N, H, W)`` the regions chosen in the latest pass (none for a sample with
            nothing to explain), as :class:`~camviz.core.targets.Region` would hold them;
            ``None`` before a pass.
    """

    class_id: int | None
    categories: Sequence[str]
    mask: torch.Tensor | None = field(default=None, init=False)
    cannot_move = Region.cannot_move

    def resolve(self, output: Any, context: Context) -> Resolved:
        logits = as_logits(output, context.output_key)
        predicted = logits.detach().argmax(1)  # (N, H, W) at the output's grid
        chosen = [region_class(classes, self.class_id, self.categories) for classes in predicted]
        ids = torch.tensor([found or 0 for found, _ in chosen], device=logits.device)
        masks = torch.stack(
            [
                classes == found
                if found is not None
                else torch.zeros_like(classes, dtype=torch.bool)
                for classes, (found, _) in zip(predicted, chosen, strict=True)
            ]
        )
        object.__setattr__(self, "mask", masks)  # what was chosen, for who looks afterwards
        score = ClassScore(RegionSums(masks.to(logits.dtype), context.output_key), ids)
        return Resolved((score,), ids.unsqueeze(1), _reasons([reason for _, reason in chosen]))

    def follow(self, change: Change) -> TargetObject:
        if change.moves:
            raise CamvizError(self.cannot_move)
        return _Fixed(change.plain)


@dataclass(frozen=True, eq=False)
class DetectedObjects(TargetObject):
    """Each image's detections scored at least ``options.min_score`` (of class ``label``,
    if given), at most ``options.max_objects``, best first, chosen in the pass: one map each,
    a whole batch in one call.

    Images of a batch keep different numbers of objects: the call has as many ranks as
    the image with the most, and an image's extra ranks are padding (label ``-1``, no map
    kept: :func:`camviz.core.detection.objects`). An image with none says why
    (:attr:`~camviz.core.targets.Resolved.reasons`).

    Attributes:
        label: The class explained; ``None``: any.
        categories: The model's class names (for the reason).
        options: ``min_score`` and ``max_objects``.
    """

    label: int | None
    categories: Sequence[str]
    options: TaskOptions

    def resolve(self, output: Any, context: Context) -> Resolved:
        detection = Detection(0)
        read = detection.reader(context.output_key)
        found = read(output)
        kept = [kept_detections(image, self.label, self.options) for image in found]
        reasons = _reasons(
            [
                None if chosen else no_object_reason(self.label, self.categories, self.options)
                for chosen in kept
            ]
        )
        if any(kept):
            chosen = objects(found, kept, read, detection)
            return dataclasses.replace(chosen, reasons=reasons)
        return Resolved(
            (_NoObject(context.output_key),),
            torch.full((len(found), 1), -1),
            reasons,
            torch.zeros(len(found), 1, 4),
        )

    def follow(self, change: Change) -> TargetObject:
        if change.plain.class_ids is not None and bool((change.plain.class_ids < 0).all()):
            return _Fixed(change.plain)  # nothing to explain anywhere: nothing to follow
        return Detection(0).follow(change)


@dataclass(frozen=True)
class _NoObject:
    """The score of a batch with no object to explain: 0, kept in the graph."""

    output_key: str | int | None

    def __call__(self, output: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        found: list[Mapping[str, torch.Tensor]] = Detection(0).detections(output, self.output_key)
        return torch.stack([detections["scores"].sum() * 0 for detections in found])


@dataclass(frozen=True, eq=False)
class _Fixed(TargetObject):
    """What the plain pass resolved, kept for a later pass of the same geometry."""

    plain: Resolved

    def resolve(self, output: Any, context: Context) -> Resolved:
        return self.plain

    def follow(self, change: Change) -> TargetObject:
        return self


def _reasons(reasons: list[str | None]) -> tuple[str | None, ...] | None:
    return tuple(reasons) if any(reason is not None for reason in reasons) else None


def groups(
    task: Task, count: int, target: Target, categories: Sequence[str], options: TaskOptions
) -> list[Group]:
    """How a batch of ``count`` samples is explained, its choices made in the pass: in one
    call, with :class:`PredictedRegion` for segmentation, :class:`DetectedObjects` for
    detection, the user's target for any other task.

    Raises:
        CamvizError: The target names no class of the model (segmentation, detection).
    """
    everyone = list(range(count))
    if task == "segmentation":
        return [Group(everyone, PredictedRegion(class_id(target, categories), categories))]
    if task == "detection":
        return [Group(everyone, DetectedObjects(class_id(target, categories), categories, options))]
    return [Group(everyone, target)]
