"""Faithfulness: does the model's score follow the map?

A heatmap claims "these pixels are the evidence". Each measurement here takes that claim
literally and changes the pixels the map ranks highest, then watches the explained score:

* :func:`deletion` and :func:`insertion` (RISE, Petsiuk, Das and Saenko, BMVC 2018): pixels,
  most important first, are removed to a baseline (deletion) or revealed on a blurred canvas
  (insertion), and the score after each step forms a curve. A faithful map makes the deletion
  curve fall fast (low AUC) and the insertion curve rise fast (high AUC).
* :func:`confidence` (Grad-CAM++, Chattopadhay et al., WACV 2018): the image multiplied by
  its map is scored; *average drop* is the mean relative fall of the score (lower is better),
  *increase in confidence* how often the score rose; :func:`win_rate` says which of several
  methods loses the least.
* :func:`road` (Remove And Debias, Rong, Leemann, Borisov, Kasneci and Kasneci, ICML 2022):
  a share of the pixels, most relevant first (MoRF) or least relevant first (LeRF), is
  removed and filled in by :func:`impute_linear`, a noisy linear interpolation of the
  neighbours. The fill carries no trace of the removed pixels' values or of the mask's
  shape, so the score reflects the information removed, not the artefact of removing it.

Every function takes a batch: ``inputs`` ``(N, C, H, W)`` as the model takes them, one map
per input (``(N, H, W)`` at any resolution, upsampled bilinearly) and one target per input
(a class id, one id per input, ``None`` for each input's top-1 class, or anything
:mod:`camviz.core.targets` accepts that gives one score per input). For the maps of a top-k
:class:`~camviz.Explanation`, pass ``inputs[result.samples]`` and ``target=result.targets``.

Scores are softmax probabilities of the target class by default, as in both papers;
``score="logit"`` uses the raw score instead (and allows a callable target). The perturbed
images are built on the model's device and scored in batches of ``batch_size`` under
``torch.no_grad()`` (never ``torch.inference_mode()``: see
:func:`camviz.core.modelstate.no_grad`), with every module in eval mode; the model comes
back as it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeAlias

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn
from torchvision.transforms.v2 import functional as TF  # noqa: N812 - the conventional name

from camviz.cams.base import with_spots
from camviz.core.errors import CamvizError
from camviz.core.inputs import as_batch, as_inputs
from camviz.core.maps import upsample
from camviz.core.modelstate import eval_mode, no_grad
from camviz.core.targets import Context, Target, as_logits, as_target, spots_of

__all__ = [
    "ROAD_FRACTIONS",
    "Baseline",
    "Confidence",
    "Curve",
    "Order",
    "Score",
    "auc",
    "confidence",
    "deletion",
    "impute_linear",
    "insertion",
    "road",
    "win_rate",
]

Score = Literal["probability", "logit"]
Baseline: TypeAlias = float | torch.Tensor | Literal["blur", "mean"]
Order = Literal["morf", "lerf"]

#: ROAD's removal shares, as in the paper's figures.
ROAD_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

# Noisy linear imputation: each removed pixel is the weighted mean of its 8 neighbours, the
# 4 direct ones weighing twice as much as the diagonal ones (Rong et al. 2022, Sec. 4).
_NEIGHBOUR_WEIGHTS = (
    (1 / 12, 1 / 6, 1 / 12),
    (1 / 6, 0.0, 1 / 6),
    (1 / 12, 1 / 6, 1 / 12),
)


@dataclass
class Curve:
    """The explained score of each input as more and more pixels are changed.

    Attributes:
        fractions: ``(S,)`` share of the pixels changed at each point, from 0 to 1.
        scores: ``(N, S)`` score of each input at each point.
    """

    fractions: torch.Tensor
    scores: torch.Tensor

    @property
    def auc(self) -> torch.Tensor:
        """``(N,)`` area under each input's curve (trapezoid rule over :attr:`fractions`)."""
        return auc(self.scores, self.fractions)


