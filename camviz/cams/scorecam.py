"""Score-CAM, SS-CAM and IS-CAM: channels weighted by the score of the input masked with them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal

import torch

from camviz.cams.base import LayerData
from camviz.cams.noise import SampleNoise
from camviz.cams.perturbation import Chunks, PerturbationMethod, checked_count, rank_scores
from camviz.cams.registry import register
from camviz.core.compiling import CompiledForward
from camviz.core.errors import CamvizError
from camviz.core.maps import normalize
from camviz.core.modelstate import changed, no_grad
from camviz.core.targets import probability_score, take_rows

# At most this many input values per forward pass on a CPU when no batch_size is given
# (see ScoreCAM).
CPU_PASS_VALUES = 2**20

Weighting = Literal["softmax", "probability"]
WEIGHTINGS = ("softmax", "probability")


@register
class ScoreCAM(PerturbationMethod):
    """Score-CAM: no gradients; each channel is weighted by what it alone lets the model see.

    Paper: Wang et al., "Score-CAM: Score-Weighted Visual Explanations for Convolutional
    Neural Networks", CVPR Workshops 2020 (Algorithm 1).

    For input ``X``, feature maps ``A^k`` of the target layer, ``U`` bilinear upsampling to
    the input size and ``s`` min-max normalisation to ``[0, 1]``::

        H^k     = s( U(A^k) )                          (mask of channel k)
        S^c_k   = y^c( X (*) H^k ) - y^c( X_b )        (increase of confidence, logits)
        alpha^c = softmax_k( S^c_k )
        L^c     = ReLU( sum_k alpha^c_k A^k )

    The baseline ``X_b`` shifts every ``S^c_k`` of an image by the same amount, which the
    softmax removes, so it is never computed.

    Cost: one forward pass of the whole network per channel and image (the masked input
    changes everything from the first layer on), run under ``torch.no_grad()`` in
    chunks of masked images sized to ``memory_budget`` by what the first masked image's
    whole pass needed (:class:`~camviz.cams.perturbation.Chunks`). Exact savings taken:

    * a channel that is constant over the grid (common: all zero after a ReLU) has a constant
      mask, which ``s`` maps to zero (camviz's convention for a constant map): its masked
      image is all zero whatever the image, so one forward pass of a zero image scores every
      constant channel of every image in the batch;
    * every rank of a top-k target is scored from the same masked forward passes.

    So a batch costs ``sum_n C'_n`` forward passes plus one, ``C'_n`` being the
    non-constant channels of image ``n``.

    ``weighting="probability"`` replaces ``alpha^c`` by the class probability of each masked
    input, ``alpha^c_k = softmax_classes( y( X (*) H^k ) )_c``, as the authors' released code
    does (the paper's equations write the softmax over channels, which the peers follow, and
    which is the default). The two rank channels alike but spread them differently: the
    softmax over channels of logits is dominated by the few best channels, the probabilities
    add up every channel that keeps the class likely. The authors' code skips constant
    channels; here they are weighted by the zero image's probability, which shifts the map by
    a constant that the normalisation removes (where nothing is clipped by the ReLU).

    Compared with the peers: camviz follows the paper's order (upsample, then normalise),
    where torchcam normalises ``A^k`` before upsampling, and pytorch-grad-cam upsamples with
    ``align_corners=True`` and adds ``1e-8`` to the normalising span (how far the maps
    differ: README, *Compared with pytorch-grad-cam, torchcam and Captum*).

    Args:
        batch_size: Masked images per forward pass; overrides ``memory_budget``. ``None``:
            as many as fit in ``memory_budget``, and on a CPU at most as many as hold about
            2^20 input values (6 at 224 x 224, 64 at most), since small batches keep a
            CPU's caches warm (README, *Speed and memory*).
        memory_budget: Bytes (or ``"512MiB"``) the masked passes may add at their peak;
            ``None``: 1 GiB, on a GPU half its free memory up to 8 GiB
            (:class:`~camviz.cams.perturbation.PerturbationMethod`).
        weighting: ``"softmax"`` (default: the paper's equation, pytorch-grad-cam and
            torchcam) or ``"probability"`` (the authors' code); needs a class-id, top-k,
            Contrast or Region target.
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod` (default ``False``).
        compile_rest: Run the masked passes through ``torch.compile`` (inductor): one
            compilation per call (minutes for a ResNet-50 on a CPU), then faster passes;
            it paid 1.65x at ResNet-50's ``layer4`` (README, *Compiled models*). The model
            is handed back uncompiled (:mod:`camviz.core.compiling`).
    """

    name = "scorecam"
    paper = (
        "Wang et al., Score-CAM: Score-Weighted Visual Explanations for Convolutional Neural "
        "Networks, CVPR Workshops 2020"
    )
    needs = "a forward pass per channel (masked inputs)"

    def __init__(
        self,
        batch_size: int | None = None,
        weighting: Weighting = "softmax",
        *,
        memory_budget: int | str | None = None,
        eigen_smooth: bool = False,
        compile_rest: bool = False,
    ) -> None:
        super().__init__(batch_size, memory_budget=memory_budget, eigen_smooth=eigen_smooth)
        if not isinstance(compile_rest, bool):
            raise CamvizError(f"{self.name} needs compile_rest=True or False, not {compile_rest!r}")
        self.compile_rest = compile_rest
        if weighting not in WEIGHTINGS:
            raise CamvizError(
                f"{self.name} needs weighting='softmax' or 'probability', not {weighting!r}"
            )
        self.weighting = weighting

    def rank_weights(self, ranks: Sequence[LayerData]) -> list[torch.Tensor]:
        if self.weighting == "probability":
            ranks = [
                dataclasses.replace(data, score_fn=probability_score(data.score_fn))
                for data in ranks
            ]
        changes = (CompiledForward(),) if self.compile_rest else ()
        with no_grad(), changed(ranks[0].model, *changes):
            weights = self.channel_scores(ranks)
        if self.weighting == "softmax":
            weights = weights.softmax(dim=-1)
        return list(weights)

    def channel_scores(self, ranks: Sequence[LayerData]) -> torch.Tensor:
        """``(K, N, C)``: the score of each rank for each image masked by each channel."""
        return self.masked_scores(ranks, 1.0)

    def masked_scores(
        self, ranks: Sequence[LayerData], scale: float, chunks: Chunks | None = None
    ) -> torch.Tensor:
        """``(K, N, C)``: the score of each rank for each image masked by ``scale`` times
        each channel's mask ``H^k``, in ``chunks`` (default: a fresh :class:`Chunks`)."""
        data = ranks[0]
        chunks = chunks or self.chunks(data.inputs)
        flat = data.activations.flatten(2)
        constant = flat.amax(dim=-1) == flat.amin(dim=-1)
        scores = flat.new_empty(len(ranks), *constant.shape)
        score = partial(self.masked_pass, ranks, lambda masks, samples: scale * masks)
        for pairs, scored in chunks.split((~constant).nonzero(), score):
            samples, channels = pairs.unbind(dim=1)
            # .to: a model run under bf16 / fp16 autocast scores in that dtype
            scores[:, samples, channels] = scored.to(scores.dtype)
        if constant.any():
            scores = torch.where(constant, self.blank_scores(data, ranks).unsqueeze(-1), scores)
        return scores

    @staticmethod
    def blank_scores(data: LayerData, ranks: Sequence[LayerData]) -> torch.Tensor:
        """``(K, N)``: the score of each rank for a zero image in place of each sample (one
        pass of one zero image, or of one per image for a list of images of their sizes)."""
        batch = torch.arange(len(data.inputs), device=data.inputs.device)
        if data.batch is not None and data.batch.image_sizes is not None:
            return rank_scores(data.run(torch.zeros_like(data.inputs), batch), ranks, batch)
        blank = data.run(torch.zeros_like(data.inputs[:1]), batch[:1])
        return rank_scores(take_rows(blank, torch.zeros_like(batch)), ranks, batch)

    def masked_pass(
        self,
        ranks: Sequence[LayerData],
        perturb: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        pairs: torch.Tensor,
    ) -> torch.Tensor:
        """``(K, R)``: each rank's score of the images masked by ``perturb(masks, samples)``,
        the masks being those of the ``(R, 2)`` (sample, channel) ``pairs``."""
        data = ranks[0]
        samples, channels = pairs.unbind(dim=1)
        masks = perturb(self.masks(data, samples, channels), samples)
        masked = data.inputs[samples] * masks.unsqueeze(1)
        return rank_scores(data.run(masked, samples), ranks, samples)

    def copies_cap(self, inputs: torch.Tensor) -> int | None:
        """On a CPU, as many masked images as hold about 2^20 input values (at most 64):
        small batches keep a CPU's caches warm."""
        if inputs.device.type == "cpu":
            return max(1, min(64, CPU_PASS_VALUES // inputs[0].numel()))
        return None

    @staticmethod
    def masks(data: LayerData, samples: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
        """``(R, *spatial)`` masks ``s(U(A^k))`` of the given (sample, channel) pairs (``U``
        lays the grid on the input: :meth:`~camviz.cams.base.LayerData.on_input`)."""
        return normalize(data.on_input(data.activations[samples, channels], samples))


@register
class SSCAM(ScoreCAM):
    """SS-CAM: Score-CAM with each channel's score averaged over noisy copies of its mask.

    Paper: Wang, Naidu et al., "SS-CAM: Smoothed Score-CAM for Sharper Visual Feature
    Localization", arXiv 2020 (the variant that adds noise to the masks).

    With Score-CAM's notation, ``M`` noise draws and ``delta_i`` Gaussian noise of standard
    deviation ``std`` drawn independently for every pixel, channel, image and draw::

        S^c_k   = (1 / M) sum_i y^c( X (*) (H^k + delta_i) )
        alpha^c = softmax_k( S^c_k ),   L^c = ReLU( sum_k alpha^c_k A^k )

    Cost: ``num_samples`` forward passes per channel and image, chunked as Score-CAM's;
    noise makes every mask distinct, so Score-CAM's constant-channel saving does not apply.
    Each image draws its noise from its own generator started from ``seed``
    (:class:`~camviz.cams.noise.SampleNoise`), draw by draw in channel order, so an image
    gets the same noise, and the same map, alone or at any position in a batch. The defaults
    (35 draws, ``std=2``) are torchcam's ``SSCAM`` ones, whose formula this is; its maps
    differ from camviz's by its normalise-then-upsample order (see :class:`ScoreCAM`) and
    its own noise.

    Args:
        batch_size, memory_budget: Masked images per forward pass, or the memory they may
            take (see :class:`ScoreCAM`).
        num_samples: Noise draws ``M``.
        std: Standard deviation of the noise added to the ``[0, 1]`` masks.
        seed: Seed of the noise (default 0, as ``smooth_gradcam++``'s), so that the same
            input always gives the same map; ``None`` draws the seed from torch's global
            generator.
        weighting: As for :class:`ScoreCAM` (default ``"softmax"``, the paper's).
        eigen_smooth, compile_rest: See :class:`ScoreCAM`.
    """

    name = "sscam"
    paper = (
        "Wang, Naidu et al., SS-CAM: Smoothed Score-CAM for Sharper Visual Feature "
        "Localization, arXiv 2020"
    )
    needs = "num_samples forward passes per channel (noisy masked inputs)"

    def __init__(
        self,
        batch_size: int | None = None,
        num_samples: int = 35,
        std: float = 2.0,
        seed: int | None = 0,
        weighting: Weighting = "softmax",
        *,
        memory_budget: int | str | None = None,
        eigen_smooth: bool = False,
        compile_rest: bool = False,
    ) -> None:
        super().__init__(
            batch_size,
            weighting,
            memory_budget=memory_budget,
            eigen_smooth=eigen_smooth,
            compile_rest=compile_rest,
        )
        if not std >= 0:
            raise CamvizError(f"sscam needs std >= 0, got {std!r}")
        self.num_samples = checked_count(self, "num_samples", num_samples)
        self.std = std
        self.seed = seed

    def channel_scores(self, ranks: Sequence[LayerData]) -> torch.Tensor:
        data = ranks[0]
        inputs = data.inputs
        batch, channels = data.activations.shape[:2]
        noise = SampleNoise(batch, self.seed, inputs.device)
        sizes = data.batch.image_sizes if data.batch is not None else None
        scores = inputs.new_zeros(len(ranks), batch, channels)
        pairs = torch.cartesian_prod(
            torch.arange(batch, device=inputs.device), torch.arange(channels, device=inputs.device)
        )

        def noisy(masks: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
            return masks + self.std * noise.draw(samples, masks.shape[1:], masks.dtype, sizes)

        chunks = self.chunks(inputs)
        for _ in range(self.num_samples):
            for chunk, scored in chunks.split(pairs, partial(self.masked_pass, ranks, noisy)):
                samples, chunk_channels = chunk.unbind(dim=1)
                scores[:, samples, chunk_channels] += scored
        return scores / self.num_samples


@register
class ISCAM(ScoreCAM):
    """IS-CAM: Score-CAM with each channel's score integrated along growing masks.

    Paper: Naidu, Ghosh, Maurya, Nayak and Kundu, "IS-CAM: Integrated Score-CAM for
    axiomatic-based explanations", arXiv 2020 (arXiv:2010.03023).

    As torchcam's ``ISCAM`` computes it: with Score-CAM's mask ``H^k`` of channel ``k`` and
    ``M`` steps, step ``i`` scales the mask by the running sum ``c_i = sum_{j<=i} j / M``
    (``c_i = i (i + 1) / (2 M)``, growing from ``1 / M`` to ``(M + 1) / 2``)::

        S^c_k   = (1 / M) sum_{i=1..M} y^c( X (*) c_i H^k )
        alpha^c = softmax_k( S^c_k ),   L^c = ReLU( sum_k alpha^c_k A^k )

    (the paper's baseline score ``y^c(X_b)`` is the same for every channel of an image and
    cancels in the softmax). Everything else is Score-CAM's: the masks, their chunking, the
    single blank pass for constant channels (once per step), and ``weighting``. Compared with
    torchcam, the masks differ as Score-CAM's do (see :class:`ScoreCAM`: camviz upsamples,
    then normalises).

    Cost: ``num_samples`` times Score-CAM's.

    Args:
        batch_size, memory_budget: Masked images per forward pass, or the memory they may
            take (see :class:`ScoreCAM`).
        num_samples: Integration steps ``M`` (default 10, torchcam's).
        weighting: As for :class:`ScoreCAM` (default ``"softmax"``, the paper's).
        eigen_smooth, compile_rest: See :class:`ScoreCAM`.
    """

    name = "iscam"
    paper = (
        "Naidu et al., IS-CAM: Integrated Score-CAM for axiomatic-based explanations, arXiv 2020"
    )
    needs = "num_samples forward passes per channel (scaled masked inputs)"

    def __init__(
        self,
        batch_size: int | None = None,
        num_samples: int = 10,
        weighting: Weighting = "softmax",
        *,
        memory_budget: int | str | None = None,
        eigen_smooth: bool = False,
        compile_rest: bool = False,
    ) -> None:
        super().__init__(
            batch_size,
            weighting,
            memory_budget=memory_budget,
            eigen_smooth=eigen_smooth,
            compile_rest=compile_rest,
        )
        self.num_samples = checked_count(self, "num_samples", num_samples)

    def channel_scores(self, ranks: Sequence[LayerData]) -> torch.Tensor:
        steps = self.num_samples
        chunks = self.chunks(ranks[0].inputs)  # measured once, for every step
        total = self.masked_scores(ranks, 1 / steps, chunks)
        for step in range(2, steps + 1):
            total += self.masked_scores(ranks, step * (step + 1) / (2 * steps), chunks)
        return total / steps
