"""The engine: one forward pass, exactly the gradients a method needs, then post-processing.

The model runs under ``torch.no_grad()``. A forward hook on each target layer copies its
output ``A`` and hands the rest of the network ``A + delta``, where ``delta`` is a zero tensor
that requires grad; ``torch.autograd.grad(y.sum(), delta)`` is then exactly ``dy/dA`` for
every sample. Nothing below the layer keeps a graph, no parameter gradient is computed, and
in-place operations after the layer cannot change what was recorded (why this way, and not
with backward hooks: ``docs/architecture.md``). Methods turn the recorded :class:`LayerData`
into raw maps; the engine applies ReLU, normalises, resizes and fuses.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.layout import as_spatial, layout_of, patch_size
from camviz.cams.registry import create
from camviz.core.batch import as_batch
from camviz.core.errors import CamvizError
from camviz.core.finite import first_nonfinite_layer, is_finite
from camviz.core.hooks import detach_to, edit
from camviz.core.layers import Layer, default_target_layer, resolve_layers
from camviz.core.maps import normalize, upsample
from camviz.core.modelstate import eval_mode, exclusive, uncompiled
from camviz.core.precision import Precision, at_least_fp32, check_precision, forward_precision
from camviz.core.targets import Contrast, Region, ScoreFn, Target, score_fns

Fuse = Literal["mean", "max", "product"]

# as_spatial is re-exported: methods that run their own layer passes use it.
__all__ = ["Explanation", "LayerPass", "as_spatial", "explain", "layer_data", "layer_pass"]

DEFAULT_AUG_SCALES = (1.0, 0.9, 1.1)


@dataclass
class Explanation:
    """The result of :func:`explain`. ``M = N * K`` maps for ``N`` inputs and ``K`` ranks.

    Attributes:
        heatmaps: ``(M, H, W)`` float maps at the input's size, min-max normalised there
            (the hottest pixel is 1; a map with no evidence is all zeros).
        layer_maps: ``(M, h, w)`` maps at the (first) target layer's resolution (at the
            input's for methods with ``input_resolution``), after ReLU and per-map min-max
            normalisation; an all-zero map stays zero.
        maps_by_layer: ``{layer: (M, h, w)}`` for every target layer.
        targets: ``(M,)`` explained class ids (``-1`` when the target was a callable).
        scores: ``(M,)`` explained scores (logits) from the forward pass.
        samples: ``(M,)`` index of the input each map belongs to.
        output: The model's output for the batch, detached.
        method: The method's registry name.
        layers: The target layer names.
    """

    heatmaps: torch.Tensor
    layer_maps: torch.Tensor
    maps_by_layer: dict[str, torch.Tensor]
    targets: torch.Tensor
    scores: torch.Tensor
    samples: torch.Tensor
    output: Any
    method: str
    layers: list[str]


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
    """

    output: Any
    activations: dict[str, torch.Tensor]
    gradients: dict[str, list[torch.Tensor]]
    scores: torch.Tensor
    score_fns: list[ScoreFn]
    class_ids: torch.Tensor | None
    hessian_products: dict[str, list[torch.Tensor]]


