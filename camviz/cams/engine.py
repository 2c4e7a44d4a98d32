"""The engine: one forward pass, exactly the gradients a method needs, then post-processing.

The model runs under ``torch.no_grad()``. A forward hook on each target layer copies its
output ``A`` and hands the rest of the network ``A + delta``, where ``delta`` is a zero tensor
that requires grad; ``torch.autograd.grad(y.sum(), delta)`` is then exactly ``dy/dA`` for
every sample. Nothing below the layer keeps a graph, no parameter gradient is computed, and
in-place operations after the layer cannot change what was recorded (why this way, and not
with backward hooks: ``docs/architecture.md``). Methods turn the recorded :class:`LayerData`
into raw maps; the engine applies ReLU, normalises, resizes and fuses.

Inputs of any spatial rank (signals, images, volumes and clips), several inputs
(:mod:`camviz.core.inputs`), taps on a layer's input or one element of its output
(:mod:`camviz.core.taps`), and layouts told from the module that produced an output
(:mod:`camviz.cams.layout`) all meet here.

Methods that need second-order information (ShapleyCAM's ``H A``) get it from the same pass:
the gradient is taken with ``create_graph=True``, so ``g = dy/d(delta)`` is itself a function
of ``delta``, and ``torch.autograd.grad(g, delta, grad_outputs=A)`` is the Hessian of ``y``
with respect to ``A`` applied to ``A``. Only the graph after the layer is walked, twice.

Whatever happens, the model comes back as it was: hooks removed, every module's train/eval
flag restored, ``requires_grad`` and ``.grad`` never touched.

**Threads.** Calls on one model are serialised (:func:`camviz.core.modelstate.exclusive`):
a second thread that explains with the same model waits until the first call is done,
since its hooks would otherwise see the other call's pass. Threads with their own copies
of the model run in parallel.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.cams.base import CamMethod, ChannelWeighted, LayerData
from camviz.cams.layout import Layout, as_spatial, layout_kind, layout_of, patch_size
from camviz.cams.registry import create
from camviz.core.detection import Detection, DetectionScore, Followed
from camviz.core.errors import CamvizError, NonFiniteError, ZeroMapWarning
from camviz.core.finite import first_nonfinite_layer, is_finite
from camviz.core.hooks import detach_to
from camviz.core.inputs import Inputs, Key, as_inputs, corner
from camviz.core.layerkinds import CallLog, Kind, module_kind, record_calls
from camviz.core.layers import Layer, default_target_layer
from camviz.core.maps import normalize as normalize_maps
from camviz.core.maps import normalize_signed, upsample
from camviz.core.modelstate import eval_mode, exclusive, uncompiled
from camviz.core.placement import Placement, recording
from camviz.core.precision import Precision, at_least_fp32, check_precision, forward_precision
from camviz.core.roiheads import RoIRows
from camviz.core.similarity import Similarity
from camviz.core.taps import (
    At,
    edit_spots,
    element_key,
    map_elements,
    parse,
    replace,
    select,
    spot_keys,
)
from camviz.core.targets import Contrast, Region, ScoreFn, Target, score_fns

Fuse = Literal["mean", "max", "product"]
# Maps on the input: an (M, *spatial) tensor, or one (h_n, w_n) map each for a list of images.
Maps = torch.Tensor | list[torch.Tensor]

# as_spatial is re-exported: methods that run their own layer passes use it.
__all__ = ["Explanation", "LayerPass", "as_spatial", "explain", "layer_data", "layer_pass"]

DEFAULT_AUG_SCALES = (1.0, 0.9, 1.1)

_INTERPOLATION = {3: "linear", 4: "bilinear", 5: "trilinear"}

# The layout kind of each (model, layer spot, input rank), once told from a recorded pass.
_kind_cache: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int], Kind | None]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class Explanation:
    """The result of :func:`explain`. ``M = N * K`` maps for ``N`` inputs and ``K`` ranks.

    Attributes:
        heatmaps: ``(M, *spatial)`` maps at the map input's size (``(M, L)``,
            ``(M, H, W)`` or ``(M, D, H, W)``). By default after ReLU, min-max normalised
            there (the hottest location is 1; a map with no evidence is all zeros). With
            ``relu=False`` they keep their sign (normalised: divided by their largest
            absolute value); with ``normalize=False`` they are in the method's own units,
            and with several layers they hold the first layer's map (raw maps of different
            layers are not fused; see ``maps_by_layer``). For a list of images given to a
            detector, a list of ``M`` maps ``(h_n, w_n)``, each at its own image's size and
            normalised over it (``heatmaps[m]`` is the map of image ``samples[m]``). A
            detector's maps are laid back on each image through its own resize and padding
            (:mod:`camviz.core.placement`).
        layer_maps: ``(M, *grid)`` maps of the (first) target layer at its own resolution
            (at the input's for methods with ``input_resolution``; a detector's grid covers
            its own resized and padded batch), processed as ``heatmaps``.
        maps_by_layer: ``{layer: (M, *grid)}`` for every target layer.
        targets: ``(M,)`` explained class ids (``-1`` when the target was a callable).
        scores: ``(M,)`` explained scores (logits) from the forward pass.
        samples: ``(M,)`` index of the input each map belongs to.
        output: The model's output for the batch, detached.
        method: The method's registry name.
        layers: The target layer spots (names; ``"name:input"`` for ``at="input"``; a
            layer whose output is a tuple, list or dict of feature maps appears as its
            maps' element spots, e.g. ``["backbone[0]", "backbone[1]", "backbone[pool]"]``).
        weights: ``{layer: (M, C)}`` channel weights for the methods whose map is a weighted
            sum of channels (Grad-CAM, Grad-CAM++, XGrad-CAM, Score-CAM, SS-CAM,
            Ablation-CAM ...), from the plain pass; ``None`` for the others.
        maps_by_input: For input-gradient methods (vanilla gradients, Guided Backprop),
            ``{input position or name: (M, *spatial)}`` for every input with spatial axes,
            processed as ``heatmaps`` (a list of maps for a list of images); ``None`` for the
            others.
        boxes: For a :class:`~camviz.core.detection.Detection` target, ``(M, 4)`` the box
            of each explained detection (``x0, y0, x1, y1`` in the input's pixels);
            ``None`` for other targets.
    """

    heatmaps: Maps
    layer_maps: torch.Tensor
    maps_by_layer: dict[str, torch.Tensor]
    targets: torch.Tensor
    scores: torch.Tensor
    samples: torch.Tensor
    output: Any
    method: str
    layers: list[str]
    weights: dict[str, torch.Tensor] | None = None
    maps_by_input: dict[Key, Maps] | None = None
    boxes: torch.Tensor | None = None


@dataclass
class LayerPass:
    """What one forward (and backward) pass recorded at the target layers.

    Attributes:
        output: The model output (with a graph after the target layers if gradients were
            asked for).
        activations: ``{layer: A}``, ``(N, ...)`` copies of each layer's output.
        gradients: ``{layer: [dy_k/dA for each rank k]}``; empty without gradients.
        hessian_products: ``{layer: [H_k A for each rank k]}``, ``H_k`` the Hessian of
            ``y_k`` with respect to ``A``; empty unless asked for.
        scores: ``(N, K)`` explained scores.
        score_fns: One function per rank from a model output to ``(N,)`` scores.
        class_ids: ``(N, K)`` explained classes, or ``None`` for a callable target.
        calls: Every module call of the pass, when asked for (to tell layouts).
        placement: Where the layers' grids lie on the map input
            (:mod:`camviz.core.placement`).
    """

    output: Any
    activations: dict[str, torch.Tensor]
    gradients: dict[str, list[torch.Tensor]]
    scores: torch.Tensor
    score_fns: list[ScoreFn]
    class_ids: torch.Tensor | None
    hessian_products: dict[str, list[torch.Tensor]]
    placement: Placement
    calls: CallLog | None = None


class _Tap:
    """The forward-hook edit on one target spot (see the module docstring, step 2).

    A spot that holds a tuple, list or dict (an FPN's levels) is tapped at each of its
    feature maps (:func:`camviz.core.taps.map_elements`), recorded under their element spots.
    """

    def __init__(self, name: str, open_gradient_path: bool, rank: int) -> None:
        self.name = name
        self.open_gradient_path = open_gradient_path
        self.rank = rank
        self.ran = False
        self.activations: dict[str, torch.Tensor] = {}
        self.deltas: dict[str, torch.Tensor] = {}

    def __call__(self, output: Any) -> Any:
        if self.ran:
            raise CamvizError(
                f"layer {self.name!r} runs more than once in one forward pass (a shared "
                "module); pick a layer that runs once"
            )
        self.ran = True
        if isinstance(output, torch.Tensor):
            return self._tapped(self.name, output)
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
        return output

    def _tapped(self, key: str, output: torch.Tensor) -> torch.Tensor:
        self.activations[key] = output.detach().clone()
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
) -> LayerPass:
    """Run the model once and record activations (and exact gradients) at ``layers``.

    The building block under every method: :func:`explain` calls it once, and methods
    that average over noisy or augmented inputs call it once per variant. The model must
    already be in the mode wanted (``explain`` puts it in eval mode). ``layers`` are spot
    keys (:mod:`camviz.core.taps`); one whose output is a tuple, list or dict is recorded at
    each of its feature maps, under their element spots (the keys of
    :attr:`LayerPass.activations`); ``hessian=True`` (with ``gradients``) also records ``H A``
    at each layer (see the module docstring); ``record`` also logs every module call (for
    layouts).
    """
    batch = inputs if isinstance(inputs, Inputs) else Inputs((inputs,), {}, 0, len(inputs))
    # A caller's inference mode would stop the graph too.
    with exclusive(model), torch.inference_mode(False):
        return _layer_pass(model, batch, layers, target, gradients, output_key, hessian, record)


def _layer_pass(
    model: nn.Module,
    batch: Inputs,
    layers: Sequence[str],
    target: Target,
    gradients: bool,
    output_key: str | int | None,
    hessian: bool = False,
    record: bool = False,
) -> LayerPass:
    taps = {name: _Tap(name, gradients, batch.main.dim() - 2) for name in layers}
    log = None
    # Exact gradients through a detector's RoI heads for the RoIs a score uses (second order
    # would need the replay's graph twice: ShapleyCAM takes the plain path).
    shortcut = (
        RoIRows.of(model, [parse(name).name for name in layers])
        if gradients and not hessian
        else None
    )
    with (
        edit_spots(model, taps, containers=True),
        recording(model) as placed,
        shortcut.cut() if shortcut else nullcontext(),
        torch.no_grad(),
    ):
        if record:
            with record_calls(model) as log:
                output = batch(model)
        else:
            output = batch(model)
    activations: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}  # one per spot when gradients are asked for
    for tap in taps.values():
        if not tap.ran:
            raise CamvizError(
                f"layer {tap.name!r} did not run in the forward pass; pick a layer that the "
                "model uses (`camviz layers` lists them with shapes)"
            )
        activations.update(tap.activations)
        deltas.update(tap.deltas)
    spots = list(activations)  # container spots expanded into their feature maps
    fns, ids = score_fns(target, output, output_key)
    per_rank: dict[str, list[torch.Tensor]] = {name: [] for name in spots} if gradients else {}
    hessian = hessian and gradients
    products: dict[str, list[torch.Tensor]] = {name: [] for name in spots} if hessian else {}
    scores = []
    with torch.enable_grad():
        for rank, score_fn in enumerate(fns):
            score = score_fn(output)
            _check_scores(score, batch.size)
            scores.append(at_least_fp32(score.detach()))
            if not gradients:
                continue
            if not score.requires_grad:
                raise CamvizError(
                    f"the explained score does not depend on layer(s) {', '.join(layers)}; "
                    "pick a layer before the model's output"
                )
            retain = hessian or rank < len(fns) - 1
            grads = (
                shortcut.gradients(score.sum(), list(deltas.values()), retain_graph=retain)
                if shortcut
                else torch.autograd.grad(
                    score.sum(),
                    list(deltas.values()),
                    retain_graph=retain,
                    create_graph=hessian,
                    allow_unused=True,
                )
            )
            for (name, delta), grad in zip(deltas.items(), grads, strict=True):
                per_rank[name].append(
                    at_least_fp32(torch.zeros_like(delta) if grad is None else grad.detach())
                )
                if hessian:
                    product = _hessian_product(grad, delta, activations[name])
                    products[name].append(at_least_fp32(product))
    return LayerPass(
        output=at_least_fp32(detach_to(output, None)),
        activations={name: at_least_fp32(values) for name, values in activations.items()},
        gradients=per_rank,
        scores=torch.stack(scores, dim=1),
        score_fns=fns,
        class_ids=ids,
        hessian_products=products,
        placement=placed.placement(batch.main.shape[2:], batch.image_sizes, batch.size),
        calls=log,
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


def explain(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[Any] | Mapping[str, Any],
    method: str | CamMethod = "gradcam",
    layer: Layer | Sequence[Layer] | None = None,
    target: Target = None,
    *,
    output_key: str | int | None = None,
    fuse: Fuse | None = None,
    aug_smooth: bool | Sequence[float] = False,
    precision: Precision = "fp32",
    channels_last: bool = False,
    at: At = "output",
    layout: str | Mapping[str, str] | None = None,
    map_input: Key | None = None,
    relu: bool = True,
    normalize: bool = True,
    **options: Any,
) -> Explanation:
    """Explain a batch with a CAM method.

    Args:
        model: Any ``nn.Module`` (a classifier, a regressor, an embedding model with
            :class:`~camviz.core.similarity.Similarity`, or any model with a ``target``
            callable); ``DataParallel``, ``DistributedDataParallel`` and ``torch.compile``
            wrappers are looked through (layer names are the inner module's). It is used in
            eval mode for the call and handed back exactly as it came.
        inputs: The batch, already preprocessed and moved to the model's device: an
            ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)`` tensor (one ``(C, H, W)``
            image for a 2-D image model), a tuple of inputs passed positionally or a dict
            passed as keywords (:mod:`camviz.core.inputs`); for a torchvision detector, also
            a list of ``(3, H_n, W_n)`` images of any sizes (a list of maps out).
        method: A registry name (:func:`camviz.cams.names`) or a method instance.
        layer: Target layer(s): names, wildcard patterns or submodules of the model,
            or a list of them; ``"name[0]"`` / ``"name[key]"`` takes one element of
            a tuple, list or dict output (:mod:`camviz.core.taps`); a layer whose output is
            a tuple, list or dict of feature maps (an FPN's levels) gives one map per level,
            fused like several layers. ``None`` picks a torchvision detector's FPN (its
            ``backbone``) or a segmentation model's last backbone stage, else the last layer
            with a spatial output, or for a vision transformer the norm before its last
            attention (:func:`camviz.core.layers.default_target_layer`; found once per model,
            with a one-sample dry run unless the model's family decides).
        target: What to explain; see :mod:`camviz.core.targets` (class id, list of ids, ``None``
            for top-1, or the output itself when it is one number per sample, ``"top3"``,
            :class:`~camviz.core.targets.Region`, :class:`~camviz.core.targets.Contrast`,
            :class:`~camviz.core.similarity.Similarity`, or a callable ``output -> (N,)``).
            Methods that re-run the model score batches whose rows come from any input; a
            callable that holds per-input data must take the rows,
            ``(output, rows) -> (R,) scores`` with ``rows[r]`` the input of row ``r``
            (:class:`~camviz.core.targets.RowTarget`).
        output_key: For models whose output is a tuple or dict: where the logits are.
        fuse: How maps of several layers combine (``"mean"``, ``"max"`` or ``"product"``):
            each layer's normalised map is upsampled to the input size, then the mean, the
            pixel-wise maximum or the product is taken and normalised again. ``None``: the
            method's own rule (``refinecam`` multiplies), else the mean.
        aug_smooth: Test-time augmentation, for any method: the batch is also explained
            flipped along its last axis and rescaled, each map is flipped back and resized
            to the input, and the maps are averaged (then normalised). ``True`` uses the
            scales ``(1.0, 0.9, 1.1)``, each with and without the flip (6 passes); a
            sequence of scales chooses them (``(1.0,)``: flips only, for models with a
            fixed input size such as ViTs); the plain pass always counts once. The explained
            classes are those of the plain pass.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the model's forward passes (and
            the perturbed passes of Score-CAM and SS-CAM) run under
            ``torch.autocast`` to that dtype; maps, weights and normalisation stay in
            float32 (float64 for a float64 model). Refused on hardware that only emulates
            it (see :mod:`camviz.core.precision`). Ablation-CAM always scores in float32.
        channels_last: Hand the model a channels-last copy of its input (its convolutions
            then compute channels-last). The model and ``inputs`` are not modified.
        at: ``"output"`` (default) explains each layer's output; ``"input"`` its first
            positional input (Captum's ``attribute_to_layer_input``).
        layout: How the target layer lays out its output, when camviz cannot tell it from
            the module that produced it: ``"channels_first"`` (``(N, C, *grid)``),
            ``"channels_last"`` (``(N, *grid, C)``) or ``"tokens"`` (``(N, T, C)``), for all
            layers or as ``{layer: layout}``.
        map_input: Which input the heatmap is laid on: a position in a tuple of inputs or a
            key of a dict (default: the first).
        relu: Apply the ReLU of the CAM formulas. ``False`` keeps signed maps.
        normalize: Normalise each map (min-max after ReLU, else divided by its largest
            absolute value). ``False`` returns the method's map in its own units.
        **options: Passed to the method's constructor (e.g. ``batch_size``, ``eigen_smooth``;
            each method's docstring lists its own); an option the method does not take is a
            :class:`CamvizError`.

    Returns:
        An :class:`Explanation`.

    Raises:
        CamvizError: A bad layer name, target, input shape, layout or method name; NaN or Inf
            in the model's scores or activations (the message names the first layer that
            output them); all-zero maps at a default layer that the score does not depend on.

    Two threads calling this with one model take turns (see the module docstring).
    """
    if not isinstance(method, (str, CamMethod)):
        raise CamvizError(
            f"method must be a method name (camviz.cams.names()) or a CamMethod, not "
            f"{type(method).__name__} {method!r}"
        )
    if isinstance(method, str):
        cam = create(method, **options)
    elif options:
        raise CamvizError(
            f"options ({', '.join(options)}) are for a method given by name; set them on the "
            "method instance instead"
        )
    else:
        cam = method
    model = _unwrapped(uncompiled(model))
    fuse = _fusion(cam, fuse)
    target = cam.explained_target(target)
    scales = _aug_scales(aug_smooth, target)
    batch = as_inputs(inputs, model, map_input)
    if scales and batch.image_sizes is not None:
        raise CamvizError(
            "aug_smooth cannot rescale a list of images; explain them without aug_smooth, "
            "or as one (N, 3, H, W) batch of one size"
        )
    rank = batch.main.dim() - 2
    if rank not in cam.spatial_ranks:
        shapes = {1: "signals (N, C, L)", 2: "images (N, C, H, W)", 3: "volumes (N, C, D, H, W)"}
        raise CamvizError(
            f"{cam.name} is defined for {' and '.join(shapes[r] for r in cam.spatial_ranks)}, "
            f"not {shapes[rank]}; pick another method (`camviz methods`)"
        )
    device = batch.main.device
    dtype = check_precision(precision, device, used=cam.reduced_precision)
    with (
        exclusive(model),
        eval_mode(model),
        forward_precision(model, dtype, channels_last, device),
    ):
        layers = (
            [default_target_layer(model, batch)] if layer is None else spot_keys(model, layer, at)
        )
        given = _given_kinds(layers, layout)
        if isinstance(target, Similarity):
            target = target.embedded(model, batch)
        recorded = layer_pass(
            model,
            batch,
            layers,
            target,
            gradients=cam.uses_gradients,
            output_key=output_key,
            hessian=cam.uses_hessian,
            record=any(_known_kind(model, name, batch, given) is None for name in layers),
        )
        _check_finite(model, batch, recorded)
        if list(recorded.activations) != layers:  # a container output: one spot per level
            given = _element_kinds(given, list(recorded.activations))
            layers = list(recorded.activations)
        kinds = {name: _kind(model, name, batch, given, recorded) for name in layers}
        raw, weights, by_input = _layer_maps(cam, model, batch, recorded, kinds)
        if layer is None:
            _check_default_layer(model, batch, raw, recorded, kinds, target, output_key)
        maps_by_layer = {name: _finish(maps, relu, normalize) for name, maps in raw.items()}
        batch_size, ranks = recorded.scores.shape
        samples = torch.arange(batch_size).repeat_interleave(ranks)
        full_size = {
            name: _on_input(cam, recorded.placement, maps, samples)
            for name, maps in maps_by_layer.items()
        }
        if scales:
            # Augmented passes explain the classes chosen here, even if augmentation flips them.
            chosen = recorded.class_ids
            fixed: Target = chosen
            if isinstance(target, Detection):  # objects are followed by box, not by class
                fixed = Followed(tuple(_detection_scores(recorded.score_fns)))
            elif chosen is None:
                fixed = target
            elif isinstance(target, Contrast):
                fixed = dataclasses.replace(target, a=chosen[:, 0])
            maps_by_layer, full_size = _aug_smoothed(
                cam,
                model,
                batch,
                layers,
                fixed,
                output_key,
                scales,
                kinds,
                maps_by_layer,
                full_size,
                relu,
                normalize,
            )
    ids = recorded.class_ids
    heatmaps = _heatmaps(list(full_size.values()), batch, samples, fuse, relu, normalize)
    if relu:
        _warn_of_empty_maps(cam.name, heatmaps, layers)
    return Explanation(
        heatmaps=heatmaps,
        layer_maps=maps_by_layer[layers[0]],
        maps_by_layer=maps_by_layer,
        targets=(ids if ids is not None else torch.full((batch_size, ranks), -1)).reshape(-1).cpu(),
        scores=recorded.scores.reshape(-1),
        samples=samples,
        output=recorded.output,
        method=cam.name,
        layers=list(layers),
        weights=weights,
        maps_by_input=(
            None
            if by_input is None
            else {
                key: _per_image(maps, batch, samples, key, relu, normalize)
                for key, maps in by_input.items()
            }
        ),
        boxes=(
            torch.stack([fn.boxes for fn in _detection_scores(recorded.score_fns)], dim=1)
            .reshape(-1, 4)
            .cpu()
            if isinstance(target, Detection)
            else None
        ),
    )


def _warn_of_empty_maps(method: str, heatmaps: Maps, layers: Sequence[str]) -> None:
    """One line when some maps are all zero, which a picture would show as nothing."""
    empty = sum(not bool(maps.any()) for maps in heatmaps)
    if empty:
        warnings.warn(
            f"{method}: {empty} of {len(heatmaps)} maps are all zero: the explained score has "
            f"no positive evidence at {', '.join(map(repr, layers))}; relu=False shows the "
            "signed map, or pick another layer",
            ZeroMapWarning,
            stacklevel=3,
        )


def _detection_scores(fns: Sequence[ScoreFn]) -> list[DetectionScore]:
    """The score functions of a :class:`Detection` target (one per object)."""
    assert all(isinstance(fn, DetectionScore) for fn in fns)  # what Detection.resolve gives
    return [fn for fn in fns if isinstance(fn, DetectionScore)]


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a ``DataParallel``/``DDP`` wrapper; models without hooks refused."""
    if isinstance(model, torch.jit.ScriptModule):
        raise CamvizError(
            "a TorchScript model has no forward hooks, which camviz needs; explain the "
            "Python nn.Module it was scripted or traced from"
        )
    if not isinstance(model, nn.Module):
        raise CamvizError(
            f"model must be a torch nn.Module, not {type(model).__name__} (an exported "
            "program has no forward hooks; explain the nn.Module it was exported from)"
        )
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def _given_kinds(layers: Sequence[str], layout: str | Mapping[str, str] | None) -> dict[str, Kind]:
    """The layout kinds that ``layout=`` gives, by spot key (or element spot of one)."""
    if layout is None:
        return {}
    if isinstance(layout, str):
        return {name: layout_kind(layout) for name in layers}
    unknown = [
        name
        for name in layout
        if not any(name == spot or name.startswith(spot + "[") for spot in layers)
    ]
    if unknown:
        raise CamvizError(f"layout= names {unknown}, which are not target layers ({layers})")
    return {name: layout_kind(value) for name, value in layout.items()}


def _element_kinds(given: Mapping[str, Kind], spots: Sequence[str]) -> dict[str, Kind]:
    """The kinds ``layout=`` gives to the element spots of a container spot (by its key)."""
    kinds = {}
    for spot in spots:
        named = [key for key in given if spot == key or spot.startswith(key + "[")]
        if named:
            kinds[spot] = given[max(named, key=len)]  # the element's own entry first
    return kinds


def _known_kind(
    model: nn.Module, name: str, batch: Inputs, given: Mapping[str, Kind]
) -> Kind | None:
    """The kind of a spot's tensor without a recorded pass: given, by module, or cached."""
    if name in given:
        return given[name]
    spot = parse(name)
    if not spot.path:
        kind = module_kind(model.get_submodule(spot.name))
        if kind is not None:
            return kind
    cached, rank = _kind_cache.get(model, {}), batch.main.dim()
    if (name, rank) in cached:
        return cached[(name, rank)]
    # A container spot (an FPN's levels): known once a pass told its maps' kind, if they agree.
    prefix = name + "["
    levels = {kind for (key, at), kind in cached.items() if at == rank and key.startswith(prefix)}
    return levels.pop() if len(levels) == 1 else None


def _kind(
    model: nn.Module, name: str, batch: Inputs, given: Mapping[str, Kind], recorded: LayerPass
) -> Kind | None:
    """The kind of a spot's tensor: as :func:`_known_kind`, else told from the recorded
    pass (the module that produced the same tensor, or for an element of a container that no
    module produced, its siblings'), and remembered."""
    known = _known_kind(model, name, batch, given)
    if known is not None or recorded.calls is None:
        return known
    spot = parse(name)
    log = recorded.calls
    end = log.starts.get(spot.name) if spot.at == "input" else log.index(spot.name)
    if end is None:
        return None
    kind = log.producer_kind(tuple(recorded.activations[name].shape), end)
    if kind is None and spot.path:
        # A level made by a function (an FPN's max-pooled 'pool'): read like the other
        # maps of its container, when they agree.
        parent = dataclasses.replace(spot, path=spot.path[:-1])
        siblings = {
            log.producer_kind(tuple(values.shape), end)
            for key, values in recorded.activations.items()
            if key != name and dataclasses.replace(parse(key), path=parse(key).path[:-1]) == parent
        } - {None}
        kind = siblings.pop() if len(siblings) == 1 else None
    if kind is not None:
        _kind_cache.setdefault(model, {})[(name, batch.main.dim())] = kind
    return kind


def layer_data(
    model: nn.Module,
    inputs: torch.Tensor | Inputs,
    recorded: LayerPass,
    name: str,
    kind: Kind | None = None,
) -> list[LayerData]:
    """What a method gets for layer ``name`` of a recorded pass: one :class:`LayerData` per
    rank, activations and gradients in their ``(N, C, *grid)`` view (``kind``: the layout
    kind when known, see :mod:`camviz.cams.layout`).

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
        kind = _known_kind(model, name, batch, {})
    layout = _layout(name, output, batch.main, model, kind)
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
            )
        )
    return ranks


def _layer_maps(
    cam: CamMethod,
    model: nn.Module,
    batch: Inputs,
    recorded: LayerPass,
    kinds: Mapping[str, Kind | None],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, dict[Key, torch.Tensor] | None]:
    """Each layer's raw ``(N * K, *grid)`` maps, sample-major; the channel weights of
    weight-based methods (``(N * K, C)`` per layer); the per-input maps of input-gradient
    methods."""
    maps_by_layer = {}
    weights_by_layer: dict[str, torch.Tensor] | None = (
        {} if isinstance(cam, ChannelWeighted) else None
    )
    by_input = None
    for name in recorded.activations:
        ranks = layer_data(model, batch, recorded, name, kinds[name])
        activations = ranks[0].activations
        if not batch.size:  # an empty batch: no maps, and nothing for a method to do
            maps_by_layer[name] = activations.new_zeros(0, *activations.shape[2:])
            continue
        with torch.no_grad():
            if weights_by_layer is not None:
                assert isinstance(cam, ChannelWeighted)
                weights = cam.rank_weights(ranks)
                per_rank = [cam.combine(cam.terms(w, activations)) for w in weights]
                weights_by_layer[name] = torch.stack(weights, dim=1).flatten(0, 1)
            elif hasattr(cam, "input_maps"):
                per_input = [cam.input_maps(data) for data in ranks]
                per_rank = [maps[batch.key] for maps in per_input]
                by_input = {
                    key: torch.stack([maps[key] for maps in per_input], dim=1).flatten(0, 1)
                    for key in per_input[0]
                }
            else:
                per_rank = cam.rank_maps(ranks)
        maps = torch.stack(per_rank, dim=1).flatten(0, 1)
        if not is_finite(maps):
            raise NonFiniteError(
                f"{cam.name} gave NaN or Inf maps at layer {name!r} from finite activations "
                "and scores; try another method or layer"
            )
        maps_by_layer[name] = maps
    return maps_by_layer, weights_by_layer, by_input


def _layout(
    name: str, output: torch.Tensor, inputs: torch.Tensor, model: nn.Module, kind: Kind | None
) -> Layout:
    """The layout of a layer's output, checked to have a grid of the input's rank."""
    patch = patch_size(model) if output.dim() == 3 else None
    layout = layout_of(output.shape, name, inputs.shape[2:], patch, kind)
    if len(layout.grid) != inputs.dim() - 2:
        raise CamvizError(
            f"layer {name!r} has a {len(layout.grid)}-D grid {layout.grid}, but the map input "
            f"has {inputs.dim() - 2} spatial axes {tuple(inputs.shape[2:])}; pick a layer "
            "with a grid like the input's"
        )
    return layout


def _rescale(maps: torch.Tensor, relu: bool, normalize: bool) -> torch.Tensor:
    """The normalisation asked for: min-max after ReLU, else by the largest absolute value."""
    if not normalize:
        return maps
    return normalize_maps(maps) if relu else normalize_signed(maps)


def _finish(maps: torch.Tensor, relu: bool, normalize: bool) -> torch.Tensor:
    """The ReLU and normalisation asked for (see :class:`Explanation`)."""
    return _rescale(torch.relu(maps) if relu else maps, relu, normalize)


def _on_input(
    cam: CamMethod, placement: Placement, maps: torch.Tensor, samples: torch.Tensor
) -> torch.Tensor:
    """A layer's ``(M, *grid)`` maps laid on the map input (already there for methods with
    ``input_resolution``)."""
    return maps if cam.input_resolution else placement.lay(maps, samples)


def _crops(maps: torch.Tensor, batch: Inputs, samples: torch.Tensor) -> list[torch.Tensor]:
    """Each of the ``(M, *canvas)`` maps of a list of images cropped to its own image."""
    sizes = batch.spatial_sizes()
    return [corner(values, sizes[n]) for values, n in zip(maps, samples.tolist(), strict=True)]


def _per_image(
    maps: torch.Tensor,
    batch: Inputs,
    samples: torch.Tensor,
    key: Key,
    relu: bool,
    normalize: bool,
) -> Maps:
    """Raw maps on input ``key``, finished; for a list of images, the map input's cropped to
    each image and normalised there."""
    if batch.image_sizes is None or key != batch.key:
        return _finish(maps, relu, normalize)
    return [_finish(crop[None], relu, normalize)[0] for crop in _crops(maps, batch, samples)]


def _heatmaps(
    maps: Sequence[torch.Tensor],
    batch: Inputs,
    samples: torch.Tensor,
    fuse: Fuse,
    relu: bool,
    normalize: bool,
) -> Maps:
    """The heatmaps: the layers' maps on the input fused; for a list of images one map per
    image, cropped to it and normalised over it."""
    if batch.image_sizes is None:
        return _fused(maps, fuse, relu, normalize)
    per_layer = [_crops(values, batch, samples) for values in maps]
    return [
        _fused([crop[None] for crop in crops], fuse, relu, normalize)[0]
        for crops in zip(*per_layer, strict=True)
    ]


def _fused(maps: Sequence[torch.Tensor], fuse: Fuse, relu: bool, normalize: bool) -> torch.Tensor:
    """The heatmaps: the layers' maps at the input size, fused (normalised maps only)."""
    if len(maps) == 1 or not normalize:
        return _rescale(maps[0], relu, normalize)
    stacked = torch.stack(list(maps))
    if fuse == "product":
        return _rescale(stacked.prod(0), relu, normalize)
    return _rescale(stacked.amax(0) if fuse == "max" else stacked.mean(0), relu, normalize)


def _check_default_layer(
    model: nn.Module,
    batch: Inputs,
    raw: dict[str, torch.Tensor],
    recorded: LayerPass,
    kinds: Mapping[str, Kind | None],
    target: Target,
    output_key: str | int | None,
) -> None:
    """All-zero maps at a layer camviz chose, because the score does not depend on its grid,
    are an error: the user never named that layer. A head that reads only a class token
    after the layer is such a case: the gradient reaches that token, not the patches.

    A default layer with several levels (an FPN) is checked as a whole: one level without
    gradient is normal there (each box is pooled from one level)."""
    if not all(len(maps) for maps in raw.values()) or any(
        bool(torch.relu(maps).any()) for maps in raw.values()
    ):
        return
    names = list(raw)
    gradients = recorded.gradients
    if not gradients:  # a method without gradients: take them now, in this rare case
        try:
            gradients = layer_pass(model, batch, names, target, output_key=output_key).gradients
        except CamvizError:  # no autograd path from the layer to the score
            gradients = {}
    for name, per_rank in gradients.items():
        layout = _layout(name, recorded.activations[name], batch.main, model, kinds[name])
        if any(bool(layout.to_spatial(values).any()) for values in per_rank):
            return  # the score depends on the layer: the maps say "no positive evidence"
    listed = ", ".join(repr(name) for name in names)
    raise CamvizError(
        f"all maps are zero: the explained score does not depend on the default layer {listed} "
        "at any location (a head that reads only a class token after it?); pass layer=NAME, "
        "e.g. the norm before the last attention (`camviz layers` lists them)"
    )


def _check_finite(model: nn.Module, batch: Inputs, recorded: LayerPass) -> None:
    """NaN or Inf in what the pass recorded is an error: the maps would be zeros."""
    forward = [("explained scores", recorded.scores)] + [
        (f"activations of layer {name!r}", values) for name, values in recorded.activations.items()
    ]
    bad = [what for what, values in forward if not is_finite(values)]
    if bad:
        single = len(batch.args) == 1 and not batch.kwargs and batch.image_sizes is None
        first = first_nonfinite_layer(model, batch.main) if single else None
        source = (
            f"layer {first!r} is the first to output NaN or Inf"
            if first is not None
            else "every layer's output is finite, so the target computes them"
            if single
            else "camviz.find_first_nonfinite on the model finds the first layer that outputs them"
        )
        raise NonFiniteError(
            f"the {bad[0]} hold NaN or Inf: {source}; camviz.find_first_nonfinite(model, "
            "inputs) says why"
        )
    for name, per_rank in recorded.gradients.items():
        if not all(is_finite(gradients) for gradients in per_rank):
            raise NonFiniteError(
                f"the gradients at layer {name!r} hold NaN or Inf although the forward pass is "
                "finite (the backward pass overflowed); explain in float32 or pick another layer"
            )


def _fusion(cam: CamMethod, fuse: Fuse | None) -> Fuse:
    """The layer fusion to use: the caller's, else the method's own, else the mean."""
    if fuse is not None and fuse not in ("mean", "max", "product"):
        raise CamvizError(f"fuse must be 'mean', 'max' or 'product', not {fuse!r}")
    if cam.fuse is not None and fuse not in (None, cam.fuse):
        raise CamvizError(
            f"{cam.name} combines layers by {cam.fuse!r}; leave fuse= unset (got {fuse!r})"
        )
    return fuse or cam.fuse or "mean"


def _aug_scales(aug_smooth: bool | Sequence[float], target: Target) -> tuple[float, ...]:
    """The scales that ``aug_smooth`` asks for (none when it is off), checked."""
    if aug_smooth is False:
        return ()
    scales = DEFAULT_AUG_SCALES if aug_smooth is True else tuple(aug_smooth)
    if not scales or not all(isinstance(s, (int, float)) and 0.1 <= s <= 10 for s in scales):
        raise CamvizError(
            f"aug_smooth must be True or a sequence of scales between 0.1 and 10, "
            f"not {aug_smooth!r}"
        )
    if isinstance(target, Region):
        raise CamvizError(
            "aug_smooth cannot explain a Region target (the mask would have to move with the "
            "augmented output); explain it without aug_smooth"
        )
    return scales


def _aug_smoothed(
    cam: CamMethod,
    model: nn.Module,
    batch: Inputs,
    layers: Sequence[str],
    target: Target,
    output_key: str | int | None,
    scales: Sequence[float],
    kinds: Mapping[str, Kind | None],
    maps_by_layer: dict[str, torch.Tensor],
    full_size: dict[str, torch.Tensor],
    relu: bool,
    normalize: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Average the plain pass's maps with those of flipped and rescaled copies of the map
    input (flipped along its last axis only).

    Each augmented map is brought back to the plain pass's geometry (resized, then flipped
    back) at the layer's resolution and at the input's, with one interpolation each (a
    detector's maps are first laid on the rescaled input it saw, see
    :mod:`camviz.core.placement`).

    Returns:
        ``(maps_by_layer, full_size)``: the averaged maps at each layer's resolution
        (normalised if asked) and at the input's (not yet normalised).
    """
    inputs = batch.main
    size = inputs.shape[2:]
    sums = {name: maps.clone() for name, maps in maps_by_layer.items()}
    full_sums = {name: maps.clone() for name, maps in full_size.items()}
    variants = [(scale, flip) for scale in dict.fromkeys(scales) for flip in (False, True)]
    for scale, flip in variants:
        if (scale, flip) == (1, False):
            continue  # the plain pass, already in the sums
        augmented = inputs
        if scale != 1:
            scaled = tuple(max(1, round(extent * scale)) for extent in size)
            augmented = F.interpolate(
                inputs,
                size=scaled,
                mode=_INTERPOLATION[inputs.dim()],
                align_corners=False,
                antialias=scale < 1 and inputs.dim() == 4,
            )
        if flip:
            augmented = augmented.flip(-1)
        variant_target = target
        if isinstance(target, Followed):  # boxes move with the image
            factors = [new / old for new, old in zip(augmented.shape[2:], size, strict=True)]
            variant_target = target.moved(factors, augmented.shape[-1] if flip else None)
        try:
            recorded = layer_pass(
                model,
                batch.with_main(augmented),
                layers,
                variant_target,
                gradients=cam.uses_gradients,
                output_key=output_key,
                hessian=cam.uses_hessian,
            )
        except (RuntimeError, AssertionError, ValueError) as error:
            if scale == 1:
                raise
            raise CamvizError(
                f"the model rejected the input rescaled by {scale} for aug_smooth ({error}); "
                "pass aug_smooth=(1.0,) to average over flips only"
            ) from error
        raw = _layer_maps(cam, model, batch.with_main(augmented), recorded, kinds)[0]
        samples = torch.arange(batch.size).repeat_interleave(recorded.scores.shape[1])
        for name, maps in raw.items():
            maps = _finish(maps, relu, normalize)
            at_layer = upsample(maps, maps_by_layer[name].shape[1:])
            at_input = (
                upsample(maps, size)
                if cam.input_resolution
                else recorded.placement.lay(maps, samples, size)
            )
            sums[name] += at_layer.flip(-1) if flip else at_layer
            full_sums[name] += at_input.flip(-1) if flip else at_input
    count = len(variants) if 1 in scales else len(variants) + 1
    return (
        {name: _rescale(total / count, relu, normalize) for name, total in sums.items()},
        {name: total / count for name, total in full_sums.items()},
    )


def _check_scores(score: torch.Tensor, batch: int) -> None:
    if not isinstance(score, torch.Tensor) or score.shape != (batch,):
        shape = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
        raise CamvizError(
            f"a target callable must return one score per sample, shape ({batch},), got {shape}"
        )
