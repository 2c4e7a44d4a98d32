"""The default target layer, told from the model's structure and from one dry run, for a
model of any library: never from a class or layer name.

torchvision's detectors and segmentation models get the layer of their family
(:func:`family_layer`), with no model call. Every other model runs once, on the first
sample, followed from its map input (:mod:`camviz.core.lineage`), and the explained score is
differentiated once with respect to every layer's output. The default layer is the last
layer, in call order, whose output

* depends on the map input (a two-tower model's text tower does not);
* has a grid with the input's proportions: a feature map of the input's rank with more than
  one location, channels first or last (told from the module, :mod:`camviz.core.layerkinds`),
  or tokens whose patches the pass shows (a patch embedding's map flattened into them) on
  such a grid; a DETR decoder's object queries, or YOLO's ``(4, anchors)`` box bins, are none;
* is not the model's output or a reshaping of it (Segformer's decode head, a UNet's last
  convolution, a map of the output's shape), nor a pooling layer's, a pass-on layer's
  (``Identity``, dropout), or a 1 x 1 convolution that maps to the classes (SqueezeNet);
* lies outside any attention computation (its q/k/v projections; attention is told by what
  it computes, :class:`~camviz.core.lineage.Lineage`) and outside a module that takes a list
  of feature maps (Ultralytics' ``Detect`` and ``Segment`` heads, Segformer's decode head):
  such a module is explained at its input levels instead (``"model.22:input"``), fused (a
  unit inside it that reads one level: at the layer that gives that level);
* and that the explained score depends on: the backward pass reaches it, and for tokens
  the patch tokens get a gradient. A ViT's head reads only the class token after the last
  attention, so its last block's output has no gradient at the patches, and the answer is
  the norm before its last attention (timm's ``blocks[-1].norm1``); a model that pools its
  tokens (Swin, DINOv2's mean of patch tokens) gets its final norm.

Containers fire after their children, so for a ResNet the answer is ``layer4`` rather than
its last ReLU. The answer is remembered per model, input rank and kind of target (and
output key), so a loop over batches pays for the dry run once.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.hooks import tensors_in
from camviz.core.inputs import Inputs
from camviz.core.layerkinds import Call, CallLog, record_calls
from camviz.core.modelstate import HookSet, eval_mode, no_grad
from camviz.core.taps import edit_spots, parse

if TYPE_CHECKING:
    from camviz.core.targets import TargetObject

__all__ = ["default_layer", "family_layer", "patch_token_layers"]

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

_Key = tuple[int, str, str | int | None, tuple[str, ...]]
_cache: weakref.WeakKeyDictionary[nn.Module, dict[_Key, str]] = weakref.WeakKeyDictionary()


def default_layer(
    model: nn.Module,
    batch: Inputs,
    target: TargetObject | None = None,
    output_key: str | int | None = None,
) -> str:
    """The layer spot to explain when none is named (see the module docstring).

    Raises:
        CamvizError: No layer qualifies, or the batch is empty (and the model is no
            torchvision detector or segmentation model).
    """
    by_family = family_layer(model)  # no model call: also for inputs it takes otherwise
    if by_family is not None:
        return by_family
    require_sample(batch)
    rank = batch.main.dim() - 2
    spots = tuple(target.spots) if target is not None else ()
    key = (rank, type(target).__name__, output_key, spots)
    per_model = _cache.setdefault(model, {})
    if key not in per_model:
        run = _dry_run(model, batch, target, output_key)
        per_model[key] = _structural_layer(model, run, tuple(batch.main.shape[2:]))
    return per_model[key]


def require_sample(batch: Inputs) -> None:
    """An empty batch is refused where the default layer is found from a sample, even when it
    is remembered, so that the answer never depends on history."""
    if not batch.size:
        raise CamvizError(
            "the batch is empty, and the default layer is found by running the model on a "
            "sample; pass layer=NAME to explain an empty batch"
        )


@dataclass
class _DryRun:
    """What :func:`default_layer` learns from one pass of the model on one sample."""

    log: CallLog
    skipped: set[str]  # layers whose output is a pooling layer's, or their own input
    output: Any
    output_key: str | int | None = None
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # by call index
    levels: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # a consumer's input
    gradients: dict[int, torch.Tensor | None] | None = None  # None: no backward pass taken
    level_gradients: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)
    spots: dict[str, torch.Tensor] = field(default_factory=dict)  # the ones the target reads


def _dry_run(
    model: nn.Module, batch: Inputs, target: TargetObject | None, output_key: str | int | None
) -> _DryRun:
    """Run the model once on the first sample, in eval mode, followed from its map input,
    and differentiate the explained score once (not on the meta device: no values there)."""
    skipped: set[str] = set()
    pool_outputs: list[torch.Tensor] = []  # kept alive, so that identity means the same tensor
    real = batch.main.device.type != "meta"
    first = torch.zeros(1, dtype=torch.long, device=batch.main.device)
    with torch.inference_mode(False):  # an ordinary copy, also of a caller's inference tensor
        source = batch.main[:1].clone().requires_grad_(real)
    sample = batch.replaced({batch.key: source}, first)
    run = _DryRun(CallLog(), skipped, None, output_key)
    if target is not None and target.spots:  # it reads them as this pass hands them on
        target = target.prepare(model, sample)

    def after(name: str, module: nn.Module, args: object, output: object) -> None:
        if isinstance(module, _PASSING_ON):
            skipped.add(name)
        elif isinstance(module, _POOLING) and isinstance(output, torch.Tensor):
            pool_outputs.append(output)
            skipped.add(name)
        elif any(output is pool_output for pool_output in pool_outputs):
            skipped.add(name)  # a container that ends with a pool (or an in-place op after it)
        if isinstance(output, torch.Tensor):
            run.tensors[len(run.log.calls) - 1] = output  # record_calls's hook ran first

    def before(name: str, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], (list, tuple, Mapping)) or name in run.levels:
            return None
        if isinstance(args[0], Mapping):
            run.levels[name] = [v for v in args[0].values() if isinstance(v, torch.Tensor)]
            return None
        # The module gets aliases of its levels, so that their gradients count only what
        # reaches them through it: a level is also the next one's source (YOLO's neck).
        levels = [v.view_as(v) if isinstance(v, torch.Tensor) else v for v in args[0]]
        run.levels[name] = [v for v in levels if isinstance(v, torch.Tensor)]
        return (type(args[0])(levels), *args[1:])

    def keep(spot: str, tensor: torch.Tensor) -> torch.Tensor:
        run.spots.setdefault(spot, tensor)
        return tensor

    grad = torch.enable_grad() if real else no_grad()
    read = {spot: partial(keep, spot) for spot in (target.spots if target is not None else ())}
    with (
        HookSet() as hooks,
        torch.inference_mode(False),
        grad,
        eval_mode(model),
        edit_spots(model, read),
        record_calls(model, source) as log,
    ):
        run.log = log
        for name, module in model.named_modules():
            if name:
                hooks.add(module.register_forward_pre_hook(partial(before, name)))
                hooks.add(module.register_forward_hook(partial(after, name)))
        run.output = sample(model)
        if real:
            _differentiate(run, target, output_key)
    return run


def _differentiate(run: _DryRun, target: TargetObject | None, output_key: str | int | None) -> None:
    """The gradient of the explained score with respect to every recorded output (``None``
    where the score does not reach it), in one backward pass; nothing when the target cannot
    score this one sample (per-sample data for a larger batch): then the top class's score."""
    score = _sample_score(run.output, target, output_key, run.spots)
    if score is None or not score.requires_grad:
        return
    outputs = {index: tensor for index, tensor in run.tensors.items() if tensor.requires_grad}
    levels = [(name, tensor) for name, maps in run.levels.items() for tensor in maps]
    levels = [(name, tensor) for name, tensor in levels if tensor.requires_grad]
    wanted = list(outputs.values()) + [tensor for _, tensor in levels]
    if not wanted:
        return
    found = torch.autograd.grad(score.sum(), wanted, allow_unused=True)
    run.gradients = dict(zip(outputs, found[: len(outputs)], strict=True))
    for (name, _), gradient in zip(levels, found[len(outputs) :], strict=True):
        run.level_gradients.setdefault(name, []).append(gradient)


