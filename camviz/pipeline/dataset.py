"""Explain many images: DataLoader workers or helper threads decode, the model explains in
batches, lazily.

:func:`explain_dataset` is a generator: it holds one batch (and a few waiting images) at a
time, so a notebook can walk through 100 000 images and keep only what it wants.

**Images of different sizes.** Preprocessing keeps each photo's aspect ratio, so photos
become tensors of different shapes. Decoded images wait in *buckets*, one per tensor shape,
and a bucket is explained when it holds a full batch; when many shapes wait at once, the
fullest bucket goes early, so memory stays bounded. Each heatmap covers exactly its photo
(why not padding or squashing: ``docs/architecture.md``).

**Unreadable inputs** (a corrupt file, a text file named ``.jpg``, a missing frame) do not
stop the run: they come out as results with ``status == "error"`` and the reason. Nor do
failures that belong to an input: the model failed on it (its exception, raised where camviz
calls the model, becomes a :class:`~camviz.core.errors.ModelError`), its output or map is
not finite, another :class:`~camviz.core.errors.CamvizError`, or memory ran out; the batch
is retried one image at a time and an image that fails alone gets its error result. Until
an input has been explained, a ``CamvizError`` about what was asked (the method, layer or
target) stops the run instead, since every input would repeat it. Any other exception is a
bug of camviz and keeps its traceback.

**JPEGs on a GPU.** With the model on CUDA, workers read JPEG files as bytes and each
batch of them is decoded, resized and normalised on the GPU (:mod:`camviz.pipeline.decoding`).

**Tasks.** Segmentation models, detectors and video models are explained through the same
loop; :mod:`camviz.pipeline.choosing` decides what each batch explains (a predicted region,
the detected objects, both chosen inside the explaining pass; clips of ``T`` frames). An
input with nothing to explain there (no object above the score asked for) is ``"ok"`` with
no explained entry and a ``reason``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from camviz.cams.engine import explain
from camviz.core.errors import CamvizError, ZeroMapWarning, first_line
from camviz.core.inputs import model_device
from camviz.core.layers import Layer
from camviz.core.precision import ChannelsLastChoice
from camviz.core.targets import Target, as_logits
from camviz.io.files import not_a_regular_file
from camviz.io.images import MAX_PIXELS, PathLike, Preprocess, load_image
from camviz.io.models import LoadedModel, Task, task_of
from camviz.io.progress import progress_bar
from camviz.io.video import FrameReader
from camviz.pipeline import choosing
from camviz.pipeline.decoding import decode, decoder, device_decodes, encoded_jpeg
from camviz.pipeline.inputs import Item, expand
from camviz.pipeline.packing import batched, packed
from camviz.pipeline.results import (
    FAILURES,
    TOP_PREDICTIONS,
    ImageResult,
    Prediction,
    about_the_arguments,
    belongs_to_input,
    failed,
    failure_reason,
    nothing,
    results_of,
)
from camviz.pipeline.tasks import Group, TaskOptions, clip_spec
from camviz.pipeline.threads import takes_turns, yield_to_model
from camviz.pipeline.writer import Writer

# ImageResult and Prediction, what explain_dataset yields, are made in results.py.
__all__ = [
    "TOP_PREDICTIONS",
    "Clip",
    "ImageResult",
    "ItemDataset",
    "Prediction",
    "explain_dataset",
]

# Images that may wait in buckets, in batches: bounds memory when many shapes are mixed.
_WAITING_BATCHES = 4


@dataclass
class Clip:
    """The frames of one clip of a video, upright RGB, in order."""

    frames: list[Image.Image]


class ItemDataset(Dataset):
    """Reads :class:`~camviz.pipeline.inputs.Item` s: image files, frames and clips of videos.

    ``dataset[i]`` is the upright RGB image of item ``i`` (a :class:`Clip` for a clip); an
    unreadable one raises a :class:`~camviz.core.errors.CamvizError` saying why.
    """

    def __init__(self, items: Sequence[Item], *, max_pixels: int | None = MAX_PIXELS) -> None:
        self.items = list(items)
        self.max_pixels = max_pixels
        self._frames = FrameReader()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Image.Image | Clip:
        item = self.items[index]
        # A file may have been replaced by a FIFO since the inputs were listed.
        reason = item.reason or not_a_regular_file(item.path)
        if reason is not None:
            raise CamvizError(reason)
        if item.frame is not None and item.clip_len is not None:
            frames = range(item.frame, item.frame + item.clip_len)
            return Clip([self._frames.read(item.path, frame) for frame in frames])
        if item.frame is not None:
            return self._frames.read(item.path, item.frame)
        return load_image(item.path, max_pixels=self.max_pixels)

    def encoded(self, index: int) -> torch.Tensor | None:
        """The bytes of item ``index`` if it is a JPEG to decode on the device, else
        ``None`` (read it with ``dataset[index]``); see :mod:`camviz.pipeline.decoding`."""
        item = self.items[index]
        if item.frame is not None or item.reason or not_a_regular_file(item.path):
            return None
        if decoder(item.path, on_device=True) != "device":
            return None
        return encoded_jpeg(item.path, self.max_pixels)

    def close(self) -> None:
        """Release the videos this process has open."""
        self._frames.close()


@dataclass
class _Sample:
    """One decoded input, as a worker hands it over (tensors cross in shared memory)."""

    index: int
    inputs: torch.Tensor | None = None
    original: torch.Tensor | None = None  # (H, W, 3) uint8; (T, H, W, 3) for a clip
    size: tuple[int, int] | None = None  # the original's (width, height)
    reason: str | None = None
    seconds: float = 0.0
    encoded: torch.Tensor | None = None  # JPEG bytes, decoded on the device by _decoded

    def pin_memory(self) -> _Sample:
        """Page-locked inputs, so that the copy to a GPU does not block (the DataLoader's
        pin thread calls this when the model is on CUDA)."""
        if self.inputs is not None:
            self.inputs = self.inputs.pin_memory()
        return self


class _Prepared(Dataset):
    """Wraps a dataset so that a worker returns a preprocessed :class:`_Sample`."""

    def __init__(
        self,
        dataset: Dataset,
        preprocess: Callable[[Image.Image], torch.Tensor],
        keep_images: bool,
        jpegs_on_device: bool = False,
    ) -> None:
        self.dataset = dataset
        self.preprocess = preprocess
        self.keep_images = keep_images
        self.jpegs_on_device = jpegs_on_device and isinstance(dataset, ItemDataset)

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))

    def __getitem__(self, index: int) -> _Sample:
        """Item ``index`` preprocessed, or only read (``encoded``) for the device to decode."""
        if self.jpegs_on_device:
            started = time.perf_counter()
            try:
                encoded = cast(ItemDataset, self.dataset).encoded(index)
            except (CamvizError, OSError):
                encoded = None  # read it with Pillow, which says what is wrong
            if encoded is not None:
                return _Sample(index, encoded=encoded, seconds=time.perf_counter() - started)
        return self.read(index)

    def thread_safe(self, index: int) -> bool:
        """Whether item ``index`` may be read on any thread: an image file (a video's
        frames come from one reader, in order; a dataset of one's own may not allow it)."""
        return isinstance(self.dataset, ItemDataset) and self.dataset.items[index].frame is None

    def read(self, index: int) -> _Sample:
        """Item ``index`` decoded on the CPU and preprocessed."""
        started = time.perf_counter()
        try:
            data = self.dataset[index]
            if isinstance(data, (tuple, list)):
                data = data[0]  # (image, label) pairs, as torchvision datasets give them
            if isinstance(data, torch.Tensor):
                sample = _Sample(index, inputs=data)
            elif isinstance(data, Image.Image):
                rgb = data if data.mode == "RGB" else data.convert("RGB")
                original = torch.from_numpy(np.array(rgb)) if self.keep_images else None
                sample = _Sample(
                    index, inputs=self.preprocess(rgb), original=original, size=rgb.size
                )
            elif isinstance(data, Clip):
                sample = self._clip(index, data)
            else:
                raise CamvizError(
                    f"item {index} of the dataset is a {type(data).__name__}; a dataset must "
                    "give PIL images or preprocessed (C, H, W) tensors"
                )
        except (CamvizError, OSError) as error:
            sample = _Sample(index, reason=first_line(error))
        sample.seconds = time.perf_counter() - started
        return sample

    def _clip(self, index: int, clip: Clip) -> _Sample:
        """A clip as ``(3, T, H, W)``: each frame preprocessed, stacked along time."""
        frames = [frame if frame.mode == "RGB" else frame.convert("RGB") for frame in clip.frames]
        original = (
            torch.from_numpy(np.stack([np.array(frame) for frame in frames]))
            if self.keep_images
            else None
        )
        inputs = torch.stack([self.preprocess(frame) for frame in frames], dim=1)
        return _Sample(index, inputs=inputs, original=original, size=frames[0].size)


def explain_dataset(
    model: nn.Module | LoadedModel,
    data: Dataset | PathLike | Iterable[PathLike],
    *,
    preprocess: Callable[[Image.Image], torch.Tensor] | None = None,
    method: str = "gradcam",
    layer: Layer | Sequence[Layer] | None = None,
    target: Target = None,
    batch_size: int = 16,
    workers: int = 0,
    every: int = 1,
    indices: Iterable[int] | None = None,
    keep_images: bool = True,
    max_pixels: int | None = MAX_PIXELS,
    progress: bool | None = False,
    task_options: TaskOptions | None = None,
    helpers: Writer | None = None,
    **options: Any,
) -> Iterator[ImageResult]:
    """Explain every image of a folder, a list of files, a video or a ``Dataset``, lazily.

    Example:
        >>> loaded = camviz.models.load()
        >>> for result in camviz.explain_dataset(loaded, "val/", batch_size=32, workers=4):
        ...     if result.ok and result.explained[0].id != label_of(result.path):
        ...         camviz.save(camviz.overlay(result.image, result.heatmaps[0]), ...)

    Args:
        model: A model from :func:`camviz.models.load` (its preprocessing, class names and
            default layer are used), or any ``nn.Module`` classifier. It is handed back as
            it came; move it to the GPU first to explain there.
        data: Paths (files, folders, globs, path lists, videos; see :mod:`camviz.pipeline.inputs`),
            or a ``Dataset`` giving PIL images, preprocessed ``(C, H, W)`` tensors, or
            ``(image, label)`` pairs (``torchvision.datasets.ImageFolder(root)`` works).
        preprocess: PIL image to ``(3, H, W)`` tensor; by default the loaded model's, or
            ImageNet's :class:`~camviz.images.Preprocess` for a plain module.
        method: A CAM method name (:func:`camviz.cams.names`).
        layer: Target layer name(s); ``None`` uses the loaded model's default, or finds one.
        target: What to explain, as in :func:`camviz.explain` (class id, ``"top3"``, ...).
        batch_size: Images per forward pass.
        workers: DataLoader processes that decode and preprocess; 0 reads in this one.
        every: For videos, explain every ``every``-th frame.
        indices: Explain only these positions of the dataset, in this order (one shard of
            a distributed run, or what is left to do).
        keep_images: Give each result its original image (needed to draw overlays).
        max_pixels: Larger images are refused (see :func:`camviz.images.load_image`).
        progress: A tqdm progress bar on stderr (images/s, time left): ``True``, ``False``,
            or ``None`` for "when stderr is a terminal".
        task_options: For detectors (``min_score``, ``max_objects``) and video models
            (``clip_len``, ``stride``), whose task is told from the model; see
            :mod:`camviz.pipeline.tasks` (``None``: its defaults).
        helpers: Threads that take turns with the model on a CPU with ``workers=0``
            (:mod:`camviz.pipeline.threads`): they read the image files between passes, and
            a pass waits until all their jobs, the caller's too, are done (None: no turns).
        **options: Passed to :func:`camviz.explain` (``output_key=``, ``aug_smooth=``,
            ``precision=``, ``channels_last=``, method options); ``channels_last=None``:
            channels-last images on a CPU unless the model fails on them (then contiguous).

    Returns:
        A generator of :class:`ImageResult`, one per input, as its batch finishes (not in
        input order: see ``result.index``); ``status == "error"`` for an unreadable one.

    Raises:
        CamvizError: A bad argument, or no input found; a mistake in ``method``, ``layer``
            or ``target`` is raised when the first batch is explained.
    """
    if isinstance(model, LoadedModel):
        network, categories, task = model.model, model.categories, model.task
        preprocess = preprocess if preprocess is not None else model.preprocess
        layer = layer if layer is not None else model.default_layer
        clip_len = model.clip_len
    elif isinstance(model, nn.Module):
        network, categories, task, clip_len = model, None, task_of(model), None
        preprocess = preprocess if preprocess is not None else Preprocess()
    else:
        raise CamvizError(
            f"model must be an nn.Module or a camviz.models.load() result, not "
            f"{type(model).__name__}"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise CamvizError(f"batch_size must be a positive integer, not {batch_size!r}")
    if not isinstance(workers, int) or workers < 0:
        raise CamvizError(f"workers must be 0 or more, not {workers!r}")
    if not isinstance(data, Dataset):
        clips = clip_spec(task, clip_len, task_options or TaskOptions())
        items: list[Item] | None = expand(data, every=every, clips=clips)
        if not items:
            raise CamvizError("no image or video found in the inputs; check the paths")
        data = ItemDataset(items, max_pixels=max_pixels)
    known = data.items if isinstance(data, ItemDataset) else None
    order = list(range(len(cast(Sized, data)))) if indices is None else list(indices)
    explainer = _BatchExplainer(
        network, categories, method, layer, target, options, task, task_options
    )
    on_device = device_decodes(explainer.device, preprocess)
    prepared = _Prepared(data, preprocess, keep_images, on_device)
    reads, before_pass = _reads(prepared, order, batch_size, workers, explainer.device, helpers)
    return _explained(
        reads, prepared, explainer, before_pass, known, batch_size, len(order), progress
    )


def _reads(
    prepared: _Prepared,
    order: list[int],
    batch_size: int,
    workers: int,
    device: torch.device,
    helpers: Writer | None,
) -> tuple[Iterable[list[_Sample]], Callable[[], None]]:
    """Where the batches of samples come from, and what each pass waits for first: the
    helpers' reads between passes and their being idle, when they take turns with the
    model; else a DataLoader, and nothing."""
    if helpers is not None and takes_turns(device, workers):
        return _read_between_passes(prepared, order, batch_size, helpers), helpers.wait
    loader = DataLoader(
        prepared,
        batch_size=batch_size,
        sampler=order,
        num_workers=workers,
        collate_fn=packed,
        pin_memory=device.type == "cuda",
        worker_init_fn=yield_to_model,
    )
    return loader, _ready


def _ready() -> None:
    """Nothing to wait for before a pass: the helpers run beside the model."""


def _read_between_passes(
    prepared: _Prepared, order: list[int], batch_size: int, helpers: Writer
) -> Iterator[list[_Sample]]:
    """The samples at ``order``, ``batch_size`` at a time, each batch read only when the
    one before is explained: image files on the helpers' threads, video frames in this
    thread and in order (one open reader per video serves them)."""
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        files = [index for index in chunk if prepared.thread_safe(index)]
        read = dict(zip(files, helpers.map(prepared.__getitem__, files), strict=True))
        yield [read[index] if index in read else prepared[index] for index in chunk]


def _explained(
    reads: Iterable[list[_Sample]],
    prepared: _Prepared,
    explainer: _BatchExplainer,
    before_pass: Callable[[], None],
    items: list[Item] | None,
    batch_size: int,
    total: int,
    progress: bool | None,
) -> Iterator[ImageResult]:
    """The results of the batches that ``reads`` gives, each pass after ``before_pass``."""
    buckets = _Buckets(batch_size)
    batches = iter(reads)  # a name to delete at the end: that shuts a DataLoader's workers
    bar = progress_bar(total, "img", progress)
    try:
        for read in batches:
            for sample in _decoded(read, prepared, explainer.device):
                if sample.reason is not None:
                    bar.update(1)
                    yield failed(sample, sample.reason, items)
                    continue
                batch = buckets.add(sample)
                if batch:
                    before_pass()
                for result in explainer(batch, items):
                    bar.update(1)
                    yield result
        for ready in buckets.drain():
            before_pass()
            for result in explainer(ready, items):
                bar.update(1)
                yield result
    finally:
        bar.close()
        del batches  # shuts the workers down, also when the consumer stops early
        if isinstance(prepared.dataset, ItemDataset):
            prepared.dataset.close()


def _decoded(samples: list[_Sample], prepared: _Prepared, device: torch.device) -> list[_Sample]:
    """``samples`` with the JPEGs the workers only read decoded on ``device``, all in one
    call, and preprocessed there; one the decoder refuses is read with Pillow instead."""
    waiting = [position for position, sample in enumerate(samples) if sample.encoded is not None]
    if not waiting:
        return samples
    started = time.perf_counter()
    decoded = decode([cast(torch.Tensor, samples[p].encoded) for p in waiting], device)
    share = (time.perf_counter() - started) / len(waiting)
    samples = list(samples)
    for position, pixels in zip(waiting, decoded, strict=True):
        index, seconds = samples[position].index, samples[position].seconds
        if pixels is None:
            samples[position] = prepared.read(index)
            continue
        started = time.perf_counter()
        try:
            inputs = prepared.preprocess(pixels)  # type: ignore[arg-type]  # a Preprocess
        except CamvizError as error:  # too large or too elongated once resized: a row
            samples[position] = _Sample(index, reason=first_line(error), seconds=seconds)
            continue
        samples[position] = _Sample(
            index,
            inputs=inputs,
            # The original comes to the CPU once: results carry it as a PIL image.
            original=pixels.permute(1, 2, 0).cpu() if prepared.keep_images else None,
            size=(pixels.shape[2], pixels.shape[1]),
            seconds=seconds + share + time.perf_counter() - started,
        )
    return samples


class _Buckets:
    """Decoded images waiting for a batch, one bucket per tensor shape (module docstring)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.capacity = _WAITING_BATCHES * batch_size
        self.by_shape: dict[tuple[int, ...], list[_Sample]] = {}
        self.waiting = 0

    def add(self, sample: _Sample) -> list[_Sample]:
        """Add ``sample``; returns a batch that is ready (full, or needed to free memory)."""
        assert sample.inputs is not None  # only decoded samples wait for a batch
        shape = tuple(sample.inputs.shape)
        self.by_shape.setdefault(shape, []).append(sample)
        self.waiting += 1
        if len(self.by_shape[shape]) == self.batch_size:
            return self._take(shape)
        if self.waiting > self.capacity:
            return self._take(max(self.by_shape, key=lambda key: len(self.by_shape[key])))
        return []

    def drain(self) -> Iterator[list[_Sample]]:
        """The remaining partial batches."""
        while self.by_shape:
            yield self._take(next(iter(self.by_shape)))

    def _take(self, shape: tuple[int, ...]) -> list[_Sample]:
        batch = self.by_shape.pop(shape)
        self.waiting -= len(batch)
        return batch


class _BatchExplainer:
    """Explains one batch of samples and turns the explanation into per-image results."""

    def __init__(
        self,
        network: nn.Module,
        categories: Sequence[str] | None,
        method: str,
        layer: Layer | Sequence[Layer] | None,
        target: Target,
        options: dict[str, Any],
        task: Task = "classification",
        task_options: TaskOptions | None = None,
    ) -> None:
        self.network = network
        self.categories = categories
        self.method = method
        self.layer = layer
        self.target = target
        self.task = task
        self.task_options = task_options or TaskOptions()
        self.device = model_device(network) or torch.device("cpu")
        self.explained_any = False  # whether an input was explained yet
        options = dict(options)
        asked = options.pop("channels_last", False)
        self.channels_last = ChannelsLastChoice(asked, self.device, images=task != "video")
        self.options = options

    def __call__(self, samples: list[_Sample], items: list[Item] | None) -> list[ImageResult]:
        if not samples:
            return []
        started = time.perf_counter()
        try:
            explained = self.channels_last.run(
                lambda channels_last: self._explained(samples, channels_last), belongs_to_input
            )
        except FAILURES as error:
            if not belongs_to_input(error):
                raise  # a bug of camviz keeps its traceback: it is no row of an input
            return self._retried(samples, items, error)
        self.explained_any = True
        share = (time.perf_counter() - started) / len(samples)
        results = []
        for group, explanation in explained:
            chosen = [samples[position] for position in group.positions]
            if explanation is None:
                results += [nothing(sample, group.reason, items, share) for sample in chosen]
            else:
                logits = self._logits(explanation, len(chosen))
                boxes = [] if explanation.boxes is None else explanation.boxes.tolist()
                results += results_of(
                    chosen, explanation, logits, boxes, self.categories, items, share
                )
        return results

    def _explained(self, samples: list[_Sample], channels_last: bool) -> list[tuple[Group, Any]]:
        """Each group of the batch of ``samples`` with its explanation (``None``: nothing to
        explain)."""
        inputs = [sample.inputs for sample in samples if sample.inputs is not None]
        assert len(inputs) == len(samples)  # only decoded samples are batched
        if self.device.type == "cpu":
            batch = batched(inputs)
        else:  # pinned samples go up one by one, without waiting
            batch = torch.stack([tensor.to(self.device, non_blocking=True) for tensor in inputs])
        categories = self.categories or []
        groups = choosing.groups(self.task, len(batch), self.target, categories, self.task_options)
        return [(group, self._explain(batch, group, channels_last)) for group in groups]

    def _retried(
        self, samples: list[_Sample], items: list[Item] | None, error: BaseException
    ) -> list[ImageResult]:
        """The results of a batch that failed: a model that fails on some input (an odd
        size, out of memory on a big batch, a NaN) fails that image, not the run, so the
        batch is retried one image at a time, and an image that fails alone gets a row."""
        if len(samples) > 1:
            return [result for sample in samples for result in self([sample], items)]
        if not self.explained_any and about_the_arguments(error):
            # Before any input is explained: a mistake in the method, layer or target, which
            # every input would repeat.
            raise error
        return [failed(samples[0], failure_reason(error), items)]

    def _explain(self, batch: torch.Tensor, group: Group, channels_last: bool) -> Any:
        """The explanation of one group's samples; ``None`` for one with nothing to explain."""
        if group.reason is not None:
            return None
        inputs = batch if len(group.positions) == len(batch) else batch[group.positions]
        with warnings.catch_warnings():
            # The rows say which maps are all zero (``empty``), once per map, not per batch.
            warnings.simplefilter("ignore", ZeroMapWarning)
            return explain(
                self.network,
                inputs,
                self.method,
                self.layer,
                group.target,
                channels_last=channels_last,
                **self.options,
            )

    def _logits(self, explanation: Any, count: int) -> torch.Tensor:
        """The class scores of an explanation's ``count`` samples; ``(N, 0)`` for a detector,
        whose output is a list of detections per image, not a score tensor."""
        if self.task == "detection":
            return torch.zeros(count, 0)
        return as_logits(explanation.output, self.options.get("output_key")).detach().float()
