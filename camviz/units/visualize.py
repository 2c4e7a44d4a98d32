"""Feature visualisation by optimisation: an image made to excite a unit.

:func:`visualize_unit` ascends the gradient of a unit's score (a :class:`~camviz.Unit`'s
channel, neuron or direction, or a class logit) with respect to an image, with the
regularisations of Olah, Mordvintsev & Schubert ("Feature Visualization", Distill 2017)
that make the picture readable rather than adversarial noise:

* **A decorrelated parameterisation.** The image is not optimised pixel by pixel but as a
  spectrum: ``x = sigmoid(M · irfft2(S * w))`` with ``w_f = 1 / max(|f|, 1 / size)``, so
  that every frequency starts with the energy natural images have at it (``1 / |f|``) and
  a step moves low frequencies as easily as high ones; ``M`` maps decorrelated colour
  channels to RGB (the square root of natural images' colour covariance, from the
  principal components of ImageNet's pixels that Krizhevsky et al. 2012 used for colour
  augmentation). Plain pixel ascent piles its energy into the highest frequencies, where
  the gradient is largest.
* **Transformation robustness.** Each step sees the image moved by up to 1/16 of its size,
  scaled by 0.95 to 1.05 and rotated by up to 5 degrees (one random draw per image and
  step), so that patterns the unit only answers at one exact pixel offset do not pay.
* **Diversity** (``diversity > 0``, a batch of several): the score minus ``diversity``
  times the mean cosine similarity of the images' Gram matrices at the unit's layer, so
  that the batch shows several things the unit answers to.

Everything random comes from one CPU generator seeded with ``seed``, so two runs on the CPU
give the same image bit for bit; on a GPU the backward passes of the convolutions and the
resampling add in an order of the hardware's choosing, so runs agree to float rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.inputs import model_device
from camviz.core.layers import default_target_layer
from camviz.core.modelstate import eval_mode, exclusive, no_grad
from camviz.core.precision import Precision, model_precision
from camviz.core.targets import as_logits
from camviz.core.targets.unit import Unit, as_units
from camviz.io.models import LoadedModel
from camviz.units.spots import outputs_at, spatial_view

__all__ = ["visualize_unit"]

# Principal components of ImageNet's RGB pixels (eigenvalues, eigenvectors as columns),
# as published with AlexNet's colour augmentation.
_EIGENVALUES = (0.2175, 0.0188, 0.0045)
_EIGENVECTORS = (
    (-0.5675, 0.7192, 0.4009),
    (-0.5808, -0.0045, -0.8140),
    (-0.5836, -0.6948, 0.4203),
)

# The random moves of each step: shift (fraction of the size), scale range, degrees.
_SHIFT = 1 / 16
_SCALE = 0.05
_DEGREES = 5.0

# The spectrum's starting spread: small, so the first image is a faint grey-ish blur.
_INITIAL_SPREAD = 0.01


def visualize_unit(
    model: nn.Module | LoadedModel,
    target: Unit | int,
    *,
    size: int = 128,
    steps: int = 256,
    lr: float = 0.05,
    batch: int = 1,
    diversity: float = 0.0,
    seed: int = 0,
    precision: Precision = "fp32",
    channels_last: bool = False,
) -> torch.Tensor:
    """Images that excite ``target``, found by gradient ascent (see the module docstring).

    Example:
        >>> loaded = camviz.load_model()
        >>> images = camviz.visualize_unit(loaded, camviz.Unit("blocks.5", channel=7))
        >>> camviz.save(images[0], "channel7.png")

    Args:
        model: A model from :func:`camviz.load_model` (its mean and std are applied to the
            image inside the optimisation) or any ``nn.Module`` (which then gets the image
            in ``[0, 1]`` as it is). Handed back as it came: no gradient is left in its
            parameters. Runs where the model is (move it to the GPU first).
        target: A :class:`~camviz.Unit` of one channel, one neuron or one direction, or a
            class id (its logit).
        size: Side of the square images, in pixels.
        steps: Optimisation steps (Adam).
        lr: Adam's learning rate on the spectrum.
        batch: How many images to make at once.
        diversity: Weight of the diversity term (``0``: none; needs ``batch >= 2``).
        seed: Seeds every random choice (the start and each step's moves).
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"`` autocast for the model's passes (the
            image, its spectrum and the score stay float32); see :func:`camviz.explain`.
        channels_last: Channels-last inputs for the model.

    Returns:
        ``(batch, 3, size, size)`` float32 images in ``[0, 1]``, on the CPU.

    Raises:
        CamvizError: A bad argument, a unit of several channels, or a unit that does not
            fit its layer.
    """
    _check(size, steps, lr, batch, diversity, target)
    generator = torch.Generator().manual_seed(seed)
    # Ordinary tensors and gradients also in a caller's inference mode (as camviz.explain).
    with torch.inference_mode(False), torch.enable_grad():
        network, mean, std = _network(model)
        device = model_device(network) or torch.device("cpu")
        image = _SpectralImage(batch, size, generator, device)
        optimizer = torch.optim.Adam([image.spectrum], lr=lr)
        objective = _Objective(network, target, size, diversity, device)
        with (
            exclusive(network),
            eval_mode(network),
            model_precision(network, precision, channels_last),
        ):
            for _ in range(steps):
                pixels = _moved(image.pixels(), generator)
                loss = -objective((pixels - mean.to(device)) / std.to(device))
                (gradient,) = torch.autograd.grad(loss, [image.spectrum])
                image.spectrum.grad = gradient
                optimizer.step()
        with no_grad():
            return image.pixels().detach().float().cpu()


def _network(model: nn.Module | LoadedModel) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The module, and the mean and std (``(1, 3, 1, 1)``) applied to its inputs."""
    if isinstance(model, LoadedModel):
        preprocess = model.preprocess
        mean = torch.tensor(getattr(preprocess, "mean", (0.0, 0.0, 0.0)))
        std = torch.tensor(getattr(preprocess, "std", (1.0, 1.0, 1.0)))
        return model.model, mean.view(1, 3, 1, 1), std.view(1, 3, 1, 1)
    if isinstance(model, nn.Module):
        return model, torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)
    raise CamvizError(
        f"model must be an nn.Module or a camviz.load_model() result, not {type(model).__name__}"
    )


