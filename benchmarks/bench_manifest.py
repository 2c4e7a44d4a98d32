"""Time and memory of the folder job's manifests at 10^5 and 10^6 rows.

Run by hand (never in the tests)::

    python benchmarks/bench_manifest.py            # 10^5 and 10^6 rows
    python benchmarks/bench_manifest.py --rows 100000 1000000 3000000

For each size, two ranks' parts of rows of about 120 bytes (each part in its shard's order
but for a writer thread's late image every 500 rows, as a ``torchrun`` job leaves them) are
written to a temporary folder; a fresh process then times the resume scan
(:func:`camviz.pipeline.manifest.done_keys`) and the merge
(:func:`camviz.pipeline.merging.merge`) and reports each one's peak resident size above the
interpreter's after its imports (``ru_maxrss``; the merge's baseline also holds the input
keys, which a job holds anyway), with its CPU time, the steadier figure on a shared machine.
Flat memory and time linear in the rows are the claims: the time ratio of 10^6 to 10^5 rows
should be about 10 (at most 12).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, time
from pathlib import Path
from camviz.pipeline import manifest, merging

out, task, rows = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
keys = [f"photos/{number:07d}.png" for number in range(rows)] if task == "merge" else []
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start, cpu = time.perf_counter(), time.process_time()
if task == "scan":
    manifest.done_keys(out)
else:
    merging.merge(out, keys, [])
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "cpu": cpu, "above_mib": (peak - baseline) / 1024}))
"""


def _row(number: int) -> str:
    return (
        f'{{"input": "photos/{number:07d}.png", "frame": null, "status": "ok", '
        f'"reason": null, "explained": [], "files": [], "seconds": 0.01}}\n'
    )


def write_parts(out: Path, rows: int, ranks: int = 2) -> None:
    """The parts ``ranks`` processes leave, round-robin shards, a neighbour out of turn."""
    for rank in range(ranks):
        numbers = list(range(rank, rows, ranks))
        for start in range(0, len(numbers) - 1, 500):
            numbers[start], numbers[start + 1] = numbers[start + 1], numbers[start]
        with open(out / f"manifest.rank{rank}.jsonl", "w") as part:
            part.writelines(map(_row, numbers))


def measure(out: Path, task: str, rows: int) -> dict[str, float]:
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(out), task, str(rows)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(child.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    arguments = parser.parse_args()
    seconds: dict[int, tuple[float, float]] = {}  # wall-clock and CPU time
    for rows in arguments.rows:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder)
            write_parts(out, rows)
            scan = measure(out, "scan", rows)
            merge = measure(out, "merge", rows)
        seconds[rows] = (scan["seconds"] + merge["seconds"], scan["cpu"] + merge["cpu"])
        print(
            f"{rows:>9,} rows: scan {scan['seconds']:6.2f} s (CPU {scan['cpu']:5.2f} s, "
            f"+{scan['above_mib']:5.1f} MiB), merge {merge['seconds']:6.2f} s "
            f"(CPU {merge['cpu']:5.2f} s, +{merge['above_mib']:5.1f} MiB)"
        )
    smallest, largest = min(seconds), max(seconds)
    if largest != smallest:
        wall, cpu = (seconds[largest][i] / seconds[smallest][i] for i in (0, 1))
        print(
            f"time ratio {largest:,} / {smallest:,} rows: {wall:.1f}, CPU {cpu:.1f} "
            f"(linear: {largest / smallest:.0f})"
        )


if __name__ == "__main__":
    main()
