"""The contract between the engine and a CAM method.

The engine (:mod:`camviz.cams.engine`) runs the model once, records the target layer's
activations and, if the method asks for them, the exact gradients of the explained score
with respect to those activations (:mod:`camviz.cams.recording`). A method only turns that
:class:`LayerData` into one raw map per sample; the engine applies ReLU, normalises and
upsamples (:mod:`camviz.cams.finishing`). What a method gives besides is declared by its
class (:class:`ChannelWeighted`, :class:`InputMapMethod`).

Activations are channels-first ``(N, C, *grid)`` with one to three grid axes (signals,
images, volumes), so methods reduce over :func:`grid_dims`, never over fixed axes.
Methods whose map is a weighted sum of channels, ``sum_k w_k A^k``, derive from
:class:`ChannelWeighted` and give the weights; the engine forms the map and reports the
weights (``Explanation.weights``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import nn

from camviz.cams.projection import first_principal_component
from camviz.core.errors import CamvizError
from camviz.core.inputs import run_model
from camviz.core.placement import Placement, Stretch
from camviz.core.taps import watching
from camviz.core.targets import SpotOutput

if TYPE_CHECKING:
    from camviz.core.attention import AttentionMaps
    from camviz.core.grids import Layout
    from camviz.core.inputs import Inputs, Key
    from camviz.core.targets import TargetObject


@dataclass
class LayerData:
    """What a method may use to compute the map of one layer for one target rank.

    Attributes:
        layer: The layer's name.
        activations: ``A``, the layer's output, ``(N, C, h, w)``.
        gradients: ``dy/dA`` for the explained score ``y`` of each sample, same shape, or
            ``None`` for methods that do not ask for gradients.
        model: The network (in eval mode while the method runs).
        inputs: The input batch, ``(N, 3, H, W)``.
        score_fn: Maps a model output to the ``(N,)`` explained scores.
        class_ids: The explained class of each sample, ``(N,)``, or ``None`` when the
            target is a callable.
        scores: The explained score of each sample in the unperturbed forward pass, ``(N,)``.
        layout: How the layer lays out its own output (:class:`camviz.core.grids.Layout`;
            ``activations`` is its ``(N, C, h, w)`` view), for methods that edit the layer.
        hessian_products: ``H A``, the Hessian of ``y`` with respect to ``A`` applied to ``A``
            (same shape), for methods that ask for it (``uses_hessian``); else ``None``.
        batch: The model's inputs, for methods that run the model again (:meth:`run`).
        placement: Where the layer's grid lies on the map input (a detector resizes and pads
            its images; :mod:`camviz.core.placement`); ``None``: it covers the whole input.
            Methods lay grid maps on the input with :meth:`on_input`, never by resizing.
        attention: Every block's attention probabilities from the same pass (and this rank's
            gradients with respect to them), for methods that ask for them (``attention``);
            else ``None``.
        target_spots: The layer spots the target reads its score from (a ``Unit``'s layer),
            which :meth:`run` records in every re-run.

    ``score_fn(output, samples)`` also scores perturbed batches: ``samples`` is the ``(R,)``
    index of the input each output row was made from (``None``: row ``n`` is input ``n``).
    A re-run's output is what :meth:`run` returns.
    """

    layer: str
    activations: torch.Tensor
    gradients: torch.Tensor | None
    model: nn.Module
    inputs: torch.Tensor
    score_fn: Callable[..., torch.Tensor]
    class_ids: torch.Tensor | None
    scores: torch.Tensor | None = None
    layout: Layout | None = None
    hessian_products: torch.Tensor | None = None
    batch: Inputs | None = None
    placement: Placement | None = None
    attention: AttentionMaps | None = None
    target_spots: tuple[str, ...] = ()

    def on_input(self, maps: torch.Tensor, samples: torch.Tensor | None = None) -> torch.Tensor:
        """``(R, *grid)`` maps at the layer's grid laid on the map input, ``(R, *spatial)``;
        row ``r`` belongs to sample ``samples[r]`` (``None``: to sample ``r``)."""
        placement = self.placement or Stretch(tuple(self.inputs.shape[2:]))
        return placement.lay(maps, samples)

    def run(self, inputs: torch.Tensor, rows: torch.Tensor | None = None) -> object:
        """The model's output with the map input replaced by ``inputs``, whose row ``r`` was
        made from sample ``rows[r]`` (the model's other inputs, if any, follow ``rows``).

        For a target that reads layer spots, a :class:`~camviz.core.targets.SpotOutput`: the
        spots are watched in this pass with the hooks the engine's pass uses
        (:func:`camviz.core.taps.watching`), inside any edit the caller makes (an ablation),
        so the score is the re-run's own.
        """
        return with_spots(self.model, self.target_spots, partial(self._run, inputs, rows))

    def _run(self, inputs: torch.Tensor, rows: torch.Tensor | None) -> object:
        if self.batch is None:
            return run_model(self.model, inputs)
        return self.batch.run(self.model, inputs, rows)

    @property
    def dy_da(self) -> torch.Tensor:
        """``gradients``, for a method that needs them (its ``uses_gradients`` is true)."""
        if self.gradients is None:
            raise CamvizError(
                f"no gradients were computed at layer {self.layer!r}; a method that reads "
                "them must set uses_gradients = True"
            )
        return self.gradients


def with_spots(model: nn.Module, spots: Sequence[str], run: Callable[[], Any]) -> Any:
    """``run()``, a pass of ``model``; with ``spots`` (those a target reads), a
    :class:`~camviz.core.targets.SpotOutput` of its output and what the pass handed on there,
    watched with the hooks of the engine's pass (:func:`camviz.core.taps.watching`)."""
    if not spots:
        return run()
    with watching(model, spots) as watches:
        output = run()
    return SpotOutput(output, {spot: watch.handed for spot, watch in watches.items() if watch.ran})


class CamMethod:
    """A CAM method. Subclasses set the class attributes and implement :meth:`layer_map`.

    Attributes:
        name: Registry name (``"gradcam"``).
        paper: Title, authors and year of the paper that defines it.
        needs: What it needs from the engine, for the docs table (``"gradients"``).
        uses_gradients: Whether the engine must compute ``dy/dA`` (wrappers of another
            method set it per instance).
        spatial_ranks: The input ranks the method is defined for (1: signals, 2: images,
            3: volumes and clips); the engine refuses the others in one line.
        uses_hessian: Whether the engine must also compute ``H A`` (second-order gradients
            through the layers after the target; wrappers set it per instance too).
        fuse: How the maps of several target layers combine when the method prescribes it
            (RefineCAM multiplies them); ``None`` leaves it to :func:`camviz.explain`.
        input_resolution: Whether its maps are at the input's resolution (the methods built
            on input gradients) rather than the target layer's.
        reduced_precision: Whether the model's passes may run under ``precision="bf16"``
            or ``"fp16"`` autocast; a method whose weights are small differences of
            scores sets it to ``False`` and always scores in float32.
        pixel_level: Whether its maps are per-pixel saliency (input gradients), drawn
            clipped at a high percentile (:data:`camviz.io.render.SALIENCY_PERCENTILE`).
        attention: What the pass records of every transformer block's attention
            (:mod:`camviz.core.attention`): ``None``, ``"probabilities"``, or
            ``"gradients"`` (also each rank's gradient with respect to them).
    """

    name: ClassVar[str]
    paper: ClassVar[str]
    needs: ClassVar[str] = "gradients"
    uses_gradients: bool = True
    uses_hessian: bool = False
    spatial_ranks: ClassVar[tuple[int, ...]] = (1, 2, 3)
    fuse: ClassVar[Literal["mean", "max", "product"] | None] = None
    input_resolution: ClassVar[bool] = False
    reduced_precision: ClassVar[bool] = True
    pixel_level: ClassVar[bool] = False
    attention: Literal["probabilities", "gradients"] | None = None

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        """Whether the method can explain ``model`` (LeGrad needs a vision transformer)."""
        return True

    def default_layer(self, model: nn.Module, batch: Inputs) -> str | None:
        """The layer explained when none is named; ``None``: camviz's default layer
        (:func:`camviz.core.layers.default_target_layer`). The attention methods take the
        last transformer block."""
        return None

    def explained_target(self, target: TargetObject) -> TargetObject:
        """The target the engine explains when the caller asks for ``target``.

        The identity; Finer-CAM turns it into a contrast with the nearest classes.
        """
        return target

    def layer_map(self, data: LayerData) -> torch.Tensor:
        """The raw ``(N, h, w)`` map, before ReLU and normalisation."""
        raise NotImplementedError

    def rank_maps(self, ranks: Sequence[LayerData]) -> list[torch.Tensor]:
        """The raw map of every target rank of one layer (top-k: one :class:`LayerData` each).

        Methods whose cost is in forward passes override this to score every rank from the
        same perturbed outputs; the others compute rank by rank.
        """
        return [self.layer_map(data) for data in ranks]


class InputMapMethod(CamMethod):
    """A method that gives a map on every input with spatial axes (the methods built on
    input gradients); the engine reports them in ``Explanation.maps_by_input``, and the map
    input's is the method's map."""

    def input_maps(self, data: LayerData) -> dict[Key, torch.Tensor]:
        """``{input position or name: (N, *spatial) map}`` for every spatial input."""
        raise NotImplementedError


class ChannelMapMethod(CamMethod):
    """A method whose map adds up per-channel terms, ``L = sum_k W^k (*) A^k``.

    Subclasses implement :meth:`weighted_activations`, the ``(N, C, h, w)`` terms
    ``W^k (*) A^k`` (a weight per channel broadcast over the grid, or one per location).

    Args:
        eigen_smooth: Replace the channel sum by the first principal component of the terms
            (each location an observation, each channel a variable, centred), as
            pytorch-grad-cam's ``eigen_smooth``: it keeps the dominant pattern and drops
            the noise that single channels add. The sign is chosen to correlate with the
            channel sum (pytorch-grad-cam keeps the SVD's arbitrary sign). Off by default:
            the methods' papers define the sum.
    """

    def __init__(self, *, eigen_smooth: bool = False) -> None:
        if not isinstance(eigen_smooth, bool):
            raise CamvizError(f"{self.name} needs eigen_smooth=True or False, not {eigen_smooth!r}")
        self.eigen_smooth = eigen_smooth

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        """The ``(N, C, h, w)`` terms ``W^k (*) A^k`` whose channel sum is the raw map."""
        raise NotImplementedError

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return self.combine(self.weighted_activations(data))

    def combine(self, weighted: torch.Tensor) -> torch.Tensor:
        """The ``(N, h, w)`` map of the terms: their channel sum, or with ``eigen_smooth``
        their first principal component."""
        if self.eigen_smooth:
            return first_principal_component(weighted)
        return weighted.sum(dim=1)


def grid_dims(tensor: torch.Tensor) -> tuple[int, ...]:
    """The grid axes of an ``(N, C, *grid)`` tensor: ``(2,)``, ``(2, 3)`` or ``(2, 3, 4)``."""
    return tuple(range(2, tensor.dim()))


class ChannelWeighted(ChannelMapMethod):
    """A method whose map is a weighted sum of the layer's channels, ``sum_k w_k A^k``.

    Subclasses implement :meth:`channel_weights` (or :meth:`rank_weights`, to share work
    between the ranks of a top-k target); the terms ``w_k A^k`` are combined as every
    :class:`ChannelMapMethod`'s (summed, or with ``eigen_smooth`` their first principal
    component), and the engine reports the weights.
    """

    def channel_weights(self, data: LayerData) -> torch.Tensor:
        """The ``(N, C)`` weights ``w_k`` of each sample."""
        raise NotImplementedError

    def rank_weights(self, ranks: Sequence[LayerData]) -> list[torch.Tensor]:
        """The ``(N, C)`` weights of every target rank of one layer."""
        return [self.channel_weights(data) for data in ranks]

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        return self.terms(self.channel_weights(data), data.activations)

    def rank_maps(self, ranks: Sequence[LayerData]) -> list[torch.Tensor]:
        weights = self.rank_weights(ranks)
        return [
            self.combine(self.terms(w, d.activations)) for w, d in zip(weights, ranks, strict=True)
        ]

    @staticmethod
    def terms(weights: torch.Tensor, activations: torch.Tensor) -> torch.Tensor:
        """``w_k A^k`` for ``(N, C)`` weights: ``(N, C, *grid)``."""
        return weights.view(*weights.shape, *[1] * (activations.dim() - 2)) * activations