def _sample_score(
    output: Any,
    target: TargetObject | None,
    output_key: str | int | None,
    spots: Mapping[str, torch.Tensor],
) -> torch.Tensor | None:
    from camviz.core.targets import Context, as_target

    for chosen in (target, None) if target is not None else (None,):
        try:
            context = Context(output_key, spots, batch_size=1)
            resolved = as_target(chosen).resolve(output, context)
            return resolved.scores[0](output)
        except CamvizError:
            continue
    return None


@dataclass(frozen=True)
class _Candidate:
    position: float  # where it lies in call order (a consumer's input: before its calls)
    spot: str


def _structural_layer(model: nn.Module, run: _DryRun, size: tuple[int, ...]) -> str:
    """The layer :func:`default_layer` picks from what the dry run recorded."""
    inside = _inner_calls(run.log)
    head = _classifier_convolution(model, run)
    # A target that reads a layer (a unit) is explained at a layer before it.
    end = min((_spot_start(run, spot) for spot in run.spots), default=len(run.log.calls))
    output_shapes, output_storages = _output_tensors(run.output, run.output_key)
    structural = [
        index
        for index, call in enumerate(run.log.calls)
        if index not in inside
        and index < end
        and call.name not in run.skipped
        and (head is None or index < head)
        and _grid_of(run.log, index, size) is not None
        and not _is_output(run.tensors.get(index), call, output_shapes, output_storages)
    ]
    candidates = [
        _Candidate(index, run.log.calls[index].name)
        for index in structural
        if _scored(run, index, run.log.calls[index])
    ]
    candidates += [
        _Candidate(start - 0.5, f"{name}:input")
        for name, start in run.log.levels.items()
        if start - 1 not in inside and start <= end and _levels_scored(run, name, size)
    ]
    if candidates:
        return max(candidates, key=lambda candidate: candidate.position).spot
    if structural:
        tokens = any(run.log.calls[index].tokens is not None for index in structural)
        hint = " (a head that reads only a class token?)" if tokens else ""
        raise CamvizError(
            "all maps would be zero: the explained score does not depend on any layer with a "
            f"grid at any location{hint}; pass layer=NAME (`camviz layers --model NAME` lists "
            "them)"
        )
    raise CamvizError(
        "could not find a layer with a spatial output to explain; pass layer=NAME "
        "(`camviz layers --model NAME` lists them)"
    )


