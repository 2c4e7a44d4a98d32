"""What each sample is explained for: the scalar whose gradient a CAM follows.

A *target* turns the model's output into one score per sample (and per rank, for top-k):

* ``None`` or ``"top1"`` - the predicted class of each sample;
* ``"topK"`` (``"top3"``) or :class:`TopK` - the K best classes, one map per rank;
* an ``int`` - that class for every sample;
* a sequence or 1-D tensor of ints - one class per sample (as many as the batch);
* an ``(N, K)`` tensor of ints - K given classes per sample, one map per rank;
* :class:`Region` - a class's logits summed over a region of a segmentation output;
* :class:`Unit` - a unit inside the model: a channel's mean over its layer's grid, one
  neuron, or a direction in channel space (:mod:`camviz.core.targets.unit`);
* :class:`~camviz.core.detection.Detection` - one object a detector found, by index or by
  box and class (:mod:`camviz.core.detection`);
* :class:`Contrast` - ``y_a - alpha * y_b``: why ``a`` rather than ``b``, any two targets
  (``b`` given as classes is scored as ``a`` scores its class: the mean of several classes,
  or the classes :class:`Nearest` to ``a``);
* :class:`~camviz.core.similarity.Similarity` - the cosine similarity of an embedding with a
  reference;
* :class:`~camviz.core.targets.textprompt.TextPrompt` - the cosine similarity of a CLIP-like
  model's image embedding with the embedding of each of its texts, one map per text;
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
For a target that reads layer spots (:attr:`TargetObject.spots`, a ``Unit``), a re-run's
output is a :class:`SpotOutput` that also holds the re-run's tensors at those spots
(:meth:`camviz.cams.base.LayerData.run` records them).

Every kind of target is an object that implements :class:`TargetObject`
(:mod:`camviz.core.targets.protocol`): the engine prepares it, resolves it on the pass's
output and asks it how to follow a re-run or an augmented input, and never asks its kind.
:func:`as_target` is the one conversion from what a user passes. Adding a kind is one class
that implements the protocol, in one file.
"""

from __future__ import annotations

from typing import Any

from camviz.core.targets.callables import CallableTarget, UserScore, call_target, takes_rows
from camviz.core.targets.classes import (
    ClassIds,
    Predicted,
    TopK,
    class_ids,
    nearest_classes,
    probability_score,
)
from camviz.core.targets.contrast import Contrast, Nearest
from camviz.core.targets.convert import Target, as_target, class_name, score_fns
from camviz.core.targets.outputs import (
    SpotOutput,
    as_logits,
    is_per_sample_list,
    map_output,
    row_count,
    spots_of,
    take_rows,
)
from camviz.core.targets.protocol import (
    Change,
    Context,
    Resolved,
    RowTarget,
    ScoreFn,
    TargetObject,
)
from camviz.core.targets.region import Region
from camviz.core.targets.unit import Unit, parse_unit

__all__ = [
    "CallableTarget",
    "Change",
    "ClassIds",
    "Context",
    "Contrast",
    "Nearest",
    "Predicted",
    "Region",
    "Resolved",
    "RowTarget",
    "ScoreFn",
    "SpotOutput",
    "Target",
    "TargetObject",
    "TopK",
    "Unit",
    "UserScore",
    "as_logits",
    "as_target",
    "call_target",
    "class_ids",
    "class_name",
    "is_per_sample_list",
    "map_output",
    "nearest_classes",
    "parse_unit",
    "probability_score",
    "row_count",
    "score_fns",
    "spots_of",
    "take_rows",
    "takes_rows",
]


def __getattr__(name: str) -> Any:
    # Detection targets live in core.detection, which imports this package; they import
    # from here as they did before targets became a package.
    if name in ("Detection", "Followed"):
        from camviz.core import detection

        return getattr(detection, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
