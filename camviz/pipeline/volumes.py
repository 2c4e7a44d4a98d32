"""3-D scans in a folder job: a NIfTI input is a volume, explained whole or in sliding windows.

For an input ``NAME.nii.gz`` (or ``.nii``) the job writes ``NAME_heatmap.nii.gz``, the map
in ``[0, 1]`` as float32 with the scan's shape, affine and qform/sform codes (it overlays the
scan in ITK-SNAP, 3D Slicer or FSLeyes), and ``NAME_montage.png``, slices of the scan with
the map over them (unless overlays are off), and one manifest row (:mod:`camviz.io.volumes`
reads and writes the files).

The scan is read in its voxel order, its intensities windowed if asked
(:class:`VolumeOptions`), normalised with the model's mean and std (0 and 1 for a factory),
and given to the model as a ``(1, 1, I, J, K)`` volume. A model whose output has the scan's
shape segments: the explained score is the region the model predicts as the class
``--target`` names (by default the class predicted at the most voxels, the background left
out), a :class:`camviz.Region` (that class's logits summed over the region); any other model
classifies, and its classes are explained as a classifier's. The default layer is the one
:func:`camviz.explain` picks for that target.

A volume that fits the memory budget is explained in one pass; a larger one needs
``roi_size``: the model then runs on MONAI-style sliding windows
(:class:`camviz.core.windows.SlidingWindowModel`), and the explained score is the region's
score in the stitched output, its layer's activations and gradients stitched on the
volume's grid; the layer must be named before the windows run, so by default it is the one
:func:`camviz.explain` picks on the first window that holds the explained region.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from camviz.cams.engine import explain
from camviz.core.errors import CamvizError
from camviz.core.inputs import model_device
from camviz.core.layers import default_target_layer
from camviz.core.memory import default_budget, format_bytes, parse_bytes, peak_bytes
from camviz.core.targets import Region, as_target, class_name
from camviz.core.windows import Blend, SlidingWindowModel, Windows, window_starts
from camviz.io.models import LoadedModel
from camviz.io.pictures import overlay
from camviz.io.volumes import Volume, intensities, is_volume, montage, read_volume
from camviz.pipeline.encoders import save_png, save_volume_heatmap
from camviz.pipeline.inputs import Item
from camviz.pipeline.naming import volume_files
from camviz.pipeline.results import ImageResult, Prediction
from camviz.pipeline.tasks import BACKGROUND, class_id

if TYPE_CHECKING:
    from camviz.pipeline.settings import JobSettings

__all__ = [
    "VolumeOptions",
    "VolumeResult",
    "explain_volume",
    "is_volume_item",
    "write_volume_files",
]

# The side of the probe that measures what one voxel of a pass costs.
_PROBE_SIDE = 32

# A pass that explains keeps the layers after the target for the backward pass: about as
# much again as the forward pass holds at its peak.
_EXPLAINING_FACTOR = 2


@dataclass(frozen=True)
class VolumeOptions:
    """How NIfTI volumes are read and cut.

    Attributes:
        window: ``(low, high)`` intensities mapped to ``[0, 1]`` (clipped outside).
        percentile: ``(low, high)`` percentiles of each scan used as its window.
        roi_size: The ``(D, H, W)`` of a sliding window (along the scan's voxel axes);
            ``None``: the whole volume when it fits the memory budget.
        overlap: The share of a window that the next one overlaps.
        blend: How overlapping windows' outputs are weighted, ``"constant"`` or
            ``"gaussian"`` (MONAI's modes).
    """

    window: tuple[float, float] | None = None
    percentile: tuple[float, float] | None = None
    roi_size: tuple[int, int, int] | None = None
    overlap: float = 0.25
    blend: Blend = "constant"

    def __post_init__(self) -> None:
        if self.window is not None and self.percentile is not None:
            raise CamvizError("give --window or --percentile, not both")
        if self.roi_size is not None and len(self.roi_size) != 3:
            raise CamvizError(f"--roi-size needs three sides D,H,W, not {self.roi_size}")
        Windows(self.roi_size or (1, 1, 1), self.overlap, self.blend)  # checks the rest

    def recorded(self) -> dict[str, Any]:
        """The options that differ from the defaults (a folder's settings)."""
        defaults = VolumeOptions()
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in vars(self).items()
            if value != getattr(defaults, name)
        }


@dataclass
class VolumeResult:
    """One explained volume.

    Attributes:
        volume: The scan as read.
        scan: The intensities the model saw (before its mean and std), ``(I, J, K)``.
        heatmap: The map, ``(I, J, K)`` in ``[0, 1]``.
        explained: The explained class, with its score.
        top: The best classes of a classifier (empty for a segmentation model).
        layers: The explained layer.
        seconds: Time taken.
        windows: How many sliding windows (1: the whole volume).
    """

    volume: Volume
    scan: torch.Tensor
    heatmap: torch.Tensor
    explained: list[Prediction]
    top: list[Prediction] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    seconds: float = 0.0
    windows: int = 1

    def row_fields(self) -> dict[str, Any]:
        """What a volume's manifest row says beyond an image's: its shape, its windows."""
        return {"size": list(self.volume.data.shape), "windows": self.windows}

    def outcome(self, index: int) -> ImageResult:
        """The result as the job's rows read it (the explained class, a classifier's best)."""
        return ImageResult(
            index, None, None, "ok", top=self.top, layers=self.layers, seconds=self.seconds
        )


def is_volume_item(item: Item) -> bool:
    """Whether ``item`` is a NIfTI volume to explain (not one that failed to expand)."""
    return item.reason is None and item.frame is None and is_volume(item.path)


def write_volume_files(
    out: Path, name: str, result: VolumeResult, settings: JobSettings, clip: float | None
) -> list[dict[str, Any]]:
    """Write a volume's map as NIfTI and, with overlays on, its montage; returns the files
    by kind (:func:`camviz.pipeline.naming.volume_files`), and the row's ``explained``."""
    files = volume_files(name, settings.outputs)
    save_volume_heatmap(result.heatmap, result.volume, out / files["heatmap"])
    if "montage" in files:
        render = settings.render

        def draw(image: Image.Image, heatmap: torch.Tensor) -> Image.Image:
            return overlay(image, heatmap, render.alpha, render.colormap, clip=clip)

        save_png(montage(result.scan, result.heatmap, draw), out / files["montage"])
    explained = [{**prediction.fields(), "files": files} for prediction in result.explained]
    if not bool(result.heatmap.any()):  # a picture of it shows nothing: say so
        explained[0]["empty"] = True
    return explained


def explain_volume(
    loaded: LoadedModel, path: str, settings: JobSettings, method_options: dict[str, Any]
) -> VolumeResult:
    """Explain the NIfTI scan at ``path`` with ``loaded``'s model (see the module docstring),
    as ``settings`` ask; ``method_options`` go to :func:`camviz.explain`.

    Raises:
        CamvizError: The file is no 3-D NIfTI scan, the volume does not fit the budget and no
            ``roi_size`` is given, no layer can be explained, or the target does not fit.
    """
    started = time.perf_counter()
    options = settings.volumes
    volume = read_volume(path)
    scan = intensities(volume.data, options.window, options.percentile)
    device = model_device(loaded.model) or torch.device("cpu")
    mean, std = loaded.preprocess.mean[0], loaded.preprocess.std[0]
    batch = ((scan - mean) / std)[None, None].to(device)
    layer = settings.layer if isinstance(settings.layer, str) else None
    given = settings.memory_budget
    budget = parse_bytes(given) if given is not None else default_budget(device)
    windows = _windows(loaded.model, batch, options, budget)
    model: torch.nn.Module = loaded.model
    if windows is not None:
        layer = layer or _window_layer(loaded.model, batch, windows, settings, loaded.categories)
        model = SlidingWindowModel(loaded.model, layer, windows)
    with torch.no_grad():
        output = model(batch)
    target, region_class = _target(output, batch, settings.target, loaded.categories)
    explanation = explain(
        model,
        batch,
        settings.method,
        layer="stitched" if windows is not None else layer,
        target=target,
        layout="channels_first" if windows is not None else None,
        # The job's own choice (None) is contiguous for volumes: channels-last 3-D
        # convolutions were not measured to pay.
        **{**method_options, "channels_last": bool(method_options.get("channels_last"))},
    )
    top = [] if region_class is not None else _top(explanation.output, loaded.categories)
    if region_class is not None:
        assert explanation.scores is not None  # explain gives every explained score
        name = class_name(loaded.categories, region_class)
        explained = [Prediction(region_class, name, float(explanation.scores[0]), None)]
    else:
        first = int(explanation.targets[0])
        explained = [next(prediction for prediction in top if prediction.id == first)]
    return VolumeResult(
        volume=volume,
        scan=scan,
        heatmap=explanation.heatmaps[0].detach().cpu(),
        explained=explained,
        top=top,
        layers=explanation.layers if layer is None else [layer],
        seconds=time.perf_counter() - started,
        windows=1 if windows is None else _window_count(batch, windows),
    )


def _window_layer(
    model: torch.nn.Module,
    batch: torch.Tensor,
    windows: Windows,
    settings: JobSettings,
    categories: list[str],
) -> str:
    """The default layer of a volume explained in sliding windows: the one
    :func:`camviz.explain` picks on the first window where the explained region lies (the
    layer must be named before the windows are stitched)."""
    size = tuple(batch.shape[2:])
    roi = tuple(min(side, extent) for side, extent in zip(windows.roi_size, size, strict=True))
    error: CamvizError | None = None
    for start in window_starts(size, roi, windows.overlap):
        crop = batch
        for axis, (first, side) in enumerate(zip(start, roi, strict=True), start=2):
            crop = crop.narrow(axis, first, side)
        with torch.no_grad():
            output = model(crop)
        try:
            target, _ = _target(output, crop, settings.target, categories)
        except CamvizError as missing:  # not in this window
            error = missing
            continue
        return default_target_layer(model, crop, as_target(target))
    assert error is not None  # there is always a window
    raise error


def _windows(
    model: torch.nn.Module, batch: torch.Tensor, options: VolumeOptions, budget: int
) -> Windows | None:
    """The sliding windows to use: ``None`` (the whole volume) when no ``roi_size`` is given
    and the volume fits ``budget``, measured on a probe of at most 32 voxels a side."""
    if options.roi_size is not None:
        return Windows(options.roi_size, options.overlap, options.blend)
    corner = tuple(slice(0, min(_PROBE_SIDE, side)) for side in batch.shape[2:])
    probe = batch[(Ellipsis, *corner)]  # type: ignore[index]  # a tuple of slices
    with torch.no_grad():
        _, peak = peak_bytes(batch.device, lambda: model(probe))
    needed = _EXPLAINING_FACTOR * peak * batch[0, 0].numel() / probe[0, 0].numel()
    if needed <= budget:
        return None
    shape = "x".join(map(str, batch.shape[2:]))
    raise CamvizError(
        f"the volume of {shape} voxels needs about {format_bytes(needed)} to explain in one "
        f"pass, more than the memory budget of {format_bytes(budget)}; give --roi-size D,H,W "
        "(sliding windows), or a larger --memory-budget"
    )


def _window_count(batch: torch.Tensor, windows: Windows) -> int:
    size = tuple(batch.shape[2:])
    roi = tuple(min(side, extent) for side, extent in zip(windows.roi_size, size, strict=True))
    return len(window_starts(size, roi, windows.overlap))


def _target(
    output: Any, batch: torch.Tensor, target: Any, categories: list[str]
) -> tuple[Any, int | None]:
    """The target to explain and, for a segmentation output (the batch's shape), the class
    of its explained region; a classifier's target is handed on as it is."""
    if not (isinstance(output, torch.Tensor) and output.shape[2:] == batch.shape[2:]):
        return target, None
    predicted = output.argmax(1)[0]
    chosen = class_id(target, categories)
    if chosen is None:
        chosen = _largest_class(predicted, categories)
    mask = predicted == chosen
    if not bool(mask.any()):
        raise CamvizError(
            f"no voxel is predicted as {class_name(categories, chosen)!r}; give another "
            "--target class"
        )
    return Region(chosen, mask), chosen


def _largest_class(predicted: torch.Tensor, categories: list[str]) -> int:
    """The class predicted at the most voxels: the background (class 0 when the classes
    have no name, else the class named ``background``) left out, unless it is all there is.
    """
    counts = torch.bincount(predicted.flatten(), minlength=max(1, len(categories)))
    named = [name.casefold() for name in categories]
    background = next(
        (named.index(name) for name in (BACKGROUND, "background") if name in named),
        0 if not categories or categories[0] == "class 0" else None,
    )
    if (
        background is not None
        and background < len(counts)
        and int(counts.sum()) > int(counts[background])
    ):
        counts[background] = 0
    return int(counts.argmax())


def _top(output: Any, categories: list[str]) -> list[Prediction]:
    """A classifier's best five classes for the one volume."""
    from camviz.core.targets import as_logits

    logits = as_logits(output)[0].detach().float().cpu()
    probabilities = logits.softmax(-1)
    best = probabilities.topk(min(5, len(logits)))
    return [
        Prediction(index, class_name(categories, index), float(logits[index]), float(probability))
        for probability, index in zip(best.values.tolist(), best.indices.tolist(), strict=True)
    ]
