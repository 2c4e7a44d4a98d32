"""Two ``torchrun`` nodes (two launchers on loopback, a c10d rendezvous) fill one output
folder as one process does, and resume it; the lock judges another machine's lock by its
heartbeat, though both share a host name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from camviz.core.errors import CamvizError
from camviz.pipeline import lock

# What each node runs: the shipped synthetic CNN explaining the folder into the output.
LAUNCHED = """
import sys
from camviz.evaluation import synthetic
from camviz.io.images import Preprocess
from camviz.io.models import LoadedModel
from camviz.pipeline.job import explain_files

loaded = LoadedModel(
    model=synthetic.load_model(),
    preprocess=Preprocess(size=32, mean=(0, 0, 0), std=(1, 1, 1)),
    categories=list(synthetic.CLASSES),
    name="synthetic-cnn",
    default_layer=synthetic.TARGET_LAYER,
)
explain_files(sys.argv[1], sys.argv[2], loaded, batch_size=2, writers=1)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _two_nodes(script, folder, out, tmp_path):
    """Run ``script`` on two nodes of one process each; wait for both launchers."""
    port = _free_port()
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    launchers = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2"),
                *("--nproc_per_node=1", f"--node_rank={node}", "--rdzv_backend=c10d"),
                *(f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=camviz-nodes"),
                *("--local_addr=127.0.0.1", "--max_restarts=0", "--monitor_interval=0.2"),
                *(str(script), str(folder), str(out)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environment,
            cwd=tmp_path,
        )
        for node in (0, 1)
    ]
    for launcher in launchers:
        output, _ = launcher.communicate(timeout=240)
        assert launcher.returncode == 0, output[-3000:]


@pytest.mark.distributed
def test_two_nodes_resume_one_folder_into_what_one_process_writes(
    tmp_path, make_photos, synthetic_classifier, manifest_rows, assert_rows_match
):
    from camviz.pipeline.job import explain_files

    folder = tmp_path / "photos"
    make_photos(folder, {f"{n}.png": (40, 30) if n % 2 else (32, 32) for n in range(5)})
    (folder / "broken.jpg").write_text("not a picture")
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    for out in (alone, shared):
        explain_files(folder, out, synthetic_classifier, batch_size=2, writers=1)
    # An earlier run into the shared folder lost one overlay: that image and the broken
    # file are to do, one for each node.
    lost = shared / "3_overlay.png"
    lost.unlink()
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHED)

    _two_nodes(script, folder, shared, tmp_path)

    summary = json.loads((shared / "manifest.json").read_text())
    assert summary["complete"]
    assert summary["counts"] == {"ok": 5, "error": 1, "already_done": 4, "empty_maps": 0}
    assert lost.is_file()

    def by_input(out):
        return sorted(manifest_rows(out), key=lambda row: row["input"])

    assert_rows_match(by_input(shared), by_input(alone))
    assert sorted(os.listdir(shared)) == sorted(os.listdir(alone))  # no parts, no lock left


def test_a_lock_of_another_machine_with_this_host_name_is_judged_by_its_heartbeat(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process id that is free here, as another machine's would be
    held = tmp_path / lock.LOCK

    def holder(machine: str, age: float) -> None:
        content = {"host": socket.gethostname(), "machine": machine, "pid": gone.pid}
        held.write_text(json.dumps({**content, "started": "then", "token": "x"}))
        os.utime(held, (time.time() - age, time.time() - age))

    holder("another-boot/4026531836", age=1)  # live: its heartbeat is fresh
    with pytest.raises(CamvizError, match="in use by another camviz run"):
        lock._Holder(tmp_path)
    holder("another-boot/4026531836", age=lock.STALE + 1)  # its heartbeat stopped
    lock._Holder(tmp_path).release()
    holder(lock.machine(), age=1)  # this machine, its process gone: taken over at once
    lock._Holder(tmp_path).release()
    assert not held.exists()
