"""``camviz units``: the top images of a layer's channels over a folder, as pictures and an
HTML index.

:func:`scan_units` runs one pass over the inputs (the scan of :mod:`camviz.units.scan`),
then draws, for each channel, its top images cropped to the layer's receptive field with
the channel's Grad-CAM map (:mod:`camviz.units.gallery`). It writes into ``out``:

* ``units.json``: the settings, the receptive field (and how it was found), and for every
  channel its top images (file, value, grid location, crop box);
* ``channel_0042.png`` per channel, and ``index.html`` showing them all;
* ``manifest.jsonl``: one row per scanned input (``ok``, or ``error`` and why), and
  ``manifest.json``, the summary that names every file the job wrote;
* ``.units.rank0.json``: the heaps so far, so that an interrupted scan resumes.

It shares the folder job's pieces: :mod:`camviz.pipeline.inputs` lists the inputs (never the
files a manifest says camviz wrote), :mod:`camviz.pipeline.lock` holds the folder,
:mod:`camviz.pipeline.manifest` logs the rows and tells what is done, and
:mod:`camviz.pipeline.distributed` shards the inputs under ``torchrun``. Resuming works by
checkpoints: every few batches the heaps are written whole (``atomic_write``), and only then
the rows of the images they hold; a crash in between scans those images again, which
changes nothing (an image enters a heap once). Under ``torchrun`` each process scans its
shard into its own heaps, rank 0 merges them (the top ``k`` of the union of the shards' top
``k`` is the top ``k`` of everything), and the processes share the drawing by channel.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from camviz.core.errors import CamvizError
from camviz.core.inputs import as_inputs, model_device
from camviz.core.layouts import tensor_spot
from camviz.core.modelstate import eval_mode, exclusive, no_grad
from camviz.core.precision import Precision, model_precision
from camviz.core.targets.unit import Unit, parse_channels
from camviz.io.atomic import atomic_write
from camviz.io.images import load_image
from camviz.io.models import LoadedModel
from camviz.io.output import save
from camviz.pipeline import distributed, lock, manifest, merging
from camviz.pipeline.dataset import ItemDataset
from camviz.pipeline.inputs import Item, expand
from camviz.units.fields import ReceptiveField, receptive_field
from camviz.units.gallery import example_grid, example_maps
from camviz.units.heaps import Example, TopHeaps
from camviz.units.scan import Statistic, UnitExamples, UnitScan, scan_batches
from camviz.units.spots import outputs_at, spatial_view

__all__ = ["RESULTS", "scan_units"]

#: The results: settings, receptive field, each channel's top images.
RESULTS = "units.json"

INDEX = "index.html"

_CHECKPOINT = ".units.rank{rank}.json"

# Batches between two checkpoints of the heaps (and the rows they cover).
_CHECKPOINT_BATCHES = 16


@dataclass(frozen=True)
class UnitJob:
    """What one ``camviz units`` run scans for."""

    layer: str
    channels: tuple[int, ...]
    k: int
    statistic: Statistic
    precision: Precision = "fp32"
    channels_last: bool | None = None

    def settings(self, loaded: LoadedModel) -> dict[str, Any]:
        return {
            "model": loaded.name,
            "layer": self.layer,
            "channels": list(self.channels),
            "k": self.k,
            "statistic": self.statistic,
            "precision": self.precision,
            "channels_last": self.channels_last,
            "preprocess": repr(loaded.preprocess),
        }


def scan_units(
    inputs: str | Sequence[str],
    out_dir: str | Path,
    loaded: LoadedModel,
    layer: str,
    channels: Sequence[int] | str | None = None,
    *,
    k: int = 9,
    statistic: Statistic = "max",
    batch_size: int = 32,
    workers: int = 0,
    progress: bool | None = False,
    precision: Precision = "fp32",
    channels_last: bool | None = None,
) -> dict[str, Any]:
    """Scan the inputs for the top images of ``layer``'s channels and draw them.

    Args:
        inputs: Files, folders, globs, path lists (see :mod:`camviz.pipeline.inputs`).
        out_dir: The output folder (see the module docstring); a rerun resumes.
        loaded: The model, its preprocessing and name, on the device to run on.
        layer: The layer spot whose channels are ranked.
        channels: Channel indices, a text such as ``"0-63"``, or ``None`` for all.
        k: Top images per channel.
        statistic: ``"max"`` or ``"mean"`` over the grid (see :func:`camviz.top_examples`).
        batch_size: Images per forward pass.
        workers: DataLoader processes that decode and preprocess.
        progress: A progress bar on stderr (``None``: when it is a terminal).
        precision, channels_last: How the scan's passes run (see :func:`camviz.explain`;
            ``channels_last=None`` as in :func:`camviz.top_examples`); the pictures' maps
            are explained in float32.

    Returns:
        The content of ``units.json``.

    Raises:
        CamvizError: No input, a bad layer or channel, the folder in use by another job or
            holding a scan with other settings.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CamvizError(f"--out {str(out)!r} is a file; give a folder")
    manifest.check_folder(out)
    items = expand(inputs, exclude=manifest.written_files(out))
    if not items:
        raise CamvizError("no image found in the inputs (files camviz wrote are never inputs)")
    layer, count = _read_layer(loaded, items, layer)
    picked = parse_channels(channels) if isinstance(channels, str) else channels
    picked = range(count) if picked is None else picked
    Unit(layer, channel=list(picked)).maps(torch.zeros(1, count, 1, 1))  # in range, or one line
    model_precision(loaded.model, precision, bool(channels_last))  # refused before any file
    job = UnitJob(layer, tuple(picked), k, statistic, precision, channels_last)
    settings = job.settings(loaded)
    with distributed.session() as context, lock.locked(out, context):
        manifest.check_settings(out, settings)
        if context.is_main and manifest.read_summary(out) is None:  # before the first row
            manifest.write_summary(out, {"settings": settings, "complete": False})
        drawn_before = _channel_entries(out)  # read before rank 0 writes the new results
        distributed.barrier(context)
        heaps = _scan(out, items, loaded, job, context, batch_size, workers, progress)
        distributed.barrier(context)
        if context.is_main:
            _write_results(out, items, loaded, job, heaps)
        distributed.barrier(context)
        results = json.loads((out / RESULTS).read_text(encoding="utf-8"))
        _draw(out, loaded, job, results, drawn_before, context)
        distributed.barrier(context)
        if context.is_main:
            _finish(out, items, results)
        distributed.barrier(context)
    return results


