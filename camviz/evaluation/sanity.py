"""Sanity checks for saliency maps: does the map change when the model does?

Adebayo, Gilmer, Muelly, Goodfellow, Hardt and Kim, "Sanity Checks for Saliency Maps",
NeurIPS 2018, found that some popular maps look the same for a trained network and for one
whose weights are random: they show the image (its edges), not what the model learnt.
Their *cascading model-parameter randomisation* replaces the weights layer by layer, from
the output down, and compares the map after each step with the original one. A method whose
maps stay alike after every layer is random is independent of the model, and is flagged.

By default each stage is one layer: a module without submodules with its parameters, or one
parameter that a parent module owns and uses itself (a ViT's ``pos_embed`` and
``cls_token``, a ConvNeXt block's ``gamma``). The stages are ordered by where their
parameters are first used in the forward pass, found by watching every torch call of one
pass, so a parent's own parameters are randomised where they act (``pos_embed`` among the
last, next to the patch embedding; ``gamma`` just before the block's own layers), not
together with everything below the parent.

:func:`cascading_randomization` works on a deep copy of the model: the user's model is
never touched. Each parameter of a randomised layer is replaced by Gaussian noise with that
tensor's own mean and standard deviation, so that activations keep their scale through a
deep network instead of exploding or vanishing, and only what was learnt is gone.

The maps are compared with :func:`spearman` (rank correlation, ties averaged) and
:func:`ssim` (structural similarity, Wang et al. 2004), per image.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.cams.base import CamMethod
from camviz.cams.engine import explain
from camviz.core.calls import CallMode
from camviz.core.errors import CamvizError
from camviz.core.hooks import tensors_in
from camviz.core.inputs import as_batch
from camviz.core.layers import Layer, resolve_layers
from camviz.core.modelstate import eval_mode, no_grad
from camviz.core.targets import Context, Target, as_target

__all__ = [
    "Explainer",
    "SanityReport",
    "cascading_randomization",
    "spearman",
    "ssim",
]

Explainer = Callable[[nn.Module, torch.Tensor, Target], torch.Tensor]
"""``fn(model, inputs, target) -> (N, H, W)`` maps: any saliency method, not only a CAM."""


@dataclass
class SanityReport:
    """How the maps changed as the layers were randomised one after another.

    Attributes:
        method: The method's name.
        stages: Layers in the order they were randomised; stage ``k`` has layers
            ``stages[0..k]`` random. A parent module's own parameter is named
            ``"parent.parameter"`` (``"pos_embed"`` for the model's own).
        spearman: ``(S, N)`` rank correlation between each image's original map and its map
            at each stage.
        ssim: ``(S, N)`` structural similarity of the same pairs.
        threshold: A method is flagged when the mean rank correlation with every layer
            random is at least this.
    """

    method: str
    stages: list[str]
    spearman: torch.Tensor
    ssim: torch.Tensor
    threshold: float

    @property
    def flagged(self) -> bool:
        """Whether the maps barely change with a fully random model: model-independent."""
        return float(self.spearman[-1].mean()) >= self.threshold

    def table(self) -> str:
        """A Markdown table: per stage, the mean rank correlation and SSIM over the images."""
        rows = ["| randomised down to | rank correlation | SSIM |", "| --- | ---: | ---: |"]
        for stage, correlation, similarity in zip(
            self.stages, self.spearman.mean(dim=1), self.ssim.mean(dim=1), strict=True
        ):
            rows.append(f"| `{stage}` | {float(correlation):.3f} | {float(similarity):.3f} |")
        verdict = "flagged: model-independent" if self.flagged else "passes"
        rows.append(f"\n{self.method}: {verdict} (threshold {self.threshold})")
        return "\n".join(rows)


def cascading_randomization(
    model: nn.Module,
    inputs: torch.Tensor,
    method: str | CamMethod | Explainer = "gradcam",
    *,
    layer: Layer | Sequence[Layer] | None = None,
    target: Target = None,
    stages: Sequence[str] | None = None,
    seed: int = 0,
    threshold: float = 0.5,
) -> SanityReport:
    """Randomise the model's layers from the output down and compare the maps each time.

    Args:
        model: The trained network; a deep copy is randomised, ``model`` comes back as it was.
        inputs: ``(N, C, H, W)`` images as the model takes them.
        method: A registry name or method instance (explained with :func:`camviz.explain` at
            ``layer``), or any :data:`Explainer` ``fn(model, inputs, target)``.
        layer: The CAM's target layer (``None``: the engine's default).
        target: What to explain. Top-1 and top-k are resolved once, on the trained model,
            so every stage explains the same classes.
        stages: Layer names (wildcards allowed) to randomise, in this order, each with all
            its parameters (its submodules' included); ``None`` takes one layer per stage,
            output first (see the module docstring).
        seed: Seeds the random weights.
        threshold: Flag the method when the mean rank correlation with every stage random
            is at least this.

    Returns:
        A :class:`SanityReport`.
    """
    explainer, name = _explainer(method, layer)
    with torch.inference_mode(False):  # a copy of ordinary tensors, also in inference mode
        copied = copy.deepcopy(model)
    if next(copied.parameters(), None) is None:
        raise CamvizError("the model has no parameters to randomise")
    inputs = as_batch(inputs, copied)
    original = explainer(copied, inputs, target)
    target = _fixed_target(target, copied, inputs)
    groups = _stages(copied, inputs, stages)
    parameter = next(copied.parameters())
    generator = torch.Generator(device=parameter.device).manual_seed(seed)
    correlations, similarities = [], []
    for parameters in groups.values():
        _randomize(parameters, generator)
        randomised = explainer(copied, inputs, target)
        correlations.append(spearman(original, randomised))
        similarities.append(ssim(original, randomised))
    return SanityReport(
        method=name,
        stages=list(groups),
        spearman=torch.stack(correlations),
        ssim=torch.stack(similarities),
        threshold=threshold,
    )


def spearman(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Spearman's rank correlation between paired maps, ``(N, ...)`` each, per pair.

    Tied values get the mean of their ranks (CAMs hold many zeros after the ReLU). A
    constant map has no order to correlate with: its correlation is 0.

    Returns:
        ``(N,)`` correlations in ``[-1, 1]``.
    """
    if first.shape != second.shape:
        raise CamvizError(f"maps to compare differ in shape: {first.shape} and {second.shape}")
    ranks_first = _average_ranks(first.flatten(1).double())
    ranks_second = _average_ranks(second.flatten(1).double())
    centred_first = ranks_first - ranks_first.mean(dim=1, keepdim=True)
    centred_second = ranks_second - ranks_second.mean(dim=1, keepdim=True)
    covariance = (centred_first * centred_second).sum(dim=1)
    spread = centred_first.norm(dim=1) * centred_second.norm(dim=1)
    return torch.where(spread > 0, covariance / spread.clamp_min(1e-300), 0.0).float()


def ssim(
    first: torch.Tensor, second: torch.Tensor, *, window: int = 11, sigma: float = 1.5
) -> torch.Tensor:
    """Structural similarity of paired ``(N, H, W)`` maps in ``[0, 1]``, per pair.

    Wang, Bovik, Sheikh and Simoncelli, "Image Quality Assessment: From Error Visibility to
    Structural Similarity", IEEE TIP 2004: local means, variances and covariance under a
    Gaussian window (``window`` pixels, ``sigma``), constants ``(0.01)^2`` and ``(0.03)^2``
    for a data range of 1, averaged over the positions where the window fits in the map.

    Returns:
        ``(N,)`` similarities, 1 for identical maps.
    """
    if first.shape != second.shape or first.dim() != 3:
        raise CamvizError(
            f"ssim takes two (N, H, W) maps of one shape, got {tuple(first.shape)} and "
            f"{tuple(second.shape)}"
        )
    if min(first.shape[-2:]) < window:
        raise CamvizError(f"maps of size {tuple(first.shape[-2:])} are smaller than the window")
    offsets = torch.arange(window, dtype=torch.float64, device=first.device) - (window - 1) / 2
    gaussian = torch.exp(-(offsets**2) / (2 * sigma**2))
    gaussian = gaussian / gaussian.sum()
    kernel = (gaussian[:, None] * gaussian[None, :]).view(1, 1, window, window)

    def local_mean(values: torch.Tensor) -> torch.Tensor:
        return F.conv2d(values, kernel)

    x, y = first.double().unsqueeze(1), second.double().unsqueeze(1)
    mean_x, mean_y = local_mean(x), local_mean(y)
    variance_x = local_mean(x * x) - mean_x**2
    variance_y = local_mean(y * y) - mean_y**2
    covariance = local_mean(x * y) - mean_x * mean_y
    c1, c2 = 0.01**2, 0.03**2
    similarity = ((2 * mean_x * mean_y + c1) * (2 * covariance + c2)) / (
        (mean_x**2 + mean_y**2 + c1) * (variance_x + variance_y + c2)
    )
    return similarity.mean(dim=(1, 2, 3)).float()


def _average_ranks(values: torch.Tensor) -> torch.Tensor:
    """``(N, P)`` ranks (0-based) of each row's values, ties sharing their mean rank."""
    rows, length = values.shape
    ordered, order = values.sort(dim=1, stable=True)
    starts_group = torch.ones_like(ordered, dtype=torch.bool)
    starts_group[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    # Number the groups of equal values across all rows at once.
    group = starts_group.flatten().cumsum(0).view(rows, length) - 1
    positions = torch.arange(length, device=values.device, dtype=values.dtype).expand(rows, -1)
    groups = int(group.max()) + 1
    first = torch.full((groups,), float(length), device=values.device, dtype=values.dtype)
    last = torch.zeros(groups, device=values.device, dtype=values.dtype)
    first.scatter_reduce_(0, group.flatten(), positions.flatten(), "amin")
    last.scatter_reduce_(0, group.flatten(), positions.flatten(), "amax")
    mean_rank = ((first + last) / 2)[group]
    return torch.empty_like(values).scatter_(1, order, mean_rank)


def _explainer(
    method: str | CamMethod | Explainer, layer: Layer | Sequence[Layer] | None
) -> tuple[Explainer, str]:
    if isinstance(method, (str, CamMethod)):
        from camviz.cams.registry import get

        name = get(method).name if isinstance(method, str) else method.name

        def explain_with_cam(
            model: nn.Module, inputs: torch.Tensor, target: Target
        ) -> torch.Tensor:
            heatmaps = explain(model, inputs, method, layer, target).heatmaps
            assert isinstance(heatmaps, torch.Tensor)  # a tensor in gives a tensor out
            return heatmaps

        return explain_with_cam, name
    if callable(method):
        return method, getattr(method, "__name__", type(method).__name__)
    raise CamvizError(f"method must be a CAM name, a CamMethod or a callable, not {method!r}")


def _fixed_target(target: Target, model: nn.Module, inputs: torch.Tensor) -> Target:
    """Top-1 and top-k as the trained model's class ids; any other target as it is."""
    chosen = as_target(target)
    if not chosen.picks_classes:
        return target
    with eval_mode(model), no_grad():
        output = model(inputs)
    ids = chosen.resolve(output, Context(batch_size=len(inputs))).class_ids
    return target if ids is None else ids.clone()


def _stages(
    model: nn.Module, inputs: torch.Tensor, stages: Sequence[str] | None
) -> dict[str, list[nn.Parameter]]:
    """``{stage name: its parameters}`` in the order to randomise them.

    The given layers with all their parameters; or one layer per stage (a module without
    submodules, or one parameter a parent uses itself), latest first use first.
    """
    if stages is not None:
        return {
            name: list(module.parameters())
            for name, module in resolve_layers(model, stages).items()
        }
    first_use = _first_use(model, inputs)
    positions: dict[str, int] = {}
    groups: dict[str, list[nn.Parameter]] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        is_layer = bool(module_name) and next(module.children(), None) is None
        for parameter_name, parameter in module.named_parameters(recurse=False):
            if id(parameter) not in first_use or id(parameter) in seen:
                continue  # unused in the forward pass, or shared and already placed
            seen.add(id(parameter))
            stage = module_name if is_layer else f"{module_name}.{parameter_name}".lstrip(".")
            groups.setdefault(stage, []).append(parameter)
            positions[stage] = min(
                positions.get(stage, first_use[id(parameter)]), first_use[id(parameter)]
            )
    return {stage: groups[stage] for stage in sorted(groups, key=lambda stage: -positions[stage])}


class _FirstUse(CallMode):
    """Numbers the watched tensors in the order torch calls first take them as arguments."""

    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched = watched
        self.order: dict[int, int] = {}

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for tensor in tensors_in((args, kwargs)):
            if id(tensor) in self.watched:
                self.order.setdefault(id(tensor), len(self.order))
        return func(*args, **kwargs)


def _first_use(model: nn.Module, inputs: torch.Tensor) -> dict[int, int]:
    """``{id(parameter): rank of its first use}`` in one forward pass of one sample."""
    recorder = _FirstUse({id(parameter) for parameter in model.parameters()})
    with eval_mode(model), no_grad(), recorder:
        model(inputs[:1])
    return recorder.order


@no_grad()
def _randomize(parameters: Sequence[nn.Parameter], generator: torch.Generator) -> None:
    """Replace each parameter by noise with the tensor's own mean and std.

    A constant tensor (a scalar, a layer scale still at its initial value) has no spread of
    its own; its noise takes ``|mean|`` as the spread, so that it still changes.
    """
    for parameter in parameters:
        mean = parameter.mean()
        std = parameter.std(correction=0) if parameter.numel() > 1 else torch.zeros_like(mean)
        spread = torch.where(std > 0, std, mean.abs())
        noise = torch.randn(
            parameter.shape, generator=generator, device=parameter.device, dtype=parameter.dtype
        )
        parameter.copy_(mean + spread * noise)
