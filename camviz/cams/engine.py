"""The engine: one explanation, in the seven steps of ``docs/architecture.md``'s flow.

:func:`explain` checks the inputs, finds the layer spots, puts the model in the state the
pass needs and prepares the target, records one pass (:mod:`camviz.cams.recording`), checks
what it recorded, lets the method turn it into raw maps, finishes them
(:mod:`camviz.cams.finishing`; with ``aug_smooth`` also the maps of flipped and rescaled
copies, :mod:`camviz.cams.augmentation`) and returns an :class:`Explanation`. Inputs of any
spatial rank, several inputs (:mod:`camviz.core.inputs`), taps on a layer's input or one
element of its output (:mod:`camviz.core.taps`), and layouts told from the module that
produced an output (:mod:`camviz.core.layouts`, :mod:`camviz.core.grids`) all meet here.

Whatever happens, the model comes back as it was: hooks removed, every module's train/eval
flag restored, ``requires_grad`` and ``.grad`` never touched.

**Threads.** Calls on one model are serialised (:func:`camviz.core.modelstate.exclusive`):
a second thread that explains with the same model waits until the first call is done,
since its hooks would otherwise see the other call's pass. Threads with their own copies
of the model run in parallel.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from camviz.cams.augmentation import Augmentation, aug_scales
from camviz.cams.base import CamMethod, ChannelWeighted, InputMapMethod
from camviz.cams.finishing import Finished, Finishing, Fuse, Maps, RawMaps
from camviz.cams.recording import LayerPass, layer_data, layer_pass, spot_layout
from camviz.cams.registry import create
from camviz.core.errors import CamvizError, NonFiniteError
from camviz.core.finite import first_nonfinite_layer, is_finite
from camviz.core.grids import NoPatchGridError
from camviz.core.inputs import Inputs, Key, as_inputs
from camviz.core.layerkinds import Kind
from camviz.core.layers import Layer, default_target_layer, patch_token_layers
from camviz.core.layouts import Layout as LayoutGiven
from camviz.core.layouts import SpotKinds
from camviz.core.modelstate import EvalMode, changed, exclusive, uncompiled
from camviz.core.precision import Precision, check_precision, forward_precision
from camviz.core.taps import At, spot_keys
from camviz.core.targets import Target, TargetObject, as_target

__all__ = ["Explanation", "LayerPass", "explain", "layer_data", "layer_pass"]


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
        reasons: Per input, why its target found nothing to explain there (its maps are
            then zero), from :attr:`camviz.core.targets.Resolved.reasons`; ``None`` when
            every input had something.
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
    reasons: tuple[str | None, ...] | None = None


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
    layout: LayoutGiven | Mapping[str, LayoutGiven] | None = None,
    map_input: Key | None = None,
    relu: bool = True,
    normalize: bool = True,
    **options: Any,
) -> Explanation:
    """Explain a batch with a CAM method.

    Args:
        model: Any ``nn.Module`` (``DataParallel``, ``DistributedDataParallel``,
            ``torch.compile`` and Ultralytics ``YOLO(...)`` wrappers looked through: layer
            names are the inner module's), used in eval mode and handed back as it came.
        inputs: The preprocessed batch on the model's device: ``(N, C, L)``, ``(N, C, H, W)``
            or ``(N, C, D, H, W)`` (one ``(C, H, W)`` image for a 2-D image model), a tuple
            passed positionally or a dict passed as keywords (:mod:`camviz.core.inputs`); for
            a torchvision detector also a list of ``(3, H_n, W_n)`` images (a list of maps).
        method: A registry name (:func:`camviz.cams.names`) or a method instance.
        layer: Target layer(s): names, wildcard patterns or submodules, or a list of them;
            ``"name[0]"`` / ``"name[key]"`` takes one element of a tuple, list or dict
            output, and a layer whose output holds feature maps (an FPN's levels) gives one
            map per level, fused (:mod:`camviz.core.taps`). ``None``: the default target
            layer (:func:`camviz.core.layers.default_target_layer`), or the method's own
            (the attention methods: the last block, ``layer=`` the last block read).
        target: What to explain (:mod:`camviz.core.targets`): a class id, ids, ``None`` for
            the top class (or the output itself when one number per sample), ``"top3"``,
            a ``Region``, ``Contrast``, ``Similarity``, ``TextPrompt`` or ``Detection``, or a
            callable ``output -> (N,)``; one that holds per-input data takes the rows,
            ``(output, rows) -> (R,)`` (:class:`~camviz.core.targets.RowTarget`).
        output_key: For models whose output is a tuple or dict: where the logits are.
        fuse: How several layers' normalised maps on the input combine, normalised again:
            ``"mean"``, ``"max"`` or ``"product"``; ``None``: the method's rule, else the mean.
        aug_smooth: Average the maps of copies flipped along the last axis and rescaled
            (:mod:`camviz.cams.augmentation`): ``True`` for the scales ``(1.0, 0.9, 1.1)``
            (6 passes), or the scales (``(1.0,)``: flips only); the plain pass's classes.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the model's passes run under
            autocast, maps stay float32 (:mod:`camviz.core.precision`).
        channels_last: Hand the model a channels-last copy of its input.
        at: ``"output"`` explains each layer's output; ``"input"`` its first positional input.
        layout: ``"channels_first"``, ``"channels_last"``, ``"tokens"`` (the grid inferred
            from the token count) or ``camviz.Tokens(patches=slice(1, 197), grid=(14, 14))``
            (where the patch tokens are), for all layers or as ``{layer: layout}``, where the
            pass cannot tell (:mod:`camviz.core.layouts`).
        map_input: Which input the heatmap is laid on: a position or key (default: the first).
        relu: Apply the ReLU of the CAM formulas; ``False`` keeps signed maps.
        normalize: Normalise each map (min-max after ReLU, else by its largest absolute
            value); ``False`` keeps the method's own units.
        **options: The method's constructor options (each method's docstring lists them).

    Returns:
        An :class:`Explanation`.

    Raises:
        CamvizError: A bad layer, target, input, layout, method or option; NaN or Inf in the
            scores or activations (naming the first layer to output them); all-zero maps at a
            default layer that the score does not depend on.

    Two threads calling this with one model take turns (see the module docstring).
    """
    cam = _method(method, options)
    model = _unwrapped(uncompiled(model))
    finishing = Finishing.of(cam, fuse, relu, normalize)
    chosen = cam.explained_target(as_target(target))
    scales = aug_scales(aug_smooth, chosen)
    batch = _checked_inputs(cam, inputs, model, map_input, augmented=bool(scales))
    device = batch.main.device
    dtype = check_precision(precision, device, used=cam.reduced_precision)
    state = changed(model, EvalMode(), *chosen.model_changes(model))  # a CLIP: its image tower
    with exclusive(model), state, forward_precision(model, dtype, channels_last, device):
        chosen = chosen.prepare(model, batch)
        passes = _Passes.of(cam, model, batch, layer, at, layout, output_key, chosen)
        recorded = passes.first(batch, chosen)
        _check_finite(model, batch, recorded)
        passes = passes.spots_of(recorded)
        try:
            raw = passes.raw_maps(batch, recorded)
        except NoPatchGridError as error:  # name the layers whose tokens are patches
            patches = patch_token_layers(model, batch)
            raise NoPatchGridError(error.layer, error.count, patches) from None
        if layer is None:
            _check_default_layer(passes, batch, raw, recorded, chosen)
        finished = finishing.layers(cam, raw.at_layer, recorded.placement, _samples(recorded))
        if scales:
            augmentation = Augmentation(scales, finishing, cam.input_resolution)
            finished = augmentation.smoothed(passes, batch, chosen, recorded.resolved, finished)
    heatmaps = finishing.heatmaps(list(finished.on_input.values()), batch, _samples(recorded))
    finishing.warn_of_empty_maps(cam.name, heatmaps, passes.layers, _independent(recorded))
    return _explanation(cam, batch, recorded, raw, finished, finishing, heatmaps)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a ``DataParallel``/``DDP`` wrapper or an Ultralytics ``YOLO(...)``
    (whose predictor runs a deep copy of its ``.model``, so hooks on the wrapper would never
    fire); models without hooks refused."""
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
    # Looked up, not imported: a model of that class means Ultralytics is imported already.
    ultralytics = sys.modules.get("ultralytics.engine.model")
    inner = getattr(model, "model", None)
    if ultralytics is not None and isinstance(model, ultralytics.Model):
        if not isinstance(inner, nn.Module):
            raise CamvizError(
                "this Ultralytics model holds no network yet (.model is not a module); load "
                "weights or a yaml first, e.g. YOLO('yolov8n.yaml')"
            )
        return inner
    return model


def _method(method: str | CamMethod, options: Mapping[str, Any]) -> CamMethod:
    """The method to explain with: created by name with its options, or the instance."""
    if not isinstance(method, (str, CamMethod)):
        raise CamvizError(
            f"method must be a method name (camviz.cams.names()) or a CamMethod, not "
            f"{type(method).__name__} {method!r}"
        )
    if isinstance(method, str):
        return create(method, **options)
    if options:
        raise CamvizError(
            f"options ({', '.join(options)}) are for a method given by name; set them on the "
            "method instance instead"
        )
    return method


def _checked_inputs(
    cam: CamMethod, inputs: Any, model: nn.Module, map_input: Key | None, *, augmented: bool
) -> Inputs:
    """The inputs as an :class:`Inputs`, checked against the method and ``aug_smooth``."""
    batch = as_inputs(inputs, model, map_input)
    if augmented and batch.image_sizes is not None:
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
    return batch


@dataclass(frozen=True)
class _Passes:
    """How one explanation records a pass and turns it into raw maps: the method, the model,
    the target spots and their layout kinds (told from the plain pass, see :meth:`spots_of`).
    """

    cam: CamMethod
    model: nn.Module
    layers: list[str]
    kinds: SpotKinds
    output_key: str | int | None
    told: Mapping[str, Kind | None] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        cam: CamMethod,
        model: nn.Module,
        batch: Inputs,
        layer: Layer | Sequence[Layer] | None,
        at: At,
        layout: LayoutGiven | Mapping[str, LayoutGiven] | None,
        output_key: str | int | None,
        target: TargetObject,
    ) -> _Passes:
        """The passes at the spots ``layer`` names (or the default layer's, for ``target``)."""
        if layer is None:
            own = cam.default_layer(model, batch)
            layers = [own or default_target_layer(model, batch, target, output_key)]
        else:
            layers = spot_keys(model, layer, at)
        return cls(
            cam, model, layers, SpotKinds.of(model, batch.main.dim(), layers, layout), output_key
        )

    def record(self, batch: Inputs, target: TargetObject, calls: bool = False) -> LayerPass:
        """One pass at the spots, with what the method needs (and the module calls)."""
        return layer_pass(
            self.model,
            batch,
            self.layers,
            target,
            gradients=self.cam.uses_gradients,
            output_key=self.output_key,
            hessian=self.cam.uses_hessian,
            record=calls,
            attention=self.cam.attention,
        )

    def first(self, batch: Inputs, target: TargetObject) -> LayerPass:
        """The plain pass, with its module calls when a spot's layout kind is not known
        without them."""
        return self.record(batch, target, calls=not self.kinds.all_known(self.layers))

    def spots_of(self, recorded: LayerPass) -> _Passes:
        """These passes at the spots the plain pass recorded (a container spot as its maps'
        element spots), with their layout kinds told from it."""
        spots = list(recorded.activations)
        kinds = self.kinds if spots == self.layers else self.kinds.expanded(spots)
        told = {name: kinds.told(name, recorded.calls, recorded.activations) for name in spots}
        return dataclasses.replace(self, layers=spots, kinds=kinds, told=told)

    def raw_maps(self, batch: Inputs, recorded: LayerPass) -> RawMaps:
        """Each layer's raw ``(N * K, *grid)`` maps, sample-major, with the channel weights of
        weight-based methods and the per-input maps of input-map methods."""
        cam = self.cam
        maps_by_layer = {}
        weights_by_layer: dict[str, torch.Tensor] | None = (
            {} if isinstance(cam, ChannelWeighted) else None
        )
        by_input = None
        for name in recorded.activations:
            ranks = layer_data(
                self.model, batch, recorded, name, self.told.get(name), self.kinds.tokens.get(name)
            )
            activations = ranks[0].activations
            if not batch.size:  # an empty batch: no maps, and nothing for a method to do
                maps_by_layer[name] = activations.new_zeros(0, *activations.shape[2:])
                continue
            with torch.no_grad():
                if isinstance(cam, ChannelWeighted):
                    weights = cam.rank_weights(ranks)
                    per_rank = [cam.combine(cam.terms(w, activations)) for w in weights]
                    assert weights_by_layer is not None  # made for a ChannelWeighted method
                    weights_by_layer[name] = torch.stack(weights, dim=1).flatten(0, 1)
                elif isinstance(cam, InputMapMethod):
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
        return RawMaps(maps_by_layer, weights_by_layer, by_input)


