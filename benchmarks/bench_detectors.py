"""Ablation-CAM against Grad-CAM per object on Faster R-CNN, and what each further object costs
RetinaNet's gradient.

Run by hand (never in the tests), on one thread::

    python benchmarks/bench_detectors.py               # about two minutes on one core
    python benchmarks/bench_detectors.py --fallback    # and the old whole-network passes (minutes)

Models have random weights (Faster R-CNN's batch norms set on the image, see ``fasterrcnn``)
and score thresholds of 0 (so that they return their best boxes),
on one 320 x 320 image, explained at camviz's default layer (``backbone``: the levels of the
feature pyramid). Times are medians of ``--repeat`` rounds after one warm-up; each round runs
every variant once, so that a busy machine slows them alike.

* ``fasterrcnn_mobilenet_v3_large_320_fpn``: Grad-CAM and Ablation-CAM of detection 0, and
  their ratio. Ablation-CAM holds the plain pass's proposals of that detection and re-runs
  only what follows the layer on them (:mod:`camviz.core.heldpasses`). With ``--fallback``,
  the same map from whole-network passes per channel (what camviz did before: it lets the
  region proposal network propose anew for each ablated copy), timed once, and the Pearson
  correlation of the two raw maps.
* ``retinanet_resnet50_fpn`` at 320 px: one plain backward pass of one detection's score to
  the layer (``torch.autograd.grad`` on the graph of a forward pass), and Grad-CAM of 1 and 5
  detections in one call, with the dense-head shortcut (:mod:`camviz.core.denseheads`) and
  without it: a further object costs ``(t5 - t1) / 4``, given as a share of the plain
  backward pass, in wall-clock time and in the process's CPU time (which other jobs on a
  shared machine disturb less).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_detection import timings
from torch import nn
from torchvision.models import detection

import camviz
from camviz.core.denseheads import DenseRows
from camviz.core.heldpasses import HeldDetector
from camviz.core.hooks import tensors_in

SIZE = 320


def image() -> torch.Tensor:
    return torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))


def fasterrcnn() -> nn.Module:
    """Random weights, with the backbone's batch norms set to the statistics of the image:
    at their initial ones the random MobileNet's feature maps are about 1e-8, every box
    scores the same and no map shows anything."""
    torch.manual_seed(0)
    model = detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0
    ).eval()
    norms = [module for module in model.backbone.modules() if isinstance(module, nn.BatchNorm2d)]
    for norm in norms:
        norm.train()
        norm.momentum = 1.0
    with torch.no_grad():
        model.backbone(model.transform(list(image()))[0].tensors)
    return model.eval()


def retinanet() -> nn.Module:
    torch.manual_seed(0)
    return detection.retinanet_resnet50_fpn(
        weights=None, weights_backbone=None, score_thresh=0.0, min_size=SIZE, max_size=SIZE
    ).eval()


def explaining(model: nn.Module, batch: torch.Tensor, method: str, count: int) -> Callable[[], Any]:
    target = camviz.Detection(list(range(count)))
    return lambda: camviz.explain(model, batch, method, target=target, relu=False, normalize=False)


def ablation(repeat: int, fallback: bool) -> None:
    model, batch = fasterrcnn(), image()
    times = timings(
        {
            "gradcam, 1 object": explaining(model, batch, "gradcam", 1),
            "ablationcam, 1 object": explaining(model, batch, "ablationcam", 1),
        },
        repeat,
    )
    for name, seconds in times.items():
        print(f"  {name:<28} {seconds:8.3f} s")
    ratio = times["ablationcam, 1 object"] / times["gradcam, 1 object"]
    print(f"  ablationcam / gradcam        {ratio:8.2f}x")
    if not fallback:
        return
    held = explaining(model, batch, "ablationcam", 1)()
    original = HeldDetector.of
    HeldDetector.of = classmethod(lambda cls, model, layer: None)  # type: ignore[method-assign,assignment]
    try:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's warning
            old = explaining(model, batch, "ablationcam", 1)()
        seconds = time.perf_counter() - start
    finally:
        HeldDetector.of = original  # type: ignore[method-assign]
    print(f"  whole-network passes (before) {seconds:8.1f} s, once")
    for level, maps in held.maps_by_layer.items():
        pair = torch.stack([maps.flatten(), old.maps_by_layer[level].flatten()])
        corr = float(torch.corrcoef(pair)[0, 1]) if pair.std(1).min() > 0 else float("nan")
        print(f"  correlation with them, {level:<14} {corr:8.3f}")


def further_objects(repeat: int) -> None:
    model, batch = retinanet(), image()
    spots = camviz.explain(model, batch, target=camviz.Detection(0)).layers
    modules = {model.get_submodule(spot.split("[")[0]) for spot in spots}
    captured: list[torch.Tensor] = []
    hooks = [
        module.register_forward_hook(lambda m, a, out: captured.extend(tensors_in(out)))
        for module in modules
    ]
    score = model(batch)[0]["scores"][0]
    for hook in hooks:
        hook.remove()

    def backward() -> object:
        return torch.autograd.grad(score, captured, retain_graph=True, allow_unused=True)

    original = DenseRows.of

    def plain(count: int) -> Callable[[], Any]:
        def run() -> Any:
            DenseRows.of = classmethod(lambda cls, model, taps: None)  # type: ignore[method-assign,assignment]
            try:
                return explaining(model, batch, "gradcam", count)()
            finally:
                DenseRows.of = original  # type: ignore[method-assign]

        return run

    times, cpu = clocked(
        {
            "plain backward after the layer": backward,
            "gradcam, 1 object": explaining(model, batch, "gradcam", 1),
            "gradcam, 5 objects": explaining(model, batch, "gradcam", 5),
            "gradcam, 1 object, no shortcut": plain(1),
            "gradcam, 5 objects, no shortcut": plain(5),
        },
        repeat,
    )
    for name, seconds in times.items():
        print(f"  {name:<34} {seconds:8.3f} s")
    backward_name = "plain backward after the layer"
    for suffix in ("", ", no shortcut"):
        wall, used = (
            (clock[f"gradcam, 5 objects{suffix}"] - clock[f"gradcam, 1 object{suffix}"]) / 4
            for clock in (times, cpu)
        )
        print(
            f"  a further object{suffix:<18} {wall:8.3f} s = {wall / times[backward_name]:.2f} "
            f"of the backward pass ({used / cpu[backward_name]:.2f} in CPU time)"
        )


def clocked(
    runs: dict[str, Callable[[], object]], repeat: int
) -> tuple[dict[str, float], dict[str, float]]:
    """The median wall-clock and CPU time of each run, over ``repeat`` rounds after a
    warm-up, every run once per round."""
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(repeat):
        for name, run in runs.items():
            started, used = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - used)
    median = statistics.median
    return (
        {name: median(values) for name, values in wall.items()},
        {name: median(values) for name, values in cpu.items()},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fallback", action="store_true", help="time the old passes too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, median of {args.repeat}"
    )
    print("fasterrcnn_mobilenet_v3_large_320_fpn, 320 px, default layer:")
    ablation(args.repeat, args.fallback)
    print(f"retinanet_resnet50_fpn, {SIZE} px, default layer:")
    further_objects(args.repeat)


if __name__ == "__main__":
    main()
