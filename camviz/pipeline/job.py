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
  :mod:`camviz.pipeline.manifest`): ``input`` (and ``input_bytes`` for a path that is not
  UTF-8), ``frame``, ``status`` (``ok`` or ``error``),
  ``reason``, ``size``, ``prediction`` (top-1), ``top5``, ``explained`` (the explained
  classes with ``id``, ``name``, ``score``, ``probability`` and their ``files``; a detected
  object also its ``box``, ``[x0, y0, x1, y1]`` in the photo's pixels; ``"empty": true``
  when the map is all zero, no positive evidence at the layer), ``files``,
  ``layers`` and ``seconds`` (decoding plus the image's share of its batch). An input with
  nothing to explain (no object above ``min_score``, no pixel of the class) is ``ok`` with
  no ``explained`` entry, and its ``reason`` says so;
* ``manifest.json``: the run's settings and, at the end, the counts (``ok``, ``error``,
  ``already_done``: inputs a previous run had finished, and ``empty_maps``), the rows of
  the inputs that failed (``failures``), the videos, ``other_files``: files in the folder
  written for inputs that are not among this run's (a rerun with fewer inputs), and
  ``skipped_rows``: lines of the row log that were not camviz rows. The rows of every input
  stay in ``manifest.jsonl`` only, so this file stays small however many inputs there are.
  While a run is under way it holds ``"complete": false``. Both manifests are strict JSON
  (no ``NaN``).

**Unreadable inputs** are skipped and get a row with the reason; so do special files
(FIFOs, devices) and inputs whose output or map is not finite (NaN weights). If *no* input
can be explained (one bad file, a folder of bad files) the job raises a
:class:`~camviz.core.errors.CamvizError` and leaves nothing behind, as after any other user
mistake: a folder created for the run is removed again while it is empty, and a mistake in
the method, layer or target surfaces before any work or with the first input. Errors that
belong to an input (the model failed on it, its map is not finite, memory ran out) are
retried one image at a time and then become its row; any other exception is a bug of camviz
and stops the run with its traceback.

