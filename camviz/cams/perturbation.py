"""What the perturbation methods (Score-CAM, SS-CAM, Ablation-CAM) share.

They weigh channels by how the explained score changes when the network runs on perturbed
copies of a sample. The copies are scored in chunks of at most ``batch_size`` rows, so memory
stays bounded whatever the number of channels, and every rank of a top-k target is scored
from the same outputs: one perturbed forward pass serves all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from camviz.cams.base import CamMethod, ChannelWeighted, LayerData
from camviz.core.errors import CamvizError


class PerturbationMethod(ChannelWeighted):
    """Base of the methods that weigh channels by scoring perturbed copies.

    Subclasses implement :meth:`rank_weights`, which scores every rank of a top-k target
    from the same perturbed passes (a single rank is the one-element case); the engine
    turns each rank's ``(N, C)`` channel weights into a map.

    Args:
        batch_size: Perturbed copies per forward pass (bounds memory); ``None`` lets the
            method choose for the device.
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod`.
    """

    uses_gradients = False

    def __init__(self, batch_size: int | None = None, *, eigen_smooth: bool = False) -> None:
        super().__init__(eigen_smooth=eigen_smooth)
        self.batch_size = (
            None if batch_size is None else checked_count(self, "batch_size", batch_size)
        )

    def channel_weights(self, data: LayerData) -> torch.Tensor:
        return self.rank_weights([data])[0]


def checked_count(method: CamMethod, option: str, value: int) -> int:
    """``value`` of a method's option if it is a positive int, else a :class:`CamvizError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CamvizError(f"{method.name} needs {option} >= 1 (an int), got {value!r}")
    return value


def rank_scores(output: Any, ranks: Sequence[LayerData], samples: torch.Tensor) -> torch.Tensor:
    """``(K, R)``: the explained score of each rank for each of the ``R`` output rows.

    Args:
        output: The model's output for a batch of ``R`` perturbed copies.
        ranks: One :class:`LayerData` per rank (their ``score`` functions are used).
        samples: ``(R,)`` index of the input each row was made from (the ``rows`` of
            :mod:`camviz.core.targets`' protocol, which every score function follows).

    Raises:
        CamvizError: A target callable does not give one score per row, or scores rows by
            their position (:func:`camviz.core.targets.call_target`).
    """
    scores = []
    for data in ranks:
        score = data.score_fn(output, samples)
        if not isinstance(score, torch.Tensor) or score.shape != samples.shape:
            shape = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
            raise CamvizError(
                f"the target must give one score per output row, shape {tuple(samples.shape)}, "
                f"got {shape}; perturbation methods score batches of perturbed copies, so a "
                "target callable must score each row on its own (e.g. lambda out: out[:, 3]) "
                "or take the rows, fn(output, rows) (see camviz.core.targets)"
            )
        scores.append(score)
    return torch.stack(scores)
