"""Ablation-CAM: channels weighted by the drop in score when each one is zeroed."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.layout import Layout
from camviz.cams.perturbation import checked_batch_size, rank_scores
from camviz.cams.registry import register
from camviz.errors import CamvizError
from camviz.hooks import edit

# What a failed broadcast run looks like: shape errors from the layers after the target,
# or a target that cannot score the rows it got.
_BROADCAST_FAILURES = (RuntimeError, ValueError, IndexError, AssertionError, CamvizError)


@register
class AblationCAM(CamMethod):
    """Ablation-CAM: no gradients; a channel's weight is the score lost without it.

    Paper: Desai and Ramaswamy, "Ablation-CAM: Visual Explanations for Deep Convolutional
    Network via Gradient-free Localization", WACV 2020.

    For the class score ``y^c`` and ``y^c_k``, the score with channel ``k`` of the target
    layer set to zero everywhere::

        w^c_k = (y^c - y^c_k) / y^c
        L^c   = ReLU( sum_k w^c_k A^k )

    Dividing by ``y^c`` only rescales the map (the engine normalises it) and flips it when
    ``y^c < 0``; where ``y^c == 0`` the division is skipped. For a transformer layer, channel
    ``k`` is zeroed in every token, the class and register tokens included.

    Cost, and the exact shortcut: nothing before the target layer depends on the ablation,
    so it runs once per chunk, for one sample; a hook then hands the rest of the network
    a batch of ablated copies of that sample's layer output, which broadcasts against any
    single-sample tensor that the later layers take from before the layer (ResNet's
    ``out += identity`` after ``layer4.1.bn2``). Per channel that is one pass of the layers
    *after* the target for one sample, plus ``1 / batch_size`` of a pass of the layers before
    it; pytorch-grad-cam re-runs the whole network per channel. All ranks of a top-k target
    are scored from the same passes. The first chunk also carries an unablated copy, which
    must reproduce the score of the plain forward pass; if it does not, or the later layers
    reject the batch (a ``torch.cat`` with an earlier tensor, an in-place update of one), the
    method warns and re-runs the whole network per channel instead.

    Compared with pytorch-grad-cam's ``AblationCAM``: the same formula and, on layers whose
    minimum activation is 0 (after a ReLU), the same maps up to float rounding. On layers
    with negative values pytorch-grad-cam replaces a channel by ``min - 1e7`` instead of 0,
    which departs from the paper; camviz zeroes, as the paper does.

    Args:
        batch_size: Ablated copies per pass of the later layers (bounds memory).
    """

    name = "ablationcam"
    paper = (
        "Desai and Ramaswamy, Ablation-CAM: Visual Explanations for Deep Convolutional Network "
        "via Gradient-free Localization, WACV 2020"
    )
    needs = "a pass of the layers after the target per channel"
    uses_gradients = False

    def __init__(self, batch_size: int = 64) -> None:
        self.batch_size = checked_batch_size(self.name, batch_size)

    def layer_map(self, data: LayerData) -> torch.Tensor:
        return self.rank_maps([data])[0]

    def rank_maps(self, ranks: Sequence[LayerData]) -> list[torch.Tensor]:
        activations = ranks[0].activations
        with torch.inference_mode():
            ablated = self.ablated_scores(ranks)
        maps = []
        for data, scores in zip(ranks, ablated, strict=True):
            original = data.scores.unsqueeze(1)
            drop = original - scores
            weights = torch.where(original != 0, drop / original, drop)
            maps.append(torch.einsum("nc,nchw->nhw", weights, activations))
        return maps

    def ablated_scores(self, ranks: Sequence[LayerData]) -> torch.Tensor:
        """``(K, N, C)``: each rank's score with each channel of the target layer zeroed."""
        data = ranks[0]
        if data.layout is None or data.scores is None:
            raise CamvizError("ablationcam needs the layer layout and scores; run it via explain")
        batch, channels = data.activations.shape[:2]
        device = data.activations.device
        scores = data.activations.new_empty(len(ranks), batch, channels)
        broadcast = None  # unknown until the first chunk has been checked
        for sample in range(batch):
            single = data.inputs[sample : sample + 1]
            for chunk in torch.arange(channels, device=device).split(self.batch_size):
                if broadcast is None:
                    broadcast = _broadcast_works(data, ranks, single, chunk, sample)
                    if broadcast is not True:
                        warnings.warn(
                            f"ablationcam: the layers after {data.layer!r} do not take a batch "
                            f"of ablated copies of one sample ({broadcast}); re-running the "
                            "whole network per channel instead",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                        broadcast = False
                keep = _keep_mask(chunk, channels)
                inputs = single if broadcast else single.expand(len(chunk), *single.shape[1:])
                output = _run_ablated(data.model, data.layer, inputs, keep, data.layout)
                samples = torch.full_like(chunk, sample)
                scores[:, sample, chunk] = rank_scores(output, ranks, samples)
        return scores


def _keep_mask(channels: torch.Tensor, total: int) -> torch.Tensor:
    """``(R, total)``: row ``r`` is False at ``channels[r]`` only; ``-1`` keeps everything."""
    keep = torch.ones(len(channels), total, dtype=torch.bool, device=channels.device)
    ablated = channels >= 0
    keep[ablated.nonzero()[:, 0], channels[ablated]] = False
    return keep


def _run_ablated(
    model: nn.Module, layer: str, inputs: torch.Tensor, keep: torch.Tensor, layout: Layout
) -> object:
    """The model's output when ``layer``'s output row ``r`` keeps only channels ``keep[r]``.

    With a one-sample ``inputs`` the ``(1, ...)`` layer output broadcasts to ``R`` rows.
    """
    mask = layout.per_channel(keep)

    def ablate(output: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, output, 0)

    with edit(model, {layer: ablate}):
        return model(inputs)


def _broadcast_works(
    data: LayerData,
    ranks: Sequence[LayerData],
    single: torch.Tensor,
    chunk: torch.Tensor,
    sample: int,
) -> bool | str:
    """``True`` if a broadcast run with an extra unablated row reproduces the plain score.

    Returns:
        ``True``, or why not (for the warning).
    """
    with_check = torch.cat([chunk.new_full((1,), -1), chunk])
    keep = _keep_mask(with_check, data.activations.shape[1])
    try:
        output = _run_ablated(data.model, data.layer, single, keep, data.layout)
        check = rank_scores(output, ranks, torch.full_like(with_check, sample))[0, 0]
    except _BROADCAST_FAILURES as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    expected = data.scores[sample]
    if not torch.isclose(check, expected, rtol=1e-3, atol=1e-4 * max(1.0, abs(float(expected)))):
        return f"the unablated copy scored {float(check):.6g}, not {float(expected):.6g}"
    return True
