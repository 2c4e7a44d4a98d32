"""Grad-CAM speed and memory against plain inference, pytorch-grad-cam and torchcam.

Run by hand (never in the tests)::

    python benchmarks/bench_gradcam.py          # resnet50: time 8 x 224 px, memory 16 x 320 px
    python benchmarks/bench_gradcam.py --quick  # resnet18, small inputs: a smoke run

Times are medians of ``--repeat`` runs after one warm-up, in one process, on the same batch.
Peak extra memory is measured for each variant in a fresh process: the peak resident set
size (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` after set-up) minus the
resident size after set-up, so the model and the input batch are not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision

VARIANTS = ("inference", "camviz", "pytorch-grad-cam", "torchcam")


def build(model_name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.get_model(model_name, weights=None).eval()


def runner(variant: str, model: torch.nn.Module, inputs: torch.Tensor) -> Callable[[], object]:
    """A no-argument function that runs ``variant`` once on ``inputs``."""
    target_classes = list(range(inputs.shape[0]))
    if variant == "inference":

        def run() -> object:
            with torch.inference_mode():
                return model(inputs)

    elif variant == "camviz":
        import camviz

        def run() -> object:
            return camviz.explain(model, inputs, layer="layer4", target=target_classes).heatmaps

    elif variant == "pytorch-grad-cam":
        from pytorch_grad_cam import GradCAM
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        cam = GradCAM(model=model, target_layers=[model.layer4])
        targets = [ClassifierOutputTarget(c) for c in target_classes]

        def run() -> object:
            return cam(inputs, targets=targets)

    elif variant == "torchcam":
        from torchcam.methods import GradCAM as TorchcamGradCAM

        def run() -> object:
            with TorchcamGradCAM(model, target_layer="layer4") as extractor:
                scores = model(inputs)
                return extractor(target_classes, scores)

    else:
        raise ValueError(variant)
    return run


def time_variants(model_name: str, batch: int, size: int, repeat: int) -> dict[str, float]:
    model = build(model_name)
    inputs = torch.randn(batch, 3, size, size)
    seconds = {}
    for variant in VARIANTS:
        run = runner(variant, model, inputs)
        run()
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        seconds[variant] = statistics.median(samples)
        model.zero_grad(set_to_none=True)
    return seconds


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_memory(variant: str, model_name: str, batch: int, size: int) -> None:
    """Child process: print the peak extra resident memory (MiB) of one run of ``variant``."""
    model = build(model_name)
    inputs = torch.randn(batch, 3, size, size)
    run = runner(variant, model, inputs)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = _status_kib("VmRSS")
    run()
    print(json.dumps({"extra_mib": (_status_kib("VmHWM") - baseline) / 1024}))


def measure_memory(model_name: str, batch: int, size: int) -> dict[str, float]:
    extra = {}
    for variant in VARIANTS:
        command = [sys.executable, __file__, "--child", variant, "--model", model_name]
        command += ["--mem-batch", str(batch), "--mem-size", str(size)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        extra[variant] = json.loads(output.strip().splitlines()[-1])["extra_mib"]
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mem-batch", type=int, default=16)
    parser.add_argument("--mem-size", type=int, default=320)
    parser.add_argument("--quick", action="store_true", help="resnet18, small inputs")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peak_extra_memory(args.child, args.model, args.mem_batch, args.mem_size)
        return
    if args.quick:
        args.model, args.batch, args.size, args.repeat = "resnet18", 2, 96, 2
        args.mem_batch, args.mem_size = 2, 96
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}")
    seconds = time_variants(args.model, args.batch, args.size, args.repeat)
    memory = measure_memory(args.model, args.mem_batch, args.mem_size)
    print(
        f"\n| variant | time, batch {args.batch} @ {args.size} px | vs inference "
        f"| peak extra memory, batch {args.mem_batch} @ {args.mem_size} px | vs inference |"
    )
    print("| --- | --- | --- | --- | --- |")
    for variant in VARIANTS:
        print(
            f"| {variant} | {seconds[variant] * 1000:.0f} ms "
            f"| {seconds[variant] / seconds['inference']:.2f}x "
            f"| {memory[variant]:.0f} MiB | {memory[variant] / memory['inference']:.2f}x |"
        )


if __name__ == "__main__":
    main()
