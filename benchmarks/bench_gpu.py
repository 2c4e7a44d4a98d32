"""camviz on a CUDA GPU: Grad-CAM, Score-CAM and the folder job against plain inference.

Run by hand on a machine with a GPU (never in the tests or CI)::

    python benchmarks/bench_gpu.py             # batch 64, 256 photos for the folder job
    python benchmarks/bench_gpu.py --quick     # batch 8, 32 photos: a smoke run

Without CUDA it prints one line and exits with status 1.

In fp32 and in bf16 (``precision="bf16"``; with ``channels_last=True`` in both, as a GPU
user would run it), each measured after a warm-up, times the median of ``--repeat`` runs
with ``torch.cuda.synchronize``, memory the peak allocated by torch during one run minus
what was allocated before it:

* plain inference of a random-weight ResNet-50 at batch 64, 224 px, under autocast for bf16;
* Grad-CAM at ``layer4`` on the same batch (target: within 1.1x of plain inference);
* Score-CAM of one image at ``layer4`` (2,048 channels; target: under 2 s in bf16);
* the folder job (:func:`camviz.pipeline.job.explain_files`, overlays and panels) of the
  offline EfficientNet-Lite0 on photos at batch 64, against plain inference through the
  same DataLoader, in images per second.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def timed(run: Callable[[], object], repeat: int) -> tuple[float, float]:
    """``(median seconds, peak extra MiB)`` of ``run`` on the GPU, after one warm-up."""
    run()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), (torch.cuda.max_memory_allocated() - before) / 2**20


def model_rows(batch: int, repeat: int) -> list[str]:
    import torchvision

    import camviz

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval().cuda()
    inputs = torch.randn(batch, 3, 224, 224, device="cuda")
    rows = []
    for precision in ("fp32", "bf16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        channels_last = inputs.contiguous(memory_format=torch.channels_last)

        def inference(dtype: torch.dtype = dtype, data: torch.Tensor = channels_last) -> None:
            with (
                torch.inference_mode(),
                torch.autocast("cuda", dtype, enabled=dtype != torch.float32),
            ):
                model(data)

        def gradcam(precision: str = precision) -> None:
            camviz.explain(
                model, inputs, "gradcam", "layer4", precision=precision, channels_last=True
            )

        def scorecam(precision: str = precision) -> None:
            camviz.explain(
                model, inputs[:1], "scorecam", "layer4", precision=precision, channels_last=True
            )

        plain, plain_mib = timed(inference, repeat)
        grad, grad_mib = timed(gradcam, repeat)
        score, score_mib = timed(scorecam, 1)
        rows += [
            f"| plain inference, batch {batch} | {precision} | {plain * 1000:.0f} ms | 1.00x "
            f"| {plain_mib:.0f} MiB |",
            f"| Grad-CAM, batch {batch} | {precision} | {grad * 1000:.0f} ms | "
            f"{grad / plain:.2f}x | {grad_mib:.0f} MiB |",
            f"| Score-CAM, 1 image (2,048 channels) | {precision} | {score:.2f} s | — "
            f"| {score_mib:.0f} MiB |",
        ]
    return rows


def folder_rows(batch: int, images: int, workers: int) -> list[str]:
    from bench_throughput import Preprocessed, make_images
    from torch.utils.data import DataLoader

    from camviz.io.models import load
    from camviz.pipeline.job import explain_files

    loaded = load()
    loaded.model.cuda()
    folder = Path(tempfile.mkdtemp(prefix="camviz-gpu-bench-"))
    rows = []
    try:
        (folder / "images").mkdir()
        paths = make_images(folder / "images", images)
        for precision in ("fp32", "bf16"):
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32

            def inference(dtype: torch.dtype = dtype) -> int:
                loader = DataLoader(
                    Preprocessed(paths, loaded.preprocess),
                    batch_size=batch,
                    num_workers=workers,
                    pin_memory=True,
                )
                with (
                    torch.inference_mode(),
                    torch.autocast("cuda", dtype, enabled=dtype != torch.float32),
                ):
                    for data in loader:
                        loaded.model(data.cuda(non_blocking=True))
                torch.cuda.synchronize()
                return len(paths)

            def job(precision: str = precision) -> int:
                shutil.rmtree(folder / "out", ignore_errors=True)
                manifest = explain_files(
                    paths,
                    folder / "out",
                    loaded,
                    batch_size=batch,
                    workers=workers,
                    precision=precision,
                    channels_last=True,
                )
                return manifest["counts"]["ok"]

            rates = {}
            for name, run in (("plain inference", inference), ("camviz explain", job)):
                run()
                started = time.perf_counter()
                count = run()
                rates[name] = count / (time.perf_counter() - started)
            for name, rate in rates.items():
                rows.append(
                    f"| {name}, {images} photos, batch {batch} | {precision} | {rate:.0f} images/s "
                    f"| {rate / rates['plain inference']:.2f}x | — |"
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="batch 8, 32 photos")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here; run it on a machine with one", file=sys.stderr)
        return 1
    if args.quick:
        args.batch, args.images, args.repeat = 8, 32, 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| what | precision | time | vs plain inference | peak extra GPU memory |")
    print("| --- | --- | --- | --- | --- |")
    for row in model_rows(args.batch, args.repeat) + folder_rows(
        args.batch, args.images, args.workers
    ):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
