"""What a folder job explains for each task of :data:`camviz.models.Task`, beyond classes.

A classifier's batch is explained in one call with the user's target. For the other tasks,
what to explain is decided from the model's answer, sample by sample: :func:`plan` decides it
from a separate forward pass (without gradients, at the run's precision), and the folder job
decides it inside the explaining pass, with the same rules (:mod:`camviz.pipeline.choosing`):

* **segmentation**: the region the model predicts as one class, ``Region(class_id, mask)``
  with ``mask = argmax over classes == class_id`` at the output's grid. The class is the one
  the user names or numbers; by default each image's largest predicted class that is not
  the background (``"__background__"`` in the weights' class names). Images that share the
  class are explained together.
* **detection**: each image alone (detectors answer per image), the detections scoring at
  least ``min_score`` (of class ``target``, if one is given), at most ``max_objects``, best
  first: ``camviz.Detection(indices)``, one map per object.
* **video**: like a classifier, on ``(N, 3, T, H, W)`` clips.

A sample with nothing to explain (no pixel of the class, no object above ``min_score``) is
no failure: it gets a :class:`Group` with a ``reason``, which the manifest row shows.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from camviz.core.errors import CamvizError
from camviz.core.modelstate import Attributes, changed
from camviz.core.targets import Region, Target, as_logits
from camviz.io.models import DEFAULT_CLIP_LEN, LoadedModel, Task, with_input_size
from camviz.io.volumes import is_volume
from camviz.pipeline.inputs import Item

#: The class name torchvision's segmentation and detection weights give the background.
BACKGROUND = "__background__"


@dataclass(frozen=True)
class TaskOptions:
    """Settings of the tasks other than classification.

    Attributes:
        min_score: Detection: explain the objects scored at least this.
        max_objects: Detection: at most this many objects per image, best first.
        clip_len: Video: frames per clip (``None``: the model's, :attr:`LoadedModel.clip_len`).
        stride: Video: frames from one clip's start to the next (``None``: ``clip_len``).
    """

    min_score: float = 0.5
    max_objects: int = 10
    clip_len: int | None = None
    stride: int | None = None

    def __post_init__(self) -> None:
        if not self.min_score >= 0:  # NaN too
            raise CamvizError(f"min_score must be 0 or more, not {self.min_score}")
        for name in ("max_objects", "clip_len", "stride"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise CamvizError(f"{name} must be a positive whole number, not {value!r}")


@dataclass
class Group:
    """Samples of one batch explained in one call.

    Attributes:
        positions: The samples' positions in the batch.
        target: What to explain (``None`` is a classifier's top class, as everywhere).
        reason: Why there is nothing to explain; ``None`` when there is something.
        boxes: Detection: the ``(x0, y0, x1, y1)`` box of each explained object, in order.
    """

    positions: list[int]
    target: Target
    reason: str | None = None
    boxes: list[list[float]] = field(default_factory=list)


def plan(
    task: Task,
    forward: Callable[[torch.Tensor], Any],
    batch: torch.Tensor,
    target: Target,
    categories: Sequence[str],
    options: TaskOptions,
) -> list[Group]:
    """How to explain ``batch`` for ``task`` (see the module docstring).

    Args:
        task: The model's task.
        forward: Runs the model on a batch without gradients (only called for
            segmentation and detection).
        batch: The ``(N, 3, H, W)`` images or ``(N, 3, T, H, W)`` clips.
        target: The user's target: a class id, a class name (segmentation, detection), or
            ``None`` / ``"top1"`` for the default.
        categories: The model's class names.
        options: Detection and video settings.
    """
    if task == "segmentation":
        return _segmentation(forward(batch), target, categories)
    if task == "detection":
        return _detection(forward(batch), target, categories, options)
    return [Group(list(range(len(batch))), target)]


def class_id(target: Target, categories: Sequence[str]) -> int | None:
    """The class a segmentation or detection target names (``None``: the default).

    Raises:
        CamvizError: An unknown name or a number outside the classes, or a target these
            tasks do not take (``top3``).
    """
    if target is None or target == "top1":
        return None
    if isinstance(target, int) and not isinstance(target, bool):
        if not 0 <= target < len(categories):
            raise CamvizError(
                f"class {target} does not exist; the model has classes 0..{len(categories) - 1}"
            )
        return target
    if isinstance(target, str):
        folded = [name.casefold() for name in categories]
        if target.casefold() in folded:
            return folded.index(target.casefold())
        close = difflib.get_close_matches(target, categories, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise CamvizError(
            f"the model has no class named {target!r}; {hint}give a class name or number "
            f"(the model's {len(categories)} classes are in the weights' metadata)"
        )
    raise CamvizError(
        f"segmentation and detection explain one class at a time; give --target a class name "
        f"or number, not {target!r}"
    )


def _segmentation(output: Any, target: Target, categories: Sequence[str]) -> list[Group]:
    predicted = as_logits(output).argmax(1)  # (N, H, W) at the output's grid
    chosen = class_id(target, categories)
    by_class: dict[int, list[int]] = {}
    groups = []
    for position, classes in enumerate(predicted):
        found, reason = region_class(classes, chosen, categories)
        if found is None:
            groups.append(Group([position], None, reason=reason))
        else:
            by_class.setdefault(found, []).append(position)
    for found, positions in by_class.items():
        groups.append(Group(positions, Region(found, predicted[positions] == found)))
    return groups


def region_class(
    classes: torch.Tensor, chosen: int | None, categories: Sequence[str]
) -> tuple[int | None, str | None]:
    """The class whose predicted region of one ``(H, W)`` prediction is explained, or why
    there is none."""
    background = categories.index(BACKGROUND) if BACKGROUND in categories else None
    found = chosen if chosen is not None else _largest_class(classes, background)
    if found is None or not bool((classes == found).any()):
        what = "any class but the background" if found is None else repr(categories[found])
        return None, f"no pixel is predicted as {what}"
    return found, None


def _largest_class(classes: torch.Tensor, background: int | None) -> int | None:
    """The class predicted at the most pixels, the background left out (``None``: none)."""
    counts = torch.bincount(classes.flatten())
    if background is not None and background < len(counts):
        counts[background] = 0
    return int(counts.argmax()) if counts.numel() and int(counts.max()) > 0 else None


def _detection(
    outputs: Any, target: Target, categories: Sequence[str], options: TaskOptions
) -> list[Group]:
    from camviz.core.detection import Detection

    label = class_id(target, categories)
    groups = []
    for position, found in enumerate(outputs):
        kept = kept_detections(found, label, options)
        if not kept:
            reason = no_object_reason(label, categories, options)
            groups.append(Group([position], None, reason=reason))
            continue
        boxes = found["boxes"][kept].detach().float().cpu().tolist()
        groups.append(Group([position], Detection(kept), boxes=boxes))
    return groups


def kept_detections(found: Any, label: int | None, options: TaskOptions) -> list[int]:
    """The indices of one image's detections that are explained: scored ``min_score`` or
    more, of class ``label`` if given, at most ``max_objects``, in the detector's order
    (best first)."""
    scores, labels = found["scores"].tolist(), found["labels"].tolist()
    return [
        index
        for index, (score, kind) in enumerate(zip(scores, labels, strict=True))
        if score >= options.min_score and (label is None or kind == label)
    ][: options.max_objects]


def no_object_reason(label: int | None, categories: Sequence[str], options: TaskOptions) -> str:
    what = "" if label is None else f" of class {categories[label]!r}"
    return f"no object{what} scored {options.min_score:g} or more"


@contextmanager
def prepared(
    loaded: LoadedModel, options: TaskOptions, input_size: int | None
) -> Iterator[LoadedModel]:
    """``loaded`` as a job runs it; the model comes back as it was when the block ends.

    Images are scaled to ``input_size`` (:func:`~camviz.models.with_input_size`), and a
    detector returns every detection scored ``options.min_score`` or more: detectors drop
    detections below their own threshold (0.05 for Faster R-CNN, 0.001 for SSDlite), so a
    lower ``min_score`` would otherwise silently miss objects. Both, and any other change
    ``loaded`` carries (:attr:`~camviz.models.LoadedModel.changes`), are made for the block
    through :func:`camviz.core.modelstate.changed`.
    """
    running = loaded if input_size is None else with_input_size(loaded, input_size)
    thresholds = _score_thresholds(loaded, options.min_score)
    with changed(running.model, *running.changes, thresholds):
        yield running


def _score_thresholds(loaded: LoadedModel, min_score: float) -> Attributes:
    """A detector's own score thresholds lowered to ``min_score`` (nothing for other tasks):
    ``roi_heads.score_thresh`` of the R-CNNs, ``score_thresh`` of RetinaNet, FCOS and SSD."""
    if loaded.task != "detection":
        return Attributes(())
    owners = [loaded.model, getattr(loaded.model, "roi_heads", None)]
    thresholds = [(owner, getattr(owner, "score_thresh", None)) for owner in owners]
    return Attributes(
        tuple(
            (owner, "score_thresh", min(threshold, min_score))
            for owner, threshold in thresholds
            if isinstance(threshold, float)
        )
    )


def clip_spec(
    task: Task, model_clip_len: int | None, options: TaskOptions
) -> tuple[int, int] | None:
    """``(clip_len, stride)`` of a video model's clips; ``None`` for the other tasks."""
    if task != "video":
        return None
    clip_len = options.clip_len or model_clip_len or DEFAULT_CLIP_LEN
    return clip_len, options.stride or clip_len


def fit_task(items: list[Item], task: Task, model_name: str) -> list[Item]:
    """``items``, with a reason on each input the model's task cannot take.

    A video model takes clips, not still images (a NIfTI volume is no clip: it is explained
    as a volume); a volume model takes NIfTI volumes only; detectors and segmentation models take
    still images, not videos (a video's frames become one item for the whole video, so it
    is listed once).
    """
    if task == "video":  # a NIfTI scan is a volume, never a clip
        return [
            replace(
                item,
                reason=f"{item.path} is a still image; {model_name} is a video model, "
                "which explains clips of videos (.mp4, .avi, ...): pass videos",
            )
            if item.frame is None and item.reason is None and not is_volume(item.path)
            else item
            for item in items
        ]
    if task == "volume":
        return [
            replace(
                item,
                reason=f"{item.path} is no NIfTI volume; {model_name} is a volume model, "
                "which explains 3-D scans (.nii, .nii.gz): pass those",
            )
            if item.reason is None and not is_volume(item.path)
            else item
            for item in items
        ]
    if task not in ("detection", "segmentation"):
        return items
    fitted: list[Item] = []
    videos: set[str] = set()
    for item in items:
        if item.video is None:
            fitted.append(item)
        elif item.path not in videos:
            videos.add(item.path)
            reason = (
                f"{item.path} is a video; {model_name} is a {task} model, which explains still "
                "images: pass images (or frames extracted from the video)"
            )
            fitted.append(Item(path=item.path, name=item.video, reason=reason))
    return fitted
