"""What each sample is explained for: the scalar whose gradient a CAM follows.

A *target* turns the model's output into one score per sample (and per rank, for top-k):

* ``None`` or ``"top1"`` - the predicted class of each sample;
* ``"topK"`` (``"top3"``) or :class:`TopK` - the K best classes, one map per rank;
* an ``int`` - that class for every sample;
* a sequence or 1-D tensor of ints - one class per sample (as many as the batch);
* an ``(N, K)`` tensor of ints - K given classes per sample, one map per rank;
* :class:`Region` - a class's logits summed over a region of a segmentation output;
* :class:`Contrast` - ``y_a - y_b``: why class ``a`` rather than class ``b``;
* a callable ``output -> (N,)`` scores - anything else (a detection score, a regression
  output).

Scores are logits (pre-softmax), as in the Grad-CAM paper: softmax couples the classes, and
its gradient vanishes for confident predictions.

Model outputs that are not a plain tensor (tuples, dicts, Hugging Face outputs with
``.logits``) are reduced to one by :func:`as_logits`, the one adapter every target goes
through; ``output_key=`` says where the scores are when that is ambiguous.

Perturbation methods (Score-CAM, Ablation-CAM) score batches of perturbed copies: each score
function takes ``(output, samples)`` where ``samples[r]`` is the input that output row ``r``
was made from. A user callable is called as ``fn(output)`` on such batches too, so it must
score each row on its own (``lambda out: out[:, 3]``); per-sample data belongs in a
:class:`Region` or a class-id target.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from camviz.core.errors import CamvizError

ScoreFn = Callable[..., torch.Tensor]
"""``fn(output, samples=None) -> (R,)`` scores of the ``R`` rows of a model output."""


@dataclass(frozen=True)
class TopK:
    """Explain each sample's ``k`` highest-scoring classes, one map per rank."""

    k: int


@dataclass(frozen=True, eq=False)
class Region:
    """A region of a segmentation output: ``y = sum_ij mask_ij * logits[class_id, i, j]``.

    For models whose output is ``(N, classes, H, W)`` (torchvision's segmentation models
    return it under ``"out"``, which :func:`as_logits` finds). The map then shows what makes
    the model label that region as ``class_id``.

    Attributes:
        class_id: The class whose logits are summed.
        mask: ``(H, W)`` for every sample or ``(N, H, W)`` per sample, at the output's
            resolution; boolean, or float weights for a weighted sum.
    """

    class_id: int
    mask: torch.Tensor


@dataclass(frozen=True)
class Contrast:
    """Why class ``a`` rather than class ``b``: the score ``y_a - y_b``.

    The map shows the evidence for ``a`` that is not evidence for ``b`` (Grad-CAM's
    counterfactual use, Selvaraju et al. 2017, Sec. 5). ``a`` and ``b`` are class ids, or one
    id per sample each.
    """

    a: int | Sequence[int] | torch.Tensor
    b: int | Sequence[int] | torch.Tensor


Target: TypeAlias = (
    int | str | Sequence[int] | torch.Tensor | TopK | Region | Contrast | ScoreFn | None
)


def as_logits(output: Any, output_key: str | int | None = None) -> torch.Tensor:
    """The class-score tensor inside a model's output.

    Args:
        output: A tensor; a tuple or list (the first element, or ``output[output_key]``);
            a dict (``output[output_key]``, or its only tensor value, or ``"logits"``/
            ``"out"``); an object with a ``.logits`` attribute (Hugging Face models).
        output_key: Which element of a tuple or dict holds the scores.

    Raises:
        CamvizError: No tensor can be found, or the key is not there.
    """
    if isinstance(output, torch.Tensor):
        return output
    if output_key is not None:
        try:
            return as_logits(output[output_key])
        except (KeyError, IndexError, TypeError):
            raise CamvizError(
                f"the model output has no element {output_key!r}; pass output_key= one of "
                f"{_keys_of(output)}"
            ) from None
    if isinstance(output, (tuple, list)) and output:
        return as_logits(output[0])
    if isinstance(output, dict):
        for key in ("logits", "out"):
            if key in output:
                return as_logits(output[key])
        tensors = [value for value in output.values() if isinstance(value, torch.Tensor)]
        if len(tensors) == 1:
            return tensors[0]
        raise CamvizError(
            f"the model returns a dict with keys {list(output)}; pass output_key= to say "
            "which one holds the class scores"
        )
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    raise CamvizError(
        f"cannot find class scores in a model output of type {type(output).__name__}; pass "
        "target= a callable that maps the output to one score per sample"
    )


