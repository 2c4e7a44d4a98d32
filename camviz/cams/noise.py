"""Gaussian noise drawn per sample, for the methods that average over noisy copies.

Each sample of a batch draws from its own generator, and every generator starts from the
same seed. A sample therefore gets the same noise, and so the same map, whether it is
explained alone or at any position in a batch of any size (a list of images of different
sizes too: each image's noise is drawn at its own size). Noise is drawn in float32 and then
cast, so a float64 or bfloat16 model gets the noise of its float32 twin (a float64 draw is
another sequence of numbers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from camviz.core.inputs import corner


class SampleNoise:
    """One seeded generator per sample of a batch.

    Args:
        batch: Number of samples.
        seed: Seed of every sample's generator; ``None`` draws one seed from torch's global
            generator (so ``torch.manual_seed`` makes the maps reproducible).
        device: Where the noise is drawn.
    """

    def __init__(self, batch: int, seed: int | None, device: torch.device) -> None:
        if seed is None:
            seed = int(torch.randint(2**62, ()))
        self.device = device
        self.generators = [torch.Generator(device).manual_seed(seed) for _ in range(batch)]

    def draw(
        self,
        samples: torch.Tensor,
        shape: torch.Size,
        dtype: torch.dtype,
        sizes: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """``(R, *shape)`` standard normal noise in ``dtype``; row ``r`` is the next draw of sample
        ``samples[r]``'s generator (rows of one sample are drawn in order).

        ``sizes``: for a list of images in a zero-padded batch, each sample's spatial size;
        its noise is drawn at that size (as if it were alone) and zero-padded to ``shape``.
        """
        rows = []
        for sample in samples.tolist():
            own = shape if sizes is None else (*shape[: -len(sizes[sample])], *sizes[sample])
            noise = torch.randn(
                own, generator=self.generators[sample], device=self.device, dtype=torch.float32
            ).to(dtype)
            if tuple(own) != tuple(shape):
                padded = noise.new_zeros(shape)
                corner(padded, own).copy_(noise)
                noise = padded
            rows.append(noise)
        return torch.stack(rows)
