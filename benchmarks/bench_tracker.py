"""What the tracker costs a training run: the same run with and without ``camviz.Tracker``.

Run by hand (never in the tests)::

    python benchmarks/bench_tracker.py            # issue 24's setting, ~25 minutes on 2 cores
    python benchmarks/bench_tracker.py --rounds 3 --steps 250 --size 32 --threads 1  # busy machine

Issue 24's setting: a small CNN (:class:`camviz.synthetic.SyntheticCNN`, ``--size`` 64 px
images, batches of 32) trained with Adam for ``--steps`` steps, with a tracker of Grad-CAM on
8 probe images every 50 steps that logs to files (PNG overlays, the strip and the JSON-lines
log, written on its background thread), against the same loop without it. Runs alternate
(without, with, without, ...) so that a machine whose load drifts slows both alike; each
figure is the median over ``--rounds`` runs (and the median of each round's ratio of
the two, which a drifting machine moves less), in wall-clock time and in the process's CPU
time (all threads, the writer's included: on a shared machine the steadier figure). Also
printed: the time of one tracker call (one forward pass of the probe batch and the backward
pass of the layers after the target) and of one plain forward pass of the probes, for
scale. Every run starts from the same weights and data.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import camviz
from camviz.evaluation.synthetic import SyntheticCNN, make_dataset


def run(
    steps: int, every: int | None, out: Path | None, batch: int, size: int
) -> tuple[float, float, list[float]]:
    """Train for ``steps`` steps; with ``every``, track into ``out``. Wall-clock seconds, CPU
    seconds of the process (all its threads, the background writer's included), and the
    seconds of each tracker call."""
    torch.manual_seed(0)
    data = make_dataset(batch * 8, size=size, seed=0)
    probes = make_dataset(8, size=size, seed=1)
    model = SyntheticCNN().train()
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    tracker = None
    if every is not None:
        tracker = camviz.Tracker(
            probes.images, probes.labels, layers="features", every=every, out_dir=out
        )
    calls = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(steps):
        rows = slice(batch * (step % 8), batch * (step % 8 + 1))
        loss = nn.functional.cross_entropy(model(data.images[rows]), data.labels[rows])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if tracker is not None:
            called = time.perf_counter()
            if tracker.step(model, step) is not None:
                calls.append(time.perf_counter() - called)
    if tracker is not None:
        tracker.close()  # the run is not over until the last files are written
    return time.perf_counter() - start, time.process_time() - cpu_start, calls


def forward_seconds(size: int, repeat: int = 20) -> float:
    model = SyntheticCNN().eval()
    probes = make_dataset(8, size=size, seed=1).images
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        with torch.no_grad():
            model(probes)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=64, help="image side, pixels")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()},")
    print(
        f"{torch.get_num_threads()} threads; {args.steps} steps, batch {args.batch}, {args.size} px"
    )
    run(20, args.every, None, args.batch, args.size)  # warm-up: imports, first calls
    plain, tracked, calls = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for number in range(args.rounds):
            plain.append(run(args.steps, None, None, args.batch, args.size)[:2])
            out = Path(folder) / str(number)
            *seconds, call_times = run(args.steps, args.every, out, args.batch, args.size)
            tracked.append(tuple(seconds))
            calls += call_times
            (wall, cpu), (tracked_wall, tracked_cpu) = plain[-1], tracked[-1]
            print(
                f"round {number + 1}: without {wall:.2f} s ({cpu:.2f} s CPU), "
                f"with {tracked_wall:.2f} s ({tracked_cpu:.2f} s CPU)"
            )
    for index, kind in enumerate(("wall-clock", "CPU")):
        without = statistics.median(times[index] for times in plain)
        with_tracker = statistics.median(times[index] for times in tracked)
        print(
            f"{kind} time, median of {args.rounds}: without the tracker {without:.2f} s, with "
            f"it {with_tracker:.2f} s (every {args.every} steps, file logging): "
            f"{100 * (with_tracker / without - 1):+.1f} %"
        )
        # Each round's two runs sit side by side in time: their ratio cancels the drift of
        # a shared machine's speed between rounds, which the two medians above keep.
        paired = statistics.median(t[index] / p[index] for p, t in zip(plain, tracked, strict=True))
        print(f"{kind} time, median of each round's ratio: {100 * (paired - 1):+.1f} %")
    print(
        f"one tracker call: {1000 * statistics.median(calls):.1f} ms; one forward pass of the "
        f"8 probes: {1000 * forward_seconds(args.size):.1f} ms"
    )


if __name__ == "__main__":
    main()