def _keys_of(output: Any) -> list[Any]:
    if isinstance(output, dict):
        return list(output)
    if isinstance(output, (tuple, list)):
        return list(range(len(output)))
    return []


def class_ids(target: Target, logits: torch.Tensor) -> torch.Tensor:
    """The class explained for each sample and rank, as an ``(N, K)`` long tensor.

    Args:
        target: ``None``, ``"topK"``, :class:`TopK`, an int, one int per sample, or an
            ``(N, K)`` tensor of ints (see the module docstring).
        logits: ``(N, num_classes)`` model scores.

    Raises:
        CamvizError: A class id is out of range, or there is not one per sample.
    """
    batch, num_classes = logits.shape[0], logits.shape[-1]
    if isinstance(target, str):
        target = _parse_top(target)
    if target is None:
        target = TopK(1)
    if isinstance(target, TopK):
        if not 1 <= target.k <= num_classes:
            raise CamvizError(f"top-k needs 1 <= k <= {num_classes}, got k={target.k}")
        return logits.detach().topk(target.k, dim=-1).indices
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
    return ids.long().view(batch, -1)


def _parse_top(text: str) -> TopK:
    match = re.fullmatch(r"top(\d+)", text.strip().lower())
    if not match:
        raise CamvizError(
            f"unknown target {text!r}; use a class id, 'top1' or 'topK' (e.g. 'top3')"
        )
    return TopK(int(match.group(1)))


def score_fns(
    target: Target, output: Any, output_key: str | int | None = None
) -> tuple[list[ScoreFn], torch.Tensor | None]:
    """One score function per rank, and the class ids they select.

    Args:
        target: What to explain (see the module docstring).
        output: The model's output for the batch, to resolve top-k and check the target.
        output_key: Where the scores are in a tuple or dict output (see :func:`as_logits`).

    Returns:
        ``(fns, ids)``: ``fns[k](output, samples=None)`` gives the scores explained at rank
        ``k``, one per output row; ``ids`` is the ``(N, K)`` explained class ids (the class
        of a :class:`Region`, ``a`` of a :class:`Contrast`), or ``None`` for a callable.

    Raises:
        CamvizError: The target does not fit the output (see :func:`class_ids`).
    """
    if isinstance(target, Region):
        logits = as_logits(output, output_key)
        ids = torch.full((logits.shape[0], 1), target.class_id, device=logits.device)
        return [_region_score(target, logits, output_key)], ids
    if isinstance(target, Contrast):
        logits = _class_scores(output, output_key)
        first, second = class_ids(target.a, logits), class_ids(target.b, logits)
        if first.shape[1] != 1 or second.shape[1] != 1:
            raise CamvizError("Contrast(a, b) takes one class (or one per sample) for a and b")
        if bool((first == second).any()):
            raise CamvizError("Contrast(a, b) needs two different classes; got a == b")
        contrast = _Difference(
            _ClassScore(first[:, 0], output_key), _ClassScore(second[:, 0], output_key)
        )
        return [contrast], first
    if callable(target) and not isinstance(target, (torch.Tensor, TopK)):
        return [_RowWise(target)], None
    if target is None and as_logits(output, output_key).dim() == 1:
        return [_Scalar(output_key)], None  # one number per sample: explained as it is
    logits = _class_scores(output, output_key)
    if target is None or isinstance(target, (str, TopK)):
        _refuse_embedding(logits)
    ids = class_ids(target, logits)
    return [_ClassScore(ids[:, rank], output_key) for rank in range(ids.shape[1])], ids


