"""The folder job's pictures on the CPU: why one torch path serves the CPU and the GPU.

Run by hand (never in the tests)::

    OMP_NUM_THREADS=1 python benchmarks/bench_render_device.py

:func:`camviz.render.overlay` and :func:`camviz.render.panel_image` run the same torch code
on every device. The one step where the CPU had a choice is the panel's photo tile, which
0.2's first Pillow panels resized with Pillow (``Image.resize(..., BILINEAR,
reducing_gap=2.0)``). This prints, for photos of 1200x900, 1600x1200 and 400x300, the
fastest of 20 turns of that resize against torchvision's uint8 resize (what the panel does
now), the largest pixel difference of the torch tile from that one and from Pillow's exact
resize (without ``reducing_gap``, an approximation for large factors), and the time of a
whole overlay and panel.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from camviz.io.pictures import PANEL_TILE_WIDTH, overlay, panel_image
from camviz.io.pictures import _resized_pixels as torch_resize

PHOTO = Path(__file__).resolve().parent.parent / "assets" / "chelsea.png"


def fastest_ms(runs: list[Callable[[], object]], repeat: int = 20) -> list[float]:
    """The fastest time of each of ``runs``, in ms, the runs taking turns (after a warm-up),
    so that other work on the machine weighs on all of them alike."""
    best = [float("inf")] * len(runs)
    for run in runs:
        run()
    for _ in range(repeat):
        for number, run in enumerate(runs):
            started = time.perf_counter()
            run()
            best[number] = min(best[number], 1000 * (time.perf_counter() - started))
    return best


def main() -> None:
    torch.manual_seed(0)
    heatmap = torch.rand(1, 1, 7, 7)
    heatmap = torch.nn.functional.interpolate(heatmap, size=(224, 298), mode="bilinear")[0, 0]
    print(
        "| photo | tile resize, Pillow | tile resize, torch | largest difference | "
        "from Pillow's exact resize | overlay | panel |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for width, height in ((1200, 900), (1600, 1200), (400, 300)):
        photo = Image.open(PHOTO).convert("RGB").resize((width, height))
        size = (PANEL_TILE_WIDTH, round(height * PANEL_TILE_WIDTH / width))
        pixels = torch.from_numpy(np.array(photo))

        def with_pillow(photo: Image.Image = photo, size: tuple[int, int] = size) -> np.ndarray:
            return np.asarray(photo.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0))

        def with_torch(pixels: torch.Tensor = pixels, size: tuple[int, int] = size) -> np.ndarray:
            return torch_resize(pixels, size).numpy()

        pillow_ms, torch_ms, overlay_ms, panel_ms = fastest_ms(
            [
                with_pillow,
                with_torch,
                lambda photo=photo: overlay(photo, heatmap),
                lambda photo=photo: panel_image(photo, heatmap),
            ]
        )
        tile = with_torch().astype(np.int16)
        exact = np.asarray(photo.resize(size, Image.Resampling.BILINEAR))
        print(
            f"| {width}x{height} | {pillow_ms:.1f} ms | {torch_ms:.1f} ms | "
            f"{np.abs(with_pillow() - tile).max()} | {np.abs(exact - tile).max()} | "
            f"{overlay_ms:.1f} ms | {panel_ms:.1f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    main()