class _Tap:
    """The forward-hook edit on one target layer (see the module docstring, step 2)."""

    def __init__(self, name: str, open_gradient_path: bool) -> None:
        self.name = name
        self.open_gradient_path = open_gradient_path
        self.activation: torch.Tensor | None = None
        self.delta: torch.Tensor | None = None

    def __call__(self, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            raise CamvizError(
                f"layer {self.name!r} returns a {type(output).__name__}, not a tensor; "
                "pick a layer that outputs a feature map"
            )
        if self.activation is not None:
            raise CamvizError(
                f"layer {self.name!r} runs more than once in one forward pass (a shared "
                "module); pick a layer that runs once"
            )
        self.activation = output.detach().clone()
        if not self.open_gradient_path:
            return output
        torch.set_grad_enabled(True)  # undone when the caller's no_grad block ends
        self.delta = torch.zeros_like(output, requires_grad=True)
        return output + self.delta


def layer_pass(
    model: nn.Module,
    inputs: torch.Tensor,
    layers: Sequence[str],
    target: Target = None,
    *,
    gradients: bool = True,
    output_key: str | int | None = None,
    hessian: bool = False,
) -> LayerPass:
    """Run the model once and record activations (and exact gradients) at ``layers``.

    The building block under every method: :func:`explain` calls it once, and methods
    that average over noisy or augmented inputs call it once per variant. The model must
    already be in the mode wanted (``explain`` puts it in eval mode). ``hessian=True`` (with
    ``gradients``) also records ``H A`` at each layer (see the module docstring).
    """
    # A caller's inference mode would stop the graph too.
    with exclusive(model), torch.inference_mode(False):
        return _layer_pass(model, inputs, layers, target, gradients, output_key, hessian)


def _layer_pass(
    model: nn.Module,
    inputs: torch.Tensor,
    layers: Sequence[str],
    target: Target,
    gradients: bool,
    output_key: str | int | None,
    hessian: bool = False,
) -> LayerPass:
    taps = {name: _Tap(name, gradients) for name in layers}
    with edit(model, taps), torch.no_grad():
        output = model(inputs)
    activations = {}
    deltas = []  # one per layer when gradients are asked for (the strict zip below checks)
    for tap in taps.values():
        if tap.activation is None:
            raise CamvizError(
                f"layer {tap.name!r} did not run in the forward pass; pick a layer that the "
                "model uses (`camviz layers` lists them with shapes)"
            )
        activations[tap.name] = tap.activation
        if tap.delta is not None:
            deltas.append(tap.delta)
    fns, ids = score_fns(target, output, output_key)
    per_rank: dict[str, list[torch.Tensor]] = {name: [] for name in layers} if gradients else {}
    hessian = hessian and gradients
    products: dict[str, list[torch.Tensor]] = {name: [] for name in layers} if hessian else {}
    scores = []
    with torch.enable_grad():
        for rank, score_fn in enumerate(fns):
            score = score_fn(output)
            _check_scores(score, inputs.shape[0])
            scores.append(at_least_fp32(score.detach()))
            if not gradients:
                continue
            if not score.requires_grad:
                raise CamvizError(
                    f"the explained score does not depend on layer(s) {', '.join(layers)}; "
                    "pick a layer before the model's output"
                )
            grads = torch.autograd.grad(
                score.sum(),
                deltas,
                retain_graph=hessian or rank < len(fns) - 1,
                create_graph=hessian,
                allow_unused=True,
            )
            for name, delta, grad in zip(layers, deltas, grads, strict=True):
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
    inputs: torch.Tensor,
    method: str | CamMethod = "gradcam",
    layer: Layer | Sequence[Layer] | None = None,
    target: Target = None,
    *,
    output_key: str | int | None = None,
    fuse: Fuse | None = None,
    aug_smooth: bool | Sequence[float] = False,
    precision: Precision = "fp32",
    channels_last: bool = False,
    **options: Any,
) -> Explanation:
    """Explain a batch with a CAM method.

    Args:
        model: Any ``nn.Module`` classifier (or a model with a ``target`` callable). It is
            used in eval mode for the call and handed back exactly as it came. For a
            ``torch.compile`` model the original module inside it is explained (layer names
            are that module's).
        inputs: ``(N, C, H, W)`` batch, or one ``(C, H, W)`` image, already preprocessed.
            Moved to the model's device.
        method: A registry name (:func:`camviz.cams.names`) or a method instance.
        layer: Target layer(s): names, wildcard patterns or submodules. ``None`` picks the last
            layer with a spatial output, or for a vision transformer the norm before its last
            attention (:func:`camviz.core.layers.default_target_layer`; found once per model
            with a one-sample dry run).
        target: What to explain; see :mod:`camviz.core.targets` (class id, list of ids, ``None``
            for top-1, ``"top3"``, :class:`~camviz.core.targets.Region`,
            :class:`~camviz.core.targets.Contrast`, or a callable ``output -> (N,) scores``).
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
            horizontally flipped and rescaled, each map is flipped back and resized to the
            input, and the maps are averaged (then normalised). ``True`` uses the scales
            ``(1.0, 0.9, 1.1)``, each with and without the flip (6 passes); a sequence of
            scales chooses them (``(1.0,)``: flips only, for models with a fixed input size
            such as ViTs); the plain pass always counts once. The explained classes are
            those of the plain pass.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the model's forward passes (and
            the perturbed passes of Score-CAM and SS-CAM) run under
            ``torch.autocast`` to that dtype; maps, weights and normalisation stay in
            float32 (float64 for a float64 model). Refused on hardware that only emulates
            it (see :mod:`camviz.core.precision`). Ablation-CAM always scores in float32.
        channels_last: Hand the model a channels-last copy of its input (its convolutions
            then compute channels-last). The model and ``inputs`` are not modified.
        **options: Passed to the method's constructor (e.g. ``batch_size``, ``eigen_smooth``;
            each method's docstring lists its own); an option the method does not take is a
            :class:`CamvizError`.

    Returns:
        An :class:`Explanation`.

    Raises:
        CamvizError: A bad layer name, target, input shape or method name; NaN or Inf in
            the model's scores or activations (the message names the first layer that
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
    model = uncompiled(model)
    fuse = _fusion(cam, fuse)
    target = cam.explained_target(target)
    scales = _aug_scales(aug_smooth, target)
    inputs = as_batch(inputs, model)
    dtype = check_precision(precision, inputs.device, used=cam.reduced_precision)
    with (
        exclusive(model),
        eval_mode(model),
        forward_precision(model, dtype, channels_last, inputs.device),
    ):
        layers = _target_layers(model, inputs, layer)
        recorded = layer_pass(
            model,
            inputs,
            layers,
            target,
            gradients=cam.uses_gradients,
            output_key=output_key,
            hessian=cam.uses_hessian,
        )
        _check_finite(model, inputs, recorded)
        maps_by_layer = _layer_maps(cam, model, inputs, recorded)
        if layer is None:
            _check_default_layer(model, inputs, maps_by_layer, recorded, target, output_key)
        full_size = {
            name: upsample(maps, inputs.shape[-2:]) for name, maps in maps_by_layer.items()
        }
        if scales:
            # Augmented passes explain the classes chosen here, even if augmentation flips them.
            chosen = recorded.class_ids
            fixed: Target = chosen
            if chosen is None:
                fixed = target
            elif isinstance(target, Contrast):
                fixed = dataclasses.replace(target, a=chosen[:, 0])
            maps_by_layer, full_size = _aug_smoothed(
                cam, model, inputs, layers, fixed, output_key, scales, maps_by_layer, full_size
            )
    stacked = torch.stack(list(full_size.values()))
    if fuse == "product":
        fused = stacked.prod(0)
    else:
        fused = stacked.amax(0) if fuse == "max" else stacked.mean(0)
    batch, ranks = recorded.scores.shape
    ids = recorded.class_ids
    return Explanation(
        heatmaps=normalize(fused),
        layer_maps=maps_by_layer[layers[0]],
        maps_by_layer=maps_by_layer,
        targets=(ids if ids is not None else torch.full((batch, ranks), -1)).reshape(-1).cpu(),
        scores=recorded.scores.reshape(-1),
        samples=torch.arange(batch).repeat_interleave(ranks),
        output=recorded.output,
        method=cam.name,
        layers=list(layers),
    )


def layer_data(
    model: nn.Module, inputs: torch.Tensor, recorded: LayerPass, name: str
) -> list[LayerData]:
    """What a method gets for layer ``name`` of a recorded pass: one :class:`LayerData` per
    rank, activations and gradients in their ``(N, C, h, w)`` view.

    Raises:
        CamvizError: The layer folds windows or heads into the batch.
    """
    output = recorded.activations[name]
    if output.shape[0] != inputs.shape[0]:
        raise CamvizError(
            f"layer {name!r} outputs a batch of {output.shape[0]} for {inputs.shape[0]} "
            "inputs (windows or heads folded into the batch); pick a layer whose output "
            "keeps one row per input"
        )
    patch = patch_size(model) if output.dim() == 3 else None
    layout = layout_of(output.shape, name, inputs.shape[-2:], patch)
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
                inputs=inputs,
                score=score_fn,
                class_ids=None if recorded.class_ids is None else recorded.class_ids[:, rank],
                scores=recorded.scores[:, rank],
                layout=layout,
                hessian_products=None if product is None else layout.to_spatial(product),
            )
        )
    return ranks


def _layer_maps(
    cam: CamMethod, model: nn.Module, inputs: torch.Tensor, recorded: LayerPass
) -> dict[str, torch.Tensor]:
    """Each layer's ``(N * K, h, w)`` maps, sample-major, after ReLU and normalisation."""
    maps_by_layer = {}
    for name in recorded.activations:
        ranks = layer_data(model, inputs, recorded, name)
        if not len(inputs):  # an empty batch: no maps, and nothing for a method to do
            activations = ranks[0].activations
            maps_by_layer[name] = activations.new_zeros(0, *activations.shape[-2:])
            continue
        with torch.no_grad():
            per_rank = cam.rank_maps(ranks)
        maps = torch.stack(per_rank, dim=1).flatten(0, 1)
        if not is_finite(maps):
            raise CamvizError(
                f"{cam.name} gave NaN or Inf maps at layer {name!r} from finite activations "
                "and scores; try another method or layer"
            )
        maps_by_layer[name] = normalize(torch.relu(maps))
    return maps_by_layer