def _read_layer(loaded: LoadedModel, items: Sequence[Item], layer: str) -> tuple[str, int]:
    """The tensor spot ``layer`` is read at (:func:`~camviz.core.layouts.tensor_spot`) and
    how many channels it has, told by the first readable input."""
    for item in items:
        try:
            inputs = loaded.preprocess(load_image(item.path)).unsqueeze(0)
        except (CamvizError, OSError):
            continue
        inputs = inputs.to(model_device(loaded.model))
        spot = tensor_spot(loaded.model, layer, as_inputs(inputs, loaded.model))
        with exclusive(loaded.model), eval_mode(loaded.model), no_grad():
            tensors, _ = outputs_at(loaded.model, inputs, [spot])
        return spot, spatial_view(loaded.model, spot, tensors[spot], inputs).shape[1]
    raise CamvizError("none of the inputs can be read as an image")


def _scan(
    out: Path,
    items: Sequence[Item],
    loaded: LoadedModel,
    job: UnitJob,
    context: distributed.Context,
    batch_size: int,
    workers: int,
    progress: bool | None,
) -> TopHeaps:
    """This process's heaps over its shard of what is not done yet, checkpointed."""
    unit = Unit(job.layer, channel=list(job.channels))
    scan = UnitScan(loaded.model, unit, job.k, job.statistic, job.precision, job.channels_last)
    paths = [item.path for item in items]
    checkpoint = out / _CHECKPOINT.format(rank=context.rank)
    scan.heaps = _read_heaps(checkpoint, paths, len(job.channels), job.k)
    done = manifest.done_keys(out)
    todo = distributed.shard([i for i, item in enumerate(items) if item.key not in done], context)
    rows = manifest.RowLog(manifest.log_path(out, context.rank, context.world_size))
    pending: list[dict[str, Any]] = []
    try:
        batches = scan_batches(
            ItemDataset(items),
            loaded.preprocess,
            todo,
            batch_size,
            workers,
            model_device(loaded.model),
            progress if context.is_main else False,
        )
        for number, (positions, batch, reason) in enumerate(batches, start=1):
            started = time.perf_counter()
            if batch is not None:
                scan.add(positions, batch)
            seconds = (time.perf_counter() - started) / len(positions)
            pending += [_row(items[p], reason, seconds) for p in positions]
            if number % _CHECKPOINT_BATCHES == 0:
                _checkpoint(checkpoint, scan.heaps, paths, rows, pending)
        _checkpoint(checkpoint, scan.heaps, paths, rows, pending)
    finally:
        rows.close()
    return scan.heaps


