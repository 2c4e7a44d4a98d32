"""Grad-CAM of detections on a torchvision detector against a plain forward pass; Ablation-CAM's
memory.

Run by hand (never in the tests)::

    python benchmarks/bench_detection.py             # times, about a minute on one core
    python benchmarks/bench_detection.py --ablation  # and Ablation-CAM's peak memory (minutes)

The model is ``fasterrcnn_mobilenet_v3_large_320_fpn`` with random weights and
``box_score_thresh=0.0`` (so that a random network still returns its 100 best boxes), on one
image at its default input size (320 px), explained at camviz's default layer for it.

Times are medians of ``--repeat`` rounds after one warm-up, in one process, on the same image;
each round runs every variant once, so that a busy machine slows them alike:

* ``forward``: one plain forward pass under ``torch.inference_mode``;
* ``forward, graph kept``: the same with autograd recording (what a gradient method needs);
* ``backward after the layer``: one ``torch.autograd.grad`` of one detection's score to the
  target layer's output, on the graph of one forward pass: the cost of one more object when
  the forward pass is shared;
* ``gradcam, K objects``: ``camviz.explain(model, image, target=camviz.Detection(range(K)))``,
  K maps from one call.

With ``--ablation``, a fresh process runs Ablation-CAM of one detection at the same layer and
reports how far its peak resident memory rose above the resident size after a plain forward
pass, next to the memory budget it was given (``--memory-budget``, else its default).
``benchmarks/bench_memory.py`` measures the budget on more models, methods and budgets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_gradcam import _status_kib
from torch import nn
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

import camviz
from camviz.core.hooks import tensors_in
from camviz.core.memory import default_budget, format_bytes, parse_bytes

OBJECTS = (1, 5, 10)
SIZE = 320


def detector() -> nn.Module:
    torch.manual_seed(0)
    return fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0
    ).eval()


def image() -> torch.Tensor:
    return torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))


def runners(
    model: nn.Module, batch: torch.Tensor, layer: str | None
) -> dict[str, Callable[[], object]]:
    """No-argument functions that each run one variant once, at ``layer`` (``None``: camviz's
    default, which may be several spots, e.g. the levels of a feature pyramid)."""
    spots = camviz.explain(model, batch, layer=layer, target=camviz.Detection(0)).layers
    print(f"layer: {', '.join(spots)}")
    modules = {model.get_submodule(spot.split("[")[0].split(":")[0]) for spot in spots}
    captured: list[torch.Tensor] = []

    def capture(_: nn.Module, __: object, output: object) -> None:
        captured.extend(tensors_in(output))

    handles = [module.register_forward_hook(capture) for module in modules]

    def forward() -> object:
        with torch.inference_mode():
            return model(batch)

    def forward_with_graph() -> object:
        return model(batch)

    def backward_after_layer() -> object:
        # A level that the score does not depend on (the pyramid's extra pooled level feeds
        # only the region proposals, which are detached) has no gradient.
        return torch.autograd.grad(score, captured, retain_graph=True, allow_unused=True)

    score = model(batch)[0]["scores"][0]  # the graph that backward_after_layer walks
    for handle in handles:
        handle.remove()
    runs: dict[str, Callable[[], object]] = {
        "forward": forward,
        "forward, graph kept": forward_with_graph,
        "backward after the layer": backward_after_layer,
    }
    for count in OBJECTS:
        runs[f"gradcam, {count} object{'s' * (count > 1)}"] = explaining(model, batch, spots, count)
    return runs


def explaining(
    model: nn.Module, batch: torch.Tensor, spots: list[str], count: int
) -> Callable[[], object]:
    """Grad-CAM of the first ``count`` detections, in one call."""
    target = camviz.Detection(list(range(count)))
    return lambda: camviz.explain(model, batch, layer=spots, target=target).heatmaps


def timings(runs: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def ablation_memory(layer: str | None, memory_budget: str | None) -> dict[str, float]:
    """In this (fresh) process: Ablation-CAM's peak resident memory above the resident size
    after a plain pass (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``, as
    ``benchmarks/bench_memory.py`` measures it), and its budget."""
    model, batch = detector(), image()
    with torch.inference_mode():
        model(batch)
    options: dict[str, Any] = {} if memory_budget is None else {"memory_budget": memory_budget}
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_kib("VmRSS")
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its fallback to whole-network passes on a detector
        target = camviz.Detection(0)
        camviz.explain(model, batch, "ablationcam", layer=layer, target=target, **options)
    seconds = time.perf_counter() - start
    budget = default_budget(batch.device) if memory_budget is None else parse_bytes(memory_budget)
    return {
        "extra": (_status_kib("VmHWM") - baseline) * 1024,
        "budget": budget,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per variant")
    parser.add_argument("--layer", help="target layer (default: camviz's default)")
    parser.add_argument("--ablation", action="store_true", help="also Ablation-CAM's memory")
    parser.add_argument("--memory-budget", help="Ablation-CAM's memory_budget, e.g. 512MiB")
    parser.add_argument("--ablation-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.ablation_child:
        print(json.dumps(ablation_memory(args.layer, args.memory_budget)))
        return

    model, batch = detector(), image()
    seconds = timings(runners(model, batch, args.layer), args.repeat)
    forward, backward = seconds["forward"], seconds["backward after the layer"]
    print(f"fasterrcnn_mobilenet_v3_large_320_fpn (random weights), one {SIZE} px image, 1 thread")
    print("| variant | median time | vs forward |")
    print("| --- | --- | --- |")
    for name, value in seconds.items():
        print(f"| {name} | {value * 1000:.0f} ms | {value / forward:.2f}x |")
    most = f"gradcam, {OBJECTS[-1]} objects"
    further = (seconds[most] - seconds["gradcam, 1 object"]) / (OBJECTS[-1] - 1)
    print(
        f"each further object: {further * 1000:.0f} ms = {further / backward:.2f} backward "
        "passes after the layer"
    )
    if args.ablation:
        command = [sys.executable, __file__, "--ablation-child"]
        if args.layer:
            command += ["--layer", args.layer]
        if args.memory_budget:
            command += ["--memory-budget", args.memory_budget]
        child = subprocess.run(command, capture_output=True, text=True, check=True)
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        print(
            f"ablationcam, 1 object: {measured['seconds']:.0f} s, peak memory "
            f"{format_bytes(measured['extra'])} above a forward pass, budget "
            f"{format_bytes(measured['budget'])}"
        )


if __name__ == "__main__":
    main()