@dataclass
class Confidence:
    """Scores of the whole image and of the image multiplied by its map (Grad-CAM++, Sec. 6).

    Attributes:
        original: ``(N,)`` score ``Y`` of each input.
        explained: ``(N,)`` score ``O`` of each input multiplied by its map.
    """

    original: torch.Tensor
    explained: torch.Tensor

    @property
    def drop(self) -> torch.Tensor:
        """``(N,)`` relative fall ``max(0, Y - O) / Y`` of each input (0 where ``Y`` is 0)."""
        fall = torch.relu(self.original - self.explained)
        return torch.where(self.original > 0, fall / self.original, 0.0)

    @property
    def average_drop(self) -> float:
        """Average drop, in percent: the mean of :attr:`drop` times 100 (lower is better)."""
        return float(self.drop.mean()) * 100

    @property
    def increase_in_confidence(self) -> float:
        """Increase in confidence, in percent: how often ``O > Y`` (higher is better)."""
        return float((self.explained > self.original).float().mean()) * 100


def auc(scores: torch.Tensor, fractions: torch.Tensor | None = None) -> torch.Tensor:
    """Area under curves by the trapezoid rule.

    Args:
        scores: ``(..., S)`` curve values.
        fractions: ``(S,)`` x positions; ``None`` spaces the ``S`` points evenly over
            ``[0, 1]``.

    Returns:
        ``(...)`` areas.
    """
    if scores.shape[-1] < 2:
        raise CamvizError(f"a curve needs at least 2 points for an area, got {scores.shape[-1]}")
    if fractions is None:
        fractions = torch.linspace(0, 1, scores.shape[-1], device=scores.device)
    return torch.trapezoid(scores, fractions.to(scores), dim=-1)


def deletion(
    model: nn.Module,
    inputs: torch.Tensor,
    heatmaps: torch.Tensor,
    target: Target = None,
    *,
    steps: int = 50,
    baseline: Baseline = 0.0,
    blur_kernel: int = 11,
    blur_sigma: float = 5.0,
    batch_size: int = 32,
    score: Score = "probability",
    output_key: str | int | None = None,
) -> Curve:
    """The deletion curve: pixels, most important first, set to the baseline step by step.

    After step ``k`` of ``steps`` the ``floor(k * P / steps)`` pixels the map ranks highest
    (of ``P``, all channels together) hold the baseline's values; ties in the map are taken
    in raster order. A faithful map gives a low area under the curve.

    Args:
        model: The classifier; used in eval mode and handed back as it came.
        inputs: ``(N, C, H, W)`` batch as the model takes it (moved to its device).
        heatmaps: ``(N, h, w)`` maps, one per input, upsampled to ``(H, W)`` if needed.
        target: What to score (see the module docstring); ``None`` for each input's top-1.
        steps: Number of steps; the curve has ``steps + 1`` points.
        baseline: What removed pixels become: a number (in the model's input space: ``0``
            is the dataset's mean colour for normalised inputs, as in RISE), ``"blur"``
            (the input blurred), ``"mean"`` (each image's mean colour), or a tensor that
            broadcasts to ``inputs``.
        blur_kernel: Gaussian kernel size for ``baseline="blur"`` (odd).
        blur_sigma: Gaussian standard deviation for ``baseline="blur"``, in pixels.
        batch_size: How many perturbed images go through the model at once.
        score: ``"probability"`` (softmax of the target class) or ``"logit"``.
        output_key: Where the scores are in a tuple or dict output.

    Returns:
        The :class:`Curve`; its ``auc`` is the deletion AUC.
    """
    context = _Context.of(model, inputs, heatmaps, target, score, output_key, batch_size)
    removed = _canvas(context.inputs, baseline, blur_kernel, blur_sigma)
    return context.curve(start=context.inputs, end=removed, steps=steps)


