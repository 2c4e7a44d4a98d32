"""The folder job's pictures drawn on the CPU two ways: Pillow's photo resize (the default,
``device=None``) against the all-torch path that a GPU runs (``device="cpu"``).

Run by hand (never in the tests)::

    OMP_NUM_THREADS=1 python benchmarks/bench_render_device.py

Prints, for a 1200x900 and a 400x300 photo, the fastest of 20 turns, in milliseconds, of
:func:`camviz.render.overlay` and :func:`camviz.render.panel_image` each way, and the
largest pixel difference between the two panels. Only the panel's photo tile differs
between the two (resized by Pillow or by torch); the overlay is the same torch code either
way, so its two columns show how noisy the machine is. On a GPU the torch path is the only
one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from camviz.io.render import overlay, panel_image

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
    print("| photo | picture | Pillow resize (CPU default) | torch (the GPU path, on the CPU) |")
    print("| --- | --- | ---: | ---: |")
    for size in ((1200, 900), (400, 300)):
        photo = Image.open(PHOTO).convert("RGB").resize(size)
        for name, draw in (("overlay", overlay), ("panel", panel_image)):
            default, on_torch = fastest_ms(
                [
                    lambda draw=draw, photo=photo: draw(photo, heatmap),
                    lambda draw=draw, photo=photo: draw(photo, heatmap, device="cpu"),
                ]
            )
            print(
                f"| {size[0]}x{size[1]} | {name} | {default:.1f} ms | {on_torch:.1f} ms |",
                flush=True,
            )
        difference = np.abs(
            np.asarray(panel_image(photo, heatmap), dtype=np.int16)
            - np.asarray(panel_image(photo, heatmap, device="cpu"), dtype=np.int16)
        )
        print(
            f"| {size[0]}x{size[1]} | panel pixels: largest difference {difference.max()}, "
            f"mean {difference.mean():.3f} levels | | |"
        )


if __name__ == "__main__":
    main()
