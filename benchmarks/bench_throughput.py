"""Images per second of the folder pipeline against the model's plain inference.

Run by hand (never in the tests), on a quiet machine::

    python benchmarks/bench_throughput.py          # 256 images, offline model, batch 16
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_throughput.py   # PyTorch's AVX2 kernels
    python benchmarks/bench_throughput.py --quick  # 32 images, batch 8, one round: a smoke run
    python benchmarks/bench_throughput.py --all    # also each thread count, maps only, ...
    python benchmarks/bench_throughput.py --writer # CPU time of each step of the writer
    python benchmarks/bench_throughput.py --allocator glibc   # glibc's defaults throughout

The images are crops and mirror images of the shipped photos, all 4:3 (so every batch is
full), written to a temporary folder. Every variant reads them the same way (decoded with
:func:`camviz.io.images.load_image`, then the model's preprocessing), in the same batch
size:

* ``inference``: the model alone in fp32, under ``torch.inference_mode()``, on torch's
  threads, reading through a DataLoader with ``--workers`` processes: the reference, a plain
  loop as one writes it;
* ``explain, fp32``: :func:`camviz.pipeline.job.explain_files` with the default outputs
  (overlay PNG and panel JPEG per image, the manifest), as ``camviz explain FOLDER`` runs
  (on a CPU: no DataLoader workers, its writer threads reading the images between the
  model's passes, and the channels-last inputs it chooses there);
* ``explain, bf16 + channels-last``: the same with ``--precision bf16 --channels-last``,
  where the CPU computes bf16 natively (it is refused where it would only be emulated);
* with ``--all`` also ``inference, channels-last`` (the plain loop with channels-last
  inputs), ``explain, fp32, contiguous`` (``--no-channels-last``), the job with
  ``--workers`` DataLoader processes beside the model (``camviz explain --workers N``, the
  model on one thread fewer), ``explain_dataset`` (Grad-CAM maps, held in memory, read by
  the DataLoader) and ``explain, overlays`` (``camviz explain --no-panel``).

Each run of a variant is a fresh Python process that sets the allocator and the threads,
loads the model, and then times the variant over the whole folder, as a user's process runs
it (:func:`run_variant`). The processes run with the allocator setting that the ``camviz``
command makes (:func:`camviz.core.allocator.retain_freed_memory`: freed blocks stay in the
heap for the next batch), plain inference included, so that the figures compare like with
like; ``--allocator glibc`` keeps glibc's defaults instead, as a script of one's own runs.

Each variant runs once to warm the file cache, then the variants take turns for
``--repeat`` rounds (7, as issue 26 asks; fewer for a quick look); each figure is the median
of its rounds. The CPU capability that PyTorch's kernels use (``ATEN_CPU_CAPABILITY``
chooses a lower one) is printed with the figures.

``--writer`` instead times, on one thread and one torch thread, what the folder job spends
per image: the model's pass (plain inference, and the explaining pass) and each step of the
writer threads (drawing the overlay and the panel, encoding each), as this
thread's CPU time (``time.thread_time``), medians of alternating rounds. CPU time per image
stays meaningful on a machine shared with other work, where images per second do not; on two
cores, every core-millisecond the writers spend is taken from the model's two threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset

import camviz
from camviz.cams.engine import explain
from camviz.core.allocator import retain_freed_memory
from camviz.core.errors import CamvizError
from camviz.core.precision import check_precision
from camviz.io.images import load_image
from camviz.io.pictures import overlay_and_panel
from camviz.pipeline.dataset import explain_dataset
from camviz.pipeline.encoders import save_jpeg, save_png
from camviz.pipeline.job import Outputs, explain_files
from camviz.pipeline.threads import default_workers, model_threads, running_on

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def make_images(folder: Path, count: int, suffix: str = ".png") -> list[Path]:
    """``count`` distinct 4:3 crops of the shipped photos, every other one mirrored, saved
    with ``suffix`` (``".jpg"``: JPEG at quality 90, as camera photos come)."""
    photos = [Image.open(ASSETS / name).convert("RGB") for name in ("chelsea.png", "coffee.png")]
    paths = []
    for number in range(count):
        photo = photos[number % 2]
        width = photo.width * (0.6 + 0.4 * ((number * 7) % 10) / 10)
        height = width * 3 / 4
        left = (photo.width - width) * ((number * 3) % 5) / 4
        top = (photo.height - height) * ((number * 5) % 3) / 2
        crop = photo.crop((round(left), round(top), round(left + width), round(top + height)))
        crop = crop.resize((400, 300))
        if number % 2:
            crop = ImageOps.mirror(crop)
        path = folder / f"{number:03d}{suffix}"
        crop.save(path, quality=90)
        paths.append(path)
    return paths


class Preprocessed(Dataset):
    """Files decoded and preprocessed exactly as camviz does it, for plain inference."""

    def __init__(self, paths: list[Path], preprocess: Callable) -> None:
        self.paths = paths
        self.preprocess = preprocess

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.preprocess(load_image(self.paths[index]))


def run_variant(spec: dict[str, Any]) -> dict[str, float]:
    """Run one variant in this process, as a user's process runs it: set the allocator and
    the threads, load the model, then time the variant over the folder. Returns the images
    explained, the seconds, and the CPU milliseconds per image of this process and its
    DataLoader workers."""
    if spec["allocator"] == "camviz":
        retain_freed_memory()
    if spec["torch_threads"]:
        torch.set_num_threads(spec["torch_threads"])
    loaded = camviz.io.models.load()
    paths = sorted(Path(spec["images"]).iterdir())
    out = Path(spec["out"])
    shutil.rmtree(out, ignore_errors=True)
    before, start = os.times(), time.perf_counter()
    if spec["kind"] == "inference":
        loader = DataLoader(
            Preprocessed(paths, loaded.preprocess),
            batch_size=spec["batch"],
            num_workers=spec["workers"],
        )
        count = 0
        with running_on(spec["threads"] or torch.get_num_threads()), torch.inference_mode():
            for batch in loader:
                if spec["precision"].get("channels_last"):
                    batch = batch.contiguous(memory_format=torch.channels_last)
                loaded.model(batch)
                count += len(batch)
    elif spec["kind"] == "maps":
        results = explain_dataset(
            loaded,
            paths,
            batch_size=spec["batch"],
            workers=spec["workers"],
            keep_images=False,
        )
        count = sum(result.ok for result in results)
    else:
        manifest = explain_files(
            paths,
            out,
            loaded,
            outputs=Outputs(overlay=True, panel=spec["kind"] == "files"),
            batch_size=spec["batch"],
            workers=spec["workers"],
            threads=spec["threads"],
            **spec["precision"],
        )
        count = manifest["counts"]["ok"]
    seconds = time.perf_counter() - start
    after = os.times()  # the workers have ended: their time is in children_*
    spent = sum(after[:4]) - sum(before[:4])
    return {"count": count, "seconds": seconds, "cpu_ms": spent * 1000 / max(count, 1)}


def median_rates(
    variants: dict[str, dict[str, Any]], repeat: int
) -> dict[str, tuple[float, float]]:
    """Images per second of each variant and its CPU milliseconds per image, the medians of
    its ``repeat`` runs, each run a fresh Python process (:func:`run_variant`).

    A fresh process each time, because a process that has already run a variant has grown
    its heap, and each later DataLoader forks from it: every page of that heap is then
    copy-on-write, a page fault on its first write, a fixed cost per run that pulls every
    ratio towards 1 (``camviz explain`` forks once, before its heap grows). Every variant
    runs once to warm the file cache; then the variants take turns, in reverse order every
    other round, so that a busy spell on the machine does not fall on one variant only.
    """

    def measure(spec: dict[str, Any]) -> dict[str, float]:
        command = [sys.executable, __file__, "--variant", json.dumps(spec)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"{spec['kind']} failed:\n{done.stderr}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    for spec in variants.values():
        measure(spec)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    costs: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(repeat):
        names = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in names:
            run = measure(variants[name])
            rates[name].append(run["count"] / run["seconds"])
            costs[name].append(run["cpu_ms"])
    return {
        name: (statistics.median(rates[name]), statistics.median(costs[name])) for name in rates
    }


def writer_steps(loaded: Any, paths: list[Path], out: Path, repeat: int) -> dict[str, float]:
    """Milliseconds of this thread's CPU time per image, one torch thread: the model's
    pass (plain and explaining, per image of a batch) and each step of the folder job's
    writer, medians of ``repeat`` alternating rounds (see the module docstring)."""
    torch.set_num_threads(1)
    results = [result for result in explain_dataset(loaded, paths) if result.ok]
    batch = torch.stack([loaded.preprocess(result.image) for result in results])
    out.mkdir(parents=True, exist_ok=True)
    drawn = {}

    def inference() -> None:
        with torch.inference_mode():
            loaded.model(batch)

    def explaining() -> None:
        explain(loaded.model, batch, "gradcam", loaded.default_layer)

    def draw() -> None:
        for result in results:
            drawn[result.index] = overlay_and_panel(
                result.image, result.heatmaps[0], title=f"{result.explained[0].name}: p=0.50"
            )

    def encode(kind: int) -> Callable[[], None]:
        def run() -> None:
            for index, pictures in drawn.items():
                (save_png if kind == 0 else save_jpeg)(pictures[kind], out / f"{index}_{kind}")

        return run

    steps = {
        "plain inference, per image": inference,
        "explaining pass (Grad-CAM), per image": explaining,
        "overlay and panel drawn": draw,
        "overlay PNG encoded and written": encode(0),
        "panel JPEG encoded and written": encode(1),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(repeat + 1):
        for name, step in steps.items():
            for path in out.iterdir():  # new files, as in a run (replacing costs more)
                path.unlink()
            start = time.thread_time()
            step()
            if round_:  # the first round warms up
                times[name].append((time.thread_time() - start) * 1000 / len(results))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=min(4, max(0, (os.cpu_count() or 1) - 1)))
    parser.add_argument(
        "--repeat", type=int, default=7, help="rounds (7; fewer for a quick look only)"
    )
    parser.add_argument("--quick", action="store_true", help="32 images, batch 8, one round")
    parser.add_argument(
        "--all", action="store_true", help="also each thread count, maps only, overlays only"
    )
    parser.add_argument("--threads", type=int, help="torch threads; 1 on a busy machine")
    parser.add_argument("--writer", action="store_true", help="CPU time of the writer's steps")
    parser.add_argument(
        "--allocator",
        choices=("camviz", "glibc"),
        default="camviz",
        help="camviz: freed memory kept, as the camviz command runs; glibc: its defaults",
    )
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one run, in a child process
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(json.loads(args.variant))))
        return
    if args.allocator == "camviz" and not retain_freed_memory():
        print("allocator: glibc's defaults (not glibc, or set in the environment)")
        args.allocator = "glibc"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.images, args.batch, args.repeat = 32, 8, 1
    elif args.repeat < 1:
        parser.error("--repeat must be at least 1 (7 for the figures issue 26 asks for)")
    reduced: dict[str, Any] = {"precision": "bf16", "channels_last": True}
    try:
        check_precision("bf16", torch.device("cpu"), used=True)
    except CamvizError as refused:
        print(f"bf16 not measured: {refused}")
        reduced = {}
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        print("bf16 not measured: ATEN_CPU_CAPABILITY=avx2 stands in for a CPU without it")
        reduced = {}
    folder = Path(tempfile.mkdtemp(prefix="camviz-bench-"))
    try:
        (folder / "images").mkdir()
        paths = make_images(folder / "images", args.images)
        if args.writer:
            loaded = camviz.io.models.load()
            steps = writer_steps(loaded, paths[: args.batch], folder / "out", args.repeat)
            print(f"{loaded.name}, one thread, CPU time per 400x300 image, median of {args.repeat}")
            print("| step | ms of CPU time per image |\n| --- | --- |")
            for name, milliseconds in steps.items():
                print(f"| {name} | {milliseconds:.1f} |")
            return
        rates = median_rates(variant_specs(args, folder, reduced), args.repeat)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    print(
        f"{camviz.io.models.load().name}, {args.images} images of 400x300 (224x299 after "
        f"preprocessing), batch {args.batch}, {args.workers} DataLoader workers for inference, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"allocator {args.allocator}, each run a fresh process, median of {args.repeat} rounds\n"
    )
    print("| variant | images/s | vs inference | CPU ms per image |")
    print("| --- | --- | --- | --- |")
    reference = rates["inference"][0]
    for name, (rate, cost) in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / reference:.2f}x | {cost:.0f} |")


def variant_specs(
    args: argparse.Namespace, folder: Path, reduced: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """What each variant's process runs (:func:`run_variant`), by the variant's name."""
    base = {
        "images": str(folder / "images"),
        "out": str(folder / "out"),
        "batch": args.batch,
        "workers": args.workers,
        "allocator": args.allocator,
        "torch_threads": args.threads,
        "threads": None,
        "precision": {},
    }
    cpu = torch.device("cpu")
    # The job as `camviz explain FOLDER` runs it: its writers read between the passes.
    job = {**base, "workers": default_workers(cpu)}
    variants = {"inference": {**base, "kind": "inference"}}
    if args.all:
        variants["inference, channels-last"] = {
            **base,
            "kind": "inference",
            "precision": {"channels_last": True},
        }
    precisions: dict[str, dict[str, Any]] = {"fp32": {}}
    if args.all:
        precisions["fp32, contiguous"] = {"channels_last": False}
    if reduced:
        precisions["bf16 + channels-last"] = reduced
    for name, precision in precisions.items():
        variants[f"explain, {name}"] = {**job, "kind": "files", "precision": precision}
    if args.all:
        if args.workers:
            threads = model_threads(None, cpu, args.workers)
            beside = (
                f"explain, fp32, {args.workers} workers beside the model on {threads} thread(s)"
            )
            variants[beside] = {**base, "kind": "files"}
        variants["explain_dataset"] = {**base, "kind": "maps"}
        variants["explain, overlays"] = {**job, "kind": "overlays"}
    return variants


if __name__ == "__main__":
    main()