def insertion(
    model: nn.Module,
    inputs: torch.Tensor,
    heatmaps: torch.Tensor,
    target: Target = None,
    *,
    steps: int = 50,
    baseline: Baseline = "blur",
    blur_kernel: int = 11,
    blur_sigma: float = 5.0,
    batch_size: int = 32,
    score: Score = "probability",
    output_key: str | int | None = None,
) -> Curve:
    """The insertion curve: pixels, most important first, revealed on a canvas step by step.

    The mirror of :func:`deletion`: the image starts as the canvas (by default the input
    blurred, so that the model sees no sharp edges that are not in the image) and after step
    ``k`` the ``floor(k * P / steps)`` pixels the map ranks highest hold the input's values.
    A faithful map gives a high area under the curve.

    Args are those of :func:`deletion`; ``baseline`` is the canvas the pixels are revealed on.

    Returns:
        The :class:`Curve`; its ``auc`` is the insertion AUC.
    """
    context = _Context.of(model, inputs, heatmaps, target, score, output_key, batch_size)
    canvas = _canvas(context.inputs, baseline, blur_kernel, blur_sigma)
    return context.curve(start=canvas, end=context.inputs, steps=steps)


def confidence(
    model: nn.Module,
    inputs: torch.Tensor,
    heatmaps: torch.Tensor,
    target: Target = None,
    *,
    batch_size: int = 32,
    score: Score = "probability",
    output_key: str | int | None = None,
) -> Confidence:
    """Score each input and the input multiplied by its map (Grad-CAM++'s explanation map).

    The product ``map * input`` is taken in the model's input space: unimportant pixels fade
    to 0, the mean colour for normalised inputs. Read :attr:`Confidence.average_drop` and
    :attr:`Confidence.increase_in_confidence`; compare methods with :func:`win_rate`.

    Args are those of :func:`deletion`.
    """
    context = _Context.of(model, inputs, heatmaps, target, score, output_key, batch_size)
    samples = torch.arange(len(context.inputs), device=context.inputs.device)
    explained = context.scores(
        lambda rows: context.inputs[rows] * context.maps[rows, None], samples
    )
    return Confidence(original=context.original, explained=explained)