def _spot_start(run: _DryRun, spot: str) -> int:
    """Where a spot's tensor begins in call order: its module's start; for an input spot,
    the start of the layer whose output it is (the outermost call that gave the tensor
    and ended before the module began; the innermost may be a module that many layers
    share, as Ultralytics' activation is, whose name gives another call's start)."""
    parsed = parse(spot)
    start = run.log.starts.get(parsed.name, len(run.log.calls))
    if parsed.at != "input":
        return start
    tensor = run.spots[spot]
    gave = [index for index, output in run.tensors.items() if output is tensor and index < start]
    if not gave:
        return start
    return run.log.starts.get(run.log.calls[max(gave)].name, max(gave))


def _inner_calls(log: CallLog) -> set[int]:
    """The calls made inside an attention module or a module that takes a list of levels
    (not their own output)."""
    inner: set[int] = set()
    for name in log.attention | set(log.levels):
        end = log.index(name)
        if end is not None:
            inner.update(range(log.starts.get(name, end), end))
    return inner


def _grid_of(log: CallLog, index: int, size: tuple[int, ...]) -> tuple[int, ...] | None:
    """The grid of call ``index``'s output, if it is a map of the input's rank or patch
    tokens, computed from the map input, with more than one location and the input's
    proportions."""
    call = log.calls[index]
    shape = call.shape
    if not call.name or shape is None or len(shape) < 3 or call.depends is False:
        return None
    rank = len(size)
    kind = call.kind or log.producer_kind(shape, index)
    grid: tuple[int, ...] | None = None
    if call.tokens is not None:
        grid = call.tokens.grid
    elif len(shape) == rank + 2 and (rank > 1 or kind == "channels_first"):
        grid = tuple(shape[1:-1] if kind == "channels_last" else shape[2:])
    if grid is None or len(grid) != rank or math.prod(grid) < 2 or not _proportional(grid, size):
        return None
    return grid


