"""Grad-CAM before and after a change: two source trees, each version in its own processes.

Run by hand (never in the tests), e.g. with a worktree of the parent commit as "before"::

    git worktree add /tmp/camviz-before HEAD~1
    python benchmarks/bench_before_after.py --before /tmp/camviz-before --after .
    python benchmarks/bench_before_after.py --before /tmp/camviz-before --after . \\
        --rounds 1 --batch 1                       # a smoke run

Each round runs, in a fresh process per tree and variant (``PYTHONPATH`` set to the tree,
the order of the trees alternating from round to round), Grad-CAM on a random-weight
ResNet-50 (``layer4``, ``--batch`` images of ``--size`` px, one class per image) and plain
inference under ``torch.inference_mode`` on the same batch; each process times ``--repeat``
runs after one warm-up and reports their median. The figures are medians over the rounds:
Grad-CAM after / before, of each round's pair (the redesign's bound is 1.03), inference
after / before (the machine's drift), and Grad-CAM / inference of each tree (the README's
bound is 1.1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("gradcam", "inference")


def child(variant: str, batch: int, size: int, repeat: int, threads: int | None) -> None:
    """Time one variant with the camviz on ``sys.path`` and print it as JSON."""
    import torch
    import torchvision

    import camviz

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).eval()
    inputs = torch.randn(batch, 3, size, size)
    classes = list(range(batch))

    def run() -> object:
        if variant == "inference":
            with torch.inference_mode():
                return model(inputs)
        return camviz.explain(model, inputs, layer="layer4", target=classes).heatmaps

    run()
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"seconds": statistics.median(seconds), "camviz": camviz.__file__}))


def measured(tree: Path, variant: str, args: argparse.Namespace) -> float:
    """The median seconds of ``variant`` in a fresh process that imports ``tree``'s camviz."""
    command = [sys.executable, __file__, "--child", variant]
    command += ["--batch", str(args.batch), "--size", str(args.size), "--repeat", str(args.repeat)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{variant} with {tree} failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["camviz"]).resolve().is_relative_to(tree):
        sys.exit(f"{tree} is not the camviz that ran ({result['camviz']}); check PYTHONPATH")
    return float(result["seconds"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="the source tree before the change")
    parser.add_argument("--after", type=Path, default=Path("."), help="the tree after it")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per process")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch, args.size, args.repeat, args.threads)
        return
    if args.before is None:
        parser.error("--before is required")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    times: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        order = ["before", "after"] if round_ % 2 == 0 else ["after", "before"]
        for name in order:
            for variant in VARIANTS:
                seconds = measured(trees[name], variant, args)
                times.setdefault((name, variant), []).append(seconds)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    median = {key: statistics.median(values) for key, values in times.items()}

    def ratio(variant: str) -> float:
        """The median over the rounds of after / before (each round's pair ran together)."""
        pairs = zip(times[("after", variant)], times[("before", variant)], strict=True)
        return statistics.median(after / before for after, before in pairs)

    print(f"ResNet-50, batch {args.batch}, {args.size} px, median of {args.rounds} rounds")
    for name in trees:
        print(
            f"  {name:6}  gradcam {median[(name, 'gradcam')]:.4f} s   "
            f"inference {median[(name, 'inference')]:.4f} s   "
            f"gradcam / inference {median[(name, 'gradcam')] / median[(name, 'inference')]:.3f}"
        )
    print(f"  gradcam after / before    {ratio('gradcam'):.3f}  (bound 1.03)")
    print(f"  inference after / before  {ratio('inference'):.3f}  (the machine's drift)")


if __name__ == "__main__":
    main()
