"""bf16 against fp32: how close each method's map is, and how much faster (the README's tables).

Run by hand (never in the tests)::

    python benchmarks/bench_precision.py --threads 1
    python benchmarks/bench_precision.py --quick      # small inputs: a smoke run
    python benchmarks/bench_precision.py --speed --threads 1   # the speed table instead

``--speed`` times, side by side in one run (fastest of ``--repeat`` runs): Grad-CAM of a
random-weight ResNet-50 (``layer4``, batch 8, 224 px) and Score-CAM of a random-weight
ResNet-18 (``layer4``, one image) in fp32, fp32 with channels-last, and bf16 with
channels-last (only where the CPU computes bf16 natively: emulated, it is refused), against
torchcam's Score-CAM (the fastest peer's) in fp32, with the correlation of each map to
camviz's fp32 map.

For every registered method, on the shipped EfficientNet-Lite0 (the cat photo, layer
``bn2``) and on a random-weight ResNet-50 (``layer4``, random inputs), the map is computed
with ``precision="fp32"`` and with ``precision="bf16", channels_last=True``, and the
Pearson correlation of the two ``heatmaps`` is printed (1.0: the same map up to scale).

On a CPU without native bf16 the bf16 passes are emulated (``CAMVIZ_EMULATED_PRECISION=1``
is set here): the numbers are bf16's, the times are not. Score-CAM and SS-CAM run one
emulated forward pass per channel, so they are measured on smaller inputs
(``PERTURBATION_SIZE``) at earlier layers with fewer channels (``PERTURBATION_LAYERS``):
what bf16 changes there, the scores of the masked inputs, is the same at every layer.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Score-CAM and SS-CAM: one pass per channel (2,048 at ResNet-50's layer4), emulated bf16.
PERTURBATION_SIZE = 64
PERTURBATION_LAYERS = {"EfficientNet-Lite0 (cat)": "blocks.3", "ResNet-50 (random)": "layer1"}
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


def timed(
    runs: dict[str, Callable[[], torch.Tensor]], repeat: int
) -> dict[str, tuple[float, torch.Tensor]]:
    """``{name: (fastest of repeat runs in seconds, the maps)}``, after a warm-up run each.

    The variants take turns, round by round, so that a busy spell on a shared machine does
    not fall on one variant only; the fastest run is the least disturbed one.
    """
    maps = {name: run() for name, run in runs.items()}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - started)
    return {name: (min(seconds[name]), maps[name]) for name in runs}


def speed_rows(
    name: str,
    model: torch.nn.Module,
    inputs: torch.Tensor,
    method: str,
    variants: dict[str, tuple[str, bool]],
    repeat: int,
) -> list[str]:
    """One table row per variant (and torchcam's Score-CAM), timed side by side."""
    import torchcam.methods

    import camviz

    with torch.inference_mode():
        classes = model(inputs).argmax(1).tolist()

    def ours(precision: str, channels_last: bool) -> torch.Tensor:
        return camviz.explain(
            model,
            inputs,
            method,
            "layer4",
            classes,
            precision=precision,
            channels_last=channels_last,
        ).layer_maps

    def torchcam_scorecam() -> torch.Tensor:
        shape = tuple(inputs.shape[1:])
        with torchcam.methods.ScoreCAM(model, "layer4", input_shape=shape) as extractor:
            (maps,) = extractor(classes, model(inputs))
        return maps.detach()

    runs = {
        f"camviz {variant}": lambda options=options: ours(*options)
        for variant, options in variants.items()
    }
    if method == "scorecam":
        runs["torchcam fp32"] = torchcam_scorecam
    results = timed(runs, repeat)
    reference_seconds, reference = results["camviz fp32"]
    return [
        f"| {name} | {variant} | {seconds:.2f} s | {reference_seconds / seconds:.2f}x "
        f"| {correlation(reference, maps):.4f} |"
        for variant, (seconds, maps) in results.items()
    ]


def speed(repeat: int, size: int) -> None:
    import torchvision

    from camviz.core.precision import native

    torch.manual_seed(0)
    setups = {
        "Grad-CAM, ResNet-50, batch 8": (
            torchvision.models.resnet50(weights=None).eval(),
            torch.randn(8, 3, size, size),
            "gradcam",
        ),
        "Score-CAM, ResNet-18, 1 image": (
            torchvision.models.resnet18(weights=None).eval(),
            torch.randn(1, 3, size, size),
            "scorecam",
        ),
    }
    variants = {"fp32": ("fp32", False), "fp32 + channels-last": ("fp32", True)}
    if native(torch.device("cpu"), torch.bfloat16):
        variants["bf16 + channels-last"] = ("bf16", True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {size} px")
    print("| what | variant | time | speed vs camviz fp32 | correlation with camviz fp32 |")
    print("| --- | --- | --- | --- | --- |")
    for name, (model, inputs, method) in setups.items():
        for row in speed_rows(name, model, inputs, method, variants, repeat):
            print(row, flush=True)
    if "bf16 + channels-last" not in variants:
        print("\nbf16 left out: this CPU does not compute it natively (no AVX-512 BF16 / AMX).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, help="torch threads; 1 on a busy machine")
    parser.add_argument("--quick", action="store_true", help="small inputs")
    parser.add_argument("--methods", nargs="*", help="only these registry names")
    parser.add_argument("--speed", action="store_true", help="the speed table instead")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size", type=int, default=224, help="--speed: input side, pixels")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.speed:
        speed(args.repeat, args.size)
        return
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
        for setup, model, layer, inputs in setups:
            if method in ("scorecam", "sscam"):
                layer = PERTURBATION_LAYERS[setup]
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
                f"({size}, `{layer}`, fp32 {seconds:.1f} s)"
            )
        print(f"| `{method}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
