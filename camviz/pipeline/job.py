"""Explain images, folders and videos into an output folder: the job behind ``camviz explain``.

What the folder receives, for an input named ``NAME`` (its file stem; a folder's files keep
their sub-folders, see :mod:`camviz.pipeline.inputs`):

* ``NAME_overlay.png``: the heatmap over the photo, at the photo's own size;
* ``NAME_panel.jpg``: image | heatmap | overlay, titled with the class and its probability
  (drawn with Pillow, 400 pixels per picture; JPEG, since a PNG of it costs more to encode
  than explaining the image);
* with ``heatmap="npz"``: ``NAME_heatmap.npz``, the float32 map (key ``heatmap``) in
  ``[0, 1]``; with ``heatmap="png16"``: ``NAME_heatmap.png``, 16-bit grey, value / 65535.
  Both are at the model's input size and cover the whole photo: resize to the photo's size
  to lay them on it;
* with a ``topK`` target, each of these per explained class, as ``NAME_rankR_...``;
* for a video ``clip.mp4``: per explained frame ``clip_frames/000012_overlay.png`` (and
  the heatmap), no panel; and ``clip_overlay.mp4``, made of those overlays;
* for a **video model**, per clip (named after its first frame)
  ``clip_frames/000016_overlay.mp4``, its ``T`` frames at the video's size with the
  spatio-temporal map over each (the heatmap ``.npz`` holds the ``(T, H, W)`` map), and
  ``clip_overlay.mp4``: each clip's frames up to where the next clip starts;
* for a **detector**, per explained object ``NAME_overlay.png`` (``NAME_rankR_overlay.png``
  for several), its map with its box and label drawn, and one ``NAME_panel.jpg`` with the
  photo and every box, then each object's overlay; for a **segmentation model**, the files
  of one image, explaining the predicted region of the class (see
  :mod:`camviz.pipeline.tasks`);
* ``manifest.jsonl``: one row per input, written as soon as its files are (see
  :mod:`camviz.pipeline.manifest`): ``input``, ``frame``, ``status`` (``ok`` or ``error``),
  ``reason``, ``size``, ``prediction`` (top-1), ``top5``, ``explained`` (the explained
  classes with ``id``, ``name``, ``score``, ``probability`` and their ``files``; a detected
  object also its ``box``, ``[x0, y0, x1, y1]`` in the photo's pixels; ``"empty": true``
  when the map is all zero, no positive evidence at the layer), ``files``,
  ``layers`` and ``seconds`` (decoding plus the image's share of its batch). An input with
  nothing to explain (no object above ``min_score``, no pixel of the class) is ``ok`` with
  no ``explained`` entry, and its ``reason`` says so;
* ``manifest.json``: the run's settings and, at the end, the counts (``ok``, ``error``,
  ``already_done``: inputs a previous run had finished, and ``empty_maps``), the rows of
  the inputs that failed (``failures``), the videos, and ``other_files``: files in the
  folder written for inputs that are not among this run's (a rerun with fewer inputs). The
  rows of every input
  stay in ``manifest.jsonl`` only, so this file stays small however many inputs there are.
  While a run is under way it holds ``"complete": false``. Both manifests are strict JSON
  (no ``NaN``).

**Unreadable inputs** are skipped and get a row with the reason; so do special files
(FIFOs, devices) and inputs whose output or map is not finite (NaN weights). If *no* input
can be explained (one bad file, a folder of bad files) the job raises a
:class:`~camviz.core.errors.CamvizError` and leaves nothing behind, as after any other user
mistake: a folder created for the run is removed again while it is empty, and a mistake in
the method, layer or target surfaces with the first batch.

**Outputs are never inputs.** The files the folder's manifests list are left out of the
inputs, so ``camviz explain photos --out photos`` explains the user's photos and never its
own overlays, however often it is run (see :mod:`camviz.pipeline.inputs`).

**One job per folder.** A job holds its output folder with a lock (see
:mod:`camviz.pipeline.lock`); a second job into the same folder stops at once with one
line, before touching anything.

**A full disk** stops the run with one line; every file is complete or absent, and the
same command resumes once there is space.

**Resuming.** Run the same job again with the same output folder and only what is not done
is explained (an input is done when its row says ``ok`` and its files exist); temporary
files of an interrupted run are removed. Every file is written atomically, so there are no
half-written ones. A folder made with other settings (model, method, layer, target, what
is drawn) is refused rather than mixed.

**Several processes.** Under ``torchrun`` each process explains its shard (see
:mod:`camviz.pipeline.distributed`) and writes its own rows; the rank-0 process merges them and
writes the videos and ``manifest.json``. The output folder must be one that every process
sees (on several machines, a shared file system).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from camviz.cams import get as get_method
from camviz.cams.perturbation import budget_option
from camviz.core.errors import CamvizError
from camviz.core.inputs import model_device
from camviz.core.layers import Layer, resolve_layers
from camviz.core.precision import check_precision
from camviz.core.targets import Target
from camviz.io.atomic import atomic_write
from camviz.io.images import PathLike
from camviz.io.models import LoadedModel
from camviz.io.render import (
    SALIENCY_PERCENTILE,
    clip_video,
    detection_panel,
    draw_box,
    overlay,
    panel_image,
)
from camviz.io.video import FrameReader, frame_count, frame_rate, write_video
from camviz.pipeline import distributed, lock, manifest
from camviz.pipeline.dataset import ImageResult, ItemDataset, Prediction, explain_dataset
from camviz.pipeline.inputs import NAME_MAX, Item, expand
from camviz.pipeline.tasks import TaskOptions, clip_spec, fit_task, prepared

#: The run's summary: settings, and every row once the run is complete.
MANIFEST = manifest.SUMMARY

#: The suffix of overlay videos.
VIDEO_SUFFIX = ".mp4"

# zlib level for overlays: level 1 encodes about 4x faster than Pillow's default 6, for
# files about 10% larger - at batch speed, encoding would otherwise cost more than the CAM.
_PNG_LEVEL = 1

# JPEG quality of panels: at 90 the picture is indistinguishable from the PNG's.
_PANEL_QUALITY = 90

HeatmapFormat = Literal["npz", "png16"]


@dataclass(frozen=True)
class RenderOptions:
    """How heatmaps are drawn: blend weight of the heatmap and matplotlib colour map."""

    alpha: float = 0.5
    colormap: str = "jet"


@dataclass(frozen=True)
class Outputs:
    """Which files are written per image (the manifest rows always are).

    Attributes:
        overlay: The heatmap over the photo (for videos, also the overlay video).
        panel: Image | heatmap | overlay with the class and probability (images only).
        heatmap: The raw map as ``"npz"`` (float32) or ``"png16"`` (16-bit PNG), or None.
    """

    overlay: bool = True
    panel: bool = True
    heatmap: HeatmapFormat | None = None

    def __post_init__(self) -> None:
        if self.heatmap not in (None, "npz", "png16"):
            raise CamvizError(f"heatmap must be 'npz', 'png16' or None, not {self.heatmap!r}")


def explain_files(
    inputs: PathLike | Iterable[PathLike],
    out_dir: PathLike,
    loaded: LoadedModel,
    *,
    method: str = "gradcam",
    layer: Layer | Sequence[Layer] | None = None,
    target: Target = None,
    render: RenderOptions = RenderOptions(),
    outputs: Outputs = Outputs(),
    batch_size: int = 16,
    workers: int = 0,
    every: int = 1,
    writers: int = 2,
    progress: bool | None = False,
    precision: str = "fp32",
    channels_last: bool = False,
    memory_budget: int | str | None = None,
    task_options: TaskOptions | None = None,
    input_size: int | None = None,
) -> dict[str, Any]:
    """Explain images, folders, globs, path lists and videos; write the results to a folder.

    See the module docstring for what is written, resuming, and ``torchrun``.

    Args:
        inputs: Files, folders, glob patterns, ``.txt`` path lists, videos.
        out_dir: Folder for the results; created (to hold its lock) when the job starts, and
            removed again if the job fails before writing anything into it.
        loaded: A model from :func:`camviz.models.load` (model, preprocessing, class names),
            on the device it should run on.
        method: A CAM method name (``camviz methods`` lists them).
        layer: Target layer name(s); ``None`` uses the model's known default or finds one.
        target: What to explain (class id, ``"top1"``, ``"top3"``, ...).
        render: Colour map and blend weight of the overlays.
        outputs: Which files to write per image.
        batch_size: Images per forward pass.
        workers: DataLoader processes that decode and preprocess images.
        every: For videos, explain every ``every``-th frame.
        writers: Threads that draw and write the files.
        progress: A progress bar on stderr: ``True``, ``False``, or ``None`` (on a terminal).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` forward passes (see
            :func:`camviz.explain`).
        channels_last: Channels-last inputs for the model (see :func:`camviz.explain`).
        memory_budget: Bytes (or ``"512MiB"``) that the perturbed passes of Score-CAM,
            SS-CAM, IS-CAM and Ablation-CAM may add (their ``memory_budget`` option; other
            methods do not batch copies and ignore it). ``None``: the methods' default.
        task_options: For detectors (``min_score``, ``max_objects``) and video models
            (``clip_len``, ``stride``); ``None``: the defaults. A detector returns every
            detection scored ``min_score`` or more during the run (see
            :func:`camviz.pipeline.tasks.prepared`).
        input_size: Scale images (frames) to this many pixels on their shorter side
            instead of the model's size (for a detector: its own resize), see
            :func:`camviz.models.with_input_size`.

    Returns:
        The summary, as written to ``out_dir/manifest.json`` (settings, counts, failures,
        videos, other files); the rows of every input are in ``out_dir/manifest.jsonl``.

    Raises:
        CamvizError: No input can be explained, the output folder is unusable, in use by
            another job or holds another run's results, a write fails (a full disk), or a
            bad method, layer or target.
    """
    out = Path(out_dir)
    cam = get_method(method)  # an unknown name fails before any work
    method = cam.name
    method_options = budget_option(cam, memory_budget)  # a bad budget too
    device = model_device(loaded.model) or torch.device("cpu")
    check_precision(precision, device, used=cam.reduced_precision)
    check_out_dir(out)
    task_options = task_options or TaskOptions()
    _check_task_outputs(loaded, outputs)
    clips = clip_spec(loaded.task, loaded.clip_len, task_options)
    items = expand(
        inputs,
        every=every,
        exclude=manifest.written_files(out),
        output_folder=out,
        max_name_bytes=_name_max(out),
        clips=clips,
    )
    if not items:
        raise CamvizError(
            "no image or video found in the inputs (files camviz wrote are never inputs); "
            "pass image files, folders, glob patterns, path lists or videos"
        )
    items = fit_task(items, loaded.task, loaded.name)
    settings = _settings(loaded, method, layer, target, render, outputs)
    settings["precision"] = precision
    settings.update(_task_settings(loaded, task_options, clips, input_size))
    with (
        distributed.session() as context,
        lock.locked(out, context),
        prepared(loaded, task_options, input_size) as running,
    ):
        try:
            _run(
                out,
                items,
                running,
                settings,
                render,
                outputs,
                context,
                every,
                method=method,
                layer=layer,
                target=target,
                batch_size=batch_size,
                workers=workers,
                writers=writers,
                progress=progress,
                precision=precision,
                channels_last=channels_last,
                **method_options,
                task_options=task_options,
            )
        except OSError as error:  # a full disk, a quota, a folder removed under the run
            reason = error.strerror or type(error).__name__
            raise CamvizError(
                f"cannot write to {str(out)!r} ({reason}); make room (or fix the folder) and "
                "run the same command again: it resumes where it stopped"
            ) from None
    return json.loads((out / MANIFEST).read_text(encoding="utf-8"))


def _run(
    out: Path,
    items: list[Item],
    loaded: LoadedModel,
    settings: dict[str, Any],
    render: RenderOptions,
    outputs: Outputs,
    context: distributed.Context,
    every: int,
    **options: Any,
) -> None:
    """The job, once the folder is held: resume, explain what is left, merge, finish."""
    _check_settings(out, settings)
    done = manifest.finished(out, manifest.read_rows(out))
    if context.is_main:
        manifest.remove_temporaries(out)
    todo = [index for index, item in enumerate(items) if item.key not in done]
    distributed.barrier(context)
    job = _Job(out, items, loaded, settings, render, outputs, context)
    progress = options.pop("progress") if context.is_main else False  # one bar, not N
    options.pop("progress", None)
    job.run(distributed.shard(todo, context), progress=progress, **options)
    if distributed.total(job.explained, context) == 0 and len(todo) == len(items):
        raise CamvizError(job.failure_message())  # nothing explained, now or before
    job.close()
    distributed.barrier(context)
    if context.is_main:
        _finish(out, items, settings, every, already_done=len(items) - len(todo))
    distributed.barrier(context)


def _name_max(out: Path) -> int:
    """The longest file name the output folder's file system takes (at most 255 bytes)."""
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    try:
        return min(NAME_MAX, os.pathconf(existing, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return NAME_MAX


class _Job:
    """One process's share of the work: explain, write files, append rows."""

    def __init__(
        self,
        out: Path,
        items: list[Item],
        loaded: LoadedModel,
        settings: dict[str, Any],
        render: RenderOptions,
        outputs: Outputs,
        context: distributed.Context,
    ) -> None:
        self.out = out
        self.items = items
        self.loaded = loaded
        self.settings = settings
        self.render = render
        self.outputs = outputs
        self.context = context
        self.log: manifest.RowLog | None = None
        self.failures: list[dict[str, Any]] = []
        self.explained = 0
        # Pixel-level saliency is drawn clipped: a few pixels hold the maximum.
        self.clip = SALIENCY_PERCENTILE if get_method(settings["method"]).pixel_level else None
        self.device = drawing_device(model_device(loaded.model))

    def run(self, indices: list[int], *, writers: int, **options: Any) -> None:
        from camviz.pipeline.writer import Writer

        results = explain_dataset(
            self.loaded,
            ItemDataset(self.items),
            indices=indices,
            keep_images=self.outputs.overlay or self.outputs.panel,
            **options,
        )
        try:
            # The queue holds a few batches' worth of results, each with its photo.
            with Writer(threads=writers, queue_size=2 * options["batch_size"]) as writer:
                for result in results:
                    if result.ok:
                        self._open()
                        self.explained += 1
                        writer.submit(self._write, result)
                    else:
                        row = _row(self.items[result.index], result, [])
                        self.failures.append(row)
                        if self.log is not None:
                            self.log.append(row)
        except BaseException:
            if self.log is not None:
                self.log.close()
            raise

    def close(self) -> None:
        """Write the rows of failed inputs if nothing opened the folder yet; close the log."""
        if self.failures:
            self._open()
        if self.log is not None:
            self.log.close()

    def failure_message(self) -> str:
        """One line for a run in which nothing could be explained."""
        if not self.failures:
            return "no input could be explained; see the other processes' messages"
        first = self.failures[0]["reason"]
        if len(self.failures) == 1:
            return first
        return f"none of the {len(self.failures)} inputs could be explained; the first: {first}"

    def _open(self) -> None:
        """Create the output folder, the settings and the row log, on first use."""
        if self.log is not None:
            return
        _write_manifest(self.out, {"complete": False, "settings": self.settings})
        self.log = manifest.RowLog(
            manifest.log_path(self.out, self.context.rank, self.context.world_size)
        )
        for row in self.failures:  # inputs that failed before the folder existed
            self.log.append(row)

    def _write(self, result: ImageResult) -> None:
        """Draw and write one image's files, then its row (runs on a writer thread)."""
        item = self.items[result.index]
        assert result.heatmaps is not None and self.log is not None  # ok; run() opened the log
        ranks = len(result.explained)
        explained = []
        for rank, (prediction, heatmap) in enumerate(
            zip(result.explained, result.heatmaps, strict=True)
        ):
            stem = item.name if ranks == 1 else f"{item.name}_rank{rank + 1}"
            files = self._write_files(stem, item, result, prediction, heatmap)
            entry = {**_prediction(prediction), "files": files}
            if not bool(heatmap.any()):  # a picture of it shows nothing: say so
                entry["empty"] = True
            explained.append(entry)
        panel = self._write_detection_panel(item, result) if self._detections(result) else None
        self.log.append(_row(item, result, explained, [] if panel is None else [panel]))

    def _detections(self, result: ImageResult) -> bool:
        """Whether ``result`` holds detected objects to draw in one panel."""
        return self.outputs.panel and bool(result.explained) and result.explained[0].box is not None

    def _write_detection_panel(self, item: Item, result: ImageResult) -> str:
        """The panel of every explained object of one image; returns its file name."""
        assert result.image is not None and result.heatmaps is not None  # kept for panels
        name = f"{item.name}_panel.jpg"
        drawn = detection_panel(
            result.image,
            list(result.heatmaps),
            [prediction.box or [] for prediction in result.explained],
            [_object_label(prediction) for prediction in result.explained],
            title=f"{result.method}, layer {', '.join(result.layers)}",
            alpha=self.render.alpha,
            colormap=self.render.colormap,
            clip=self.clip,
        )
        with atomic_write(self.out / name) as file:
            drawn.save(file, format="JPEG", quality=_PANEL_QUALITY)
        return name

    def _write_files(
        self,
        stem: str,
        item: Item,
        result: ImageResult,
        prediction: Prediction,
        heatmap: torch.Tensor,
    ) -> dict[str, str]:
        files = {}
        alpha, colormap = self.render.alpha, self.render.colormap
        image = result.image  # kept whenever an overlay or a panel is drawn
        if self.outputs.overlay and result.frames is not None:
            files["overlay"] = f"{stem}_overlay{VIDEO_SUFFIX}"
            self._write_clip(item, result.frames, heatmap, self.out / files["overlay"])
        elif self.outputs.overlay:
            assert image is not None
            files["overlay"] = f"{stem}_overlay.png"
            drawn = overlay(image, heatmap, alpha, colormap, clip=self.clip, device=self.device)
            if prediction.box is not None:
                draw_box(drawn, prediction.box, _object_label(prediction))
            _save_png(drawn, self.out / files["overlay"])
        if self.outputs.panel and item.frame is None and prediction.box is None:
            assert image is not None
            files["panel"] = f"{stem}_panel.jpg"
            shown = (
                f"p={prediction.probability:.2f}"
                if prediction.probability is not None
                else f"score {prediction.score:.2f}"
            )
            layers = ", ".join(result.layers)
            title = f"{prediction.name}: {shown} ({result.method}, layer {layers})"
            drawn = panel_image(
                image,
                heatmap,
                title=title,
                alpha=alpha,
                colormap=colormap,
                clip=self.clip,
                device=self.device,
            )
            with atomic_write(self.out / files["panel"]) as file:
                drawn.save(file, format="JPEG", quality=_PANEL_QUALITY)
        if self.outputs.heatmap is not None:
            suffix = ".npz" if self.outputs.heatmap == "npz" else ".png"
            files["heatmap"] = f"{stem}_heatmap{suffix}"
            save_heatmap(heatmap, self.out / files["heatmap"])
        return files

    def _write_clip(
        self, item: Item, frames: torch.Tensor, heatmap: torch.Tensor, path: Path
    ) -> None:
        """A clip's overlay video: its ``(T, H, W, 3)`` frames with the ``(T, h, w)`` map."""
        path.parent.mkdir(parents=True, exist_ok=True)
        clip = frames.permute(3, 0, 1, 2).float().div_(255)
        clip_video(
            clip,
            heatmap,
            path,
            fps=frame_rate(item.path),
            alpha=self.render.alpha,
            colormap=self.render.colormap,
        )


def _object_label(prediction: Prediction) -> str:
    """A detected object's label as drawn: its class name and score."""
    return f"{prediction.name} {prediction.score:.2f}"


def drawing_device(device: torch.device | None) -> torch.device | None:
    """Where overlays and panels are computed for a model on ``device``: on a CUDA GPU, the
    GPU itself (:mod:`camviz.io.render`); else the CPU (``None``), also for other
    accelerators, which lack some of the operations (MPS has no ``kthvalue``)."""
    return device if device is not None and device.type == "cuda" else None


def save_heatmap(heatmap: torch.Tensor, path: PathLike) -> Path:
    """Write a ``(H, W)`` map in ``[0, 1]``, atomically, as ``.npz`` or 16-bit ``.png``.

    ``.npz`` keeps the float32 values under the key ``heatmap`` (``np.load(path)["heatmap"]``);
    ``.png`` stores ``round(value * 65535)`` as 16-bit grey, 1/65535 apart from the values.
    """
    path = Path(path)
    values = heatmap.detach().to("cpu", torch.float32).numpy()
    with atomic_write(path) as file:
        if path.suffix == ".npz":
            np.savez_compressed(file, heatmap=values)
        else:
            levels = np.rint(np.clip(values, 0, 1) * 65535).astype(np.uint16)
            Image.fromarray(levels).save(file, format="PNG")
    return path


def _save_png(image: Image.Image, path: Path) -> None:
    with atomic_write(path) as file:
        image.save(file, format="PNG", compress_level=_PNG_LEVEL)


def _prediction(prediction: Prediction) -> dict[str, Any]:
    entry = {
        "id": prediction.id,
        "name": prediction.name,
        "score": prediction.score,
        "probability": prediction.probability,
    }
    if prediction.box is not None:
        entry["box"] = [round(value, 2) for value in prediction.box]
    return entry


def _row(
    item: Item, result: ImageResult, explained: list[dict[str, Any]], others: Sequence[str] = ()
) -> dict[str, Any]:
    """The manifest row of one input (see the module docstring); ``others``: files of the
    whole input (a detection panel)."""
    top = [_prediction(prediction) for prediction in result.top]
    return {
        "input": item.path,
        "frame": item.frame,
        "status": result.status,
        "reason": result.reason,
        "size": None if result.size is None else list(result.size),
        "prediction": top[0] if top else None,
        "top5": top,
        "explained": explained,
        "files": [name for entry in explained for name in entry["files"].values()] + [*others],
        "layers": result.layers,
        "seconds": round(result.seconds, 4),
    }


def _settings(
    loaded: LoadedModel,
    method: str,
    layer: Layer | Sequence[Layer] | None,
    target: Target,
    render: RenderOptions,
    outputs: Outputs,
) -> dict[str, Any]:
    """What decides the results; a resumed run must match it (as stored in JSON)."""
    settings = {
        "model": loaded.name,
        "classes": len(loaded.categories),
        "method": method,
        "layer": _layer_setting(loaded.model, layer),
        "target": _target_text(target),
        "alpha": render.alpha,
        "colormap": render.colormap,
        "overlay": outputs.overlay,
        "panel": outputs.panel,
        "heatmap": outputs.heatmap,
    }
    return json.loads(json.dumps(settings))


def _task_settings(
    loaded: LoadedModel,
    options: TaskOptions,
    clips: tuple[int, int] | None,
    input_size: int | None,
) -> dict[str, Any]:
    """The settings that only some tasks have (none for a classifier at its own size)."""
    settings: dict[str, Any] = {} if input_size is None else {"input_size": input_size}
    if loaded.task != "classification":
        settings["task"] = loaded.task
    if loaded.task == "detection":
        settings.update(min_score=options.min_score, max_objects=options.max_objects)
    if clips is not None:
        settings.update(clip_len=clips[0], stride=clips[1])
    return settings


def _check_task_outputs(loaded: LoadedModel, outputs: Outputs) -> None:
    """Refuse outputs the model's task cannot have, before any work."""
    if loaded.task == "video" and outputs.heatmap == "png16":
        raise CamvizError(
            f"{loaded.name} is a video model: its maps have a time axis, which a 16-bit PNG "
            "cannot hold; use --heatmap npz"
        )


def _target_text(target: Target) -> int | str | None:
    return target if isinstance(target, (int, str, type(None))) else repr(target)


def _layer_setting(
    model: torch.nn.Module, layer: Layer | Sequence[Layer] | None
) -> str | list[str] | None:
    """``layer`` as JSON: names and patterns as given, a submodule by its name in ``model``."""

    def named(one: Layer) -> str:
        return one if isinstance(one, str) else next(iter(resolve_layers(model, one)))

    if layer is None:
        return None
    if isinstance(layer, (str, torch.nn.Module)):
        return named(layer)
    return [named(one) for one in layer]


def _check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Refuse to resume into a folder whose results were made with other settings."""
    previous = _read_manifest(out)
    if previous is None:
        return
    stored = previous.get("settings")
    if stored == settings:
        return
    differences = (
        [
            f"{key} {stored.get(key)!r} there, {value!r} now"
            for key, value in settings.items()
            if stored.get(key) != value
        ]
        if isinstance(stored, dict)
        else ["it has no camviz settings"]
    )
    raise CamvizError(
        f"{out} holds the results of another run ({'; '.join(differences)}); pass another "
        "--out, or delete that folder to start again"
    )


def _read_manifest(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError):
        return {}


def _write_manifest(out: Path, content: dict[str, Any]) -> None:
    with atomic_write(out / MANIFEST, "w") as file:
        file.write(manifest.dumps(content, indent=2) + "\n")


def _finish(
    out: Path, items: list[Item], settings: dict[str, Any], every: int, already_done: int
) -> None:
    """Merge the rows, write the overlay videos and the complete ``manifest.json``."""
    previous = _read_manifest(out) or {}
    rows, others = manifest.merge(out, [item.key for item in items])
    explained = [row for row in rows if row["status"] == "ok"]
    stride = settings.get("stride")
    videos = _write_videos(out, items, rows, every, stride) if settings["overlay"] else []
    current = {name for row in explained for name in row["files"]}
    current.update(video["file"] for video in videos)
    earlier = [name for row in others for name in row.get("files", [])]
    earlier += [
        video.get("file") for video in previous.get("videos", []) if isinstance(video, dict)
    ]
    earlier += previous.get("other_files", [])
    _write_manifest(
        out,
        {
            "model": settings["model"],
            "method": settings["method"],
            "layers": explained[0]["layers"] if explained else None,
            "target": settings["target"],
            "complete": True,
            "counts": {
                "ok": len(explained),
                "error": len(rows) - len(explained),
                "already_done": already_done,
                "empty_maps": sum(
                    bool(entry.get("empty")) for row in explained for entry in row["explained"]
                ),
            },
            "settings": settings,
            "rows": manifest.ROWS,
            "failures": [row for row in rows if row["status"] != "ok"],
            "videos": videos,
            "other_files": sorted(
                {
                    name
                    for name in earlier
                    if isinstance(name, str) and name not in current and (out / name).is_file()
                }
            ),
        },
    )


def _write_videos(
    out: Path, items: list[Item], rows: list[dict[str, Any]], every: int, stride: int | None
) -> list[dict[str, Any]]:
    """One overlay video per input video, in order: from its explained frames' overlays or,
    for a video model (``stride`` given), from its clips' overlay videos, each clip up to
    where the next one starts, so that every frame shows once."""
    by_key = {manifest.row_key(row): row for row in rows}
    # video name -> (path, [(overlay file, frame or clip start)])
    frames: dict[str, tuple[str, list[tuple[str, int]]]] = {}
    for item in items:
        row = by_key.get(item.key)
        if item.video is None or item.frame is None or row is None or not row["explained"]:
            continue
        overlay_file = row["explained"][0]["files"]["overlay"]
        frames.setdefault(item.video, (item.path, []))[1].append((overlay_file, item.frame))
    videos = []
    for name, (path, overlays) in frames.items():
        video = f"{name}_overlay{VIDEO_SUFFIX}"
        if stride is None:
            pictures: Iterable[Path | Image.Image] = (out / file for file, _ in overlays)
            fps = frame_rate(path) / every
        else:
            pictures, fps = _clip_frames(out, overlays), frame_rate(path)
        count = write_video(pictures, out / video, fps)
        entry = {"input": path, "frames": count, "every": every, "file": video}
        videos.append(entry if stride is None else {**entry, "every": 1, "stride": stride})
    return videos


def _clip_frames(out: Path, clips: list[tuple[str, int]]) -> Iterator[Image.Image]:
    """The frames of consecutive clips' overlay videos (file, first frame), each clip's up to
    where the next one starts (all of the last one's)."""
    reader = FrameReader()
    try:
        for number, (name, start) in enumerate(clips):
            count = frame_count(out / name)
            following = clips[number + 1][1] if number + 1 < len(clips) else start + count
            for index in range(min(count, following - start)):
                yield reader.read(str(out / name), index)
    finally:
        reader.close()


def check_out_dir(out: Path) -> None:
    """Fail early, before any work, if ``out`` cannot become a folder we write into."""
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir():
        raise CamvizError(
            f"cannot use {str(out)!r} as the output folder: {str(existing)!r} is a file; "
            "pass --out a folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CamvizError(f"output folder {str(out)!r} is not writable; pass --out another folder")
