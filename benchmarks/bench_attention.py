"""The attention methods on ViT-B/16 against the passes they cannot do without.

Run by hand (never in the tests)::

    python benchmarks/bench_attention.py            # timm ViT-B/16, random weights, 8 x 224 px
    python benchmarks/bench_attention.py --quick    # ViT-Ti/16 at 64 px, 2 images: a smoke run

Times are medians of ``--repeat`` rounds (default 7) after one warm-up, in one process, on
the same batch; each round runs every variant once, so that a busy machine slows them
alike. timm's fused attention is on (``F.scaled_dot_product_attention``), which camviz
computes explicitly to record it.

* ``forward``: one plain (fused) forward pass under ``torch.inference_mode``: what
  ``attention_rollout`` (one forward pass, no gradient) is measured against (target 1.3x).
* ``forward+grad``: a forward pass and ``torch.autograd.grad`` of the explained scores with
  respect to the first block's input: what ``gradient_rollout`` and
  ``transformer_attribution`` (the gradient at every block) are measured against (target
  1.2x).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import timm
import torch

import camviz

METHODS = ("attention_rollout", "gradient_rollout", "transformer_attribution")
VARIANTS = ("forward", "forward+grad", *METHODS)
BASELINES = {"attention_rollout": "forward"} | {method: "forward+grad" for method in METHODS[1:]}


def runner(variant: str, model: torch.nn.Module, images: torch.Tensor) -> Callable[[], object]:
    """A no-argument function that runs ``variant`` once on ``images``."""
    classes = torch.arange(len(images)) % 1000
    if variant == "forward":

        def run() -> object:
            with torch.inference_mode():
                return model(images)

    elif variant == "forward+grad":

        def run() -> object:
            with torch.no_grad():
                tokens = model.norm_pre(model._pos_embed(model.patch_embed(images)))
            tokens.requires_grad_()
            logits = model.forward_head(model.norm(model.blocks(tokens)))
            score = logits[torch.arange(len(images)), classes].sum()
            return torch.autograd.grad(score, tokens)

    else:

        def run() -> object:
            return camviz.explain(model, images, variant, target=classes.tolist()).heatmaps

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny ViT: a smoke run")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    name, batch, size = (
        ("vit_tiny_patch16_224", 2, 64) if args.quick else ("vit_base_patch16_224", 8, 224)
    )
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=size).eval().to(args.device)
    images = torch.randn(batch, 3, size, size, device=args.device)
    synchronise = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    runs = {variant: runner(variant, model, images) for variant in VARIANTS}
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
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"{name}, {batch} images at {size} px, {args.device} ({capability}), {args.repeat} rounds"
    )
    print("| variant | median time | vs its baseline |")
    print("| --- | --- | --- |")
    for variant, value in seconds.items():
        baseline = BASELINES.get(variant)
        ratio = f"{value / seconds[baseline]:.2f}x {baseline}" if baseline else "-"
        print(f"| {variant} | {value * 1000:.0f} ms | {ratio} |")


if __name__ == "__main__":
    main()
