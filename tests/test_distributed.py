"""``torchrun`` with two CPU processes (gloo) gives the manifest that one process gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from camviz.cli import main

pytestmark = pytest.mark.distributed

# What `torchrun -m camviz` runs (runpy is how `python -m` runs a module), with each
# process's shard recorded, to show that the processes split the work.
LAUNCHED = """
import json, os, runpy
import camviz.pipeline.distributed

real_shard = camviz.pipeline.distributed.shard

def recorded_shard(indices, context):
    mine = real_shard(indices, context)
    with open(f"{os.environ['SHARD_LOG']}.{context.rank}", "w") as file:
        json.dump({"todo": list(indices), "mine": mine, "world": context.world_size}, file)
    return mine

camviz.pipeline.distributed.shard = recorded_shard
runpy.run_module("camviz", run_name="__main__", alter_sys=True)
"""


def test_two_processes_write_the_manifest_of_one(
    tmp_path, make_photos, tiny_mobilenet, assert_rows_match, manifest_rows
):
    folder = tmp_path / "photos"
    make_photos(folder, {f"{n}.png": (40, 30) if n % 2 else (32, 32) for n in range(5)})
    (folder / "broken.jpg").write_text("not a picture")
    common = [str(folder), "--model", "mobilenet_v3_small", "--weights", tiny_mobilenet]
    common += ["--no-panel", "--heatmap", "png16", "--batch-size", "2", "--workers", "0"]
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    assert main(["explain", *common, "--quiet", "--out", str(alone)]) == 0

    script = tmp_path / "launch.py"
    script.write_text(LAUNCHED)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "SHARD_LOG": str(tmp_path / "shard")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    launched = subprocess.run(
        [*torchrun, str(script), "explain", *common, "--quiet", "--out", str(shared)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout.count("explained 5 of 6 inputs") == 1  # rank 0 reports, once

    shards = [json.loads((tmp_path / f"shard.{rank}").read_text()) for rank in (0, 1)]
    assert [shard["world"] for shard in shards] == [2, 2]
    mine = [set(shard["mine"]) for shard in shards]
    assert mine[0] and mine[1] and not mine[0] & mine[1]
    assert mine[0] | mine[1] == set(range(6)) == set(shards[0]["todo"])

    def by_input(out):
        return sorted(
            manifest_rows(out),
            key=lambda row: row["input"],
        )

    assert_rows_match(by_input(shared), by_input(alone))
    shared_summary = json.loads((shared / "manifest.json").read_text())
    assert shared_summary["counts"] == {"ok": 5, "error": 1, "already_done": 0, "empty_maps": 0}
    assert shared_summary["complete"]
    assert sorted(os.listdir(shared)) == sorted(os.listdir(alone))  # no per-process parts left
    maps = [name for name in os.listdir(alone) if name.endswith("_heatmap.png")]
    assert len(maps) == 5
    for name in maps:
        assert _levels_apart(shared / name, alone / name) <= 8  # of 65535: float noise only


def _levels_apart(first, second) -> int:
    """The largest difference between two 16-bit heatmap PNGs."""
    import numpy as np
    from PIL import Image

    with Image.open(first) as a, Image.open(second) as b:
        return int(np.abs(np.asarray(a, dtype=np.int64) - np.asarray(b, dtype=np.int64)).max())