def _check_default_layer(
    passes: _Passes, batch: Inputs, raw: RawMaps, recorded: LayerPass, target: TargetObject
) -> None:
    """All-zero maps at a layer camviz chose, because the score does not depend on its grid,
    are an error: the user never named that layer. A head that reads only a class token
    after the layer is such a case: the gradient reaches that token, not the patches.

    A default layer with several levels (an FPN) is checked as a whole: one level without
    gradient is normal there (each box is pooled from one level)."""
    maps = raw.at_layer
    if not all(len(values) for values in maps.values()) or any(
        bool(torch.relu(values).any()) for values in maps.values()
    ):
        return
    names = list(maps)
    gradients = recorded.gradients
    if not gradients:  # a method without gradients: take them now, in this rare case
        try:
            gradients = layer_pass(
                passes.model, batch, names, target, output_key=passes.output_key
            ).gradients
        except CamvizError:  # no autograd path from the layer to the score
            gradients = {}
    tokens = False
    for name, per_rank in gradients.items():
        activations = recorded.activations[name]
        layout = spot_layout(
            name,
            activations,
            batch.main,
            passes.model,
            passes.told.get(name),
            passes.kinds.tokens.get(name) or recorded.tokens.get(name),
        )
        if any(bool(layout.to_spatial(values).any()) for values in per_rank):
            return  # the score depends on the layer: the maps say "no positive evidence"
        tokens = tokens or layout.kind == "tokens"
    listed = ", ".join(repr(name) for name in names)
    hint = (
        " (a head that reads only a class token after it?); pass layer=NAME, e.g. the norm "
        "before the last attention"
        if tokens
        else "; pass layer=NAME, a layer the score reads"
    )
    raise CamvizError(
        f"all maps are zero: the explained score does not depend on the default layer {listed} "
        f"at any location{hint} (`camviz layers` lists them)"
    )


