"""A million manifest rows: the resume scan and the merge of the ranks' parts stay flat in
memory (peak resident size, ``ru_maxrss``, measured in a fresh interpreter), and give the
rows that the small-folder tests check one by one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from camviz.pipeline import manifest, merging

ROWS = 1_000_000
LIMIT_MIB = 200
FAILED_EVERY = 1000  # every 1000th input failed: not done, and a failure row of the summary

# Runs in a fresh interpreter: the peak resident size above the one after the imports (and,
# for the merge, after the input keys, which a job holds anyway as its list of inputs).
MEASURE = """
import json, resource, sys
from pathlib import Path
from camviz.pipeline import manifest, merging

out, task, rows = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
keys = [f"photos/{number:07d}.png" for number in range(rows)] if task == "merge" else []
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if task == "scan":
    result = {"done": len(manifest.done_keys(out))}
else:
    merged = merging.merge(out, keys, [])
    result = {"ok": merged.ok, "failed": len(merged.failures), "skipped": merged.skipped}
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if task == "merge":  # the merged log holds every input once, in input order
    with open(out / manifest.ROWS) as merged_rows:
        result["in_order"] = all(
            line.startswith(f'{{"input": "{key}"') for key, line in zip(keys, merged_rows)
        )
print(json.dumps({**result, "above_mib": (peak - baseline) / 1024}))
"""


def _row(number: int) -> str:
    status = "error" if number % FAILED_EVERY == 0 else "ok"
    return (
        f'{{"input": "photos/{number:07d}.png", "frame": null, "status": "{status}", '
        f'"reason": null, "explained": [], "files": [], "seconds": 0.01}}\n'
    )


def _write_parts(out, ranks=2):
    """The parts that ``ranks`` processes leave: each its shard (round-robin), its writer
    threads finishing neighbours out of turn, and one line cut short by a crash."""
    for rank in range(ranks):
        numbers = list(range(rank, ROWS, ranks))
        for start in range(0, len(numbers) - 1, 500):  # a writer thread's late image
            numbers[start], numbers[start + 1] = numbers[start + 1], numbers[start]
        with open(out / f"manifest.rank{rank}.jsonl", "w") as part:
            part.writelines(map(_row, numbers))
            part.write('{"input": "photos/cut')
    return ROWS - ROWS // FAILED_EVERY


def _measuring(out, task):
    return subprocess.Popen(
        [sys.executable, "-c", MEASURE, str(out), task, str(ROWS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": ":".join(sys.path)},
    )


def _measured(process):
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(stdout)


def test_a_million_rows_are_scanned_and_merged_in_bounded_memory(tmp_path):
    scanned_folder, merged_folder = tmp_path / "scanned", tmp_path / "merged"
    scanned_folder.mkdir()
    merged_folder.mkdir()
    explained = _write_parts(scanned_folder)
    for part in scanned_folder.iterdir():  # the same parts, for the merge to remove
        os.link(part, merged_folder / part.name)
    # Both at once: two cores, and the scan reads what the merge is given.
    scanning, merging_ = _measuring(scanned_folder, "scan"), _measuring(merged_folder, "merge")
    scanned, merged = _measured(scanning), _measured(merging_)

    assert scanned["done"] == explained
    assert scanned["above_mib"] <= LIMIT_MIB
    assert merged["in_order"]
    assert (merged["ok"], merged["failed"], merged["skipped"]) == (explained, ROWS - explained, 2)
    assert merged["above_mib"] <= LIMIT_MIB
    assert not list(merged_folder.glob("manifest.rank*"))


@pytest.fixture
def small_runs(monkeypatch):
    """Buckets of two inputs, spilled every three rows, so that a few rows spill and merge
    as a million would."""
    monkeypatch.setattr(merging, "BUCKET_INPUTS", 2)
    monkeypatch.setattr(merging, "HELD_ROWS", 3)


def test_the_merge_keeps_each_inputs_latest_row_in_input_order_across_runs(tmp_path, small_runs):
    def row(name, status, files=None):
        return {
            "input": name,
            "frame": None,
            "status": status,
            "explained": [],
            "files": files or [],
        }

    # An earlier run's log in another order, with an input this run no longer has.
    earlier = [row("c", "error"), row("gone", "ok", ["gone_overlay.png"]), row("a", "ok")]
    (tmp_path / "gone_overlay.png").write_bytes(b"")
    (tmp_path / manifest.ROWS).write_text("".join(manifest.dumps(r) + "\n" for r in earlier))
    parts = [
        [row("b", "error"), row("d", "ok"), row("b", "ok", ["b_overlay.png"])],  # b retried
        [row("c", "ok", ["c_overlay.png"]), "not json", row("e", "error")],
    ]
    for rank, rows in enumerate(parts):
        text = "".join((r if isinstance(r, str) else manifest.dumps(r)) + "\n" for r in rows)
        (tmp_path / f"manifest.rank{rank}.jsonl").write_text(text)

    merged = merging.merge(tmp_path, ["a", "b", "c", "d", "e"], ["old.mp4"])

    lines = (tmp_path / manifest.ROWS).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        row("a", "ok"),
        row("b", "ok", ["b_overlay.png"]),
        row("c", "ok", ["c_overlay.png"]),
        row("d", "ok"),
        row("e", "error"),
    ]
    assert (merged.ok, merged.failures, merged.skipped) == (4, [row("e", "error")], 1)
    assert merged.earlier == {"old.mp4", "gone_overlay.png"}


def test_the_merge_counts_plain_rows_in_bulk_as_it_counts_every_other_row(tmp_path, small_runs):
    def row(name, status="ok", layers=None, explained=(), frame=None):
        files = [file for entry in explained for file in entry["files"].values()]
        return {
            "input": name,
            "frame": frame,
            "status": status,
            "explained": list(explained),
            "files": files,
            "layers": layers,
        }

    empty = {"files": {"overlay": "c_overlay.png"}, "empty": True}
    frame = {"files": {"overlay": "v_3_overlay.png"}}
    rows = [
        row("a", layers=["first"]),
        row("b", "error"),
        row("d", "error"),
        row("c", explained=[empty]),
        row("d", layers=["later"]),
        row("e"),
        row("v.mp4", explained=[frame], frame=3),
    ]
    (tmp_path / "manifest.rank0.jsonl").write_text("".join(manifest.dumps(r) + "\n" for r in rows))

    # Buckets (a, b), (c, d), (e, v.mp4#3): the first is counted row by row (no layers yet),
    # the others in bulk, where c and the frame are still counted in full.
    merged = merging.merge(tmp_path, ["a", "b", "c", "d", "e", "v.mp4#3"], [])

    assert (merged.ok, merged.empty_maps, merged.layers) == (5, 1, ["first"])
    assert merged.failures == [row("b", "error")]
    assert merged.overlays == {"v.mp4#3": "v_3_overlay.png"}
    lines = (tmp_path / manifest.ROWS).read_text().splitlines()
    assert [json.loads(line)["input"] for line in lines] == ["a", "b", "c", "d", "e", "v.mp4"]
    assert json.loads(lines[3])["status"] == "ok"  # d's later row


def test_white_space_around_a_row_that_json_does_not_allow_is_left_out_of_the_merged_log(
    tmp_path,
):
    def row(name, status):
        return {"input": name, "frame": None, "status": status, "explained": [], "files": []}

    # Hand-edited lines: a form feed after a failed row (counted in full) and before a plain
    # one, a tab and a vertical tab after another: rows to the reader, not JSON as they are.
    (tmp_path / "manifest.rank0.jsonl").write_text(
        manifest.dumps(row("a", "error"))
        + "\x0c\n"
        + "\x0c"
        + manifest.dumps(row("b", "ok"))
        + "\n"
        + manifest.dumps(row("c", "ok"))
        + "\t\x0b\n"
    )
    merged = merging.merge(tmp_path, ["a", "b", "c"], [])
    assert (merged.ok, merged.failures, merged.skipped) == (2, [row("a", "error")], 0)
    lines = (tmp_path / manifest.ROWS).read_text().split("\n")
    assert [json.loads(line) for line in lines[:-1]] == [
        row("a", "error"),
        row("b", "ok"),
        row("c", "ok"),
    ]
    assert lines[-1] == ""