def _check(size: int, steps: int, lr: float, batch: int, diversity: float, target: object) -> None:
    for name, value in (("size", size), ("steps", steps), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CamvizError(f"{name} must be a positive whole number, not {value!r}")
    if not lr > 0:
        raise CamvizError(f"lr must be positive, not {lr!r}")
    if not diversity >= 0:
        raise CamvizError(f"diversity must be 0 or more, not {diversity!r}")
    if diversity > 0 and batch < 2:
        raise CamvizError("diversity compares the images of a batch; give batch=2 or more")
    if isinstance(target, bool) or (isinstance(target, int) and target < 0):
        raise CamvizError(f"target must be a camviz.Unit or a class id, not {target!r}")
    if not isinstance(target, int):
        (unit,) = as_units(target, "target")
        if unit.ranks != 1:
            raise CamvizError(
                f"visualize_unit draws one unit at a time, and {unit.label} has "
                f"{unit.ranks} channels; call it for each of target.ranked()"
            )


class _SpectralImage:
    """Images held as decorrelated, 1/f-scaled spectra (the module docstring's ``S``)."""

    def __init__(
        self, batch: int, size: int, generator: torch.Generator, device: torch.device
    ) -> None:
        self.size = size
        start = torch.randn(batch, 3, size, size // 2 + 1, 2, generator=generator)
        self.spectrum = (start * _INITIAL_SPREAD).to(device).requires_grad_()
        rows = torch.fft.fftfreq(size).view(-1, 1)
        columns = torch.fft.rfftfreq(size).view(1, -1)
        frequency = torch.sqrt(rows**2 + columns**2).clamp(min=1.0 / size)
        self.weights = (1.0 / frequency).to(device)
        vectors = torch.tensor(_EIGENVECTORS) * torch.tensor(_EIGENVALUES).sqrt()
        self.colours = (vectors / vectors.norm(dim=0).max()).to(device)

    def pixels(self) -> torch.Tensor:
        """``(N, 3, size, size)`` in ``(0, 1)``."""
        spectrum = torch.view_as_complex(self.spectrum) * self.weights
        decorrelated = torch.fft.irfft2(spectrum, s=(self.size, self.size), norm="ortho")
        return torch.sigmoid(torch.einsum("rc,nchw->nrhw", self.colours, decorrelated))


def _moved(pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``pixels`` shifted, scaled and rotated at random (one draw per image)."""
    count = pixels.shape[0]
    draws = torch.rand(count, 4, generator=generator) * 2 - 1
    angle = draws[:, 0] * math.radians(_DEGREES)
    scale = 1 + draws[:, 1] * _SCALE
    shift = draws[:, 2:] * 2 * _SHIFT  # normalised coordinates span 2
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack(
        [torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1
    ).to(pixels.device, pixels.dtype)
    grid = F.affine_grid(theta, list(pixels.shape), align_corners=False)
    return F.grid_sample(pixels, grid, padding_mode="reflection", align_corners=False)


class _Objective:
    """The score to ascend, summed over the images, minus the diversity penalty."""

    def __init__(
        self,
        model: nn.Module,
        target: Unit | int,
        size: int,
        diversity: float,
        device: torch.device,
    ) -> None:
        self.model = model
        self.class_id = target if isinstance(target, int) else -1
        self.diversity = diversity
        self.unit = None if isinstance(target, int) else as_units(target)[0]
        self.spots: list[str] = [] if self.unit is None else [self.unit.layer]
        if diversity > 0 and not self.spots:  # a class: diversity at the default layer
            probe = torch.zeros(1, 3, size, size, device=device)
            self.spots = [default_target_layer(model, probe)]

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        tensors, output = outputs_at(self.model, inputs, self.spots, finish=self.unit is None)
        views = [spatial_view(self.model, spot, tensors[spot], inputs) for spot in self.spots]
        if self.unit is not None:
            value = self.unit.scores(views[0])[:, 0].sum()
        else:
            value = self._logits(output)[:, self.class_id].sum()
        if self.diversity > 0:
            value = value - self.diversity * _similarity(views[0].float()) * len(inputs)
        return value.float()

    def _logits(self, output: object) -> torch.Tensor:
        logits = as_logits(output)
        if logits.dim() != 2 or not 0 <= self.class_id < logits.shape[1]:
            raise CamvizError(
                f"class id {self.class_id} is out of range for the model's output of shape "
                f"{tuple(logits.shape)}"
            )
        return logits


def _similarity(spatial: torch.Tensor) -> torch.Tensor:
    """The mean cosine similarity of the images' ``C x C`` Gram matrices, over pairs."""
    flat = spatial.flatten(2)
    grams = F.normalize((flat @ flat.transpose(1, 2)).flatten(1), dim=1)
    similarity = grams @ grams.T
    count = len(grams)
    return (similarity.sum() - similarity.diagonal().sum()) / (count * (count - 1))