def win_rate(drops: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """How often, in percent, each method's map loses the least confidence.

    Grad-CAM++ compares two methods: method A wins an image when the fall in confidence for
    A's explanation map is lower than for B's. With more methods, a method wins an image
    when its fall is the lowest of all; methods tied for the lowest share that image equally,
    so the rates add up to 100.

    Args:
        drops: Method name -> ``(N,)`` relative falls (:attr:`Confidence.drop`) on the same
            ``N`` images.

    Returns:
        Method name -> win rate in percent.
    """
    if not drops:
        raise CamvizError("win_rate needs the drops of at least one method")
    shapes = {tuple(drop.shape) for drop in drops.values()}
    if len(shapes) != 1:
        raise CamvizError(f"every method needs a drop for the same images; got shapes {shapes}")
    stacked = torch.stack([drop.float() for drop in drops.values()])
    lowest = stacked == stacked.amin(dim=0, keepdim=True)
    shares = lowest / lowest.sum(dim=0, keepdim=True)
    return {name: float(rate) * 100 for name, rate in zip(drops, shares.mean(dim=1), strict=True)}


def road(
    model: nn.Module,
    inputs: torch.Tensor,
    heatmaps: torch.Tensor,
    target: Target = None,
    *,
    order: Order = "morf",
    fractions: Sequence[float] = ROAD_FRACTIONS,
    noise: float = 0.01,
    seed: int = 0,
    batch_size: int = 32,
    score: Score = "probability",
    output_key: str | int | None = None,
) -> Curve:
    """ROAD: remove a share of the pixels and fill them by noisy linear imputation.

    Args:
        model, inputs, heatmaps, target, batch_size, score, output_key: As in
            :func:`deletion`.
        order: ``"morf"`` removes the most relevant pixels first (a faithful map makes the
            score fall fast); ``"lerf"`` the least relevant first (the score should hold).
        fractions: Shares of the pixels removed, one curve point each, in ``[0, 1)``.
        noise: Standard deviation of the Gaussian noise added to the imputed values, in the
            model's input space.
        seed: Seeds that noise, so that a measurement can be repeated exactly.

    Returns:
        The :class:`Curve` over ``fractions``.
    """
    if order not in ("morf", "lerf"):
        raise CamvizError(f"order must be 'morf' or 'lerf', not {order!r}")
    shares = torch.as_tensor(list(fractions), dtype=torch.float64)
    if shares.dim() != 1 or not len(shares) or bool(((shares < 0) | (shares >= 1)).any()):
        raise CamvizError(f"fractions must be shares of the pixels in [0, 1), got {fractions}")
    context = _Context.of(model, inputs, heatmaps, target, score, output_key, batch_size)
    device = context.inputs.device
    pixels = context.ranks.shape[1]
    counts = (shares * pixels).floor().long().to(device)
    generator = torch.Generator(device=device).manual_seed(seed)

    def imputed(rows: torch.Tensor) -> torch.Tensor:
        samples, points = rows // len(counts), rows % len(counts)
        ranks = context.ranks[samples]
        if order == "lerf":
            ranks = pixels - 1 - ranks
        removed = (ranks < counts[points, None]).view(-1, *context.inputs.shape[-2:])
        return impute_linear(context.inputs[samples], removed, noise=noise, generator=generator)

    rows = torch.arange(len(context.inputs) * len(counts), device=device)
    scores = context.scores(imputed, rows // len(counts))
    return Curve(fractions=shares.float().to(device), scores=scores.view(-1, len(counts)))


def impute_linear(
    images: torch.Tensor,
    removed: torch.Tensor,
    *,
    noise: float = 0.01,
    generator: torch.Generator | None = None,
    tolerance: float = 1e-4,
    max_iterations: int = 2000,
) -> torch.Tensor:
    """Fill removed pixels with the weighted mean of their neighbours, plus noise (ROAD).

    Each removed pixel ``i`` is set so that ``x_i = sum_j w_ij x_j / sum_j w_ij`` over its
    neighbours ``j`` inside the image (weight 1/6 for the 4 direct, 1/12 for the 4
    diagonal ones), removed neighbours included: one sparse linear system for all removed
    pixels of an image, per channel. The system is symmetric positive definite, and is
    solved here by conjugate gradients with a diagonal preconditioner, all images and
    channels at once on their device (one 3x3 convolution per iteration). A removed region
    that touches no kept pixel is filled with 0. Noise ``N(0, noise^2)`` is added to the
    filled pixels, so that a model cannot tell them by their smoothness.

    Args:
        images: ``(B, C, H, W)`` images.
        removed: ``(B, H, W)`` boolean, True where a pixel is removed.
        noise: Standard deviation of the added noise.
        generator: Random generator for the noise (on the images' device).
        tolerance: Stop when every system's residual is below this share of its right-hand
            side.
        max_iterations: Most conjugate-gradient iterations; a warning says if they ran out.

    Returns:
        ``(B, C, H, W)`` images, kept pixels unchanged.
    """
    if removed.shape != images.shape[:1] + images.shape[2:]:
        raise CamvizError(
            f"removed must be (B, H, W) = {(images.shape[0], *images.shape[2:])}, got "
            f"{tuple(removed.shape)}"
        )
    channels = images.shape[1]
    weights = torch.tensor(_NEIGHBOUR_WEIGHTS, dtype=images.dtype, device=images.device)
    kernel = weights.expand(channels, 1, 3, 3)
    unknown = removed.unsqueeze(1).to(images.dtype)
    # The weight of the neighbours inside the image: 1 inside, less along the border.
    degree = F.conv2d(torch.ones_like(images[:1, :1]), weights.view(1, 1, 3, 3), padding=1)

    def neighbour_sum(values: torch.Tensor) -> torch.Tensor:
        return F.conv2d(values, kernel, padding=1, groups=channels)

    def system(values: torch.Tensor) -> torch.Tensor:
        return unknown * (degree * values - neighbour_sum(unknown * values))

    right_hand_side = unknown * neighbour_sum((1 - unknown) * images)
    solution = _conjugate_gradients(
        system, right_hand_side, unknown / degree, tolerance, max_iterations
    )
    if noise:
        solution = solution + noise * torch.randn(
            solution.shape, generator=generator, device=images.device, dtype=images.dtype
        )
    return torch.where(unknown.bool(), solution, images)


def _conjugate_gradients(
    system: Callable[[torch.Tensor], torch.Tensor],
    right_hand_side: torch.Tensor,
    inverse_diagonal: torch.Tensor,
    tolerance: float,
    max_iterations: int,
) -> torch.Tensor:
    """Solve ``system(x) = b`` for each ``(h, w)`` plane of ``b``, preconditioned by a diagonal."""

    def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(dim=(2, 3), keepdim=True)

    def ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        # A plane with nothing left to solve has a zero denominator: its step is 0.
        return torch.where(denominator > 0, numerator / denominator.clamp_min(1e-30), 0.0)

    solution = torch.zeros_like(right_hand_side)
    residual = right_hand_side.clone()
    preconditioned = inverse_diagonal * residual
    direction = preconditioned.clone()
    alignment = dot(residual, preconditioned)
    goal = tolerance * right_hand_side.flatten(2).norm(dim=2)
    for _ in range(max_iterations):
        # One device sync per iteration, not per image: all planes stop together.
        if bool((residual.flatten(2).norm(dim=2) <= goal).all()):
            return solution
        image = system(direction)
        step = ratio(alignment, dot(direction, image))
        solution += step * direction
        residual -= step * image
        preconditioned = inverse_diagonal * residual
        new_alignment = dot(residual, preconditioned)
        direction = preconditioned + ratio(new_alignment, alignment) * direction
        alignment = new_alignment
    warnings.warn(
        f"linear imputation did not converge in {max_iterations} iterations; the filled "
        "pixels are approximate (raise max_iterations or tolerance)",
        stacklevel=4,
    )
    return solution


def _canvas(
    inputs: torch.Tensor, baseline: Baseline, blur_kernel: int, blur_sigma: float
) -> torch.Tensor:
    """The image that changed pixels take their values from, shaped like ``inputs``."""
    if isinstance(baseline, str):
        if baseline == "blur":
            if blur_kernel < 1 or blur_kernel % 2 == 0 or blur_sigma <= 0:
                raise CamvizError(
                    f"blur needs an odd blur_kernel >= 1 and blur_sigma > 0, got "
                    f"{blur_kernel} and {blur_sigma}"
                )
            # Reflection padding needs the kernel's half-width below the image's side.
            kernel = min(blur_kernel, 2 * min(inputs.shape[-2:]) - 1)
            return TF.gaussian_blur(inputs, [kernel, kernel], [blur_sigma, blur_sigma])
        if baseline == "mean":
            return inputs.mean(dim=(2, 3), keepdim=True).expand_as(inputs)
        raise CamvizError(
            f"unknown baseline {baseline!r}; use a number, 'blur', 'mean' or a tensor"
        )
    if isinstance(baseline, (int, float)) and not isinstance(baseline, bool):
        return torch.full_like(inputs, float(baseline))
    if isinstance(baseline, torch.Tensor):
        try:
            return baseline.to(inputs).expand_as(inputs)
        except RuntimeError:
            raise CamvizError(
                f"a baseline tensor of shape {tuple(baseline.shape)} does not broadcast to the "
                f"inputs' {tuple(inputs.shape)}"
            ) from None
    raise CamvizError(f"unknown baseline {baseline!r}; use a number, 'blur', 'mean' or a tensor")


@dataclass
class _Context:
    """What every measurement shares: the checked batch, the maps, their pixel order, a scorer.

    Attributes:
        model: The model (callers enter eval mode through :meth:`scores`).
        inputs: ``(N, C, H, W)`` on the model's device.
        maps: ``(N, H, W)`` maps at the inputs' size.
        ranks: ``(N, H * W)`` position of each pixel when ordered by the map, highest first.
        original: ``(N,)`` score of each unperturbed input.
        score_of: ``(output, samples) -> (R,)`` scores of a batch of perturbed images.
        batch_size: Images per forward pass.
    """

    model: nn.Module
    inputs: torch.Tensor
    maps: torch.Tensor
    ranks: torch.Tensor
    original: torch.Tensor
    score_of: Callable[[Any, torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor], Any]
    batch_size: int

    @classmethod
    def of(
        cls,
        model: nn.Module,
        inputs: torch.Tensor,
        heatmaps: torch.Tensor,
        target: Target,
        score: Score,
        output_key: str | int | None,
        batch_size: int,
    ) -> _Context:
        if score not in ("probability", "logit"):
            raise CamvizError(f"score must be 'probability' or 'logit', not {score!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise CamvizError(f"batch_size must be a positive integer, not {batch_size!r}")
        inputs = as_batch(inputs, model)
        maps = _checked_maps(heatmaps, inputs)
        order = torch.argsort(maps.flatten(1), dim=1, descending=True, stable=True)
        ranks = torch.empty_like(order)
        positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
        ranks.scatter_(1, order, positions)
        # A target that reads layer spots (a Unit) is scored on what every pass handed on there.
        chosen = as_target(target).prepare(model, as_inputs(inputs, model))
        run = partial(_recorded_pass, model, chosen.spots)
        with eval_mode(model), no_grad():
            output = run(inputs)
        resolved = chosen.resolve(output, Context(output_key, spots_of(output), len(inputs)))
        fns, ids = list(resolved.scores), resolved.class_ids
        if len(fns) != 1:
            raise CamvizError(
                f"the metrics score one target per input, but the target gives {len(fns)}; for "
                "top-k maps pass inputs[result.samples] and target=result.targets"
            )
        if score == "probability" and ids is None:
            raise CamvizError(
                f"a {type(chosen).__name__} target scores no class, so it has no class "
                "probability; pass score='logit' to use its raw score"
            )
        score_fn = fns[0]

        def score_of(model_output: Any, samples: torch.Tensor) -> torch.Tensor:
            if score == "logit":
                return score_fn(model_output, samples)
            logits = as_logits(model_output, output_key)
            return score_fn(logits.softmax(dim=1), samples)

        samples = torch.arange(len(inputs), device=inputs.device)
        original = score_of(output, samples)
        return cls(model, inputs, maps, ranks, original, score_of, run, batch_size)

    def scores(
        self, images: Callable[[torch.Tensor], torch.Tensor], samples: torch.Tensor
    ) -> torch.Tensor:
        """Score ``images(rows)`` for all rows in batches; row ``r`` is made from input
        ``samples[r]``."""
        rows = torch.arange(len(samples), device=samples.device)
        scores = []
        with eval_mode(self.model), no_grad():
            for batch in rows.split(self.batch_size):
                scores.append(self.score_of(self.run(images(batch)), samples[batch]))
        return torch.cat(scores)

    def curve(self, start: torch.Tensor, end: torch.Tensor, steps: int) -> Curve:
        """Scores as pixels switch from ``start`` to ``end`` in the map's order, ``steps`` steps."""
        if not isinstance(steps, int) or steps < 1:
            raise CamvizError(f"steps must be a positive integer, not {steps!r}")
        pixels = self.ranks.shape[1]
        points = torch.arange(steps + 1, device=self.inputs.device)
        counts = points * pixels // steps

        def step_images(rows: torch.Tensor) -> torch.Tensor:
            samples, steps_done = rows // len(points), rows % len(points)
            changed = self.ranks[samples] < counts[steps_done, None]
            changed = changed.view(-1, 1, *self.inputs.shape[-2:])
            return torch.where(changed, end[samples], start[samples])

        rows = torch.arange(len(self.inputs) * len(points), device=self.inputs.device)
        scores = self.scores(step_images, rows // len(points))
        return Curve(fractions=counts.float() / pixels, scores=scores.view(-1, len(points)))


def _recorded_pass(model: nn.Module, spots: Sequence[str], inputs: torch.Tensor) -> Any:
    """The model's output for ``inputs``, with what it handed on at ``spots``."""
    return with_spots(model, spots, lambda: model(inputs))


def _checked_maps(heatmaps: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    if not isinstance(heatmaps, torch.Tensor):
        raise CamvizError(f"heatmaps must be a tensor, not {type(heatmaps).__name__}")
    maps = heatmaps.detach().to(inputs.device, inputs.dtype)
    if maps.dim() == 2:
        maps = maps.unsqueeze(0)
    if maps.dim() != 3 or maps.shape[0] != inputs.shape[0]:
        raise CamvizError(
            f"heatmaps must be (N, h, w) with one map per input (N = {inputs.shape[0]}), got "
            f"{tuple(heatmaps.shape)}"
        )
    if not bool(torch.isfinite(maps).all()):
        raise CamvizError("the heatmaps hold NaN or infinite values; check the explanation")
    return upsample(maps, inputs.shape[-2:])
