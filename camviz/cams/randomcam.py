"""A random baseline: activations weighted by seeded random channel weights."""

from __future__ import annotations

import torch

from camviz.cams.base import ChannelMapMethod, ChannelWeighted, LayerData
from camviz.cams.registry import register
from camviz.core.errors import CamvizError


@register
class RandomCAM(ChannelMapMethod):
    """A random baseline, for metrics and sanity checks: what a map without information scores.

    No paper: pytorch-grad-cam's ``RandomCAM``. Uniform random weights per channel::

        w_k ~ U(-1, 1)
        L   = ReLU( sum_k w_k A^k )

    The map keeps the layer's spatial structure (it is a mix of its channels) but no
    relation to the class. The weights of each sample are drawn from a generator of its own
    seeded with ``seed``, so a batch gives the same maps as its samples explained one by one,
    and a run the same maps as the last (on the same device type); every sample, and every
    rank of a top-k target, gets the same ``C`` weights. They are drawn in float32 and then
    cast, so a float64 model gets the weights of its float32 twin. pytorch-grad-cam draws
    from numpy's global generator.

    Args:
        seed: The seed (default 0, so that baselines are reproducible); ``None`` draws from
            torch's global generator instead.
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "random"
    paper = "No paper; a baseline with uniform random channel weights, as pytorch-grad-cam's"
    needs = "activations"
    uses_gradients = False

    def __init__(self, seed: int | None = 0, *, eigen_smooth: bool = False) -> None:
        super().__init__(eigen_smooth=eigen_smooth)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise CamvizError(f"random needs seed to be an int or None, not {seed!r}")
        self.seed = seed

    def weighted_activations(self, data: LayerData) -> torch.Tensor:
        activations = data.activations
        batch, channels = activations.shape[:2]
        device = activations.device
        # Drawn in float32 whatever the activations' dtype: a float64 draw is another
        # sequence, so the same seed would give other weights.
        if self.seed is None:
            uniform = torch.rand(batch, channels, device=device, dtype=torch.float32)
        else:
            # Each sample's generator would start from the same seed: one draw serves all.
            generator = torch.Generator(device).manual_seed(self.seed)
            uniform = torch.rand(channels, generator=generator, device=device, dtype=torch.float32)
            uniform = uniform.expand(batch, -1)
        weights = (2 * uniform - 1).to(activations.dtype)  # in [-1, 1)
        return ChannelWeighted.terms(weights, activations)
