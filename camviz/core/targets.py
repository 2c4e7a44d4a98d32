"""What each sample is explained for: the scalar whose gradient a CAM follows.

A *target* turns the model's output into one score per sample (and per rank, for top-k):

* ``None`` or ``"top1"`` - the predicted class of each sample;
* ``"topK"`` (``"top3"``) or :class:`TopK` - the K best classes, one map per rank;
* an ``int`` - that class for every sample;
* a sequence or 1-D tensor of ints - one class per sample (as many as the batch);
* an ``(N, K)`` tensor of ints - K given classes per sample, one map per rank;
* :class:`Region` - a class's logits summed over a region of a segmentation output;
* :class:`~camviz.core.detection.Detection` - one object a detector found, by index or by
  box and class (:mod:`camviz.core.detection`);
* :class:`Contrast` - ``y_a - alpha * y_b``: why class ``a`` rather than class ``b`` (or the
  mean of several classes ``b``, or the classes :class:`Nearest` to ``a``);
* a callable ``output -> (N,)`` scores - anything else (a detection score, a regression
  output), or a :class:`RowTarget` ``(output, rows) -> (R,)`` scores (below).

Scores are logits (pre-softmax), as in the Grad-CAM paper: softmax couples the classes, and
its gradient vanishes for confident predictions.

Model outputs that are not a plain tensor (tuples, dicts, Hugging Face outputs with
``.logits``) are reduced to one by :func:`as_logits`, the one adapter every target goes
through; ``output_key=`` says where the scores are when that is ambiguous.

Rows of re-run outputs. Perturbation methods (Score-CAM, Ablation-CAM) and the faithfulness
metrics run the model again on batches of perturbed copies, in chunks whose rows come from
any of the ``N`` inputs, in any number. Every score function therefore takes
``(output, rows)``, ``rows`` being the ``(R,)`` long tensor of the input index of each of
the ``R`` output rows (``None`` for the plain batch, where row ``n`` is input ``n``). A user
callable joins in by taking a second positional argument (:class:`RowTarget`): it is called
as ``fn(output, rows)`` on every output, the plain batch included (``rows = arange(N)``),
so it can score row ``r`` for input ``rows[r]``::

    ids = torch.tensor([3, 7])                              # one class per input
    target = lambda out, rows: out[torch.arange(len(rows)), ids[rows]]

A one-argument callable ``fn(output)`` must score each row on its own (``lambda out:
out[:, 3]``); on re-run batches camviz checks that (the rows' scores must not depend on
their position) and raises a :class:`CamvizError` that points here when they do.
:func:`call_target` is the one place that calls a user callable.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import torch

from camviz.core.detection import Detection, Followed, is_detection_output
from camviz.core.errors import CamvizError, first_line
from camviz.core.hooks import tensors_in

ScoreFn = Callable[..., torch.Tensor]
"""``fn(output, rows=None) -> (R,)`` scores of the ``R`` rows of a model output."""


class RowTarget(Protocol):
    """A target that is told which input each output row belongs to (see the module doc).

    Any callable with a second positional parameter is one; camviz calls it as
    ``target(output, rows)`` with ``rows`` the ``(R,)`` long tensor of the input index of
    each output row, and expects ``(R,)`` scores. Per-input data (classes, reference
    embeddings, boxes) is indexed with ``rows``, so it stays right in perturbed batches.
    """

    def __call__(self, output: Any, rows: torch.Tensor, /) -> torch.Tensor: ...


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
class Nearest:
    """The ``k`` classes whose scores are closest to the explained class's, as ``Contrast.b``.

    Found per sample from the forward pass: ``|y_j - y_a|`` smallest over ``j != a`` (the
    reference classes of Finer-CAM, Zhang et al. 2025).
    """

    k: int = 1


@dataclass(frozen=True)
class Contrast:
    """Why class ``a`` rather than class ``b``: the score ``y_a - alpha * mean_t y_{b_t}``.

    The map shows the evidence for ``a`` that is not evidence for ``b`` (Grad-CAM's
    counterfactual use, Selvaraju et al. 2017, Sec. 5). ``a`` is a class id, one id per
    sample, ``None`` for each sample's top class, or a top-k target (``"top3"``: one
    contrast per rank). ``b`` is a class id, one id per sample,
    ``T`` ids per sample (an ``(N, T)`` tensor or list of lists: their scores are averaged),
    or :class:`Nearest` for the ``k`` classes scored closest to ``a``. ``alpha`` scales the
    reference (Finer-CAM's comparison strength; ``1`` is the plain difference).
    """

    a: int | Sequence[int] | torch.Tensor | None
    b: int | Sequence[int] | Sequence[Sequence[int]] | torch.Tensor | Nearest
    alpha: float = 1.0


Target: TypeAlias = (
    int
    | str
    | Sequence[int]
    | Sequence[Sequence[int]]
    | torch.Tensor
    | TopK
    | Region
    | Contrast
    | Detection
    | Followed
    | ScoreFn
    | None
)


def takes_rows(fn: Callable[..., Any]) -> bool:
    """Whether a callable target takes a second positional argument (a :class:`RowTarget`)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature: called as fn(output)
        return False
    kinds = [parameter.kind for parameter in parameters]
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Parameter.VAR_POSITIONAL in kinds or sum(k in positional for k in kinds) >= 2


def call_target(
    fn: Callable[..., torch.Tensor], output: Any, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The scores of a user's callable target for the rows of ``output``.

    Args:
        fn: ``fn(output)`` or a :class:`RowTarget` ``fn(output, rows)``.
        output: A model output with ``R`` rows.
        rows: ``(R,)`` input index of each row; ``None`` when row ``n`` is input ``n``.

    Returns:
        What ``fn`` returns (callers check its shape).

    Raises:
        CamvizError: A one-argument ``fn`` scores a row differently depending on its
            position in a re-run batch (it holds per-input data), so it would score the
            wrong rows; it must take ``rows``.
    """
    if takes_rows(fn):
        if rows is None and is_detection_output(output):  # one dict per input
            rows = torch.arange(len(output), device=output[0]["boxes"].device)
        if rows is None:
            first = next(tensors_in(output), getattr(output, "logits", None))
            if not isinstance(first, torch.Tensor) or first.dim() == 0:
                raise CamvizError(
                    "a target that takes rows needs a model output with one row per input"
                )
            rows = torch.arange(first.shape[0], device=first.device)
        return fn(output, rows)
    if rows is None:
        return fn(output)
    try:
        scores = fn(output)
    except (IndexError, RuntimeError, ValueError) as error:
        raise CamvizError(
            f"the target callable fails on a re-run batch of {len(rows)} rows "
            f"({first_line(error)}); {_TAKE_ROWS}"
        ) from error
    if len(rows) < 2 or not _is_row_vector(scores, len(rows)):
        return scores
    # Row r of the rolled batch is row r - 1: a row-wise fn gives the rolled scores.
    rolled = torch.arange(len(rows), device=rows.device).roll(1)
    moved = fn(take_rows(output, rolled))
    if not _is_row_vector(moved, len(rows)) or not torch.allclose(
        moved, scores[rolled.to(scores.device)], rtol=1e-4, atol=1e-6, equal_nan=True
    ):
        raise CamvizError(
            "the target callable scores a row differently depending on its position in the "
            f"batch; {_TAKE_ROWS}"
        )
    return scores


_TAKE_ROWS = (
    "re-run batches hold rows of any input in any number, so a target callable must score "
    "each row on its own (lambda out: out[:, 3]) or take the rows, fn(output, rows), rows[r] "
    "being the input of row r (see camviz.core.targets)"
)


def _is_row_vector(scores: Any, count: int) -> bool:
    return isinstance(scores, torch.Tensor) and scores.shape == (count,)


def take_rows(output: Any, rows: torch.Tensor) -> Any:
    """The rows ``rows`` of every tensor in a model output (tensor, tuple, list or dict)."""
    if isinstance(output, torch.Tensor):
        return output[rows.to(output.device)]
    if is_detection_output(output):  # a detector's list holds one dict per row
        return [output[row] for row in rows.tolist()]
    if isinstance(output, (tuple, list)):
        return type(output)(take_rows(item, rows) for item in output)
    if isinstance(output, Mapping):
        return {key: take_rows(item, rows) for key, item in output.items()}
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return {"logits": logits[rows.to(logits.device)]}
    return output


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
    return ids.long().view(batch, -1)


def _holds_bool(target: Any) -> bool:
    """Whether a target given as Python values is, or holds, a bool (numpy's too)."""
    if isinstance(target, (list, tuple)):
        return any(_holds_bool(item) for item in target)
    return isinstance(target, bool) or type(target).__name__ == "bool_"


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
    if isinstance(target, (Detection, Followed)):
        detection_scores, labels = target.resolve(output, output_key)
        return list(detection_scores), labels
    if isinstance(target, Region):
        logits = as_logits(output, output_key)
        ids = torch.full((logits.shape[0], 1), target.class_id, device=logits.device)
        return [_region_score(target, logits, output_key)], ids
    if isinstance(target, Contrast):
        logits = _class_scores(output, output_key)
        first = class_ids(target.a, logits)
        contrasts: list[ScoreFn] = []
        for rank in range(first.shape[1]):  # a top-k ``a``: one contrast per rank
            ids = first[:, rank]
            if isinstance(target.b, Nearest):
                second = nearest_classes(logits, ids, target.b.k)
            else:
                second = class_ids(target.b, logits)
            if bool((ids.unsqueeze(1) == second).any()):
                raise CamvizError("Contrast(a, b) needs two different classes; got a class in both")
            contrasts.append(
                _Difference(
                    _ClassScore(ids, output_key), _ClassScore(second, output_key), target.alpha
                )
            )
        return contrasts, first
    if callable(target) and not isinstance(target, (torch.Tensor, TopK)):
        return [_UserTarget(target)], None
    if target is None and as_logits(output, output_key).dim() == 1:
        return [_Scalar(output_key)], None  # one number per sample: explained as it is
    logits = _class_scores(output, output_key)
    if target is None or isinstance(target, (str, TopK)):
        _refuse_embedding(logits)
    ids = class_ids(target, logits)
    return [_ClassScore(ids[:, rank], output_key) for rank in range(ids.shape[1])], ids


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
    :class:`Contrast`, the masked sum of ``p_c`` for a :class:`Region`.

    Raises:
        CamvizError: ``score`` is a callable target, whose logits camviz cannot see.
    """
    if isinstance(score, _Difference):
        first, second = probability_score(score.first), probability_score(score.second)
        return _Difference(first, second, score.weight)
    if isinstance(score, (_ClassScore, _RegionScore)):
        return _OnProbabilities(score)
    raise CamvizError(
        "scoring class probabilities needs a class-id, top-k, Contrast or Region target, not "
        "a callable; give class ids, or fold the softmax into the callable"
    )


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
    """The logit of one given class per sample, or the mean logit of ``(N, T)`` classes."""

    ids: torch.Tensor
    output_key: str | int | None

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        ids = self.ids if samples is None else self.ids[samples]
        ids = ids.unsqueeze(-1) if ids.dim() == 1 else ids  # view(N, -1) fails for N = 0
        return as_logits(output, self.output_key).gather(-1, ids).mean(dim=-1)


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
    """``first - weight * second``."""

    first: ScoreFn
    second: ScoreFn
    weight: float = 1.0

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        return self.first(output, samples) - self.weight * self.second(output, samples)


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
class _OnProbabilities:
    """A class or region score read from the softmax of the logits over their class dim."""

    score: _ClassScore | _RegionScore

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        probabilities = as_logits(output, self.score.output_key).softmax(dim=1)
        return self.score(probabilities, samples)


@dataclass(frozen=True, eq=False)
class _UserTarget:
    """A user's callable, called through :func:`call_target`."""

    fn: Callable[..., torch.Tensor]

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        return call_target(self.fn, output, samples)


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
