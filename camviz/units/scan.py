"""Top-activating examples: one pass over many images, keeping each unit's k best.

:func:`top_examples` runs the model once per batch with hooks at the units' layers and stops
the pass there (the layers after the last unit are not run), reads each unit's statistic
per image (its maximum or mean over the grid, or a neuron's value) with the grid location
of its maximum, and offers them to one heap per unit (:class:`~camviz.units.heaps.TopHeaps`).
Nothing else is kept: memory grows with the number of units times ``k``, never with the
number of images, and no activation outlives its batch.

Images are read as the folder job reads them (:mod:`camviz.pipeline.inputs` lists the
files, :class:`~camviz.pipeline.dataset.ItemDataset` decodes them, DataLoader workers
preprocess them), and batched with images of the same shape: preprocessing keeps each
photo's aspect ratio, so that locations map back onto the photo.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from camviz.core.errors import CamvizError, first_line
from camviz.core.inputs import as_inputs, model_device
from camviz.core.modelstate import eval_mode, exclusive, no_grad
from camviz.core.precision import ChannelsLastChoice, Precision, model_precision
from camviz.core.targets.unit import Unit, as_units
from camviz.io.images import PathLike, Preprocess
from camviz.io.models import LoadedModel
from camviz.io.progress import progress_bar
from camviz.pipeline.dataset import ItemDataset
from camviz.pipeline.inputs import expand
from camviz.pipeline.threads import yield_to_model
from camviz.units.heaps import Example, TopHeaps
from camviz.units.spots import outputs_at, spatial_view

__all__ = ["Statistic", "UnitExamples", "UnitScan", "image_source", "scan_batches", "top_examples"]

Statistic = Literal["max", "mean"]

# Images that may wait for a batch of their shape, in batches (bounds memory).
_WAITING_BATCHES = 4


@dataclass(frozen=True)
class UnitExamples:
    """A unit and its top images, best first."""

    unit: Unit
    examples: tuple[Example, ...]


def top_examples(
    model: nn.Module | LoadedModel,
    source: Dataset | PathLike | Iterable[PathLike],
    units: Unit | Sequence[Unit],
    k: int = 9,
    statistic: Statistic = "max",
    *,
    preprocess: Callable[[Image.Image], torch.Tensor] | None = None,
    batch_size: int = 32,
    workers: int = 0,
    progress: bool | None = False,
    precision: Precision = "fp32",
    channels_last: bool | None = None,
) -> list[UnitExamples]:
    """The ``k`` images of ``source`` that excite each unit most, in one pass.

    Example:
        >>> loaded = camviz.load_model()
        >>> tops = camviz.top_examples(loaded, "photos/", camviz.Unit("blocks.5", channel=[0, 1]))
        >>> [(e.path, round(e.value, 2), e.location) for e in tops[0].examples]

    Args:
        model: A model from :func:`camviz.load_model` (its preprocessing is used) or any
            ``nn.Module``; handed back as it came. Move it to the GPU first to scan there.
        source: Paths (files, folders, globs, path lists; see :mod:`camviz.pipeline.inputs`)
            or a ``Dataset`` of PIL images, ``(C, H, W)`` tensors or ``(image, label)`` pairs.
        units: One :class:`~camviz.Unit` or several; a unit of several channels counts as
            one unit per channel, in its order.
        k: How many images each unit keeps.
        statistic: ``"max"`` (the unit's highest value anywhere in the image) or ``"mean"``
            (its mean over the grid, the score :class:`~camviz.Unit` explains); a neuron is
            ranked by its own value either way.
        preprocess: PIL image to tensor; by default the loaded model's, or ImageNet's
            :class:`~camviz.images.Preprocess` for a plain module.
        batch_size: Images per forward pass.
        workers: DataLoader worker processes that decode and preprocess.
        progress: A progress bar on stderr (``None``: when stderr is a terminal).
        precision: ``"fp32"``, or ``"bf16"``/``"fp16"`` autocast for the passes (the
            statistics are compared in float32); see :func:`camviz.explain`.
        channels_last: Channels-last inputs for the model; ``None`` (the default) chooses
            them for images on a CPU, where a batch's convolutions run up to 3x faster,
            unless the model fails on them (then one warning, and contiguous inputs).

    Returns:
        One :class:`UnitExamples` per unit (per channel), in the order given; each holds up
        to ``k`` :class:`~camviz.units.heaps.Example` (position in the source, value, grid
        location of the maximum, path), best first. Unreadable images are left out.

    Raises:
        CamvizError: A bad argument, no image in ``source``, or a unit that does not fit its
            layer (raised on the first batch).
    """
    network, preprocess = _model_and_preprocess(model, preprocess)
    dataset, paths = image_source(source)
    scan = UnitScan(network, units, k, statistic, precision, channels_last)
    order = list(range(len(cast(Sized, dataset))))
    for positions, batch, _ in scan_batches(
        dataset, preprocess, order, batch_size, workers, model_device(network), progress
    ):
        if batch is not None:
            scan.add(positions, batch)
    return scan.result(paths)


def _model_and_preprocess(
    model: nn.Module | LoadedModel, preprocess: Callable[[Image.Image], torch.Tensor] | None
) -> tuple[nn.Module, Callable[[Image.Image], torch.Tensor]]:
    if isinstance(model, LoadedModel):
        return model.model, preprocess if preprocess is not None else model.preprocess
    if isinstance(model, nn.Module):
        return model, preprocess if preprocess is not None else Preprocess()
    raise CamvizError(
        f"model must be an nn.Module or a camviz.load_model() result, not {type(model).__name__}"
    )


def image_source(
    source: Dataset | PathLike | Iterable[PathLike],
) -> tuple[Dataset, list[str] | None]:
    """A ``Dataset`` to scan and, for paths, each position's file.

    Raises:
        CamvizError: The paths hold no image.
    """
    if isinstance(source, Dataset):
        return source, None
    items = expand(cast(Any, source))
    if not items:
        raise CamvizError("no image found in the inputs; check the paths")
    return ItemDataset(items), [item.path for item in items]


class UnitScan:
    """The running heaps of a scan: what :func:`top_examples` and ``camviz units`` add
    batches to.

    Args:
        model: The network.
        units: The units (a unit of several channels is one unit per channel).
        k: Images kept per unit.
        statistic: ``"max"`` or ``"mean"``.
        precision, channels_last: How the passes run (see :func:`top_examples`).

    Attributes:
        memory_format: Whether the batches go channels-last, chosen on the first batch.
    """

    def __init__(
        self,
        model: nn.Module,
        units: Unit | Sequence[Unit],
        k: int,
        statistic: Statistic,
        precision: Precision = "fp32",
        channels_last: bool | None = None,
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise CamvizError(f"k must be a positive whole number, not {k!r}")
        if statistic not in ("max", "mean"):
            raise CamvizError(f"statistic must be 'max' or 'mean', not {statistic!r}")
        self.model = model
        self.units = [single for unit in as_units(units) for single in unit.ranked()]
        self.statistic = statistic
        self.precision = precision
        self.channels_last = channels_last
        self.memory_format: ChannelsLastChoice | None = None  # as the first batch tells it
        model_precision(model, precision, bool(channels_last))  # an unknown or emulated one: now
        self.heaps = TopHeaps(len(self.units), k)

    def add(self, positions: Sequence[int], batch: torch.Tensor) -> None:
        """Scan one batch of images (``positions``: their places in the source)."""
        values, locations = self.read(batch)
        self.heaps.add(values, locations, positions)

    def read(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, U)`` statistics and ``(B, U, D)`` grid locations of every unit."""
        if any(unit.reading is None for unit in self.units):  # as the first batch tells it
            inputs = as_inputs(batch, self.model)
            self.units = [unit.prepare(self.model, inputs) for unit in self.units]
        if self.memory_format is None:
            device = model_device(self.model) or torch.device("cpu")
            images = batch.dim() == 4
            self.memory_format = ChannelsLastChoice(self.channels_last, device, images=images)
        spots = list(dict.fromkeys(unit.layer for unit in self.units))
        tensors = self.memory_format.run(
            lambda channels_last: self._outputs(batch, spots, channels_last),
            lambda error: isinstance(error, RuntimeError),  # the model failed on the batch
        )
        views = {spot: spatial_view(self.model, spot, tensors[spot], batch) for spot in tensors}
        read = [_statistic(unit, views[unit.layer], self.statistic) for unit in self.units]
        return torch.stack([r[0] for r in read], dim=1), torch.stack([r[1] for r in read], dim=1)

    def _outputs(
        self, batch: torch.Tensor, spots: Sequence[str], channels_last: bool
    ) -> dict[str, torch.Tensor]:
        with (
            exclusive(self.model),
            eval_mode(self.model),
            model_precision(self.model, self.precision, channels_last),
            no_grad(),
        ):
            return outputs_at(self.model, batch, spots)[0]

    def result(self, paths: Sequence[str] | None = None) -> list[UnitExamples]:
        """Each unit with its kept images, best first."""
        return [
            UnitExamples(unit, tuple(examples))
            for unit, examples in zip(self.units, self.heaps.best(paths), strict=True)
        ]


def _statistic(
    unit: Unit, spatial: torch.Tensor, statistic: Statistic
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B,)`` values and ``(B, D)`` locations of one single-rank unit."""
    maps = unit.maps(spatial)[:, 0].float()
    grid = tuple(maps.shape[1:])
    flat = maps.flatten(1)
    where = torch.stack(torch.unravel_index(flat.argmax(dim=1), grid), dim=1)
    if unit.neuron is not None:
        place = torch.tensor(unit.neuron[1:], device=maps.device).expand(len(maps), -1)
        return unit.scores(spatial)[:, 0].float(), place
    if statistic == "max":
        return flat.amax(dim=1), where
    return flat.mean(dim=1), where


def scan_batches(
    dataset: Dataset,
    preprocess: Callable[[Image.Image], torch.Tensor],
    order: Sequence[int],
    batch_size: int,
    workers: int,
    device: torch.device | None,
    progress: bool | None = False,
) -> Iterator[tuple[list[int], torch.Tensor | None, str | None]]:
    """``(positions, batch, None)`` for batches of equal-shaped preprocessed images on
    ``device``, and ``([position], None, reason)`` for an image that cannot be read."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise CamvizError(f"batch_size must be a positive integer, not {batch_size!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise CamvizError(f"workers must be 0 or more, not {workers!r}")
    loader = DataLoader(
        _Read(dataset, preprocess),
        batch_size=batch_size,
        sampler=list(order),
        num_workers=workers,
        collate_fn=list,
        worker_init_fn=yield_to_model,
    )
    waiting: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
    bar = progress_bar(len(order), "img", progress)
    try:
        for read in loader:
            bar.update(len(read))
            for position, tensor, reason in read:
                if tensor is None:
                    yield [position], None, reason
                    continue
                shape = tuple(tensor.shape)
                waiting.setdefault(shape, []).append((position, tensor))
                if len(waiting[shape]) < batch_size:
                    if sum(map(len, waiting.values())) <= _WAITING_BATCHES * batch_size:
                        continue
                    shape = max(waiting, key=lambda key: len(waiting[key]))
                yield _batch(waiting.pop(shape), device)
        while waiting:
            yield _batch(waiting.pop(next(iter(waiting))), device)
    finally:
        bar.close()


def _batch(
    samples: list[tuple[int, torch.Tensor]], device: torch.device | None
) -> tuple[list[int], torch.Tensor, None]:
    positions = [position for position, _ in samples]
    return positions, torch.stack([tensor for _, tensor in samples]).to(device), None


class _Read(Dataset):
    """Item ``i`` of a dataset as ``(i, preprocessed tensor or None, why not)``."""

    def __init__(self, dataset: Dataset, preprocess: Callable[[Image.Image], torch.Tensor]) -> None:
        self.dataset = dataset
        self.preprocess = preprocess

    def __len__(self) -> int:
        return len(cast(Sized, self.dataset))

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str | None]:
        try:
            data = self.dataset[index]
            if isinstance(data, (tuple, list)):
                data = data[0]  # (image, label) pairs, as torchvision datasets give them
            if isinstance(data, torch.Tensor):
                return index, data, None
            if isinstance(data, Image.Image):
                return index, self.preprocess(data.convert("RGB")), None
            if isinstance(data, np.ndarray):
                return index, self.preprocess(Image.fromarray(data).convert("RGB")), None
            raise CamvizError(
                f"item {index} of the dataset is a {type(data).__name__}; a dataset must give "
                "PIL images or preprocessed (C, H, W) tensors"
            )
        except (CamvizError, OSError) as error:
            return index, None, first_line(error)
