"""Ablation-CAM: channels weighted by the drop in score when each one is zeroed."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from functools import partial
from typing import Literal

import torch

from camviz.cams.base import LayerData
from camviz.cams.perturbation import PerturbationMethod, rank_scores
from camviz.cams.registry import register
from camviz.core.errors import CamvizError
from camviz.core.heldpasses import HeldDetector
from camviz.core.modelstate import no_grad
from camviz.core.taps import edit_spots

# What a failed broadcast run looks like: shape errors from the layers after the target,
# or a target that cannot score the rows it got.
_BROADCAST_FAILURES = (RuntimeError, ValueError, IndexError, AssertionError, CamvizError)


@register
class AblationCAM(PerturbationMethod):
    """Ablation-CAM: no gradients; a channel's weight is the score lost without it.

    Paper: Desai and Ramaswamy, "Ablation-CAM: Visual Explanations for Deep Convolutional
    Network via Gradient-free Localization", WACV 2020.

    For the class score ``y^c`` and ``y^c_k``, the score with channel ``k`` of the target
    layer set to zero everywhere::

        w^c_k = (y^c - y^c_k) / y^c
        L^c   = ReLU( sum_k w^c_k A^k )

    Dividing by ``y^c`` only rescales the map (the engine normalises it) and flips it when
    ``y^c < 0``; where ``y^c == 0`` the division is skipped. A drop within float rounding of
    ``y^c`` (4 eps) counts as none: passes of another batch size round the score differently.
    For a transformer layer, channel ``k`` is zeroed in every token, the class and register
    tokens included.

    Cost, and the exact shortcut: nothing before the target layer depends on the ablation.
    For each chunk of channels the layers before the target run once, on the one sample, and
    a hook hands the layers after it a batch of ablated copies of that sample's layer
    output, which broadcasts against any one-sample tensor that the later layers take from
    before the layer (ResNet's ``out += identity`` after ``layer4.1.bn2``). Per channel that
    is one pass of the layers *after* the target for one sample plus ``1 / chunk`` of a pass
    of the layers before it; pytorch-grad-cam re-runs the whole network per channel. All
    ranks of a top-k target are scored from the same passes. A chunk holds as many copies
    as ``memory_budget`` allows for what one copy costs the layers after the target,
    measured on the first pass (:class:`~camviz.cams.perturbation.Chunks`; a detector's
    heads need far more per copy than the copy itself).

    A torchvision detector (Faster, Mask and Keypoint R-CNN, RetinaNet, FCOS, SSD) explained
    at a layer of its backbone takes the copies through hooks that hold its image size and,
    for an R-CNN, the region proposals of the explained detections
    (:mod:`camviz.core.heldpasses`): only what follows the layer runs on the copies, and the
    RoI heads score one row per object and copy. Each ablated score is the whole network's
    with those proposals, where before the copies went through the whole network and the
    region proposal network proposed anew for each.

    The first chunk also carries an unablated copy, which must reproduce the score of the
    plain forward pass; if it does not, or the later layers reject the batch (a
    ``torch.cat`` with an earlier tensor, an in-place update of one), the method warns and
    re-runs the whole network per channel instead, in chunks sized again from what one copy
    costs the whole network. A model that takes no batch but the one it was given (one whose
    ``forward`` concatenates a tensor of that batch size it holds or computes from another
    input) is then run on that batch once per channel, the channel zeroed in every sample.
    Either fallback is said in one warning that gives the reason.

    With ``precision="bf16"`` or ``"fp16"`` Ablation-CAM still scores in float32: its weights
    are small differences of scores, which 8 bits of mantissa do not resolve.

    Compared with pytorch-grad-cam's ``AblationCAM``: the same formula and, on layers whose
    minimum activation is 0 (after a ReLU), the same maps up to float rounding. On layers
    with negative values pytorch-grad-cam replaces a channel by ``min - 1e7`` instead of 0,
    which departs from the paper; camviz zeroes, as the paper does.

    Args:
        batch_size: Ablated copies per pass; overrides ``memory_budget``. ``None``: as many
            as fit in ``memory_budget``, at least one.
        memory_budget: Bytes (or ``"512MiB"``) the ablated passes may add at their peak;
            ``None``: 1 GiB, on a GPU half its free memory up to 8 GiB
            (:class:`~camviz.cams.perturbation.PerturbationMethod`).
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
    """

    name = "ablationcam"
    paper = (
        "Desai and Ramaswamy, Ablation-CAM: Visual Explanations for Deep Convolutional Network "
        "via Gradient-free Localization, WACV 2020"
    )
    needs = "a pass of the layers after the target per channel"
    # (y - y_k) / y from bf16 scores keeps 8 bits of each: the map's correlation with the
    # fp32 map fell to 0.40 on a ResNet-50 (benchmarks/bench_precision.py), so it stays fp32.
    reduced_precision = False
    # The detector hooks of the last layer, and what they were made for (_held_detector).
    _held: tuple[tuple[object, ...], HeldDetector] | None = None

    def rank_weights(self, ranks: Sequence[LayerData]) -> list[torch.Tensor]:
        with no_grad():
            ablated = self.ablated_scores(ranks)
        weights = []
        for data, scores in zip(ranks, ablated, strict=True):
            assert data.scores is not None  # the engine scores every rank
            original = data.scores.unsqueeze(1)
            drop = original - scores
            # A pass of another batch size (the chunks follow the memory budget) may round
            # the score differently: a drop within that rounding is no drop.
            rounding = 4 * torch.finfo(scores.dtype).eps * original.abs()
            drop = torch.where(drop.abs() <= rounding, 0, drop)
            weights.append(torch.where(original != 0, drop / original, drop))
        return weights

    def ablated_scores(self, ranks: Sequence[LayerData]) -> torch.Tensor:
        """``(K, N, C)``: each rank's score with each channel of the target layer zeroed."""
        data = ranks[0]
        if data.layout is None or data.scores is None:
            raise CamvizError("ablationcam needs the layer layout and scores; run it via explain")
        batch, channels = data.activations.shape[:2]
        scores = data.activations.new_empty(len(ranks), batch, channels)
        every = torch.arange(channels, device=data.activations.device)
        held = self._held_detector(data, ranks)
        mode: _Mode = "broadcast" if held is None else "held"
        chunks = self.chunks(data.inputs)
        # The first pass (of each sample, for a detector whose proposals are held per
        # sample) checks the shortcut (one channel, or a whole chunk of batch_size, and the
        # unablated row) and measures what its copies cost.
        first = every[: self.batch_size or 1]
        reason = ""
        try:
            for sample in range(batch):
                todo = every
                if mode == "held" or (mode == "broadcast" and sample == 0):
                    check = partial(_checked_pass, data, ranks, mode, held, sample, first)
                    checked, reason = chunks.measured(len(first) + 1, check)
                    if checked is None:
                        mode = "copies"
                        chunks = self.chunks(data.inputs)  # a whole-network copy costs more
                    else:
                        scores[:, sample, first] = checked.to(scores.dtype)
                        todo = every[len(first) :]
                ablate = partial(_ablated_pass, data, ranks, mode, held, sample)
                for chunk, ablated in chunks.split(todo, ablate):
                    scores[:, sample, chunk] = ablated.to(scores.dtype)  # bf16 under autocast
        except _BROADCAST_FAILURES as error:
            # A model that takes only its own batch size passes the checks when a chunk
            # happens to have as many rows, and fails on the next one.
            mode, reason = "batch", _failure(error)
            for channel in every:
                scores[:, :, channel] = _ablated_pass(data, ranks, mode, None, 0, channel[None])
        if mode in _FALLBACKS:
            message = _FALLBACKS[mode].format(layer=data.layer, reason=reason)
            warnings.warn(message, RuntimeWarning, stacklevel=3)  # from rank_weights' caller
        return scores

    def _held_detector(self, data: LayerData, ranks: Sequence[LayerData]) -> HeldDetector | None:
        """The hooks for a torchvision detector at this layer (``None``: not one), sharing
        the proposals held at another layer of the same pass (the same inputs and scores:
        the levels of a feature pyramid), so that each sample's are found once."""
        held = HeldDetector.of(data.model, data.layer)
        if held is None:
            return None
        source = (data.model, data.inputs, *(rank.score_fn for rank in ranks))
        kept = self._held
        if kept is not None and [id(part) for part in kept[0]] == [id(part) for part in source]:
            held.proposals = kept[1].proposals
        self._held = (source, held)
        return held


# How a pass runs the network (see _ablated_pass), and the warning of each fallback.
_Mode = Literal["broadcast", "held", "copies", "batch"]
_FALLBACKS = {
    "copies": "ablationcam: the layers after {layer!r} do not take a batch of ablated copies "
    "of one sample ({reason}); re-running the whole network per channel instead",
    "batch": "ablationcam: the model does not take a batch of copies of one sample "
    "({reason}); re-running it on the batch as given, once per channel, instead",
}


def _ablated_pass(
    data: LayerData,
    ranks: Sequence[LayerData],
    mode: _Mode,
    held: HeldDetector | None,
    sample: int,
    channels: torch.Tensor,
) -> torch.Tensor:
    """``(K, R)`` scores with channel ``channels[r]`` zeroed in row ``r``.

    A channel of ``-1`` zeroes nothing. ``"broadcast"``: the layers before the target run
    on sample ``sample`` (the model's other inputs, if any, come as ``R`` copies) and its
    ``(1, ...)`` layer output becomes ``R`` ablated copies. ``"held"``: the same for a
    torchvision detector given ``R`` copies of the image, ``held``'s hooks holding its image
    size and (R-CNN) proposals (:mod:`camviz.core.heldpasses`). ``"copies"``: the whole network
    runs on ``R`` copies of the sample. ``"batch"``: the whole network runs on the batch as
    given, the one channel in ``channels`` zeroed in every sample (``R`` is the batch size),
    for a model that takes no other batch.
    """
    if mode == "batch":
        inputs = data.inputs
        samples = torch.arange(len(inputs), device=channels.device)
        channels = channels.expand(len(inputs))
    else:
        single = data.inputs[sample : sample + 1]
        inputs = single
        if mode == "copies":
            inputs = single.repeat(len(channels), *[1] * (single.dim() - 1))
        elif mode == "held":  # views: the detector's transform reads the first one only
            inputs = single.expand(len(channels), *single.shape[1:])
        samples = torch.full_like(channels, sample)
    rows = (channels >= 0).nonzero()[:, 0]
    assert data.layout is not None  # checked by AblationCAM.ablated_scores
    # Channels are dim 1 of channels-first maps and the last dim of the other layouts.
    last = data.layout.channel_dim != 1
    index = (rows, ..., channels[rows]) if last else (rows, channels[rows])

    def ablate(output: torch.Tensor) -> torch.Tensor:
        copies = output.expand(len(channels), *output.shape[1:]).clone()
        copies[index] = 0
        return copies

    fns = [rank.score_fn for rank in ranks]
    passes = held.passes(sample, fns) if mode == "held" and held is not None else nullcontext()
    with edit_spots(data.model, {data.layer: ablate}), passes as held_pass:
        output = data.run(inputs, samples)
    scored = None if held_pass is None else held_pass.scores()
    return rank_scores(output, ranks, samples) if scored is None else scored


def _failure(error: BaseException) -> str:
    """``error`` in a few words, for a fallback's warning."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


def _checked_pass(
    data: LayerData,
    ranks: Sequence[LayerData],
    mode: _Mode,
    held: HeldDetector | None,
    sample: int,
    chunk: torch.Tensor,
) -> tuple[torch.Tensor | None, str]:
    """The chunk's scores from a ``"broadcast"`` or ``"held"`` pass, if an extra unablated
    row in it reproduces the plain forward pass's score; else ``None`` and why not (for the
    warning). A held pass first holds the detector's proposals of the sample."""
    with_check = torch.cat([chunk.new_full((1,), -1), chunk])
    try:
        fns = [rank.score_fn for rank in ranks]
        if held is not None and not held.hold(
            sample, partial(_plain_scores, data, ranks, sample), fns
        ):
            return None, "the explained scores use no region proposal"
        scores = _ablated_pass(data, ranks, mode, held, sample, with_check)
    except _BROADCAST_FAILURES as error:
        return None, _failure(error)
    assert data.scores is not None  # checked by AblationCAM.ablated_scores
    check, expected = scores[0, 0], data.scores[sample]
    # Under bf16 / fp16 autocast another batch size may round the score differently.
    rtol = max(1e-3, 4 * torch.finfo(check.dtype).eps)
    if not torch.isclose(
        check.to(expected.dtype),
        expected,
        rtol=rtol,
        atol=rtol * 0.1 * max(1.0, abs(float(expected))),
    ):
        return None, f"the unablated copy scored {float(check):.6g}, not {float(expected):.6g}"
    return scores[:, 1:], ""


def _plain_scores(data: LayerData, ranks: Sequence[LayerData], sample: int) -> list[torch.Tensor]:
    """Every rank's score in a plain pass of sample ``sample`` alone."""
    rows = torch.tensor([sample], device=data.inputs.device)
    output = data.run(data.inputs[sample : sample + 1], rows)
    return [rank.score_fn(output, rows) for rank in ranks]
