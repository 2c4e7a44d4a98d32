"""Peak extra memory of Ablation-CAM and Score-CAM against their memory budget.

Run by hand (never in the tests)::

    python benchmarks/bench_memory.py                    # every case (minutes on a CPU)
    python benchmarks/bench_memory.py --cases resnet50-ablationcam fasterrcnn-ablationcam
    python benchmarks/bench_memory.py --budgets default 256MiB

Each (case, budget) runs in a fresh process: the model is built and run once, the peak
resident set size (Linux ``VmHWM``) is reset through ``/proc/self/clear_refs``, the method
explains one image, and the peak extra memory is ``VmHWM`` minus the resident size at the
reset (the model, the image and the plain pass's warm-up are not counted; the engine's own
recorded pass is). The child also reports what the method measured for one perturbed copy
(``copy_bytes``) and the copies per pass that follow from the budget.

Cases (random weights, offline):

* ``resnet50-*``: 224 px; Ablation-CAM at ``layer4`` (2048 channels, its broadcast shortcut
  runs), Score-CAM at ``layer1`` (256 channels: 256 whole passes);
* ``fasterrcnn-*``: ``fasterrcnn_mobilenet_v3_large_320_fpn`` at its default size (320 px),
  scores kept down to 0, the target the top detection's score of each output
  (``lambda out, rows: torch.stack([o["scores"][:1].sum() for o in out])``), at
  ``backbone.body.3`` (24 channels, so that a CPU run takes a minute or two). Ablated copies
  reach the region proposal network, which takes one image, so Ablation-CAM falls back to
  whole-network passes: the case that asked for gigabytes at once before the budget.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torchvision
from bench_gradcam import _status_kib

import camviz
from camviz.cams import create
from camviz.cams.perturbation import BUDGET_FILL
from camviz.core.memory import default_budget, format_bytes, parse_bytes

CASES = {
    "resnet50-ablationcam": ("resnet50", "ablationcam", "layer4"),
    "resnet50-scorecam": ("resnet50", "scorecam", "layer1"),
    "fasterrcnn-ablationcam": ("fasterrcnn", "ablationcam", "backbone.body.3"),
    "fasterrcnn-scorecam": ("fasterrcnn", "scorecam", "backbone.body.3"),
}


def top_detection(out: list[dict[str, torch.Tensor]], rows: torch.Tensor) -> torch.Tensor:
    """The score of each output's first (best) detection."""
    return torch.stack([o["scores"][:1].sum() for o in out])


def build(model_name: str) -> tuple[torch.nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    if model_name == "resnet50":
        return torchvision.models.resnet50().eval(), torch.rand(1, 3, 224, 224), None
    detector = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0
    )
    return detector.eval(), torch.rand(1, 3, 320, 320), top_detection


def child(case: str, budget: str) -> None:
    """Child process: print one JSON line with the peak extra memory of one explanation."""
    model_name, method, layer = CASES[case]
    model, inputs, target = build(model_name)
    with torch.inference_mode():
        model(inputs)  # the plain pass's allocations, before the reset
    options = {} if budget == "default" else {"memory_budget": budget}
    cam = create(method, **options)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = _status_kib("VmRSS")
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Ablation-CAM's fallback on the detector
        camviz.explain(model, inputs, cam, layer=layer, target=target)
    seconds = time.perf_counter() - started
    bytes_budget = default_budget(inputs.device) if budget == "default" else parse_bytes(budget)
    copy_bytes = cam.copy_bytes or 1
    cap = cam.copies_cap(inputs) or bytes_budget
    result = {
        "extra_mib": (_status_kib("VmHWM") - baseline) / 1024,
        "budget_mib": bytes_budget / 2**20,
        "copy_mib": copy_bytes / 2**20,
        "per_pass": max(1, min(int(bytes_budget * BUDGET_FILL) // copy_bytes, cap)),
        "seconds": seconds,
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--budgets", nargs="+", default=["default", "256MiB"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(*args.child)
        return
    print("| model | method, layer | budget | one copy | copies per pass | peak extra | time |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for case in args.cases:
        model_name, method, layer = CASES[case]
        for budget in args.budgets:
            command = [sys.executable, __file__, "--child", case, budget]
            if args.threads:
                command += ["--threads", str(args.threads)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            row = json.loads(output.strip().splitlines()[-1])
            within = "" if row["extra_mib"] <= row["budget_mib"] else " (over)"
            print(
                f"| {model_name} | {method}, `{layer}` | "
                f"{format_bytes(row['budget_mib'] * 2**20)} | "
                f"{format_bytes(row['copy_mib'] * 2**20)} | {row['per_pass']} | "
                f"{format_bytes(row['extra_mib'] * 2**20)}{within} | {row['seconds']:.1f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