def _class_scores(output: Any, output_key: str | int | None) -> torch.Tensor:
    logits = as_logits(output, output_key)
    if logits.dim() != 2:
        raise CamvizError(
            f"class-id targets need (N, classes) scores, but the model output has shape "
            f"{tuple(logits.shape)}; for a segmentation output use "
            "camviz.Region(class_id, mask), or pass a callable target"
        )
    return logits


@dataclass(frozen=True, eq=False)
class _ClassScore:
    """The logit of one given class per sample."""

    ids: torch.Tensor
    output_key: str | int | None

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        ids = self.ids if samples is None else self.ids[samples]
        return as_logits(output, self.output_key).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True, eq=False)
class _Scalar:
    """The output itself, for models that give one number per sample."""

    output_key: str | int | None

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        return as_logits(output, self.output_key)


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


@dataclass(frozen=True, eq=False)
class _Difference:
    """``first - second``."""

    first: ScoreFn
    second: ScoreFn

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        return self.first(output, samples) - self.second(output, samples)


@dataclass(frozen=True, eq=False)
class _RegionScore:
    """``sum_ij mask_ij * logits[class_id, i, j]``, with the mask of each row's sample."""

    class_id: int
    mask: torch.Tensor
    output_key: str | int | None

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        mask = self.mask if samples is None or self.mask.dim() == 2 else self.mask[samples]
        logits = as_logits(output, self.output_key)[:, self.class_id]
        return (logits * mask).sum(dim=(-2, -1))


@dataclass(frozen=True, eq=False)
class _RowWise:
    """A user's ``fn(output)``, which must score each output row on its own."""

    fn: Callable[[Any], torch.Tensor]

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        return self.fn(output)


def _region_score(
    region: Region, logits: torch.Tensor, output_key: str | int | None
) -> _RegionScore:
    """Check a :class:`Region` against a segmentation output and build its score."""
    if logits.dim() != 4:
        raise CamvizError(
            f"a Region target needs a segmentation output (N, classes, H, W), but the model "
            f"output has shape {tuple(logits.shape)}"
        )
    batch, num_classes, height, width = logits.shape
    class_id = region.class_id
    if isinstance(class_id, bool) or not isinstance(class_id, int):
        raise CamvizError(f"Region.class_id must be an int, not {class_id!r}")
    if not 0 <= class_id < num_classes:
        raise CamvizError(
            f"class id {class_id} is out of range: the model has {num_classes} classes "
            f"(0..{num_classes - 1})"
        )
    mask = torch.as_tensor(region.mask, device=logits.device)
    if (
        mask.shape[-2:] != (height, width)
        or mask.dim() not in (2, 3)
        or (mask.dim() == 3 and mask.shape[0] != batch)
    ):
        raise CamvizError(
            f"Region.mask has shape {tuple(mask.shape)}; it must be ({height}, {width}) or "
            f"({batch}, {height}, {width}) to match the output's grid"
        )
    if not bool(mask.flatten(-2).ne(0).any(-1).all()):
        raise CamvizError("Region.mask selects no pixel (for some sample); give a non-empty region")
    return _RegionScore(class_id, mask.to(logits.dtype), output_key)


def class_name(categories: Sequence[str] | None, class_id: int) -> str:
    """The name of class ``class_id``: from ``categories``, or ``"class 7"``.

    ``-1`` stands for a target that is not a class (a callable, a region, a contrast).
    """
    if class_id < 0:
        return "custom target"
    if categories is not None and class_id < len(categories):
        return categories[class_id]
    return f"class {class_id}"
