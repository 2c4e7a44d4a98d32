"""Images per second of the folder pipeline against the model's plain inference.

Run by hand (never in the tests), on a quiet machine::

    python benchmarks/bench_throughput.py          # 64 images, offline model, batch 16
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_throughput.py   # PyTorch's AVX2 kernels
    python benchmarks/bench_throughput.py --quick  # 16 images, batch 8: a smoke run
    python benchmarks/bench_throughput.py --all    # also the maps-only and no-panel variants
    python benchmarks/bench_throughput.py --writer # CPU time of each step of the writer
    python benchmarks/bench_throughput.py --allocator glibc   # glibc's defaults throughout

The images are crops and mirror images of the shipped photos, all 4:3 (so every batch is
full), written to a temporary folder. Every variant reads them with the same DataLoader
settings (``--workers`` processes that decode with :func:`camviz.io.images.load_image` and
apply the model's preprocessing) and the same batch size:

* ``inference``: the model alone in fp32, under ``torch.inference_mode()``, on torch's
  threads: the reference, a plain loop as one writes it;
* ``inference, N thread(s) as the job``: the same on the threads the folder job gives the
  model (one fewer on a CPU, :mod:`camviz.pipeline.threads`), leaving the loader a core too;
* ``explain, fp32``: :func:`camviz.pipeline.job.explain_files` with the default outputs
  (overlay PNG and panel JPEG per image, the manifest), as ``camviz explain FOLDER`` runs;
* ``explain, bf16 + channels-last``: the same with ``--precision bf16 --channels-last``,
  where the CPU computes bf16 natively (it is refused where it would only be emulated);
* with ``--all`` also ``explain_dataset`` (Grad-CAM maps, held in memory) and ``explain,
  overlays`` (``camviz explain --no-panel``).

The whole process, plain inference included, runs with the allocator setting that the
``camviz`` command makes (:func:`camviz.core.allocator.retain_freed_memory`: freed blocks stay
in the heap for the next batch), so that the figures compare like with like; ``--allocator
glibc`` keeps glibc's defaults throughout instead, as a script of one's own runs.

Each variant runs once to warm up, then the variants take turns for ``--repeat`` rounds
(7, as issue 26 asks; fewer for a quick look); each figure is the median of its rounds. The
CPU capability that PyTorch's kernels use (``ATEN_CPU_CAPABILITY`` chooses a lower one) is
printed with the figures.

``--writer`` instead times, on one thread and one torch thread, what the folder job spends
per image: the model's pass (plain inference, and the explaining pass) and each step of the
writer threads (drawing the overlay and the panel, encoding each), as this
thread's CPU time (``time.thread_time``), medians of alternating rounds. CPU time per image
stays meaningful on a machine shared with other work, where images per second do not; on two
cores, every core-millisecond the writers spend is taken from the model's two threads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
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
from camviz.pipeline.threads import model_threads, running_on

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


def median_rates(
    variants: dict[str, Callable[[], int]], repeat: int
) -> dict[str, tuple[float, float]]:
    """Images per second of each variant and its CPU milliseconds per image (this process's
    threads and its DataLoader workers), the medians of its ``repeat`` passes.

    Every variant runs once to warm up; then the variants take turns, ``repeat`` rounds,
    so that a busy spell on the machine does not fall on one variant only.
    """
    for run in variants.values():
        run()
    rates: dict[str, list[float]] = {name: [] for name in variants}
    costs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, run in variants.items():
            before, start = os.times(), time.perf_counter()
            count = run()
            rates[name].append(count / (time.perf_counter() - start))
            after = os.times()  # the workers have ended: their time is in children_*
            spent = sum(after[:4]) - sum(before[:4])
            costs[name].append(spent * 1000 / count)
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
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=min(4, max(0, (os.cpu_count() or 1) - 1)))
    parser.add_argument(
        "--repeat", type=int, default=7, help="rounds (7; fewer for a quick look only)"
    )
    parser.add_argument("--quick", action="store_true", help="16 images, batch 8, one pass")
    parser.add_argument("--all", action="store_true", help="also maps only and overlays only")
    parser.add_argument("--threads", type=int, help="torch threads; 1 on a busy machine")
    parser.add_argument("--writer", action="store_true", help="CPU time of the writer's steps")
    parser.add_argument(
        "--allocator",
        choices=("camviz", "glibc"),
        default="camviz",
        help="camviz: freed memory kept, as the camviz command runs; glibc: its defaults",
    )
    args = parser.parse_args()
    if args.allocator == "camviz" and not retain_freed_memory():
        print("allocator: glibc's defaults (not glibc, or set in the environment)")
        args.allocator = "glibc"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.images, args.batch, args.repeat = 16, 8, 1
    elif args.repeat < 1:
        parser.error("--repeat must be at least 1 (7 for the figures issue 26 asks for)")
    loaded = camviz.io.models.load()
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
        out = folder / "out"
        if args.writer:
            steps = writer_steps(loaded, paths[: args.batch], out, args.repeat)
            print(f"{loaded.name}, one thread, CPU time per 400x300 image, median of {args.repeat}")
            print("| step | ms of CPU time per image |\n| --- | --- |")
            for name, milliseconds in steps.items():
                print(f"| {name} | {milliseconds:.1f} |")
            return

        def inference(threads: int) -> Callable[[], int]:
            def run() -> int:
                loader = DataLoader(
                    Preprocessed(paths, loaded.preprocess),
                    batch_size=args.batch,
                    num_workers=args.workers,
                )
                count = 0
                with running_on(threads), torch.inference_mode():
                    for batch in loader:
                        loaded.model(batch)
                        count += len(batch)
                return count

            return run

        def maps() -> int:
            results = explain_dataset(
                loaded, paths, batch_size=args.batch, workers=args.workers, keep_images=False
            )
            return sum(result.ok for result in results)

        def files(outputs: Outputs, **precision: Any) -> Callable[[], int]:
            def run() -> int:
                shutil.rmtree(out, ignore_errors=True)
                manifest = explain_files(
                    paths,
                    out,
                    loaded,
                    outputs=outputs,
                    batch_size=args.batch,
                    workers=args.workers,
                    **precision,
                )
                return manifest["counts"]["ok"]

            return run

        threads = torch.get_num_threads()
        variants = {"inference": inference(threads)}
        job_threads = model_threads(None, torch.device("cpu"))
        if job_threads != threads:  # the same cores left to the loader as the job leaves
            variants[f"inference, {job_threads} thread(s) as the job"] = inference(job_threads)
        variants["explain, fp32"] = files(Outputs())
        if reduced:
            variants["explain, bf16 + channels-last"] = files(Outputs(), **reduced)
        if args.all:
            variants["explain_dataset"] = maps
            variants["explain, overlays"] = files(Outputs(overlay=True, panel=False))
        rates = median_rates(variants, args.repeat)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    print(
        f"{loaded.name}, {args.images} images of 400x300 (224x299 after preprocessing), "
        f"batch {args.batch}, {args.workers} DataLoader workers, {torch.get_num_threads()} "
        f"torch threads, {os.cpu_count()} CPUs, torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, allocator {args.allocator}, median of "
        f"{args.repeat} rounds\n"
    )
    print("| variant | images/s | vs inference | CPU ms per image |")
    print("| --- | --- | --- | --- |")
    reference = rates["inference"][0]
    for name, (rate, cost) in rates.items():
        print(f"| {name} | {rate:.1f} | {rate / reference:.2f}x | {cost:.0f} |")


if __name__ == "__main__":
    main()
