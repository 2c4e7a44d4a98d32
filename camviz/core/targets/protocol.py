"""The target protocol: what every kind of target answers, so that nothing else asks its kind.

A target kind is one class that implements :class:`TargetObject`:

* :meth:`~TargetObject.prepare` - the target ready for a pass on ``model`` and ``inputs``
  (:class:`~camviz.core.similarity.Similarity` embeds its reference images there);
* :meth:`~TargetObject.resolve` - the model's output (and the :class:`Context` of the pass)
  -> a :class:`Resolved`: one score function per rank, the class ids and, per sample, why
  there is nothing to explain;
* :meth:`~TargetObject.follow` - the target of a later pass (a re-run, an augmented input),
  given how that pass differs (:class:`Change`): fixed class ids, detections followed by box;
* :meth:`~TargetObject.model_changes` - how the model must be called for this score, as
  temporary changes the engine makes for the explanation (a text prompt,
  :class:`~camviz.core.targets.textprompt.TextPrompt`, calls a CLIP model's
  ``get_image_features``).

A target may ask for extra layer spots to be recorded in the pass (:attr:`TargetObject.spots`);
``resolve`` then finds their tensors in :attr:`Context.spots`. Kinds that want the defaults of
the other members subclass :class:`TargetObject` explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from camviz.core.inputs import Inputs
    from camviz.core.modelstate import ModelChange

ScoreFn = Callable[..., torch.Tensor]
"""``fn(output, rows=None) -> (R,)`` scores of the ``R`` rows of a model output."""


class RowTarget(Protocol):
    """A target that is told which input each output row belongs to (see
    :mod:`camviz.core.targets`).

    Any callable with a second positional parameter is one; camviz calls it as
    ``target(output, rows)`` with ``rows`` the ``(R,)`` long tensor of the input index of
    each output row, and expects ``(R,)`` scores. Per-input data (classes, reference
    embeddings, boxes) is indexed with ``rows``, so it stays right in perturbed batches.
    """

    def __call__(self, output: Any, rows: torch.Tensor, /) -> torch.Tensor: ...


@dataclass(frozen=True)
class Context:
    """What :meth:`TargetObject.resolve` may read besides the model's output.

    Attributes:
        output_key: Where the scores are in a tuple or dict output (see
            :func:`camviz.core.targets.as_logits`).
        spots: ``{spot key: tensor}`` of the spots the target asked for
            (:attr:`TargetObject.spots`), as the pass handed them on (in the graph when
            gradients are taken).
        batch_size: ``N``, the number of inputs; ``None`` when the caller does not know it.
    """

    output_key: str | int | None = None
    spots: Mapping[str, torch.Tensor] = field(default_factory=dict)
    batch_size: int | None = None


@dataclass(frozen=True, eq=False)
class Resolved:
    """A target resolved on a pass's output.

    Attributes:
        scores: One score function per rank (``fn(output, rows=None) -> (R,)``).
        class_ids: ``(N, K)`` the class explained at each rank, or ``None`` when the target
            is no class (a callable, a similarity).
        reasons: Per sample, why there is nothing to explain (``None``: there is
            something); ``None`` when every sample has something.
        boxes: ``(N, K, 4)`` the explained detections' boxes, for detection targets.

    It unpacks as the pair ``(scores, class_ids)``, which ``Detection.resolve`` returned
    before targets were objects.
    """

    scores: tuple[ScoreFn, ...]
    class_ids: torch.Tensor | None = None
    reasons: tuple[str | None, ...] | None = None
    boxes: torch.Tensor | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.scores, self.class_ids))

    def __getitem__(self, index: int) -> Any:
        return (self.scores, self.class_ids)[index]


@dataclass(frozen=True)
class Change:
    """How a later pass differs from the plain one (:meth:`TargetObject.follow`).

    Attributes:
        plain: What the target resolved to in the plain pass.
        factors: Per spatial axis of the map input, its new size over the plain one (empty
            or all ones: the same geometry, as in a re-run on perturbed copies).
        flip_width: The width of the input it was then flipped left to right in; ``None``:
            not flipped.
    """

    plain: Resolved
    factors: tuple[float, ...] = ()
    flip_width: float | None = None

    @property
    def moves(self) -> bool:
        """Whether the input was rescaled or flipped."""
        return self.flip_width is not None or any(factor != 1 for factor in self.factors)


@runtime_checkable
class TargetObject(Protocol):
    """What the engine asks of a target (see the module docstring).

    Attributes:
        spots: Layer spots (``"layer4.1"``, ``"head:input"``) whose tensors the pass must
            record for :meth:`resolve` (in :attr:`Context.spots`).
        picks_classes: Whether the target picks its classes from the model's output (top-k),
            so that another model, or a changed input, may pick others.
        cannot_move: Why the target cannot follow a rescaled or flipped input
            (``aug_smooth``), or ``None`` when it can.
    """

    spots: tuple[str, ...] = ()
    picks_classes: bool = False
    cannot_move: str | None = None

    def model_changes(self, model: nn.Module) -> tuple[ModelChange, ...]:
        """The temporary changes (:mod:`camviz.core.modelstate`) under which ``model``'s
        calls answer what this target scores; made before :meth:`prepare`, undone at the end
        of the explanation."""
        return ()

    def prepare(self, model: nn.Module, inputs: Inputs) -> TargetObject:
        """The target ready for passes of ``model`` on ``inputs`` (the model in eval mode)."""
        return self

    def resolve(self, output: Any, context: Context) -> Resolved:
        """The score functions, class ids and reasons for a pass's ``output``.

        Raises:
            CamvizError: The target does not fit the output.
        """
        ...

    def follow(self, change: Change) -> TargetObject:
        """The target of a later pass that differs from the plain one by ``change``."""
        ...

    def nearest_contrast(self, k: int, alpha: float) -> TargetObject | None:
        """This target compared with the ``k`` classes scored nearest to its own (Finer-CAM),
        or ``None`` when it has no classes to compare; a contrast is kept as it is."""
        return None
