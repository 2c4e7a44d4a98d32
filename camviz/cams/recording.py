"""Recording: one forward pass, and exactly the gradients a method needs, at the target spots.

The model runs under ``torch.no_grad()``. A forward hook on each target layer (a *tap*)
copies its output ``A`` and hands the rest of the network ``A + delta``, where ``delta`` is a
zero tensor that requires grad; ``torch.autograd.grad(y.sum(), delta)`` is then exactly
``dy/dA`` for every sample. Nothing below the layer keeps a graph, no parameter gradient is
computed, and in-place operations after the layer cannot change what was recorded (why this
way, and not with backward hooks: ``docs/architecture.md``).

Methods that need second-order information (ShapleyCAM's ``H A``) get it from the same pass:
the gradient is taken with ``create_graph=True``, so ``g = dy/d(delta)`` is itself a function
of ``delta``, and ``torch.autograd.grad(g, delta, grad_outputs=A)`` is the Hessian of ``y``
with respect to ``A`` applied to ``A``. Only the graph after the layer is walked, twice.

A method that reads attention (``attention``) gets every block's attention probabilities
from the same pass (:mod:`camviz.core.attention`), and with ``"gradients"`` each rank's
gradient with respect to them, taken in the same backward pass as the layers'.

The target is resolved on the pass's output (:meth:`camviz.core.targets.TargetObject.resolve`),
with the tensors of the extra spots it asks for. :func:`layer_data` turns what a pass
recorded at one layer into the :class:`~camviz.cams.base.LayerData` a method reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from camviz.cams.base import LayerData
from camviz.core.attention import AttentionCapture, AttentionMaps, as_maps, capturing
from camviz.core.denseheads import DenseRows
from camviz.core.errors import CamvizError
from camviz.core.grids import Layout, layout_of, patch_size
from camviz.core.hooks import detach_to
from camviz.core.inputs import Inputs
from camviz.core.layerkinds import CallLog, Kind, module_kind, record_calls
from camviz.core.layouts import SpotKinds, Tokens
from camviz.core.lineage import Lineage, TokenGrid
from camviz.core.modelstate import exclusive
from camviz.core.placement import Placement, recording
from camviz.core.precision import at_least_fp32
from camviz.core.roiheads import RoIRows
from camviz.core.taps import (
    Watch,
    edit_spots,
    element_key,
    map_elements,
    parse,
    replace,
    select,
)
from camviz.core.targets import Context, Resolved, ScoreFn, Target, TargetObject, as_target


@dataclass
class LayerPass:
    """What one forward (and backward) pass recorded at the target layers.

    Attributes:
        output: The model output (with a graph after the target layers if gradients were
            asked for).
        activations: ``{layer: A}``, ``(N, ...)`` copies of each layer's output.
        gradients: ``{layer: [dy_k/dA for each rank k]}``; empty without gradients.
        scores: ``(N, K)`` explained scores.
        resolved: The target resolved on the output: its score functions (one per rank,
            from a model output to ``(N,)`` scores), class ids and boxes.
        hessian_products: ``{layer: [H_k A for each rank k]}``, ``H_k`` the Hessian of
            ``y_k`` with respect to ``A``; empty unless asked for.
        placement: Where the layers' grids lie on the map input
            (:mod:`camviz.core.placement`).
        calls: Every module call of the pass, when asked for (to tell layouts).
        tokens: Where the patch tokens of each spot's tensor are, when the pass was followed
            from the map input and they are patch tokens (:mod:`camviz.core.lineage`).
        attention: Every block's attention, one :class:`~camviz.core.attention.AttentionMaps`
            per rank (with its gradients when asked for); empty unless asked for.
        target_spots: The spots the target reads (:attr:`TargetObject.spots`), which
            re-runs of the model record for it too (:meth:`LayerData.run`).
    """

    output: Any
    activations: dict[str, torch.Tensor]
    gradients: dict[str, list[torch.Tensor]]
    scores: torch.Tensor
    resolved: Resolved
    hessian_products: dict[str, list[torch.Tensor]]
    placement: Placement
    calls: CallLog | None = None
    tokens: dict[str, TokenGrid | None] = field(default_factory=dict)
    attention: list[AttentionMaps] = field(default_factory=list)
    target_spots: tuple[str, ...] = ()

    @property
    def score_fns(self) -> list[ScoreFn]:
        """One function per rank from a model output to ``(N,)`` scores."""
        return list(self.resolved.scores)

    @property
    def class_ids(self) -> torch.Tensor | None:
        """``(N, K)`` explained classes, or ``None`` for a target that is no class."""
        return self.resolved.class_ids


class Tap:
    """The forward-hook edit on one target spot (see the module docstring).

    A spot that holds a tuple, list or dict (an FPN's levels) is tapped at each of its
    feature maps (:func:`camviz.core.taps.map_elements`), recorded under their element spots.
    ``handed`` keeps what the rest of the network got, for a target that asks for the spot.
    """

    def __init__(
        self, name: str, open_gradient_path: bool, rank: int, lineage: Lineage | None
    ) -> None:
        self.name = name
        self.open_gradient_path = open_gradient_path
        self.rank = rank
        self.lineage = lineage
        self.ran = False
        self.activations: dict[str, torch.Tensor] = {}
        self.deltas: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, TokenGrid | None] = {}
        self.handed: Any = None

    def __call__(self, output: Any) -> Any:
        if self.ran:
            raise CamvizError(
                f"layer {self.name!r} runs more than once in one forward pass (a shared "
                "module); pick a layer that runs once"
            )
        self.ran = True
        if isinstance(output, torch.Tensor):
            self.handed = self._tapped(self.name, output)
            return self.handed
        items = map_elements(output, self.rank)
        if not items:
            raise CamvizError(
                f"layer {self.name!r} gives a {type(output).__name__} with no feature map of "
                f"the input's rank ({self.rank + 2}-D tensors); pick a layer that outputs one, "
                "or one element of it as 'name[0]' or 'name[key]'"
            )
        for item in items:
            key = element_key(self.name, item)
            output = replace(output, (item,), self._tapped(key, select(output, (item,), key)))
        self.handed = output
        return output

    def _tapped(self, key: str, output: torch.Tensor) -> torch.Tensor:
        self.activations[key] = output.detach().clone()
        if self.lineage is not None:
            self.tokens[key] = self.lineage.token_grid(output)
        if not self.open_gradient_path:
            return output
        torch.set_grad_enabled(True)  # undone when the caller's no_grad block ends
        delta = torch.zeros_like(output, requires_grad=True)
        self.deltas[key] = delta
        return output + delta


def layer_pass(
    model: nn.Module,
    inputs: torch.Tensor | Inputs,
    layers: Sequence[str],
    target: Target = None,
    *,
    gradients: bool = True,
    output_key: str | int | None = None,
    hessian: bool = False,
    record: bool = False,
    follow: bool | None = None,
    attention: Attention = None,
) -> LayerPass:
    """Run the model once and record activations (and exact gradients) at ``layers``.

    The building block under every method: :func:`camviz.explain` calls it once, and methods
    that average over noisy or augmented inputs call it once per variant. The model must
    already be in the mode wanted (``explain`` puts it in eval mode), and ``target`` ready
    for it (:meth:`~camviz.core.targets.TargetObject.prepare`). ``layers`` are spot keys
    (:mod:`camviz.core.taps`); one whose output is a tuple, list or dict is recorded at each
    of its feature maps, under their element spots (the keys of
    :attr:`LayerPass.activations`); ``hessian=True`` (with ``gradients``) also records ``H A``
    at each layer (see the module docstring); ``record`` also logs every module call (for
    layouts); ``follow`` follows the pass from the map input to tell where the patch tokens
    of each spot are (:attr:`LayerPass.tokens`; by default unless every spot is a module
    that outputs channels-first maps); ``attention`` also records every block's attention
    probabilities, and with ``"gradients"`` their gradients (:attr:`LayerPass.attention`).
    """
    batch = inputs if isinstance(inputs, Inputs) else Inputs((inputs,), {}, 0, len(inputs))
    chosen = as_target(target)
    if follow is None:
        follow = any(_may_hold_tokens(model, name) for name in layers)
    lineage = Lineage(batch.main) if follow else None
    # A caller's inference mode would stop the graph too.
    with exclusive(model), torch.inference_mode(False):
        taps = {name: Tap(name, gradients, batch.main.dim() - 2, lineage) for name in layers}
        # Exact gradients through a detector's RoI or dense heads for the RoIs or anchors a
        # score uses (second order would need the replay's graph twice: ShapleyCAM takes the
        # plain path).
        tapped = [parse(name).name for name in layers]
        shortcut = (
            RoIRows.of(model, tapped) or DenseRows.of(model, tapped)
            if gradients and not hessian
            else None
        )
        captured = (
            capturing(model, attention == "gradients") if attention is not None else nullcontext()
        )
        # The capture outside the lineage: the lineage sees the fused call it knows.
        with captured as capture, lineage if lineage is not None else nullcontext():
            output, spots, placement, calls = _forward(model, batch, taps, chosen, shortcut, record)
        activations, deltas = _recorded(taps)
        resolved = chosen.resolve(output, Context(output_key, spots, batch.size))
        backward = _GradientPass(
            output, deltas, activations, shortcut, gradients and hessian, list(layers), capture
        )
        fns = resolved.scores
        scores, per_rank, products = backward.run(fns, batch.size, gradients)
    return LayerPass(
        output=at_least_fp32(detach_to(output, None)),
        activations={name: at_least_fp32(values) for name, values in activations.items()},
        gradients=per_rank,
        scores=scores,
        resolved=resolved,
        hessian_products=products,
        placement=placement,
        calls=calls,
        tokens={key: grid for tap in taps.values() for key, grid in tap.tokens.items()},
        attention=(
            [] if capture is None else as_maps(capture, backward.attention_gradients, len(fns))
        ),
        target_spots=tuple(chosen.spots),
    )


def _may_hold_tokens(model: nn.Module, name: str) -> bool:
    """Whether a spot's tensor may be a token sequence: anything but a module's output that
    is channels first by the module's nature (a convolution, batch norm or pooling)."""
    spot = parse(name)
    return (
        spot.at == "input"
        or bool(spot.path)
        or (module_kind(model.get_submodule(spot.name)) != "channels_first")
    )


def _forward(
    model: nn.Module,
    batch: Inputs,
    taps: dict[str, Tap],
    target: TargetObject,
    shortcut: RoIRows | DenseRows | None,
    record: bool,
) -> tuple[Any, dict[str, Any], Placement, CallLog | None]:
    """The model's output with the taps on, what the target's spots handed on, where the
    grids lie on the input, and the module calls if ``record``."""
    watches = {spot: Watch(spot) for spot in target.spots if spot not in taps}
    log = None
    with (
        edit_spots(model, {**taps, **watches}, containers=True),
        recording(model) as placed,
        shortcut.cut() if shortcut else nullcontext(),
        torch.no_grad(),
    ):
        if record:
            with record_calls(model) as log:
                output = batch(model)
        else:
            output = batch(model)
    edits: dict[str, Tap | Watch] = {**taps, **watches}
    for edit in edits.values():
        if not edit.ran:
            raise CamvizError(
                f"layer {edit.name!r} did not run in the forward pass; pick a layer that the "
                "model uses (`camviz layers` lists them with shapes)"
            )
    spots = {spot: edits[spot].handed for spot in target.spots}
    placement = placed.placement(batch.main.shape[2:], batch.image_sizes, batch.size)
    return output, spots, placement, log


def _recorded(taps: dict[str, Tap]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The activations of every tapped spot (container spots expanded into their feature
    maps) and their ``delta`` tensors (when gradients are asked for)."""
    activations: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    for tap in taps.values():
        activations.update(tap.activations)
        deltas.update(tap.deltas)
    return activations, deltas


#: What a pass records of the attention: nothing, the probabilities, or also their gradients.
Attention = Literal["probabilities", "gradients"] | None


@dataclass
class _GradientPass:
    """The backward passes of one recorded forward pass: each rank's score differentiated
    with respect to every ``delta`` (and once more along ``A`` for ``hessian``), the
    attention's among them when the capture took gradients (``attention_gradients``: per
    rank, per call)."""

    output: Any
    deltas: dict[str, torch.Tensor]
    activations: dict[str, torch.Tensor]
    shortcut: RoIRows | DenseRows | None
    hessian: bool
    layers: list[str]
    capture: AttentionCapture | None = None
    attention_gradients: list[list[torch.Tensor | None]] = field(default_factory=list)

    @property
    def _attention_deltas(self) -> list[torch.Tensor]:
        calls = self.capture.calls if self.capture is not None else []
        return [call.delta for call in calls if call.delta is not None]

    def run(
        self, fns: Sequence[ScoreFn], batch: int, gradients: bool
    ) -> tuple[torch.Tensor, dict[str, list[torch.Tensor]], dict[str, list[torch.Tensor]]]:
        """The ``(N, K)`` scores, and each spot's gradients and Hessian products per rank."""
        spots = list(self.activations)
        per_rank: dict[str, list[torch.Tensor]] = {name: [] for name in spots} if gradients else {}
        products: dict[str, list[torch.Tensor]] = (
            {name: [] for name in spots} if self.hessian else {}
        )
        scores = []
        with torch.enable_grad():
            for rank, score_fn in enumerate(fns):
                score = score_fn(self.output)
                _check_scores(score, batch)
                scores.append(at_least_fp32(score.detach()))
                if not gradients and not self._attention_deltas:
                    continue
                if not score.requires_grad:
                    raise CamvizError(
                        "the explained score does not depend on layer(s) "
                        f"{', '.join(self.layers)}; pick a layer before the model's output"
                    )
                grads = self._gradients(score, retain=self.hessian or rank < len(fns) - 1)
                if self._attention_deltas:
                    self.attention_gradients.append(list(grads[len(self.deltas) :]))
                    grads = grads[: len(self.deltas)]
                for (name, delta), grad in zip(self.deltas.items(), grads, strict=True):
                    per_rank[name].append(
                        at_least_fp32(torch.zeros_like(delta) if grad is None else grad.detach())
                    )
                    if self.hessian:
                        product = _hessian_product(grad, delta, self.activations[name])
                        products[name].append(at_least_fp32(product))
        return torch.stack(scores, dim=1), per_rank, products

    def _gradients(self, score: torch.Tensor, retain: bool) -> Sequence[torch.Tensor | None]:
        deltas = list(self.deltas.values()) + self._attention_deltas
        if self.shortcut:
            return self.shortcut.gradients(score.sum(), deltas, retain_graph=retain)
        return torch.autograd.grad(
            score.sum(), deltas, retain_graph=retain, create_graph=self.hessian, allow_unused=True
        )


def _hessian_product(
    gradient: torch.Tensor | None, delta: torch.Tensor, activation: torch.Tensor
) -> torch.Tensor:
    """``H A``: the derivative of ``gradient`` (``dy/d(delta)``, with its graph) along ``A``.

    Zero where the gradient does not depend on ``delta`` (the layers after the target are
    piecewise linear in it, as with ReLU networks, or do not use it).
    """
    if gradient is None or not gradient.requires_grad:
        return torch.zeros_like(delta)
    (product,) = torch.autograd.grad(
        gradient, delta, grad_outputs=activation, retain_graph=True, allow_unused=True
    )
    return torch.zeros_like(delta) if product is None else product


def _check_scores(score: torch.Tensor, batch: int) -> None:
    if not isinstance(score, torch.Tensor) or score.shape != (batch,):
        shape = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
        raise CamvizError(
            f"a target callable must return one score per sample, shape ({batch},), got {shape}"
        )


def layer_data(
    model: nn.Module,
    inputs: torch.Tensor | Inputs,
    recorded: LayerPass,
    name: str,
    kind: Kind | None = None,
    tokens: Tokens | None = None,
) -> list[LayerData]:
    """What a method gets for layer ``name`` of a recorded pass: one :class:`LayerData` per
    rank, activations and gradients in their ``(N, C, *grid)`` view (``kind``: the layout
    kind when known, ``tokens``: where ``layout=`` puts the patch tokens, see
    :mod:`camviz.core.grids`; else where the pass found them).

    Raises:
        CamvizError: The layer folds windows or heads into the batch, or its layout is unclear.
    """
    batch = inputs if isinstance(inputs, Inputs) else Inputs((inputs,), {}, 0, len(inputs))
    output = recorded.activations[name]
    if output.shape[0] != batch.size:
        raise CamvizError(
            f"layer {name!r} outputs a batch of {output.shape[0]} for {batch.size} "
            "inputs (windows, frames or heads folded into the batch); pick a layer whose "
            "output keeps one row per input"
        )
    if kind is None:  # a method's own pass: the kind the module or an earlier pass told
        kind = SpotKinds(model, batch.main.dim()).known(name)
    layout = spot_layout(name, output, batch.main, model, kind, tokens or recorded.tokens.get(name))
    activations = layout.to_spatial(output)
    ranks = []
    for rank, score_fn in enumerate(recorded.score_fns):
        gradients = recorded.gradients[name][rank] if recorded.gradients else None
        product = recorded.hessian_products[name][rank] if recorded.hessian_products else None
        ranks.append(
            LayerData(
                layer=name,
                activations=activations,
                gradients=None if gradients is None else layout.to_spatial(gradients),
                model=model,
                inputs=batch.main,
                score_fn=score_fn,
                class_ids=None if recorded.class_ids is None else recorded.class_ids[:, rank],
                scores=recorded.scores[:, rank],
                layout=layout,
                batch=batch,
                hessian_products=None if product is None else layout.to_spatial(product),
                placement=recorded.placement,
                attention=recorded.attention[rank] if recorded.attention else None,
                target_spots=recorded.target_spots,
            )
        )
    return ranks


def spot_layout(
    name: str,
    output: torch.Tensor,
    inputs: torch.Tensor,
    model: nn.Module,
    kind: Kind | None,
    tokens: TokenGrid | Tokens | None = None,
) -> Layout:
    """The layout of a layer's output, checked to have a grid of the input's rank."""
    patch = patch_size(model) if output.dim() == 3 else None
    layout = layout_of(output.shape, name, inputs.shape[2:], patch, kind, tokens)
    if len(layout.grid) != inputs.dim() - 2:
        raise CamvizError(
            f"layer {name!r} has a {len(layout.grid)}-D grid {layout.grid}, but the map input "
            f"has {inputs.dim() - 2} spatial axes {tuple(inputs.shape[2:])}; pick a layer "
            "with a grid like the input's"
        )
    return layout