def _independent(recorded: LayerPass) -> bool:
    """Whether the explained score does not depend on the target spots at all: every gradient
    the pass took is exactly zero (``False`` when it took none)."""
    gradients = [values for per_rank in recorded.gradients.values() for values in per_rank]
    return bool(gradients) and not any(bool(values.any()) for values in gradients)


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


def _samples(recorded: LayerPass) -> torch.Tensor:
    """``(N * K,)``: the input each map belongs to, sample-major."""
    batch_size, ranks = recorded.scores.shape
    return torch.arange(batch_size).repeat_interleave(ranks)


def _explanation(
    cam: CamMethod,
    batch: Inputs,
    recorded: LayerPass,
    raw: RawMaps,
    finished: Finished,
    finishing: Finishing,
    heatmaps: Maps,
) -> Explanation:
    """The :class:`Explanation` of a finished explanation."""
    samples = _samples(recorded)
    ids = recorded.class_ids
    boxes = recorded.resolved.boxes
    layers = list(finished.at_layer)
    return Explanation(
        heatmaps=heatmaps,
        layer_maps=finished.at_layer[layers[0]],
        maps_by_layer=finished.at_layer,
        targets=(ids if ids is not None else torch.full(recorded.scores.shape, -1))
        .reshape(-1)
        .cpu(),
        scores=recorded.scores.reshape(-1),
        samples=samples,
        output=recorded.output,
        method=cam.name,
        layers=layers,
        weights=raw.weights,
        maps_by_input=(
            None
            if raw.by_input is None
            else {
                key: finishing.per_image(maps, batch, samples, key)
                for key, maps in raw.by_input.items()
            }
        ),
        boxes=None if boxes is None else boxes.reshape(-1, 4).cpu(),
        reasons=recorded.resolved.reasons,
    )
