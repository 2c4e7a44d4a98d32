"""Pointing-game accuracy of every registered CAM method on the synthetic benchmark.

    python benchmarks/eval_localization.py                  # every method, 500 images
    python benchmarks/eval_localization.py --methods gradcam,layercam --images 200

Draws a held-out set (a seed the training never used), explains each image for its true
class with each method at the CNN's last feature map, and prints a Markdown table: the
pointing game (the map's maximum on the object's box, without and with a tolerance), the
energy-based pointing game (the map's share inside the box) and the time per image. A
uniformly random map is the floor: it scores the box's share of the image on average, the
last line of the table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import camviz
from camviz.core.errors import CamvizError
from camviz.evaluation.localization import box_masks, energy_pointing_game, pointing_game
from camviz.evaluation.synthetic import SHIPPED_WEIGHTS, TARGET_LAYER, load_model, make_dataset

EVALUATION_SEED = 12345


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--methods", default="all", help="comma-separated names, or all")
    parser.add_argument("--tolerance", type=float, default=3.0, help="pixels, at 64 x 64")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--weights", type=Path, default=SHIPPED_WEIGHTS)
    args = parser.parse_args()

    torch.manual_seed(0)
    data = make_dataset(args.images, seed=EVALUATION_SEED)
    model = load_model(args.weights)
    with torch.inference_mode():
        predicted = torch.cat([model(batch).argmax(1) for batch in data.images.split(100)])
    accuracy = float((predicted == data.labels).float().mean())
    methods = camviz.cams.names() if args.methods == "all" else args.methods.split(",")
    print(f"{len(data)} images, classifier accuracy {accuracy:.3f}, tolerance {args.tolerance} px")
    print()
    print(
        "| method | pointing game | pointing game (tolerance) | energy pointing game | ms / image |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for method in methods:
        try:
            started = time.perf_counter()
            heatmaps = torch.cat(
                [
                    camviz.explain(
                        model, images, method, layer=TARGET_LAYER, target=labels
                    ).heatmaps
                    for images, labels in zip(
                        data.images.split(args.batch_size),
                        data.labels.split(args.batch_size),
                        strict=True,
                    )
                ]
            )
            elapsed = (time.perf_counter() - started) / len(data) * 1000
        except CamvizError as error:
            print(f"| {method} | - | - | - | ({error}) |")
            continue
        print(row(method, heatmaps, data.boxes, args.tolerance, f"{elapsed:.1f}"))
    generator = torch.Generator().manual_seed(EVALUATION_SEED)
    random_maps = torch.rand(data.masks.shape, generator=generator)
    print(row("random map", random_maps, data.boxes, args.tolerance, "-"))
    share = float(box_masks(data.boxes, *data.masks.shape[-2:]).float().mean())
    print(f"| (box share of the image) | {share:.3f} | | {share:.3f} | |")


def row(name: str, heatmaps: torch.Tensor, boxes: torch.Tensor, tolerance: float, ms: str) -> str:
    hits = pointing_game(heatmaps, boxes, tolerance=0).float().mean()
    near = pointing_game(heatmaps, boxes, tolerance=tolerance).float().mean()
    energy = energy_pointing_game(heatmaps, boxes).mean()
    return f"| {name} | {hits:.3f} | {near:.3f} | {energy:.3f} | {ms} |"


if __name__ == "__main__":
    main()