def _row(item: Item, reason: str | None, seconds: float) -> dict[str, Any]:
    """An input's row: ``ok`` (scanned: nothing explained, no file of its own) or why not."""
    fields = manifest.input_fields(item.path)
    if reason is None:
        return {
            **fields,
            "status": "ok",
            "explained": [],
            "files": [],
            "seconds": round(seconds, 4),
        }
    return {**fields, "status": "error", "reason": reason, "files": []}


def _checkpoint(
    path: Path,
    heaps: TopHeaps,
    paths: Sequence[str],
    rows: manifest.RowLog,
    pending: list[dict[str, Any]],
) -> None:
    """Write the heaps whole, then the rows of the images they now cover."""
    with atomic_write(path, "w") as file:
        file.write(manifest.dumps(_heaps_by_path(heaps, paths)))
    for row in pending:
        rows.append(row)
    pending.clear()


def _heaps_by_path(heaps: TopHeaps, paths: Sequence[str]) -> dict[str, Any]:
    """The heaps with each image named by its file (positions change when files are added)."""
    state = heaps.state()
    state["heaps"] = [
        [[value, paths[-negated], place] for value, negated, place in heap]
        for heap in state["heaps"]
    ]
    return state


def _read_heaps(path: Path, paths: Sequence[str], units: int, k: int) -> TopHeaps:
    """The heaps a checkpoint holds, by the positions of today's inputs (images that are no
    longer inputs are dropped); empty heaps when there is none."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return TopHeaps(units, k)
    position = {file: number for number, file in enumerate(paths)}
    heaps = state.get("heaps") if isinstance(state, dict) else None
    if not isinstance(heaps, list) or len(heaps) != units:
        return TopHeaps(units, k)
    state = {
        "k": k,
        "heaps": [
            [[value, -position[file], place] for value, file, place in heap if file in position]
            for heap in heaps
        ],
    }
    return TopHeaps.from_state(state)


def _write_results(
    out: Path, items: Sequence[Item], loaded: LoadedModel, job: UnitJob, own: TopHeaps
) -> None:
    """Merge every process's heaps into ``units.json`` and rank 0's checkpoint."""
    paths = [item.path for item in items]
    merged = own
    for part in sorted(out.glob(_CHECKPOINT.format(rank="*"))):
        merged.merge(_read_heaps(part, paths, len(job.channels), job.k))
    field = _field(loaded, items, job.layer)
    tops = UnitScan(loaded.model, Unit(job.layer, channel=list(job.channels)), job.k, job.statistic)
    tops.heaps = merged
    results = {
        "settings": job.settings(loaded),
        "receptive_field": field.as_dict(),
        "channels": [
            {
                "channel": top.unit.channels[0],
                "image": _image_name(top.unit.channels[0]),
                "examples": [_example(example) for example in top.examples],
            }
            for top in tops.result(paths)
        ],
    }
    with atomic_write(out / RESULTS, "w") as file:
        file.write(manifest.dumps(results, indent=1))
    with atomic_write(out / _CHECKPOINT.format(rank=0), "w") as file:
        file.write(manifest.dumps(_heaps_by_path(merged, paths)))
    for part in out.glob(_CHECKPOINT.format(rank="*")):
        if part.name != _CHECKPOINT.format(rank=0):
            part.unlink()


def _field(loaded: LoadedModel, items: Sequence[Item], layer: str) -> ReceptiveField:
    """The layer's receptive field for the first readable input's size."""
    for item in items:
        try:
            inputs = loaded.preprocess(load_image(item.path)).unsqueeze(0)
        except (CamvizError, OSError):
            continue
        return receptive_field(loaded.model, inputs.to(model_device(loaded.model)), layer)
    raise CamvizError("none of the inputs can be read as an image")


def _example(example: Example) -> dict[str, Any]:
    return {"file": example.path, "value": example.value, "location": list(example.location)}


def _image_name(channel: int) -> str:
    return f"channel_{channel:04d}.png"


def _channel_entries(out: Path) -> list[dict[str, Any]]:
    """The channels of an earlier run's ``units.json`` (their pictures may be kept)."""
    try:
        entries = json.loads((out / RESULTS).read_text(encoding="utf-8")).get("channels")
    except (OSError, ValueError, AttributeError):
        return []
    return entries if isinstance(entries, list) else []


