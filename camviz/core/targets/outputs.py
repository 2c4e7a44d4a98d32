"""Reading a model's output: where its scores are, and which of its parts are rows.

Rows are what a target scores: row ``r`` of a batch output belongs to one input. A tensor's
rows are along its first axis; a tuple, list or dict holds tensors with rows; a list with
one element per sample (a detector's per-image dicts, or one dict of scores per sample) is
itself a batch of rows.

A re-run of the model for a target that reads layer spots (a :class:`~camviz.core.targets.Unit`)
hands its score functions a :class:`SpotOutput`: the output with the tensors that re-run
handed on at those spots. Every other score reads its ``output`` as before (:func:`as_logits`
and :func:`take_rows` look through it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from camviz.core.errors import CamvizError
from camviz.core.hooks import tensors_in


@dataclass(frozen=True, eq=False)
class SpotOutput:
    """A pass's model output with what it handed on at the spots its target reads.

    Attributes:
        output: The model's output.
        spots: ``{spot key: tensor}`` for each spot the target asked for
            (:attr:`~camviz.core.targets.TargetObject.spots`), one row per output row.
    """

    output: Any
    spots: Mapping[str, torch.Tensor]


def spots_of(output: Any) -> Mapping[str, torch.Tensor]:
    """What a pass handed on at the spots its target reads: a :class:`SpotOutput`'s, else
    none."""
    return output.spots if isinstance(output, SpotOutput) else {}


def map_output(output: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn(output)``; for a :class:`SpotOutput`, ``fn`` of its model output, its spots kept
    (a method that transforms the output, SESS's softmax, leaves a unit's spot as it is)."""
    if isinstance(output, SpotOutput):
        return SpotOutput(fn(output.output), output.spots)
    return fn(output)


def is_per_sample_list(output: Any) -> bool:
    """Whether ``output`` is a list (or tuple) with one element per sample: a detector's
    per-image dicts (``boxes``, ``scores``, ``labels``), or one dict of 0-d scores each."""
    return (
        isinstance(output, (list, tuple))
        and len(output) > 0
        and all(isinstance(item, Mapping) and _one_sample(item) for item in output)
    )


def _one_sample(item: Mapping[Any, Any]) -> bool:
    """Whether a dict holds one sample: detections, or only 0-d tensors (at least one)."""
    if "boxes" in item:
        return True
    tensors = [value for value in item.values() if isinstance(value, torch.Tensor)]
    return bool(tensors) and all(tensor.dim() == 0 for tensor in tensors)


def row_count(output: Any) -> tuple[int, torch.device] | None:
    """How many rows a model output has and on which device, or ``None`` if it has none."""
    if isinstance(output, SpotOutput):
        return row_count(output.output)
    if is_per_sample_list(output):
        first = next(tensors_in(output), None)
        return len(output), first.device if first is not None else torch.device("cpu")
    first = next(tensors_in(output), getattr(output, "logits", None))
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return None
    return first.shape[0], first.device


def take_rows(output: Any, rows: torch.Tensor) -> Any:
    """The rows ``rows`` of every tensor in a model output (tensor, tuple, list or dict;
    a :class:`SpotOutput`'s spots too)."""
    if isinstance(output, SpotOutput):
        spots = {key: take_rows(tensor, rows) for key, tensor in output.spots.items()}
        return SpotOutput(take_rows(output.output, rows), spots)
    if isinstance(output, torch.Tensor):
        return output[rows.to(output.device)]
    if is_per_sample_list(output):  # one element per row
        return [output[row] for row in rows.tolist()]
    if isinstance(output, (tuple, list)):
        return type(output)(take_rows(item, rows) for item in output)
    if isinstance(output, Mapping):
        return {key: take_rows(item, rows) for key, item in output.items()}
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return {"logits": logits[rows.to(logits.device)]}
    return output


def as_logits(
    output: Any, output_key: str | int | None = None, what: str = "the class scores"
) -> torch.Tensor:
    """The class-score tensor inside a model's output.

    Args:
        output: A tensor; a tuple or list (the first element, or ``output[output_key]``; a
            pair of probabilities and the logits they are the softmax of, as Ultralytics'
            classifiers return, gives the logits); a dict (``output[output_key]``, or its
            only tensor value, or ``"logits"``/``"out"``); an object with a ``.logits``
            attribute (Hugging Face models).
        output_key: Which element of a tuple or dict holds the scores.
        what: What is looked for, for the message when a dict does not tell.

    Raises:
        CamvizError: No tensor can be found, or the key is not there.
    """
    if isinstance(output, SpotOutput):
        return as_logits(output.output, output_key, what)
    if isinstance(output, torch.Tensor):
        return output
    if output_key is not None:
        try:
            return as_logits(output[output_key], what=what)
        except (KeyError, IndexError, TypeError):
            raise CamvizError(
                f"the model output has no element {output_key!r}; pass output_key= one of "
                f"{_keys_of(output)}"
            ) from None
    if isinstance(output, (tuple, list)) and output:
        logits = _softmax_logits(output)
        return as_logits(output[0], what=what) if logits is None else logits
    if isinstance(output, dict):
        for key in ("logits", "out"):
            if key in output:
                return as_logits(output[key], what=what)
        tensors = [value for value in output.values() if isinstance(value, torch.Tensor)]
        if len(tensors) == 1:
            return tensors[0]
        raise CamvizError(
            f"the model returns a dict with keys {list(output)}; pass output_key= to say "
            f"which one holds {what}"
        )
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    raise CamvizError(
        f"cannot find class scores in a model output of type {type(output).__name__}; pass "
        "target= a callable that maps the output to one score per sample"
    )


def _softmax_logits(output: tuple[Any, ...] | list[Any]) -> torch.Tensor | None:
    """The logits of a ``(probabilities, logits)`` pair whose first element is the softmax of
    its second (an Ultralytics classifier in eval mode); ``None`` for any other output."""
    if len(output) != 2 or not all(isinstance(value, torch.Tensor) for value in output):
        return None
    probabilities, logits = output
    if (
        probabilities.shape != logits.shape
        or logits.dim() != 2
        or not logits.is_floating_point()
        or not torch.allclose(
            probabilities.detach().float(), logits.detach().float().softmax(-1), atol=1e-6
        )
    ):
        return None
    return logits


def _keys_of(output: Any) -> list[Any]:
    if isinstance(output, dict):
        return list(output)
    if isinstance(output, (tuple, list)):
        return list(range(len(output)))
    return []
