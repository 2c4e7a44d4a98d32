"""What each sample is explained for: the scalar whose gradient a CAM follows.

A *target* turns the model's output into one score per sample (and per rank, for top-k):

* ``None`` or ``"top1"`` - the predicted class of each sample;
* ``"topK"`` (``"top3"``) or :class:`TopK` - the K best classes, one map per rank;
* an ``int`` - that class for every sample;
* a sequence or 1-D tensor of ints - one class per sample;
* a callable ``output -> (N,)`` scores - anything else (a region of a segmentation output,
  the difference of two classes, a detection score).

Scores are logits (pre-softmax), as in the Grad-CAM paper: softmax couples the classes, and
its gradient vanishes for confident predictions.

Model outputs that are not a plain tensor are reduced to one by :func:`as_logits`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeAlias

import torch

from camviz.errors import CamvizError

ScoreFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class TopK:
    """Explain each sample's ``k`` highest-scoring classes, one map per rank."""

    k: int


Target: TypeAlias = int | str | Sequence[int] | torch.Tensor | TopK | ScoreFn | None


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
        target: Anything but a callable (see the module docstring).
        logits: ``(N, num_classes)`` model scores.

    Raises:
        CamvizError: A class id is out of range, or a list's length is not the batch size.
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
    ids = torch.as_tensor(target, device=logits.device)
    if ids.is_floating_point() or ids.is_complex() or ids.dim() > 1:
        raise CamvizError(f"a target must be class ids (ints), not {target!r}")
    if ids.dim() == 0:
        ids = ids.expand(batch)
    elif ids.numel() != batch:
        raise CamvizError(
            f"got {ids.numel()} target classes for a batch of {batch}; give one per sample, "
            "or a single class for all"
        )
    bad = ids[(ids < 0) | (ids >= num_classes)]
    if bad.numel():
        raise CamvizError(
            f"class id {int(bad[0])} is out of range: the model has {num_classes} classes "
            f"(0..{num_classes - 1})"
        )
    return ids.long().unsqueeze(1)


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

    Returns:
        ``(fns, ids)``: ``fns[k](output)`` gives the ``(N,)`` scores explained at rank ``k``;
        ``ids`` is the ``(N, K)`` class-id tensor, or ``None`` for a callable target.
    """
    if callable(target) and not isinstance(target, (torch.Tensor, TopK)):
        return [target], None
    ids = class_ids(target, as_logits(output, output_key))

    def score(rank: int, model_output: Any) -> torch.Tensor:
        logits = as_logits(model_output, output_key)
        return logits.gather(-1, ids[:, rank : rank + 1]).squeeze(-1)

    return [partial(score, rank) for rank in range(ids.shape[1])], ids