**Outputs are never inputs.** The files the folder's manifests list, and those an
interrupted run wrote before their rows (marked as camviz's, :mod:`camviz.pipeline.encoders`),
are left out of the inputs, so ``camviz explain photos --out photos`` explains the user's
photos and never its own overlays, however often it is run. The user's own files stay
inputs, also one named like an output (``cat_overlay.png`` beside ``cat.png``), and no
output is written over them: the input whose output it would be gets another name
(``cat-3f2a9c1b_overlay.png``, see :mod:`camviz.pipeline.inputs`). A ``manifest.jsonl``
that camviz did not write is refused and left as it is.

**One job per folder.** A job holds its output folder with a lock (see
:mod:`camviz.pipeline.lock`); a second job into the same folder stops at once with one
line, before touching anything.

**A full disk** stops the run with one line; every file is complete or absent, and the
same command resumes once there is space. So does an output folder removed or moved during
the run (the rows would be lost).

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

import os
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from camviz.cams import get as get_method
from camviz.cams.settings import settings_or_keywords
from camviz.core.errors import CamvizError
from camviz.core.inputs import model_device
from camviz.core.layers import Layer
from camviz.core.targets import Target
from camviz.io.images import PathLike
from camviz.io.models import LoadedModel
from camviz.io.output import clip_video
from camviz.io.pictures import (
    SALIENCY_PERCENTILE,
    detection_panel,
    draw_box,
    overlay,
    overlay_and_panel,
    panel_image,
)
from camviz.io.video import frame_rate
from camviz.pipeline import distributed, lock, manifest, merging
from camviz.pipeline.dataset import ImageResult, ItemDataset, Prediction, explain_dataset
from camviz.pipeline.encoders import existing_outputs, save_heatmap, save_jpeg
from camviz.pipeline.encoders import save_png as _save_png
from camviz.pipeline.inputs import NAME_MAX, Item, expand
from camviz.pipeline.naming import VIDEO_SUFFIX, result_files
from camviz.pipeline.settings import HeatmapFormat, JobSettings, Outputs, RenderOptions
from camviz.pipeline.tasks import TaskOptions, clip_spec, fit_task, prepared
from camviz.pipeline.threads import model_threads, running_on, takes_turns
from camviz.pipeline.videos import write_videos
from camviz.pipeline.volumes import explain_volume, is_volume_item, write_volume_files

# The names this module always offered, now made in the modules beside it.
__all__ = [
    "MANIFEST",
    "VIDEO_SUFFIX",
    "HeatmapFormat",
    "JobSettings",
    "Outputs",
    "RenderOptions",
    "check_out_dir",
    "drawing_device",
    "explain_files",
    "save_heatmap",
]

#: The run's summary: settings, and every row once the run is complete.
MANIFEST = manifest.SUMMARY


def explain_files(
    inputs: PathLike | Iterable[PathLike],
    out_dir: PathLike,
    loaded: LoadedModel,
    settings: JobSettings | None = None,
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
    threads: int | None = None,
    progress: bool | None = False,
    precision: str = "fp32",
    channels_last: bool | None = None,
    memory_budget: int | str | None = None,
    task_options: TaskOptions | None = None,
    input_size: int | None = None,
) -> dict[str, Any]:
    """Explain images, folders, globs, path lists and videos; write the results to a folder.

    See the module docstring for what is written, resuming, and ``torchrun``. The settings
    are keywords or one :class:`~camviz.pipeline.settings.JobSettings` holding them
    (``camviz explain`` builds one), not both.

    Args:
        inputs: Files, folders, glob patterns, ``.txt`` path lists, videos.
        out_dir: Folder for the results; created (to hold its lock) when the job starts, and
            removed again if the job fails before writing anything into it.
        loaded: A model from :func:`camviz.models.load` (model, preprocessing, class names),
            on the device it should run on.
        settings: All the settings in one object.
        **keywords: The settings one by one instead (``method``, ``layer``, ``target``,
            ``render``, ``outputs``, ``batch_size``, ``workers``, ``every``, ``writers``,
            ``threads``, ``progress``, ``precision``, ``channels_last``, ``memory_budget``,
            ``task_options``, ``input_size``): each is the attribute of that name of
            :class:`~camviz.pipeline.settings.JobSettings`, which says what it does.

    Returns:
        The summary, as written to ``out_dir/manifest.json`` (settings, counts, failures,
        videos, other files); the rows of every input are in ``out_dir/manifest.jsonl``.

    Raises:
        CamvizError: No input can be explained, the output folder is unusable, in use by
            another job or holds another run's results, a write fails (a full disk), or a
            bad method, layer or target.
    """
    keywords = JobSettings(
        method=method,
        layer=layer,
        target=target,
        render=render,
        outputs=outputs,
        batch_size=batch_size,
        workers=workers,
        every=every,
        writers=writers,
        threads=threads,
        progress=progress,
        precision=precision,  # type: ignore[arg-type]  # checked by JobSettings.check
        channels_last=channels_last,
        memory_budget=memory_budget,
        task_options=task_options or TaskOptions(),
        input_size=input_size,
    )
    chosen = settings_or_keywords(settings, keywords)
    chosen = replace(chosen, method=get_method(chosen.method).name)  # an unknown name fails
    return _explain_files(inputs, Path(out_dir), loaded, chosen)


def _explain_files(
    inputs: PathLike | Iterable[PathLike], out: Path, loaded: LoadedModel, settings: JobSettings
) -> dict[str, Any]:
    """:func:`explain_files` with its settings chosen: check, list the inputs, hold the
    folder, run, and turn a failed write into one line."""
    options = settings.check(loaded)
    check_out_dir(out)
    manifest.check_folder(out)
    clips = clip_spec(loaded.task, loaded.clip_len, settings.task_options)
    items = fit_task(_items(inputs, out, settings.every, clips), loaded.task, loaded.name)
    recorded = settings.recorded(loaded, clips)
    with (
        distributed.session() as context,
        lock.locked(out, context),
        prepared(loaded, settings.task_options, settings.input_size) as running,
    ):
        try:
            _run(out, items, running, settings, recorded, options, context)
        except OSError as error:  # a full disk, a quota, a folder removed under the run
            reason = error.strerror or type(error).__name__
            raise CamvizError(
                f"cannot write to {str(out)!r} ({reason}); make room (or fix the folder) and "
                "run the same command again: it resumes where it stopped"
            ) from None
    return manifest.read_summary(out) or {}


def _items(
    inputs: PathLike | Iterable[PathLike], out: Path, every: int, clips: tuple[int, int] | None
) -> list[Item]:
    """The inputs, without the files camviz wrote, named so that no output lands on a file
    of the user's."""
    written = manifest.written_files(out)
    leftovers, taken = existing_outputs(out, written, manifest.folder_used(out))
    items = expand(
        inputs,
        every=every,
        exclude=written | leftovers,
        taken=taken,
        max_name_bytes=_name_max(out),
        clips=clips,
    )
    if not items:
        raise CamvizError(
            "no image or video found in the inputs (files camviz wrote are never inputs); "
            "pass image files, folders, glob patterns, path lists or videos"
        )
    return items


def _run(
    out: Path,
    items: list[Item],
    loaded: LoadedModel,
    settings: JobSettings,
    recorded: dict[str, Any],
    options: dict[str, Any],
    context: distributed.Context,
) -> None:
    """The job, once the folder is held: resume, explain what is left, merge, finish."""
    manifest.check_settings(out, recorded)
    done = manifest.done_keys(out)
    if context.is_main:
        manifest.remove_temporaries(out)
    todo = [index for index, item in enumerate(items) if item.key not in done]
    distributed.barrier(context)
    job = _Job(out, items, loaded, settings, recorded, context)
    job.run(distributed.shard(todo, context), options)
    if distributed.total(job.explained, context) == 0 and len(todo) == len(items):
        raise CamvizError(job.failure_message())  # nothing explained, now or before
    job.close()
    distributed.barrier(context)
    if context.is_main:
        _finish(out, items, recorded, settings.every, already_done=len(items) - len(todo))
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
        settings: JobSettings,
        recorded: dict[str, Any],
        context: distributed.Context,
    ) -> None:
        self.out = out
        self.items = items
        self.loaded = loaded
        self.settings = settings
        self.recorded = recorded
        self.render = settings.render
        self.outputs = settings.outputs
        self.context = context
        self.log: manifest.RowLog | None = None
        self.failures: list[dict[str, Any]] = []
        self.explained = 0
        # Pixel-level saliency is drawn clipped: a few pixels hold the maximum.
        self.clip = SALIENCY_PERCENTILE if get_method(settings.method).pixel_level else None
        self.device = drawing_device(model_device(loaded.model))

    def run(self, indices: list[int], options: dict[str, Any]) -> None:
        """Explain the items at ``indices`` with ``options`` for :func:`camviz.explain`."""
        from camviz.pipeline.writer import Writer

        volumes = {index for index in indices if is_volume_item(self.items[index])}
        for index in sorted(volumes):
            self._volume(index, options)
        indices = [index for index in indices if index not in volumes]
        if not indices:
            return
        settings = self.settings
        device = model_device(self.loaded.model)
        threads = model_threads(settings.threads, device, settings.workers)
        # Taking turns with the model, the helpers have every core between its passes.
        turns = takes_turns(device, settings.workers)
        helpers = max(settings.writers, threads) if turns else settings.writers
        try:
            # The queue holds a few batches' worth of results, each with its photo.
            with (
                running_on(threads),
                Writer(threads=helpers, queue_size=2 * settings.batch_size) as writer,
            ):
                results = explain_dataset(
                    self.loaded,
                    ItemDataset(self.items),
                    method=settings.method,
                    layer=settings.layer,
                    target=settings.target,
                    batch_size=settings.batch_size,
                    workers=settings.workers,
                    every=settings.every,
                    indices=indices,
                    keep_images=self.outputs.overlay or self.outputs.panel,
                    progress=settings.progress if self.context.is_main else False,  # one bar
                    task_options=settings.task_options,
                    helpers=writer,
                    **options,
                )
                for result in results:
                    if result.ok:
                        self._open()
                        self.explained += 1
                        writer.submit(self._write, result)
                    else:
                        self._failed(_row(self.items[result.index], result, []))
        except BaseException:
            if self.log is not None:
                self.log.close(check=False)
                self.log = None
            raise

    def _volume(self, index: int, options: dict[str, Any]) -> None:
        """Explain one NIfTI volume, write its files and its row (see
        :mod:`camviz.pipeline.volumes`); a volume that fails gets a failed row."""
        item = self.items[index]
        try:
            result = explain_volume(self.loaded, item.path, self.settings, options)
        except CamvizError as error:
            self._failed(_row(item, ImageResult(index, item.path, None, "error", str(error)), []))
            return
        self._open()
        assert self.log is not None  # _open made it
        self.explained += 1
        explained = write_volume_files(self.out, item.name, result, self.settings, self.clip)
        self.log.append({**_row(item, result.outcome(index), explained), **result.row_fields()})

    def _failed(self, row: dict[str, Any]) -> None:
        self.failures.append(row)
        if self.log is not None:
            self.log.append(row)

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
        manifest.write_summary(self.out, {"complete": False, "settings": self.recorded})
        self.log = manifest.RowLog(
            manifest.log_path(self.out, self.context.rank, self.context.world_size)
        )
        for row in self.failures:  # inputs that failed before the folder existed
            self.log.append(row)

    def _write(self, result: ImageResult) -> None:
        """Draw and write one image's files, then its row (runs on a writer thread)."""
        item = self.items[result.index]
        assert result.heatmaps is not None and self.log is not None  # ok; run() opened the log
        boxes = bool(result.explained) and result.explained[0].box is not None
        names = result_files(
            item.name,
            len(result.explained),
            self.outputs,
            still=item.frame is None,
            clip=result.frames is not None,
            boxes=boxes,
        )
        explained = []
        for prediction, heatmap, files in zip(
            result.explained, result.heatmaps, names.ranks, strict=True
        ):
            self._write_files(files, item, result, prediction, heatmap)
            entry = {**prediction.fields(), "files": files}
            if not bool(heatmap.any()):  # a picture of it shows nothing: say so
                entry["empty"] = True
            explained.append(entry)
        for name in names.whole:
            self._write_detection_panel(name, result)
        self.log.append(_row(item, result, explained, names.whole))

    def _write_detection_panel(self, name: str, result: ImageResult) -> None:
        """The panel of every explained object of one image."""
        assert result.image is not None and result.heatmaps is not None  # kept for panels
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
        save_jpeg(drawn, self.out / name)

    def _write_files(
        self,
        files: dict[str, str],
        item: Item,
        result: ImageResult,
        prediction: Prediction,
        heatmap: torch.Tensor,
    ) -> None:
        """Draw and write one map's ``files`` (by kind, as named by
        :func:`~camviz.pipeline.naming.result_files`)."""
        image = result.image  # kept whenever an overlay or a panel is drawn
        if "overlay" in files and result.frames is not None:
            self._write_clip(item, result.frames, heatmap, self.out / files["overlay"])
        elif "overlay" in files or "panel" in files:
            assert image is not None
            drawn, panel = self._draw(image, heatmap, result, prediction, files)
            if drawn is not None:
                if prediction.box is not None:
                    draw_box(drawn, prediction.box, _object_label(prediction))
                _save_png(drawn, self.out / files["overlay"])
            if panel is not None:
                save_jpeg(panel, self.out / files["panel"])
        if "heatmap" in files:
            save_heatmap(heatmap, self.out / files["heatmap"])

    def _draw(
        self,
        image: Image.Image,
        heatmap: torch.Tensor,
        result: ImageResult,
        prediction: Prediction,
        files: dict[str, str],
    ) -> tuple[Image.Image | None, Image.Image | None]:
        """The overlay and the panel of one map, those of the two that ``files`` holds;
        both drawn together when both are (what they share is made once)."""
        alpha, colormap, clip, device = (
            self.render.alpha,
            self.render.colormap,
            self.clip,
            self.device,
        )
        if "panel" not in files:
            return overlay(image, heatmap, alpha, colormap, clip=clip, device=device), None
        shown = (
            f"p={prediction.probability:.2f}"
            if prediction.probability is not None
            else f"score {prediction.score:.2f}"
        )
        title = f"{prediction.name}: {shown} ({result.method}, layer {', '.join(result.layers)})"
        draw = overlay_and_panel if "overlay" in files else panel_image
        drawn = draw(
            image, heatmap, title=title, alpha=alpha, colormap=colormap, clip=clip, device=device
        )
        return drawn if isinstance(drawn, tuple) else (None, drawn)

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


def _row(
    item: Item, result: ImageResult, explained: list[dict[str, Any]], others: Sequence[str] = ()
) -> dict[str, Any]:
    """The manifest row of one input (see the module docstring); ``others``: files of the
    whole input (a detection panel)."""
    top = [prediction.fields() for prediction in result.top]
    return {
        **manifest.input_fields(item.path),
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


def _finish(
    out: Path, items: list[Item], settings: dict[str, Any], every: int, already_done: int
) -> None:
    """Merge the rows, write the overlay videos and the complete ``manifest.json``."""
    previous = manifest.read_summary(out) or {}
    merged = merging.merge(out, [item.key for item in items], manifest.summary_files(previous))
    stride = settings.get("stride")
    videos = write_videos(out, items, merged.overlays, every, stride) if settings["overlay"] else []
    manifest.write_summary(out, manifest.summary(out, settings, merged, videos, already_done))


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
