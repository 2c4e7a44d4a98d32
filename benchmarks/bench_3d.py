"""3-D Grad-CAM on a video model against a plain forward pass, and pytorch-grad-cam.

Run by hand (never in the tests)::

    python benchmarks/bench_3d.py          # r3d_18 (random weights), 2 clips of 8 frames, 112 px
    python benchmarks/bench_3d.py --quick  # 1 clip of 4 frames at 56 px: a smoke run

Times are medians of ``--repeat`` rounds after one warm-up, in one process, on the same batch;
each round runs every variant once, so that a busy machine slows them alike.
``inference`` is one forward pass under ``torch.inference_mode``; ``camviz`` is
``camviz.explain(model, clips, layer="layer4")`` (one forward pass, gradients from layer4
on only); ``pytorch-grad-cam`` is its ``GradCAM`` on the same layer (a full backward pass).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torchvision.models.video import r3d_18

VARIANTS = ("inference", "camviz", "pytorch-grad-cam")


def runner(variant: str, model: torch.nn.Module, clips: torch.Tensor) -> Callable[[], object]:
    """A no-argument function that runs ``variant`` once on ``clips``."""
    classes = list(range(clips.shape[0]))
    if variant == "inference":

        def run() -> object:
            with torch.inference_mode():
                return model(clips)

    elif variant == "camviz":
        import camviz

        def run() -> object:
            return camviz.explain(model, clips, layer="layer4", target=classes).heatmaps

    elif variant == "pytorch-grad-cam":
        from pytorch_grad_cam import GradCAM
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        cam = GradCAM(model=model, target_layers=[model.layer4])
        targets = [ClassifierOutputTarget(c) for c in classes]

        def run() -> object:
            return cam(clips, targets=targets)

    else:
        raise ValueError(variant)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny clips: a smoke run")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per variant")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    batch, frames, size = (1, 4, 56) if args.quick else (2, 8, 112)
    torch.manual_seed(0)
    model = r3d_18(weights=None).eval().to(args.device)
    clips = torch.randn(batch, 3, frames, size, size, device=args.device)
    synchronise = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    runs = {variant: runner(variant, model, clips) for variant in VARIANTS}
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for run in runs.values():
        run()
    for _ in range(args.repeat):
        for variant, run in runs.items():
            synchronise()
            start = time.perf_counter()
            run()
            synchronise()
            times[variant].append(time.perf_counter() - start)
    seconds = {variant: statistics.median(values) for variant, values in times.items()}
    print(f"r3d_18, {batch} clip(s) of {frames} frames at {size} px, {args.device}")
    print("| variant | median time | vs inference |")
    print("| --- | --- | --- |")
    for variant, value in seconds.items():
        print(f"| {variant} | {value * 1000:.1f} ms | {value / seconds['inference']:.2f}x |")


if __name__ == "__main__":
    main()
