"""A user's callable as a target: ``fn(output) -> (N,)`` or a :class:`RowTarget`
``fn(output, rows) -> (R,)`` (see :mod:`camviz.core.targets` for why rows).

:func:`call_target` is the one place that calls a user callable.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from camviz.core.errors import CamvizError, first_line
from camviz.core.hooks import tensors_in
from camviz.core.targets.outputs import SpotOutput, row_count, take_rows
from camviz.core.targets.protocol import Change, Context, Resolved, TargetObject


@dataclass(frozen=True, eq=False)
class CallableTarget(TargetObject):
    """A user's callable (or a score function handed on by a method) as a target: scored
    through :func:`call_target`, and no class.

    A method's own passes that hand on the explained target's score function give the
    ``spots`` it reads (:attr:`camviz.cams.base.LayerData.target_spots`): the pass records
    them and the function gets its output as a :class:`SpotOutput`, as a re-run's.
    """

    fn: Callable[..., torch.Tensor]
    spots: tuple[str, ...] = ()

    def resolve(self, output: Any, context: Context) -> Resolved:
        recorded = SpotOutput(output, context.spots) if self.spots else None
        return Resolved((UserScore(self.fn, context.batch_size, recorded),))

    def follow(self, change: Change) -> TargetObject:
        return self


@dataclass(frozen=True, eq=False)
class UserScore:
    """The score function of a :class:`CallableTarget`: in the pass it was resolved on
    (``rows=None``), a callable that takes rows gets those of the ``batch_size`` inputs
    (``None``: as many as the output has rows). ``recorded``: that pass's output with the
    spots the target asked for, handed to ``fn`` in place of the bare output."""

    fn: Callable[..., torch.Tensor]
    batch_size: int | None
    recorded: SpotOutput | None = None

    def __call__(self, output: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.recorded is not None and output is self.recorded.output:
            output = self.recorded
        if rows is None and self.batch_size is not None and takes_rows(self.fn):
            first = next(tensors_in(output), None)
            device = first.device if first is not None else None
            rows = torch.arange(self.batch_size, device=device)
        return call_target(self.fn, output, rows)


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
        output: A model output with ``R`` rows (a list with one element per sample is a
            batch of rows, see :mod:`camviz.core.targets.outputs`).
        rows: ``(R,)`` input index of each row; ``None`` when row ``n`` is input ``n``.

    Returns:
        What ``fn`` returns (callers check its shape).

    Raises:
        CamvizError: A one-argument ``fn`` scores a row differently depending on its
            position in a re-run batch (it holds per-input data), so it would score the
            wrong rows; it must take ``rows``.
    """
    if takes_rows(fn):
        if rows is None:
            counted = row_count(output)
            if counted is None:
                raise CamvizError(
                    "a target that takes rows needs a model output with one row per input"
                )
            rows = torch.arange(counted[0], device=counted[1])
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