def _check_finite(model: nn.Module, inputs: torch.Tensor, recorded: LayerPass) -> None:
    """NaN or Inf in what the pass recorded is an error: the maps would be zeros."""
    forward = [("explained scores", recorded.scores)] + [
        (f"activations of layer {name!r}", values) for name, values in recorded.activations.items()
    ]
    bad = [what for what, values in forward if not is_finite(values)]
    if bad:
        first = first_nonfinite_layer(model, inputs)
        source = (
            f"layer {first!r} is the first to output NaN or Inf"
            if first is not None
            else "every layer's output is finite, so the target computes them"
        )
        raise CamvizError(
            f"the {bad[0]} hold NaN or Inf: {source}; camviz.find_first_nonfinite(model, "
            "inputs) says why"
        )
    for name, per_rank in recorded.gradients.items():
        if not all(is_finite(gradients) for gradients in per_rank):
            raise CamvizError(
                f"the gradients at layer {name!r} hold NaN or Inf although the forward pass is "
                "finite (the backward pass overflowed); explain in float32 or pick another layer"
            )


def _check_default_layer(
    model: nn.Module,
    inputs: torch.Tensor,
    maps_by_layer: dict[str, torch.Tensor],
    recorded: LayerPass,
    target: Target,
    output_key: str | int | None,
) -> None:
    """All-zero maps at a layer camviz chose, because the score does not depend on it, are
    an error: the user never named that layer."""
    ((name, maps),) = maps_by_layer.items()
    if not len(maps) or bool(maps.any()):
        return
    gradients = recorded.gradients.get(name)
    if gradients is None:  # a method without gradients: take them now, in this rare case
        try:
            with_gradients = layer_pass(model, inputs, [name], target, output_key=output_key)
        except CamvizError:  # no autograd path from the layer to the score
            with_gradients = None
        gradients = with_gradients.gradients[name] if with_gradients else []
    if any(bool(values.any()) for values in gradients):
        return  # the score depends on the layer: the maps say "no positive evidence"
    raise CamvizError(
        f"all maps are zero: the explained score does not depend on the default layer {name!r}; "
        "pass layer=NAME (`camviz layers` lists them)"
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
    inputs: torch.Tensor,
    layers: Sequence[str],
    target: Target,
    output_key: str | int | None,
    scales: Sequence[float],
    maps_by_layer: dict[str, torch.Tensor],
    full_size: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Average the plain pass's maps with those of flipped and rescaled copies of the batch.

    Each augmented map is brought back to the plain pass's geometry (resized, then flipped
    back) at the layer's resolution and at the input's, with one interpolation each.

    Returns:
        ``(maps_by_layer, full_size)``: the averaged maps at each layer's resolution
        (normalised) and at the input's (not yet normalised).
    """
    height, width = inputs.shape[-2:]
    sums = {name: maps.clone() for name, maps in maps_by_layer.items()}
    full_sums = {name: maps.clone() for name, maps in full_size.items()}
    variants = [(scale, flip) for scale in dict.fromkeys(scales) for flip in (False, True)]
    for scale, flip in variants:
        if (scale, flip) == (1, False):
            continue  # the plain pass, already in the sums
        augmented = inputs
        if scale != 1:
            size = (max(1, round(height * scale)), max(1, round(width * scale)))
            augmented = F.interpolate(
                inputs, size=size, mode="bilinear", align_corners=False, antialias=scale < 1
            )
        if flip:
            augmented = augmented.flip(-1)
        try:
            recorded = layer_pass(
                model,
                augmented,
                layers,
                target,
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
        for name, maps in _layer_maps(cam, model, augmented, recorded).items():
            at_layer = upsample(maps, maps_by_layer[name].shape[-2:])
            at_input = upsample(maps, (height, width))
            sums[name] += at_layer.flip(-1) if flip else at_layer
            full_sums[name] += at_input.flip(-1) if flip else at_input
    count = len(variants) if 1 in scales else len(variants) + 1
    return (
        {name: normalize(total / count) for name, total in sums.items()},
        {name: total / count for name, total in full_sums.items()},
    )


def _target_layers(
    model: nn.Module, inputs: torch.Tensor, layer: Layer | Sequence[Layer] | None
) -> list[str]:
    if layer is None:
        return [default_target_layer(model, inputs)]
    return list(resolve_layers(model, layer))


def _check_scores(score: torch.Tensor, batch: int) -> None:
    if not isinstance(score, torch.Tensor) or score.shape != (batch,):
        shape = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
        raise CamvizError(
            f"a target callable must return one score per sample, shape ({batch},), got {shape}"
        )
