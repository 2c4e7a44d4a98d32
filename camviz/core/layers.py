"""Turn layer names, patterns and modules into named modules; pick a default target layer.

A layer is given as a name of ``model.named_modules()`` (``"layer4"``, ``"layer4.1.bn2"``,
``"features.8"``), a shell-wildcard pattern (``"layer*.0.conv1"``) or the submodule itself
(``model.layer4``). An unknown name is a :class:`~camviz.core.errors.CamvizError` that lists
the closest real names.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeAlias

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs, as_inputs
from camviz.core.layerkinds import CallLog, record_calls
from camviz.core.modelstate import HookSet, eval_mode
from camviz.core.precision import Precision, model_precision

__all__ = [
    "Layer",
    "default_target_layer",
    "layer_shapes",
    "resolve_layers",
]

_WILDCARDS = frozenset("*?[")

# Layers that pool a map into a coarser one (or into one value per channel).
_POOLING: tuple[type[nn.Module], ...] = (
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.modules.pooling._LPPoolNd,
)

# Layers that hand on their input at inference: their output is the map before them.
_PASSING_ON: tuple[type[nn.Module], ...] = (nn.Identity, nn.modules.dropout._DropoutNd)

Layer: TypeAlias = str | nn.Module
"""A layer: its name, a wildcard pattern, or the submodule itself."""


def resolve_layers(model: nn.Module, layers: Layer | Iterable[Layer]) -> dict[str, nn.Module]:
    """Map names, wildcard patterns or submodules to named modules, keeping the given order.

    Args:
        model: The network whose submodules are looked up.
        layers: One layer or several; each a name, a pattern such as ``"layer*.0.conv1"``,
            or a submodule of ``model`` (found by identity, named as ``named_modules`` does).

    Returns:
        An ordered ``{name: module}`` dict without duplicates.

    Raises:
        CamvizError: A name matches nothing (the message suggests the closest names), a
            module is not part of ``model``, or a layer is neither a string nor a module.
    """
    if isinstance(layers, (str, nn.Module)):
        layers = [layers]
    elif not isinstance(layers, Iterable):
        raise CamvizError(_wrong_type_message(layers))
    modules = dict(model.named_modules())
    modules.pop("", None)
    resolved: dict[str, nn.Module] = {}
    for layer in layers:
        if isinstance(layer, nn.Module):
            matches = [name for name, module in modules.items() if module is layer][:1]
            if not matches:
                raise CamvizError(
                    f"the {type(layer).__name__} given as layer is not a submodule of this "
                    "model; pass one of its submodules (model.NAME) or a layer name"
                )
        elif isinstance(layer, str):
            if _WILDCARDS.intersection(layer):
                matches = [name for name in modules if fnmatch.fnmatchcase(name, layer)]
            else:
                matches = [layer] if layer in modules else []
            if not matches:
                raise CamvizError(_unknown_layer_message(layer, list(modules)))
        else:
            raise CamvizError(_wrong_type_message(layer))
        for match in matches:
            resolved[match] = modules[match]
    if not resolved:
        raise CamvizError("no layer was named; give at least one layer name")
    return resolved


def _wrong_type_message(layer: object) -> str:
    return (
        f"a layer must be a name, a wildcard pattern or a submodule of the model, not "
        f"{type(layer).__name__} {layer!r}"
    )


def _unknown_layer_message(name: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=5, cutoff=0.5)
    if not close:
        # Fall back to names that share the last component ("conv1" -> "layer1.0.conv1").
        tail = name.rsplit(".", 1)[-1]
        close = [candidate for candidate in candidates if candidate.endswith(tail)][:5]
    listing = "`camviz layers --model NAME` lists them all"
    hint = f"did you mean {', '.join(repr(c) for c in close)}? {listing}" if close else listing
    return f"no layer named {name!r} in the model; {hint}"


# Default layers are found with one dry run; remember them per model, spatial rank of the
# input and layer they must come before, so that a loop over batches pays for that run once.
_default_cache: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, str | None], str]] = (
    weakref.WeakKeyDictionary()
)


def default_target_layer(
    model: nn.Module, inputs: torch.Tensor | Inputs, before: str | None = None
) -> str:
    """The layer to explain when none is named: by the model's family, else the last layer,
    in call order, whose output is a spatial map and not the head's.

    torchvision's detectors and segmentation models get the layer of their family
    (:func:`family_layer`): the last spatial layer would be a head (a detector's RoI pooling
    folds its proposals into the batch; a segmentation model's final 1x1 classifier has one
    channel per class, so its map is the class mask itself). Every other model
    (classifiers, video models, models of any family that are not torchvision's) gets the
    rule below; for torchvision's video models it picks the last 3-D stage (``layer4`` of
    ``r3d_18``, ``mc3_18`` and ``r2plus1d_18``, ``features`` of ``s3d``, the final norm of
    ``swin3d_t``).

    One dry forward pass on the first sample records every module's output. A spatial map
    has the input's rank and more than one location: ``(N, C, L)`` for a signal,
    ``(N, C, H, W)`` (or Swin's channels-last ``(N, H, W, C)``) for an image,
    ``(N, C, D, H, W)`` for a volume or clip; whether the channels come first or last is
    told from the module that produced it (:mod:`camviz.core.layerkinds`), never from the
    rank alone. Containers fire after their children, so for a ResNet the answer is
    ``layer4`` rather than its last ReLU, and for a Swin transformer its final norm. Three
    kinds of output do not count, told from the modules that produced them:

    * a pooling layer's, and that of a container that ends with one: pooling only
      summarises the map before it, at a coarser grid. VGG's and AlexNet's answer is the
      last ReLU of ``features`` (``features.29`` of ``vgg16``, 14 x 14 at 224 px; ``features.11``
      of ``alexnet``), not the max-pool after it, nor ``features`` (which ends with that pool)
      or the adaptive ``avgpool``;
    * the output of a layer that hands on its input at inference (``Identity``, dropout),
      which is the map before it;
    * a classifier written as a convolution: when the model answers ``(N, K)`` scores and
      its last convolution is a 1 x 1 one with ``K`` output channels (SqueezeNet's
      ``classifier.1``), that convolution and everything after it map the classes, so
      SqueezeNet's answer is ``features``.

    Vision transformers (ViT, DeiT: token outputs ``(N, T, C)`` from linear layers, norms
    or attention after the last map) get the input of their last attention layer instead:
    the last block's first norm (timm's ``blocks[-1].norm1``, torchvision's
    ``encoder_layer_{L-1}.ln_1``), as is common practice. The last block's *output* is a
    poor choice: the head reads only the class token there, so every patch token has zero
    gradient and the map would be empty; the last attention still mixes the patches into
    the class token, so its input has a gradient at every patch. The model's train/eval
    modes are left as they were.

    ``before`` names a layer (a :class:`~camviz.Unit`'s): the answer is then, whatever the
    model's family, the last layer by the same rule whose call ends before that layer's
    begins (for tokens, the last such token output), so that the unit's score depends on it.

    Raises:
        CamvizError: No layer produces a spatial output (before ``before``), ``before``
            does not run, or the batch is empty (and the model is none of the families
            above).
    """
    by_family = None if before is not None else family_layer(model)  # no model call
    if by_family is not None:
        return by_family
    batch = inputs if isinstance(inputs, Inputs) else as_inputs(inputs, model)
    if not batch.size:  # refused even when remembered, so the answer never depends on history
        raise CamvizError(
            "the batch is empty, and the default layer is found by running the model on a "
            "sample; pass layer=NAME to explain an empty batch"
        )
    rank = batch.main.dim() - 2
    per_model = _default_cache.setdefault(model, {})
    if (rank, before) not in per_model:
        per_model[rank, before] = _structural_layer(model, _dry_run(model, batch), rank, before)
    return per_model[rank, before]


@dataclass
class _DryRun:
    """What :func:`default_target_layer` learns from one pass of the model."""

    log: CallLog
    attention_starts: list[int]  # how many calls had ended when each attention began
    skipped: set[str]  # layers whose output is a pooling layer's, or their own input
    output: object


def _dry_run(model: nn.Module, batch: Inputs) -> _DryRun:
    """Run the model once on the first sample, in eval mode and without gradients."""
    attention_starts: list[int] = []
    skipped: set[str] = set()
    pool_outputs: list[torch.Tensor] = []  # kept alive, so that identity means the same tensor

    def before_attention(module: nn.Module, args: object) -> None:
        attention_starts.append(len(log.calls))

    def after(name: str, module: nn.Module, args: object, output: object) -> None:
        if isinstance(module, _PASSING_ON):
            skipped.add(name)
        elif isinstance(module, _POOLING) and isinstance(output, torch.Tensor):
            pool_outputs.append(output)
            skipped.add(name)
        elif any(output is pool_output for pool_output in pool_outputs):
            skipped.add(name)  # a container that ends with a pool (or an in-place op after it)

    first = torch.zeros(1, dtype=torch.long, device=batch.main.device)
    with HookSet() as hooks, record_calls(model) as log, torch.inference_mode(), eval_mode(model):
        for name, module in model.named_modules():
            if _is_attention(module):
                hooks.add(module.register_forward_pre_hook(before_attention))
            if name:
                hooks.add(module.register_forward_hook(partial(after, name)))
        output = batch.replaced({}, first)(model)
    return _DryRun(log, attention_starts, skipped, output)


def _structural_layer(model: nn.Module, run: _DryRun, rank: int, before: str | None) -> str:
    """The layer :func:`default_target_layer` picks from what the dry run recorded."""
    calls = run.log.calls
    head = _classifier_convolution(model, run)
    end = len(calls) if before is None else _start_of(run.log, before)
    kinds = [_output_kind(run.log, index, rank) for index in range(len(calls))]
    candidates = [
        index
        for index, kind in enumerate(kinds[:end])
        if kind is not None
        and calls[index].name not in run.skipped
        and (head is None or index < head)
    ]
    if not candidates:
        where = "" if before is None else f" before {before!r}"
        raise CamvizError(
            f"could not find a layer with a spatial output{where} to explain; pass "
            "layer=NAME (`camviz layers --model NAME` lists them)"
        )
    if kinds[candidates[-1]] != "tokens" or before is not None:
        return calls[candidates[-1]].name
    tokens = [index for index in candidates if kinds[index] == "tokens"]
    attention_inputs = [
        max(i for i in tokens if i < start) for start in run.attention_starts if tokens[0] < start
    ]
    return calls[attention_inputs[-1] if attention_inputs else tokens[-1]].name


def _start_of(log: CallLog, layer: str) -> int:
    """How many calls had ended when ``layer`` began (its spot's module, for a spot)."""
    name = layer.split(":")[0].split("[")[0]
    if name not in log.starts:
        raise CamvizError(
            f"layer {name!r} did not run in the forward pass; pick a layer that the model "
            "uses (`camviz layers` lists them with shapes)"
        )
    return log.starts[name]


def _classifier_convolution(model: nn.Module, run: _DryRun) -> int | None:
    """The call of the model's last convolution if it maps to the ``K`` classes of an
    ``(N, K)`` output with a 1 x 1 kernel (SqueezeNet's head); else ``None``."""
    output = run.output
    if not isinstance(output, torch.Tensor) or output.dim() != 2:
        return None
    modules = dict(model.named_modules())
    convolutions = [
        index
        for index, call in enumerate(run.log.calls)
        if call.name and isinstance(modules.get(call.name), nn.modules.conv._ConvNd)
    ]
    if not convolutions:
        return None
    last = modules[run.log.calls[convolutions[-1]].name]
    assert isinstance(last, nn.modules.conv._ConvNd)
    one_by_one = all(size == 1 for size in last.kernel_size)
    return convolutions[-1] if one_by_one and last.out_channels == output.shape[1] else None


def family_layer(model: nn.Module) -> str | None:
    """The default layer of a torchvision detector or segmentation model, told from its
    classes and structure (never from its name); ``None`` for other models. A model that
    wraps one (pre- or post-processing around it) gets the layer inside it.

    * Detectors (``GeneralizedRCNN``: Faster, Mask and Keypoint R-CNN; ``RetinaNet``;
      ``FCOS``; ``SSD`` and SSDlite): ``"backbone"``. Its output is the dict of feature
      levels the heads read (the FPN's ``'0'``, ``'1'``, ..., ``'pool'``; SSD's extractor's
      levels), which the engine explains one map per level, fused. Each box is predicted
      from one level, so a single stage would miss the boxes of the others (SSD's trunk
      reaches most of its heads only through the extra blocks, at a coarser grid).
    * Segmentation models (``FCN``, ``DeepLabV3``, ``LRASPP``), and any model whose
      ``backbone`` is an ``IntermediateLayerGetter`` (a ``return_layers`` dict of its
      stages): the backbone's last returned stage (``backbone.layer4`` of ``fcn_resnet50``,
      ``backbone.16`` of the MobileNetV3 ones), the richest map before the segmentation
      head; with another backbone, ``"backbone"`` (its maps, one per level).
    """
    for name, module in model.named_modules():
        layer = _own_family_layer(module)
        if layer is not None:
            return f"{name}.{layer}" if name else layer
    return None


def _own_family_layer(model: nn.Module) -> str | None:
    """:func:`family_layer` for ``model`` itself (not its submodules)."""
    backbone = getattr(model, "backbone", None)
    if not isinstance(backbone, nn.Module):
        return None
    from torchvision.models.detection import FCOS, RetinaNet, generalized_rcnn, ssd
    from torchvision.models.segmentation import _utils, lraspp

    detectors = (generalized_rcnn.GeneralizedRCNN, RetinaNet, FCOS, ssd.SSD)
    if isinstance(model, detectors):
        return "backbone"
    returned = getattr(backbone, "return_layers", None)  # an IntermediateLayerGetter's
    if isinstance(returned, Mapping):
        stages = [name for name, _ in backbone.named_children() if name in returned]
        if stages:
            return f"backbone.{stages[-1]}"
    segmenters = (_utils._SimpleSegmentationModel, lraspp.LRASPP)
    if isinstance(model, segmenters):
        return "backbone"  # another backbone: its dict of maps, one per level
    return None


def _output_kind(log: CallLog, index: int, rank: int) -> str | None:
    """``"spatial"``, ``"tokens"`` or ``None``: what the output of call ``index`` is."""
    call = log.calls[index]
    shape = call.shape
    if not call.name or shape is None or len(shape) < 3:
        return None  # the model's input, or no map
    kind = call.kind or log.producer_kind(shape, index)
    if len(shape) == rank + 2 and (rank > 1 or kind == "channels_first"):
        grid = shape[1:-1] if kind == "channels_last" else shape[2:]
        return "spatial" if math.prod(grid) > 1 else None
    if len(shape) == 3 and kind == "channels_last" and shape[1] > 1:
        return "tokens"
    return None


def _is_attention(module: nn.Module) -> bool:
    """torch's ``MultiheadAttention`` (torchvision ViT), or an attention class of timm or HF
    (``*Attention``, or ``*Attn*`` such as CoaT's ``FactorAttnConvRelPosEnc``)."""
    name = type(module).__name__
    return isinstance(module, nn.MultiheadAttention) or name.endswith("Attention") or "Attn" in name


def layer_shapes(
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    precision: Precision = "fp32",
    channels_last: bool = False,
) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, type, output shape)`` of every layer, in call order, from one dry run.

    A layer called several times appears once per call. Outputs that are not tensors show
    the shape ``()``. The model's train/eval flags are left as they were. ``precision`` and
    ``channels_last`` run the dry run as :func:`camviz.explain` would (see
    :mod:`camviz.core.precision`), so a model that fails under them fails here too.
    """
    rows: list[tuple[str, str, tuple[int, ...]]] = []

    def record(name: str, module: nn.Module, args: object, output: object) -> None:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else ()
        rows.append((name, type(module).__name__, shape))

    with (
        model_precision(model, precision, channels_last),
        HookSet() as hooks,
        torch.inference_mode(),
        eval_mode(model),
    ):
        for name, module in model.named_modules():
            if name:
                hooks.add(module.register_forward_hook(partial(record, name)))
        model(inputs)
    return rows