def _draw(
    out: Path,
    loaded: LoadedModel,
    job: UnitJob,
    results: dict[str, Any],
    drawn_before: list[dict[str, Any]],
    context: distributed.Context,
) -> None:
    """This process's share of the channel pictures (channel ``i`` goes to rank
    ``i mod world_size``); a picture an earlier run drew of the same top images is kept."""
    field = ReceptiveField.from_dict(results["receptive_field"])
    own = [
        entry
        for entry in results["channels"][context.rank :: context.world_size]
        if entry not in drawn_before or not (out / entry["image"]).is_file()
    ]
    tops = [
        UnitExamples(
            Unit(job.layer, channel=entry["channel"]),
            tuple(
                Example(number, e["value"], tuple(e["location"]), e["file"])
                for number, e in enumerate(entry["examples"])
            ),
        )
        for entry in own
    ]
    drawn = example_maps(loaded.model, tops, field, _read, loaded.preprocess)
    for entry, maps in zip(own, drawn, strict=True):
        title = f"{job.layer} channel {entry['channel']} ({job.statistic}); {field.describe()}"
        save(example_grid(maps, title), out / entry["image"])


def _read(example: Example) -> Image.Image:
    return load_image(str(example.path))


def _finish(out: Path, items: Sequence[Item], results: dict[str, Any]) -> None:
    """The index page, the merged rows and the summary."""
    merged = merging.merge(out, [item.key for item in items], earlier=[])
    images = [entry["image"] for entry in results["channels"]]
    with atomic_write(out / INDEX, "w") as file:
        file.write(_index_html(results))
    counts = {"inputs": len(items), "scanned": merged.ok, "failed": len(merged.failures)}
    summary = {
        "settings": results["settings"],
        "complete": True,
        "counts": counts,
        "skipped_rows": merged.skipped,
        "rows": manifest.ROWS,
        "failures": merged.failures,
        "other_files": [RESULTS, INDEX, *images],
    }
    manifest.write_summary(out, summary)


def _index_html(results: dict[str, Any]) -> str:
    """A page with every channel's picture and its top images' files and values."""
    settings = results["settings"]
    title = f"{settings['model']} {settings['layer']}: top {settings['k']} images per channel"
    sections = []
    for entry in results["channels"]:
        rows = "".join(
            f"<tr><td>{number}</td><td>{example['value']:.4g}</td>"
            f"<td>{html.escape(str(example['file']))}</td></tr>"
            for number, example in enumerate(entry["examples"], start=1)
        )
        sections.append(
            f'<section id="channel-{entry["channel"]}"><h2>channel {entry["channel"]}</h2>'
            f'<img src="{html.escape(entry["image"])}" alt="channel {entry["channel"]}">'
            f"<table><tr><th>#</th><th>value</th><th>image</th></tr>{rows}</table></section>"
        )
    links = " ".join(
        f'<a href="#channel-{entry["channel"]}">{entry["channel"]}</a>'
        for entry in results["channels"]
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif}img{max-width:100%}td,th{padding:0 8px}</style>"
        f"</head><body><h1>{html.escape(title)}</h1>"
        f"<p>{html.escape(settings['statistic'])} over the grid; "
        f"{html.escape(results['receptive_field']['text'])}</p><p>{links}</p>"
        f"{''.join(sections)}</body></html>"
    )