def _proportional(grid: Sequence[int], size: Sequence[int]) -> bool:
    """Whether a grid has the input's proportions on every pair of axes, up to rounding (of
    a volume or clip, its last two: a clip's time is downsampled on its own)."""
    grid, size = (tuple(grid)[-2:], tuple(size)[-2:]) if len(size) == 3 else (grid, size)
    return all(
        abs(grid[i] * size[j] - grid[j] * size[i]) <= 2 * (size[i] + size[j])
        for i in range(len(size))
        for j in range(i + 1, len(size))
    )


def _output_tensors(
    output: Any, output_key: str | int | None
) -> tuple[set[tuple[int, ...]], set[int]]:
    """The shapes of the output tensor the scores are read from (every tensor of the output
    when none is: an embedding, a callable's pick), and their storages (real tensors only)."""
    from camviz.core.targets import as_logits

    try:
        tensors = [as_logits(output, output_key)]
    except CamvizError:
        tensors = list(tensors_in(output))
    storages = {
        tensor.untyped_storage().data_ptr() for tensor in tensors if tensor.device.type != "meta"
    }
    return {tuple(tensor.shape) for tensor in tensors if tensor.dim() >= 3}, storages


def _is_output(
    tensor: torch.Tensor | None, call: Call, shapes: set[tuple[int, ...]], storages: set[int]
) -> bool:
    """Whether a layer's output is the model's output, a reshaping of it (the same storage),
    or a map of its shape (a segmentation head's logits before a last residual sum)."""
    if call.tokens is None and call.shape in shapes:
        return True
    if tensor is None or tensor.device.type == "meta":
        return False
    return tensor.untyped_storage().data_ptr() in storages


def _scored(run: _DryRun, index: int, call: Call) -> bool:
    """Whether the explained score depends on call ``index``'s output: the backward pass
    reaches it with a gradient that is not zero everywhere (for tokens, at their patches).
    Without a backward pass (the meta device, or a score the sample cannot give), tokens
    count only when an attention comes after them (a ViT's last block reads the class token
    alone)."""
    if run.gradients is None:
        return call.tokens is None or any(
            run.log.starts.get(name, -1) > index for name in run.log.attention
        )
    gradient = run.gradients.get(index)
    if gradient is None:
        return False
    if call.tokens is not None:
        gradient = gradient[:, call.tokens.start : call.tokens.end]
    return bool(gradient.ne(0).any())


def _levels_scored(run: _DryRun, name: str, size: tuple[int, ...]) -> bool:
    """Whether a module that takes a list holds at least two feature maps of the input's
    proportions, one of which the explained score depends on; for a target that reads a
    layer (a unit), two of which it depends on. A unit inside such a module (one of YOLO's
    per-level branches) depends on its level alone, whatever the image: it is explained at
    the layer that gives that level, not at all of them with the others' maps zero. A
    detection's one level is a matter of the object, so its levels stay fused."""
    maps = [
        tensor
        for tensor in run.levels.get(name, [])
        if tensor.dim() == len(size) + 2 and _proportional(tuple(tensor.shape[2:]), size)
    ]
    if len(maps) < 2:
        return False
    if run.gradients is None:
        return True
    gradients = run.level_gradients.get(name, [])
    scored = sum(gradient is not None and bool(gradient.ne(0).any()) for gradient in gradients)
    return scored >= (2 if run.spots else 1)


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


def patch_token_layers(model: nn.Module, batch: Inputs, most: int = 3) -> list[str]:
    """The last ``most`` layers whose outputs are patch tokens, from one pass on a sample
    (for the message that refuses tokens without a grid)."""
    first = torch.zeros(1, dtype=torch.long, device=batch.main.device)
    sample = batch.replaced({}, first)
    with no_grad(), eval_mode(model), record_calls(model, sample.main) as log:
        sample(model)
    names = [call.name for call in log.calls if call.name and call.tokens is not None]
    return list(dict.fromkeys(reversed(names)))[:most]
