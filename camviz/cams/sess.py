"""SESS: a base method run on sliding windows of the image at several scales, then fused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from camviz.cams.base import CamMethod, LayerData
from camviz.cams.engine import layer_data, layer_pass
from camviz.cams.perturbation import checked_count
from camviz.cams.registry import register
from camviz.cams.wrappers import Wrapper
from camviz.core.errors import CamvizError
from camviz.core.maps import normalize, upsample
from camviz.core.modelstate import no_grad
from camviz.core.targets import CallableTarget, ScoreFn, map_output


@dataclass(frozen=True, eq=False)
class _PatchScore:
    """The explained score of the image each patch was cut from."""

    score: ScoreFn
    images: torch.Tensor

    def __call__(self, output: Any, samples: torch.Tensor | None = None) -> torch.Tensor:
        return self.score(output, self.images if samples is None else self.images[samples])


def _softmax(output: Any) -> torch.Tensor:
    """The softmax of a logits output."""
    if not isinstance(output, torch.Tensor):
        raise CamvizError(
            "sess scores windows on the softmax of a logits tensor, but the model returns a "
            "structure; pass softmax=False"
        )
    return output.softmax(dim=-1)


def window_starts(length: int, window: int, step: int) -> list[int]:
    """Where windows of ``window`` pixels start along ``length`` pixels, every ``step``; the
    last window is moved back inside the image."""
    starts = list(range(0, max(length - window, 0), step))
    return [*starts, max(length - window, 0)]


def gaussian_blur(maps: torch.Tensor, size: int = 11, sigma: float = 5.0) -> torch.Tensor:
    """``(M, H, W)`` maps blurred by a ``size x size`` Gaussian, mirrored at the borders."""
    offsets = torch.arange(size, dtype=maps.dtype, device=maps.device) - (size - 1) / 2
    kernel = torch.exp(-(offsets**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    pad = size // 2
    blurred = maps.unsqueeze(1)
    for weight, padding in (
        (kernel.view(1, 1, 1, -1), (pad, pad, 0, 0)),
        (kernel.view(1, 1, -1, 1), (0, 0, pad, pad)),
    ):
        mode = "reflect" if min(blurred.shape[-2:]) > pad else "replicate"
        blurred = F.conv2d(F.pad(blurred, padding, mode=mode), weight)
    return blurred[:, 0]


@register
class SESS(Wrapper):
    """SESS: Saliency Enhancing with Scaling and Sliding, around any base method.

    Paper: Tyagi et al., "SESS: Saliency Enhancing with Scaling and Sliding", ECCV 2022.

    The image is resized so that its shorter side is each of the ``scales`` sizes ``s_i``
    (``window * (1 + i * step_ratio)``, ``i = 0 .. scales - 1``), and square windows of
    ``window`` pixels slide over each size every ``stride`` pixels. For window ``p`` with
    base map ``M_p`` (at the window's size, min-max normalised) and score
    ``c_p = max(0, softmax(y(p))_c)`` (the explained score of the window)::

        kept       = the (1 - pre_filter) share of windows with the highest c_p
        w_p        = c_p / max_kept c                      (channel-wise weight)
        P_p        = U( M_p * w_p pasted at its place in its resized image, 0 elsewhere )
        S(x)       = sum_p P_p(x) 1[P_p(x) > theta] / sum_p 1[P_p(x) > theta]    (mean pool)
        S(x)       = max_p P_p(x)                                              (max pool)

    then a Gaussian blur (11 x 11, sigma 5) when ``smooth``. ``U`` resizes a pasted image
    back to the input's size (bilinear). The map is at the input's resolution. Cost: one
    scoring pass per window plus the base method's cost per kept window, in chunks of
    ``batch_size`` windows.

    Defaults: pytorch-grad-cam's (window = the input's shorter side, stride = window), but 3
    scales instead of the paper's 12, so that the default costs about 10 windows for a
    224 x 336 image; pass ``scales=12`` for the paper's setting.

    Compared with pytorch-grad-cam's ``SESS``: the same steps; its base maps are resized
    with OpenCV and min-max normalised with ``+ 1e-7``, camviz's with torch and exactly.

    Args:
        base: The base method (default ``"gradcam"``).
        scales: The number of scales.
        step_ratio: Growth of the shorter side per scale, as a share of the window.
        window: The window's side in pixels; ``None``: the input's shorter side.
        stride: Pixels between windows; ``None``: the window's side.
        pre_filter: The share of lowest-scoring windows dropped before the base runs.
        theta: Values at or below it do not count in the mean pool.
        pool: ``"mean"`` or ``"max"``.
        smooth: Blur the fused map.
        softmax: Score windows on the softmax of the logits (the paper); ``False``: on the
            explained score itself (for targets where a softmax means nothing).
        batch_size: Windows per forward pass.
        **options: Passed to the base method.
    """

    name = "sess"
    paper = "Tyagi et al., SESS: Saliency Enhancing with Scaling and Sliding, ECCV 2022"
    needs = "its base method (default gradcam) on every window of several rescaled copies"
    spatial_ranks = (2,)  # windows of images
    default_base = "gradcam"
    input_resolution = True

    def __init__(
        self,
        base: str | CamMethod | None = None,
        scales: int = 3,
        step_ratio: float = 2 / 7,
        window: int | None = None,
        stride: int | None = None,
        pre_filter: float = 0.0,
        theta: float = 0.0,
        pool: Literal["mean", "max"] = "mean",
        smooth: bool = True,
        softmax: bool = True,
        batch_size: int = 32,
        **options: Any,
    ) -> None:
        super().__init__(base, **options)
        for option, value in (("scales", scales), ("window", window), ("stride", stride)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise CamvizError(f"sess needs {option} >= 1 (an int), got {value!r}")
        if not 0 <= pre_filter < 1:
            raise CamvizError(f"sess needs 0 <= pre_filter < 1, got {pre_filter!r}")
        if pool not in ("mean", "max"):
            raise CamvizError(f"sess pools by 'mean' or 'max', not {pool!r}")
        self.scales, self.step_ratio = scales, step_ratio
        self.window, self.stride = window, stride
        self.pre_filter, self.theta, self.pool = pre_filter, theta, pool
        self.smooth, self.softmax = smooth, softmax
        self.batch_size = checked_count(self, "batch_size", batch_size)
        self.uses_gradients = False  # the base runs on the windows, not on the engine's pass

    rank_maps = CamMethod.rank_maps  # rank by rank: each rank's base maps are its own

    def layer_map(self, data: LayerData) -> torch.Tensor:
        if data.batch is not None and data.batch.image_sizes is not None:
            raise CamvizError(
                "sess cuts its windows from a batch of one image size; explain a list of "
                "images one by one"
            )
        height, width = data.inputs.shape[-2:]
        window = self.window or min(height, width)
        stride = self.stride or window
        patches, images, places = self.windows(data.inputs, window, stride)
        scores = self.window_scores(data, patches, images)
        total = data.inputs.new_zeros(data.inputs.shape[0], height, width)
        counts = torch.zeros_like(total)
        for image in range(data.inputs.shape[0]):
            mine = (images == image).nonzero()[:, 0]
            kept = mine[scores[mine].argsort()][int(len(mine) * self.pre_filter) :]
            best = scores[kept].max()
            weights = scores[kept] / best if best > 0 else torch.ones_like(scores[kept])
            for chunk, chunk_weights in zip(
                kept.split(self.batch_size), weights.split(self.batch_size), strict=True
            ):
                maps = self.base_maps(data, patches[chunk], images[chunk])
                for index, patch_map, weight in zip(chunk, maps, chunk_weights, strict=True):
                    pasted = self.pasted(patch_map * weight, places[int(index)], (height, width))
                    if self.pool == "max":
                        total[image] = torch.maximum(total[image], pasted)
                    else:
                        counted = pasted > self.theta
                        total[image] += torch.where(counted, pasted, 0)
                        counts[image] += counted
        fused = total if self.pool == "max" else total / counts.clamp_min(1)
        return gaussian_blur(fused) if self.smooth else fused

    def windows(
        self, inputs: torch.Tensor, window: int, stride: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]:
        """Every window of every image at every scale: ``(P, C, window, window)`` patches,
        the ``(P,)`` image of each, and each one's ``(top, left, height, width)`` place in
        its resized image."""
        height, width = inputs.shape[-2:]
        step = round(window * self.step_ratio)
        patches, places = [], []
        for scale in range(self.scales):
            shorter = window + step * scale
            size = (
                (shorter, int(shorter * width / height))
                if height <= width
                else (int(shorter * height / width), shorter)
            )
            resized = (
                F.interpolate(
                    inputs, size=size, mode="bilinear", align_corners=False, antialias=True
                )
                if size != (height, width)
                else inputs
            )
            for top in window_starts(size[0], window, stride):
                for left in window_starts(size[1], window, stride):
                    patches.append(resized[:, :, top : top + window, left : left + window])
                    places.append((top, left, *size))
        batch = inputs.shape[0]
        stacked = torch.stack(patches, dim=1).flatten(0, 1)  # image-major
        images = torch.arange(batch, device=inputs.device).repeat_interleave(len(patches))
        return stacked, images, places * batch

    def window_scores(
        self, data: LayerData, patches: torch.Tensor, images: torch.Tensor
    ) -> torch.Tensor:
        """``(P,)`` non-negative scores ``c_p`` of the windows."""
        scores = []
        with no_grad():
            for chunk, chunk_images in zip(
                patches.split(self.batch_size), images.split(self.batch_size), strict=True
            ):
                output = data.run(chunk, chunk_images)
                if self.softmax:
                    output = map_output(output, _softmax)  # a unit's spot stays
                scores.append(data.score_fn(output, chunk_images))
        return torch.cat(scores).clamp_min(0)

    def base_maps(
        self, data: LayerData, patches: torch.Tensor, images: torch.Tensor
    ) -> torch.Tensor:
        """The base method's ``(P, window, window)`` maps of some windows, normalised."""
        score = _PatchScore(data.score_fn, images)
        recorded = layer_pass(
            data.model,
            patches,
            [data.layer],
            CallableTarget(score, data.target_spots),
            gradients=self.base.uses_gradients,
            attention=self.base.attention,
        )
        ids = None if data.class_ids is None else data.class_ids[images]
        ranks = [
            replace(rank, score_fn=score, class_ids=ids)
            for rank in layer_data(data.model, patches, recorded, data.layer)
        ]
        raw = self.base.rank_maps(ranks)[0]
        return normalize(ranks[0].on_input(normalize(torch.relu(raw))))

    @staticmethod
    def pasted(
        patch_map: torch.Tensor, place: tuple[int, int, int, int], size: Sequence[int]
    ) -> torch.Tensor:
        """A window's map in a blank copy of its resized image, resized to ``size``."""
        top, left, height, width = place
        canvas = patch_map.new_zeros(height, width)
        canvas[top : top + patch_map.shape[0], left : left + patch_map.shape[1]] = patch_map
        return upsample(canvas.unsqueeze(0), size)[0]
