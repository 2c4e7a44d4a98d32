"""How close each method's bf16 map is to its fp32 map: the README's accuracy table.

Run by hand (never in the tests)::

    python benchmarks/bench_precision.py --threads 1
    python benchmarks/bench_precision.py --quick      # small inputs: a smoke run

For every registered method, on the shipped EfficientNet-Lite0 (the cat photo, layer
``bn2``) and on a random-weight ResNet-50 (``layer4``, random inputs), the map is computed
with ``precision="fp32"`` and with ``precision="bf16", channels_last=True``, and the
Pearson correlation of the two ``heatmaps`` is printed (1.0: the same map up to scale).

On a CPU without native bf16 the bf16 passes are emulated (``CAMVIZ_EMULATED_PRECISION=1``
is set here): the numbers are bf16's, the times are not. Score-CAM and SS-CAM run one
forward pass per channel, so they are measured on smaller inputs (``PERTURBATION_SIZE``).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Score-CAM and SS-CAM: one pass per channel (2,048 at ResNet-50's layer4), emulated bf16.
PERTURBATION_SIZE = 64
OPTIONS = {"sscam": {"num_samples": 2, "std": 0.5, "seed": 0}, "smooth_gradcam++": {"samples": 4}}


def models(quick: bool) -> list[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """``(name, model, layer, inputs)`` of each set-up."""
    import torchvision
    from PIL import Image

    from camviz.io.models import load

    loaded = load("efficientnet_lite0")
    cat = loaded.preprocess(Image.open(ROOT / "assets" / "chelsea.png").convert("RGB"))[None]
    torch.manual_seed(0)
    resnet = torchvision.models.resnet50(weights=None).eval()
    size = 64 if quick else 224
    batch = torch.randn(1 if quick else 2, 3, size, size)
    if quick:
        cat = torch.nn.functional.interpolate(cat, size=(96, 128), mode="bilinear")
    return [
        ("EfficientNet-Lite0 (cat)", loaded.model.eval(), "bn2", cat),
        ("ResNet-50 (random)", resnet, "layer4", batch),
    ]


def correlation(first: torch.Tensor, second: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([first.flatten(), second.flatten()]))[0, 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, help="torch threads; 1 on a busy machine")
    parser.add_argument("--quick", action="store_true", help="small inputs")
    parser.add_argument("--methods", nargs="*", help="only these registry names")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["CAMVIZ_EMULATED_PRECISION"] = "1"
    warnings.simplefilter("ignore", UserWarning)
    import camviz.cams

    setups = models(args.quick)
    methods = args.methods or camviz.cams.names()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| method | " + " | ".join(name for name, *_ in setups) + " |")
    print("| --- |" + " --- |" * len(setups))
    for method in methods:
        cells = []
        for _, model, layer, inputs in setups:
            if method in ("scorecam", "sscam"):
                height, width = inputs.shape[-2:]
                scale = PERTURBATION_SIZE / min(height, width)
                size = (round(height * scale), round(width * scale))
                inputs = torch.nn.functional.interpolate(inputs, size=size, mode="bilinear")
            options = OPTIONS.get(method, {})
            with torch.inference_mode():
                classes = model(inputs).argmax(1).tolist()
            started = time.perf_counter()
            reference = camviz.explain(model, inputs, method, layer, classes, **options)
            seconds = time.perf_counter() - started
            reduced = camviz.explain(
                model,
                inputs,
                method,
                layer,
                classes,
                precision="bf16",
                channels_last=True,
                **options,
            )
            size = "x".join(str(side) for side in inputs.shape[-2:])
            cells.append(
                f"{correlation(reference.heatmaps, reduced.heatmaps):.4f} "
                f"({size}, fp32 {seconds:.1f} s)"
            )
        print(f"| `{method}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
