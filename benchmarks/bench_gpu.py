"""camviz on a GPU: Grad-CAM, Score-CAM and the folder job against plain inference.

Run by hand on a machine with a CUDA GPU (never in the tests or CI)::

    python benchmarks/bench_gpu.py                        # ResNet-50, batch 64, 256 photos
    python benchmarks/bench_gpu.py --quick                # batch 8, 32 photos: a smoke run
    python benchmarks/bench_gpu.py --device cpu --quick   # ResNet-18 at 64 px on the CPU:
                                                          # proves the script runs, no more

Without CUDA (and without ``--device cpu``) it prints one line and exits with status 1.

In fp32 and in bf16 (``precision="bf16"``; with ``channels_last=True`` in both, as a GPU
user would run it; bf16 only where the device computes it natively, or with
``CAMVIZ_EMULATED_PRECISION=1``), each measured after
a warm-up, times the median of ``--repeat`` runs (with ``torch.cuda.synchronize`` on a GPU),
memory the peak allocated by torch on the GPU during the runs minus what was allocated
before them:

* plain inference of a random-weight ResNet-50 at batch 64, 224 px, under autocast for bf16;
* Grad-CAM at ``layer4`` on the same batch (target: within 1.1x of plain inference);
* Score-CAM of one image at ``layer4`` (2,048 channels; target: under 2 s in bf16);
* the folder job (:func:`camviz.pipeline.job.explain_files`, overlays and panels, the
  CLI's default outputs) of the offline EfficientNet-Lite0 on JPEG photos at batch 64,
  against plain inference of the same photos through a DataLoader with the same workers,
  in images per second. On CUDA the job decodes the JPEGs on the GPU and draws the
  pictures there (``camviz.pipeline.decoding``, ``camviz.io.render``); plain inference
  decodes them with Pillow in the workers, as a plain PyTorch script would.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from camviz.core.precision import EMULATED_VARIABLE, native


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], object], repeat: int, device: torch.device) -> tuple[float, str]:
    """``(median seconds, peak extra GPU memory)`` of ``run``, after one warm-up."""
    run()
    synchronize(device)
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    if device.type != "cuda":
        return statistics.median(seconds), "—"
    peak = torch.cuda.max_memory_allocated(device) - before
    return statistics.median(seconds), f"{peak / 2**20:.0f} MiB"


def autocast(device: torch.device, precision: str) -> torch.autocast:
    return torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16")


def model_rows(
    device: torch.device, precisions: list[str], name: str, size: int, batch: int, repeat: int
) -> list[str]:
    import torchvision

    import camviz

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None).eval().to(device)
    inputs = torch.randn(batch, 3, size, size, device=device)
    channels = model.fc.in_features
    rows = []
    fp32_plain = 0.0  # the reference of the "vs plain fp32" column
    for precision in precisions:

        def inference(precision: str = precision) -> None:
            data = inputs.contiguous(memory_format=torch.channels_last)
            with torch.inference_mode(), autocast(device, precision):
                model(data)

        def gradcam(precision: str = precision) -> None:
            camviz.explain(
                model, inputs, "gradcam", "layer4", precision=precision, channels_last=True
            )

        def scorecam(precision: str = precision) -> None:
            camviz.explain(
                model, inputs[:1], "scorecam", "layer4", precision=precision, channels_last=True
            )

        plain, plain_memory = timed(inference, repeat, device)
        grad, grad_memory = timed(gradcam, repeat, device)
        score, score_memory = timed(scorecam, 1, device)
        fp32_plain = fp32_plain or plain
        rows += [
            f"| plain inference, {name}, batch {batch} | {precision} | {plain * 1000:.0f} ms "
            f"| 1.00x | {plain / fp32_plain:.2f}x | {plain_memory} |",
            f"| Grad-CAM, {name}, batch {batch} | {precision} | {grad * 1000:.0f} ms | "
            f"{grad / plain:.2f}x | {grad / fp32_plain:.2f}x | {grad_memory} |",
            f"| Score-CAM, {name}, 1 image ({channels:,} channels) | {precision} | "
            f"{score:.2f} s | — | — | {score_memory} |",
        ]
    return rows


def folder_rows(
    device: torch.device, precisions: list[str], batch: int, images: int, workers: int
) -> list[str]:
    from bench_throughput import Preprocessed, make_images
    from torch.utils.data import DataLoader

    from camviz.io.models import load
    from camviz.pipeline.job import explain_files

    loaded = load()
    loaded.model.to(device)
    folder = Path(tempfile.mkdtemp(prefix="camviz-gpu-bench-"))
    rows = []
    try:
        (folder / "images").mkdir()
        paths = make_images(folder / "images", images, suffix=".jpg")
        fp32_rate = 0.0
        for precision in precisions:

            def inference(precision: str = precision) -> int:
                loader = DataLoader(
                    Preprocessed(paths, loaded.preprocess),
                    batch_size=batch,
                    num_workers=workers,
                    pin_memory=device.type == "cuda",
                )
                with torch.inference_mode(), autocast(device, precision):
                    for data in loader:
                        loaded.model(data.to(device, non_blocking=True))
                synchronize(device)
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
                assert manifest["counts"]["ok"] == len(paths), manifest["failures"][:1]
                return len(paths)

            rates, memory = {}, {}
            for name, run in (("plain inference", inference), ("camviz explain", job)):
                seconds, memory[name] = timed(run, 1, device)
                rates[name] = len(paths) / seconds
            fp32_rate = fp32_rate or rates["plain inference"]
            # Rates: "0.80x rate" is 80% of the images per second (the model rows compare times).
            for name, rate in rates.items():
                rows.append(
                    f"| {name}, {images} JPEG photos, batch {batch} | {precision} | "
                    f"{rate:.1f} images/s | {rate / rates['plain inference']:.2f}x rate | "
                    f"{rate / fp32_rate:.2f}x rate | {memory[name]} |"
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:1, or cpu")
    parser.add_argument("--model", default="resnet50", help="torchvision model with layer4")
    parser.add_argument("--size", type=int, default=224, help="input side, pixels")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="batch 8, 32 photos, 2 repeats; with --device cpu: ResNet-18 at 64 px (or a "
        "smaller --size), batch 4, 8 photos, no workers",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here; run it on a machine with one", file=sys.stderr)
        return 1
    if args.quick:
        args.batch, args.images, args.repeat = 8, 32, 2
        if device.type == "cpu":
            args.model, args.batch, args.images, args.workers = "resnet18", 4, 8, 0
            args.size = min(args.size, 64)
    precisions = ["fp32"]
    if native(device, torch.bfloat16) or os.environ.get(EMULATED_VARIABLE) == "1":
        precisions.append("bf16")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}")
    if "bf16" not in precisions:
        print(f"bf16 left out: this {device.type.upper()} does not compute it natively")
    print(
        "\n| what | precision | time | vs plain inference | vs plain fp32 inference "
        "| peak extra GPU memory |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    rows = model_rows(device, precisions, args.model, args.size, args.batch, args.repeat)
    rows += folder_rows(device, precisions, args.batch, args.images, args.workers)
    for row in rows:
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
