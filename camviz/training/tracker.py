"""Explain a fixed probe batch while a model trains, without changing the training run.

>>> tracker = camviz.Tracker(probes, every=50, out_dir="runs/maps")
>>> for step, (images, labels) in enumerate(loader):
...     loss = loss_fn(model(images), labels)
...     loss.backward()
...     tracker.step(model, step)        # explains the probes when step % 50 == 0
...     optimiser.step()
...     optimiser.zero_grad()
>>> tracker.close()                      # waits for the background writer
>>> tracker.summary("maps.png")

Each computing step calls :func:`camviz.explain` once per method and layer on the probe
batch (one forward pass of the probes and the backward pass of the layers after the target
layer, for Grad-CAM), inside :func:`~camviz.training.isolation.untouched_run`: the model, its
gradients, the optimiser, the random generators and the caller's grad mode are as they were,
so that a run with the tracker equals the run without it. The numbers of each step
(:mod:`camviz.training.change`) are computed at once; pictures and logging happen on a
background thread (:mod:`camviz.training.publisher`).

In a distributed run only the process of rank 0 explains and logs; the others return at
once from :meth:`Tracker.step` and record nothing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from camviz.cams.base import CamMethod
from camviz.cams.engine import Explanation, explain
from camviz.cams.registry import get
from camviz.core.errors import CamvizError, ZeroMapWarning
from camviz.core.inputs import model_device
from camviz.core.layers import Layer
from camviz.core.targets import Target
from camviz.evaluation.localization import box_masks
from camviz.pipeline.distributed import from_environment
from camviz.training.change import correlation, inside_share, top_overlap
from camviz.training.isolation import untouched_run
from camviz.training.publisher import Publisher
from camviz.training.record import Record, TrackedMaps
from camviz.training.sinks import sinks_for
from camviz.training.summary import TrainingSummary, summarize, write_summary

__all__ = ["Tracker"]


class Tracker:
    """Maps of a fixed probe batch, every ``every`` training steps, logged as they come.

    Args:
        images: The probe batch, ``(N, C, H, W)``, as the model takes it (a copy is kept).
        targets: What to explain, as ``camviz.explain``'s ``target``: class ids (one for all
            or one per probe), a :class:`~camviz.Region`, a :class:`~camviz.Detection`, or
            ``None`` for each probe's predicted class at that step. It must give one map per
            probe image (no top-k, one object per image).
        methods: Method names or instances; each is tracked on its own.
        layers: A layer, a list of layers (each tracked on its own), or ``None`` for the
            model's default target layer.
        every: :meth:`step` explains when ``step % every == 0``.
        masks: ``(N, H, W)`` booleans, each probe's object at the probes' size: adds the
            share of the map inside it (``inside``, the localisation curve).
        boxes: ``(N, 4)`` boxes ``(x0, y0, x1, y1)`` in pixels instead of masks.
        logger: A TensorBoard ``SummaryWriter``, a W&B run, or a list of them
            (:mod:`camviz.training.sinks`).
        out_dir: A folder for plain files: ``camviz_tracker.jsonl``, ``steps/*.png`` and
            ``strip.png``. With neither ``logger`` nor ``out_dir`` the records are only kept
            in :attr:`history`.

    Attributes:
        history: The :class:`~camviz.training.record.Record` of every explained step, in
            order.

    Raises:
        CamvizError: A probe batch that is not ``(N, C, H, W)``, an unknown method, a bad
            ``every``, masks or boxes that do not fit the probes, or a logger it cannot use.
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: Target = None,
        methods: Sequence[str | CamMethod] | str | CamMethod = ("gradcam",),
        layers: Layer | Sequence[Layer] | None = None,
        every: int = 50,
        masks: torch.Tensor | None = None,
        boxes: torch.Tensor | Sequence[Sequence[float]] | None = None,
        logger: Any = None,
        out_dir: str | Path | None = None,
    ) -> None:
        self.images = _probe_batch(images)
        self.targets = targets
        self.methods = _methods(methods)
        self.layers = _layers(layers)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CamvizError(f"every must be a whole number of steps >= 1, not {every!r}")
        self.every = every
        self.regions = _regions(masks, boxes, self.images)
        self.history: list[Record] = []
        self._publisher = Publisher(sinks_for(logger, out_dir), self.images)
        self._on_device: dict[torch.device, torch.Tensor] = {}
        self._said_empty = False  # whether all-zero maps were reported yet

    def step(self, model: nn.Module, step: int, *, force: bool = False) -> Record | None:
        """Explain the probes if ``step % every == 0`` (or ``force``); the record, else ``None``.

        A step already recorded last is not explained again (the same weights give the same
        maps), and processes other than rank 0 of a distributed run return ``None`` at once.
        The call returns when the maps and numbers are computed; the pictures and logging
        follow on the background writer.

        Raises:
            CamvizError: What ``camviz.explain`` refuses (a layer the model lacks, a target
                it cannot find), or what an earlier write failed with.
        """
        step = int(step)
        if (not force and step % self.every) or not is_logging_process():
            return None
        if self.history and self.history[-1].step == step:
            return None
        record = self._explain(model, step)
        self.history.append(record)
        self._publisher.submit(record, self.history)
        return record

    def summary(self, path: str | Path | None = None) -> TrainingSummary:
        """Every number over the steps, each step's change to the final map, and the
        summary picture (the strip above the curves), written to ``path`` (a PNG) if given.

        Raises:
            CamvizError: No step was recorded (or this is not rank 0), or ``path`` is no PNG.
        """
        result = summarize(self.history, self.images)
        if path is not None:
            write_summary(result, path)
        return result

    def close(self) -> None:
        """Wait for the background writer and flush the loggers (a later step logs again)."""
        self._publisher.close()

    def log_to(self, logger: Any = None, out_dir: str | Path | None = None) -> None:
        """Log the next records to ``logger`` and ``out_dir`` instead (after flushing)."""
        sinks = sinks_for(logger, out_dir)
        self.close()
        self._publisher = Publisher(sinks, self.images)

    def state_dict(self) -> dict[str, Any]:
        """The history as plain tensors and numbers, for a checkpoint."""
        return {"history": [record.state() for record in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the history of ``state`` (from :meth:`state_dict`).

        Raises:
            CamvizError: The saved maps are of another probe batch (count or size), or of
                other methods or layers.
        """
        history = [Record.from_state(entry) for entry in state["history"]]
        wanted = (len(self.images), *self.images.shape[2:])
        methods = {method if isinstance(method, str) else method.name for method in self.methods}
        layers = {layer for layer in self.layers if isinstance(layer, str)}
        for record in history:
            saved_methods = {tracked.method for tracked in record.maps.values()}
            saved_layers = {tracked.layer for tracked in record.maps.values()}
            if saved_methods != methods or not layers <= saved_layers:
                raise CamvizError(
                    f"the saved tracker history is of methods {sorted(saved_methods)} at "
                    f"layers {sorted(saved_layers)}; resume with the same methods and layers"
                )
            for tracked in record.maps.values():
                if tuple(tracked.heatmaps.shape) != wanted:
                    raise CamvizError(
                        f"the saved tracker history holds maps of shape "
                        f"{tuple(tracked.heatmaps.shape)}, but the probes give {wanted}; "
                        "resume with the same probe images"
                    )
        self.history = history

    def __enter__(self) -> Tracker:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _explain(self, model: nn.Module, step: int) -> Record:
        device = model_device(model) or torch.device("cpu")
        maps: dict[str, TrackedMaps] = {}
        with untouched_run(device):
            images = self._probes_on(device)
            for method in self.methods:
                for layer in self.layers:
                    explanation = self._explain_one(model, images, method, layer, step)
                    tracked = self._tracked(explanation, layer)
                    maps[tracked.series] = tracked
        return Record(step=step, maps=maps)

    def _explain_one(
        self,
        model: nn.Module,
        images: torch.Tensor,
        method: str | CamMethod,
        layer: Layer | None,
        step: int,
    ) -> Explanation:
        """``camviz.explain``, with its all-zero-map warning said once per tracker: early in
        training such maps are common, and a line at every step would bury the others."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ZeroMapWarning)
            explanation = explain(model, images, method, layer, self.targets)
        for warning in caught:
            if not issubclass(warning.category, ZeroMapWarning):
                warnings.warn_explicit(
                    warning.message, warning.category, warning.filename, warning.lineno
                )
            elif not self._said_empty:
                self._said_empty = True
                warnings.warn(
                    f"step {step}: {warning.message} (kept as all-zero maps, their "
                    "correlations as NaN; said once per tracker)",
                    ZeroMapWarning,
                    stacklevel=4,
                )
        return explanation

    def _probes_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on_device:
            self._on_device[device] = self.images.to(device)
        return self._on_device[device]

    def _tracked(self, explanation: Explanation, layer: Layer | None) -> TrackedMaps:
        count = len(self.images)
        if not torch.equal(explanation.samples, torch.arange(count)):
            raise CamvizError(
                f"the tracker follows one map per probe image, but the target gave "
                f"{len(explanation.samples)} maps for {count} images; give one class per "
                "image (or None), a Region, or a Detection of one object"
            )
        heatmaps = explanation.heatmaps
        assert isinstance(heatmaps, torch.Tensor)  # a probe batch is one tensor
        heatmaps = heatmaps.detach().float().cpu().clone()
        name = layer if isinstance(layer, str) else "+".join(explanation.layers)
        series = f"{explanation.method}/{name}"
        numbers = {"score": explanation.scores.detach().float().cpu().clone()}
        previous = self.history[-1].maps.get(series) if self.history else None
        first = self.history[0].maps.get(series) if self.history else None
        if not self.history:
            first_maps: torch.Tensor | None = heatmaps  # the first step is its own first
        else:
            first_maps = None if first is None else first.heatmaps
        for suffix, reference in (
            ("prev", None if previous is None else previous.heatmaps),
            ("first", first_maps),
        ):
            undefined = torch.full((count,), math.nan)
            numbers[f"corr_{suffix}"] = (
                undefined if reference is None else correlation(heatmaps, reference)
            )
            numbers[f"top15_{suffix}"] = (
                undefined if reference is None else top_overlap(heatmaps, reference)
            )
        if self.regions is not None:
            numbers["inside"] = inside_share(heatmaps, self.regions)
        return TrackedMaps(
            method=explanation.method,
            layer=name,
            heatmaps=heatmaps,
            targets=explanation.targets.detach().cpu().clone(),
            numbers=numbers,
        )


def is_logging_process() -> bool:
    """Whether this process records and logs: rank 0 of a distributed run, or the only one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return from_environment().is_main


def _probe_batch(images: Any) -> torch.Tensor:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or not images.is_floating_point():
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise CamvizError(
            f"the tracker's probe images must be one float (N, C, H, W) batch, got {shape}"
        )
    if len(images) == 0:
        raise CamvizError("the tracker needs at least one probe image")
    # An ordinary copy on the CPU: probes made under inference mode are inference tensors,
    # which no graph may use; the caller's tensor may change later.
    with torch.inference_mode(False):
        return images.detach().cpu().clone()


def _methods(methods: Any) -> tuple[str | CamMethod, ...]:
    given = (methods,) if isinstance(methods, (str, CamMethod)) else tuple(methods)
    if not given:
        raise CamvizError("the tracker needs at least one method, e.g. methods=('gradcam',)")
    checked: list[str | CamMethod] = []
    for method in given:
        if isinstance(method, str):
            checked.append(get(method).name)  # an unknown name is a one-line error here
        elif isinstance(method, CamMethod):
            checked.append(method)
        else:
            raise CamvizError(
                f"methods must be method names or CamMethod instances, not {method!r}"
            )
    return tuple(checked)


def _layers(layers: Any) -> tuple[Layer | None, ...]:
    if layers is None or isinstance(layers, (str, nn.Module)):
        return (layers,)
    given = tuple(layers)
    if not given:
        raise CamvizError("layers must name at least one layer, or be None for the default")
    return given


def _regions(masks: Any, boxes: Any, images: torch.Tensor) -> torch.Tensor | None:
    if masks is not None and boxes is not None:
        raise CamvizError("give the probes' objects as masks or as boxes, not both")
    count, height, width = len(images), *images.shape[2:]
    if boxes is not None:
        boxes = torch.as_tensor(boxes)
        if tuple(boxes.shape) != (count, 4):
            raise CamvizError(
                f"boxes must be ({count}, 4), one (x0, y0, x1, y1) per probe image, got "
                f"{tuple(boxes.shape)}"
            )
        return box_masks(boxes, height, width)
    if masks is None:
        return None
    masks = torch.as_tensor(masks)
    if masks.dtype != torch.bool or tuple(masks.shape) != (count, height, width):
        raise CamvizError(
            f"masks must be ({count}, {height}, {width}) booleans, one per probe image at its "
            f"size, got {masks.dtype} of shape {tuple(masks.shape)}"
        )
    return masks.cpu()
