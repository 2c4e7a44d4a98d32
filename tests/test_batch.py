"""Many images: input expansion, bucketed batches, the writer, manifests, skipping and resuming.

Results of the batched pipeline are checked against :func:`camviz.explain` run on each image
alone, so a mix-up between images, or a heatmap laid on the wrong photo, would show.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import conv_net
from PIL import Image

import camviz
from camviz.cli import main
from camviz.core.errors import CamvizError
from camviz.io.atomic import atomic_write
from camviz.io.images import load_image
from camviz.io.models import LoadedModel
from camviz.pipeline.dataset import ItemDataset, _Buckets, _Prepared, _Sample, explain_dataset
from camviz.pipeline.distributed import Context, shard
from camviz.pipeline.inputs import expand
from camviz.pipeline.job import Outputs, save_heatmap
from camviz.pipeline.manifest import written_files
from camviz.pipeline.packing import batched, packed
from camviz.pipeline.writer import Writer

MODEL = "mobilenet_v3_small"


def model_args(weights: str) -> list[str]:
    return ["--model", MODEL, "--weights", weights]


# --- Inputs ------------------------------------------------------------------------------------


def test_expand_folders_globs_lists_and_missing_inputs(tmp_path, make_photos):
    make_photos(tmp_path / "data", {"cat/1.png": (8, 8), "dog/1.png": (8, 8), "dog/2.jpg": (8, 8)})
    (tmp_path / "data" / "README.txt").write_text("not an input")
    (tmp_path / "data" / ".hidden.png").write_bytes(b"")
    out = tmp_path / "data" / "out"
    out.mkdir()
    (out / "old_overlay.png").write_bytes(b"")  # an output its manifest lists
    (out / "manifest.jsonl").write_text('{"input": "x.png", "files": ["old_overlay.png"]}\n')
    listing = tmp_path / "list.txt"
    listing.write_text("# chosen files\n\ndata/dog/2.jpg\ndata/cat/1.png\n")

    folder = expand([tmp_path / "data"], exclude=written_files(out))
    assert [item.name for item in folder] == ["cat/1", "dog/1", "dog/2"]

    mixed = expand(
        [
            str(listing),
            str(tmp_path / "data" / "*" / "1.png"),
            str(tmp_path / "nothing" / "*.png"),
            str(tmp_path / "missing.png"),
        ]
    )
    # The list's two files, then the glob's new match (cat/1.png only once), then failures.
    assert [Path(item.path).relative_to(tmp_path).as_posix() for item in mixed[:3]] == [
        "data/dog/2.jpg",
        "data/cat/1.png",
        "data/dog/1.png",
    ]
    # cat/1.png and dog/1.png share a stem: each gets a hash of its path, whatever the order.
    names = [item.name for item in mixed[:3]]
    assert names[0] == "2" and names[1].startswith("1-") and names[2].startswith("1-")
    cat, dog = tmp_path / "data" / "cat" / "1.png", tmp_path / "data" / "dog" / "1.png"
    assert [item.name for item in expand([dog, cat])] == [names[2], names[1]]
    assert [item.reason is None for item in mixed] == [True, True, True, False, False]
    assert "no image or video matches" in mixed[3].reason
    assert "not found" in mixed[4].reason
    with pytest.raises(CamvizError, match="every"):
        expand([tmp_path], every=0)


def test_shards_cover_every_index_once():
    for count in range(8):
        for world_size in (1, 2, 3):
            indices = list(range(100, 100 + count))
            shards = [shard(indices, Context(rank, world_size, rank)) for rank in range(world_size)]
            assert sorted(index for part in shards for index in part) == indices
            assert max(map(len, shards)) - min(map(len, shards)) <= 1


# --- Buckets, writer, heatmap files ------------------------------------------------------------


def test_buckets_batch_equal_shapes_and_bound_what_waits():
    def sample(index, width):
        return _Sample(index, inputs=torch.zeros(3, 4, width))

    buckets = _Buckets(batch_size=2)
    assert buckets.add(sample(0, 5)) == [] and buckets.add(sample(1, 6)) == []
    assert [s.index for s in buckets.add(sample(2, 5))] == [0, 2]
    assert [[s.index for s in batch] for batch in buckets.drain()] == [[1]]
    # Nine shapes, one image each: the ninth exceeds 4 batches' worth and one is let out.
    released = [buckets.add(sample(index, 10 + index)) for index in range(9)]
    assert [len(batch) for batch in released] == [0] * 8 + [1]
    assert sum(len(batch) for batch in buckets.drain()) == 8


def test_writer_reraises_a_failed_job_and_skips_the_rest():
    done = []
    lock = threading.Lock()

    def job(value):
        if value == 3:
            raise CamvizError("disk full")
        with lock:
            done.append(value)

    writer = Writer(threads=1, queue_size=2)
    with pytest.raises(CamvizError, match="disk full"):
        for value in range(50):
            writer.submit(job, value)
        writer.close()
    writer.cancel()
    assert sorted(done) == [0, 1, 2]


def test_writer_threads_run_torch_on_one_thread_and_leave_the_callers_setting():
    # A second OpenMP team beside the model's slows the model's every parallel region.
    before = torch.get_num_threads()
    seen: list[int] = []
    with Writer(threads=2) as writer:
        for _ in range(4):
            writer.submit(lambda: seen.append(torch.get_num_threads()))
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [1, 1, 1, 1]
    assert torch.get_num_threads() == before and later == [before]


@pytest.mark.parametrize("size", [(1, 1), (5, 7), (400, 300)])
def test_overlay_pngs_hold_the_pixels_and_the_mark_for_every_reader(tmp_path, size):
    import cv2
    from torchvision.io import decode_png

    from camviz.pipeline.encoders import MARK, save_png

    pixels = np.random.default_rng(sum(size)).integers(0, 256, (size[1], size[0], 3), np.uint8)
    save_png(Image.fromarray(pixels), tmp_path / "overlay.png")
    with Image.open(tmp_path / "overlay.png") as image:
        assert np.array_equal(np.asarray(image), pixels) and image.info["Software"] == MARK
    read = cv2.imread(str(tmp_path / "overlay.png"), cv2.IMREAD_COLOR)
    assert np.array_equal(read[..., ::-1], pixels)
    data = torch.frombuffer(bytearray((tmp_path / "overlay.png").read_bytes()), dtype=torch.uint8)
    assert torch.equal(decode_png(data).permute(1, 2, 0), torch.from_numpy(pixels))


def test_heatmap_files_hold_the_values(tmp_path):
    heatmap = torch.tensor([[0.0, 0.5], [1.0, 0.25]])
    save_heatmap(heatmap, tmp_path / "map.png")
    save_heatmap(heatmap, tmp_path / "map.npz")
    with Image.open(tmp_path / "map.png") as image:
        levels = np.asarray(image)
    assert levels.tolist() == [[0, 32768], [65535, 16384]]
    assert np.array_equal(np.load(tmp_path / "map.npz")["heatmap"], heatmap.numpy())


# --- explain_dataset ---------------------------------------------------------------------------


class CountingDataset(torch.utils.data.Dataset):
    """``(image, label)`` pairs that count how often they are read."""

    def __init__(self, images):
        self.images = images
        self.reads = 0

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        self.reads += 1
        return self.images[index], index


def test_explain_dataset_is_lazy_matches_single_images_and_leaves_model(
    tmp_path, make_photos, untouched, tiny_mobilenet
):
    model = camviz.io.models.load(MODEL, weights=tiny_mobilenet).model.train()
    model.features[0][0].weight.requires_grad_(False)
    paths = make_photos(tmp_path, {f"{n}.png": (40, 30) if n < 4 else (30, 40) for n in range(6)})
    dataset = CountingDataset([load_image(path) for path in paths])
    preprocess = camviz.Preprocess(size=64)
    with untouched(model):
        results = explain_dataset(
            model, dataset, preprocess=preprocess, layer="features", batch_size=2
        )
        first = next(results)
        assert dataset.reads == 2  # one batch read, not the whole dataset
        results.close()
        everything = list(
            explain_dataset(model, dataset, preprocess=preprocess, layer="features", batch_size=4)
        )
    assert first.ok and first.index in (0, 1)
    assert sorted(result.index for result in everything) == list(range(6))
    for result in everything:
        inputs = preprocess(dataset.images[result.index])
        alone = camviz.explain(model, inputs, layer="features")
        with torch.no_grad():
            probabilities = model.eval()(inputs[None]).softmax(-1)[0]
        assert result.explained[0].id == int(alone.targets[0])
        assert result.explained[0].probability == pytest.approx(
            float(probabilities[alone.targets[0]]), abs=1e-5
        )
        assert torch.allclose(result.heatmaps[0], alone.heatmaps[0], atol=1e-5)
        assert result.image.size == dataset.images[result.index].size == result.size
        assert [p.id for p in result.top] == probabilities.topk(5).indices.tolist()


# --- The folder job through the CLI ------------------------------------------------------------


@pytest.fixture
def mixed_folder(tmp_path, make_photos):
    """Good photos of three shapes (one in a sub-folder), and three bad files."""
    folder = tmp_path / "photos"
    make_photos(
        folder,
        {"a.png": (40, 30), "b.jpg": (30, 40), "c.png": (40, 30), "sub/d.png": (32, 32)},
    )
    (folder / "corrupt.png").write_bytes((folder / "a.png").read_bytes()[:60])
    (folder / "empty.png").write_bytes(b"")
    (folder / "notes.jpg").write_text("this is not a picture")
    (folder / "README.txt").write_text("not an input")
    return folder


def test_folder_with_bad_files_gives_a_row_for_each(
    mixed_folder, tmp_path, tiny_mobilenet, manifest_rows
):
    out = tmp_path / "out"
    args = [str(mixed_folder), *model_args(tiny_mobilenet), "--out", str(out)]
    options = ["--batch-size", "2", "--workers", "1", "--heatmap", "npz", "--no-panel"]
    assert main(["explain", *args, *options, "--quiet"]) == 0
    summary = json.loads((out / "manifest.json").read_text())
    rows = manifest_rows(out)
    assert [Path(row["input"]).relative_to(mixed_folder).as_posix() for row in rows] == [
        "a.png",
        "b.jpg",
        "c.png",
        "corrupt.png",
        "empty.png",
        "notes.jpg",
        "sub/d.png",
    ]
    statuses = {Path(row["input"]).name: (row["status"], row["reason"]) for row in rows}
    assert (
        statuses["corrupt.png"][0] == "error"
        and "truncated or corrupt" in statuses["corrupt.png"][1]
    )
    assert statuses["empty.png"][0] == "error" and "empty (0 bytes)" in statuses["empty.png"][1]
    assert statuses["notes.jpg"][0] == "error" and "not an image" in statuses["notes.jpg"][1]
    assert summary["complete"] and summary["counts"] == {
        "ok": 4,
        "error": 3,
        "already_done": 0,
        "empty_maps": 0,
    }
    assert summary["failures"] == [row for row in rows if row["status"] == "error"]
    assert "images" not in summary  # the rows stay in manifest.jsonl only

    loaded = camviz.io.models.load(MODEL, weights=tiny_mobilenet)
    for row in rows:
        if row["status"] != "ok":
            assert row["files"] == [] and row["prediction"] is None
            continue
        image = load_image(row["input"])
        inputs = loaded.preprocess(image)
        alone = camviz.explain(loaded.model, inputs, layer="features")
        with torch.no_grad():
            probabilities = loaded.model(inputs[None]).softmax(-1)[0]
        explained = row["explained"][0]
        assert explained["id"] == row["prediction"]["id"] == int(alone.targets[0])
        assert explained["probability"] == pytest.approx(
            float(probabilities[explained["id"]]), abs=1e-5
        )
        stem = Path(row["input"]).relative_to(mixed_folder).with_suffix("").as_posix()
        assert explained["files"] == {
            "overlay": f"{stem}_overlay.png",
            "heatmap": f"{stem}_heatmap.npz",
        }
        heatmap = np.load(out / explained["files"]["heatmap"])["heatmap"]
        assert np.allclose(heatmap, alone.heatmaps[0].numpy(), atol=1e-5)
        with Image.open(out / explained["files"]["overlay"]) as overlay:
            assert overlay.size == image.size == tuple(row["size"])


def test_resume_refuses_a_folder_made_with_other_settings(tmp_path, make_photos, tiny_mobilenet):
    (photo,) = make_photos(tmp_path, {"a.png": (32, 32)})
    out = tmp_path / "out"
    common = [str(photo), *model_args(tiny_mobilenet), "--out", str(out), "--no-panel"]
    assert main(["explain", *common, "--workers", "0"]) == 0
    before = (out / "a_overlay.png").stat().st_mtime_ns
    assert main(["explain", *common, "--workers", "0"]) == 0  # all done: nothing redone
    assert (out / "a_overlay.png").stat().st_mtime_ns == before
    assert main(["explain", *common, "--alpha", "0.7"]) == 1
    assert (out / "a_overlay.png").stat().st_mtime_ns == before


def test_a_submodule_layer_is_recorded_by_name_and_resumes_as_that_name(tmp_path, make_photos):
    (photo,) = make_photos(tmp_path, {"a.png": (16, 16)})
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(3)
    )
    model(torch.zeros(1, 3, 16, 16))  # sizes the lazy layer
    loaded = LoadedModel(model, camviz.Preprocess(size=16), ["a", "b", "c"], "tiny")
    out = tmp_path / "out"
    outputs = Outputs(panel=False)

    camviz.explain_files([photo], out, loaded, layer=model[0], outputs=outputs)
    settings = json.loads((out / "manifest.json").read_text())["settings"]
    assert settings["layer"] == "0"
    before = (out / "a_overlay.png").stat().st_mtime_ns
    camviz.explain_files([photo], out, loaded, layer="0", outputs=outputs)  # the same settings
    assert (out / "a_overlay.png").stat().st_mtime_ns == before


def run_killed_while_writing_the_third_overlay(argv: list[str]) -> None:
    """In a forked child: run the CLI and die like a killed process, SIGKILL in the middle of
    writing the third overlay. The fork shares the already imported modules, so nothing is
    imported again; the patch lives in the child only."""
    import camviz.pipeline.job

    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive the fork
    # A hang ends the child with every thread's stack on stderr, before the parent gives up.
    faulthandler.dump_traceback_later(240, exit=True)

    real_save = camviz.pipeline.job._save_png
    saved = 0

    def save_then_die(image, path):
        nonlocal saved
        saved += 1
        if saved < 3:
            return real_save(image, path)
        with atomic_write(path) as file:
            file.write(b"half a PNG")
            file.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    camviz.pipeline.job._save_png = save_then_die
    main(argv)


def test_a_killed_run_resumes_to_the_clean_result(
    tmp_path, make_photos, tiny_mobilenet, assert_rows_match, manifest_rows
):
    sizes = {f"{n}.png": (40, 30) if n % 2 else (32, 32) for n in range(6)}
    folder = tmp_path / "photos"
    make_photos(folder, sizes)
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    common = [str(folder), *model_args(tiny_mobilenet), "--batch-size", "2", "--workers", "0"]
    common += ["--no-panel"]
    assert main(["explain", *common, "--quiet", "--out", str(clean)]) == 0

    killed = multiprocessing.get_context("fork").Process(
        target=run_killed_while_writing_the_third_overlay,
        args=(["explain", *common, "--quiet", "--out", str(resumed)],),
    )
    killed.start()
    killed.join(timeout=300)
    assert killed.exitcode == -signal.SIGKILL
    assert list(resumed.glob(".*.tmp")), "the kill should leave a temporary file behind"
    assert json.loads((resumed / "manifest.json").read_text())["complete"] is False
    # A writer thread takes the third image only after finishing (files, then row) another.
    logged = [json.loads(line) for line in (resumed / "manifest.jsonl").read_text().splitlines()]
    assert 1 <= len(logged) <= 2
    finished_before = {
        name: (resumed / name).stat().st_mtime_ns for row in logged for name in row["files"]
    }

    assert main(["explain", *common, "--quiet", "--out", str(resumed)]) == 0
    lines = (resumed / "manifest.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len({row["input"] for row in rows}) == len(rows) == len(sizes)
    assert_rows_match(rows, manifest_rows(clean))
    assert sorted(os.listdir(resumed)) == sorted(os.listdir(clean))
    for name, modified in finished_before.items():  # done before the kill: not redone
        assert (resumed / name).stat().st_mtime_ns == modified
    for path in resumed.glob("*.png"):
        with Image.open(path) as image:
            image.load()


def test_a_workers_batch_crosses_packed_and_explains_as_in_one_process(tmp_path, make_photos):
    """A worker packs a batch's inputs per shape and its originals into a few shared blocks;
    the batches of one shape are explained from them without a copy, and every result (map,
    photo) is the one the main process makes reading the files itself."""
    sizes = {f"{n}.png": (40, 30) if n % 3 else (30, 40) for n in range(6)}
    paths = make_photos(tmp_path, sizes)
    model = conv_net(4, padding=1)
    preprocess = camviz.Preprocess(size=16)
    results = {
        workers: {
            result.index: result
            for result in explain_dataset(
                model, paths, preprocess=preprocess, layer="1", batch_size=2, workers=workers
            )
        }
        for workers in (0, 1)
    }
    assert sorted(results[1]) == list(range(6))
    for index, result in results[1].items():
        alone = results[0][index]
        assert torch.equal(result.heatmaps, alone.heatmaps)
        assert np.array_equal(np.asarray(result.image), np.asarray(alone.image))
    loader = torch.utils.data.DataLoader(
        _Prepared(ItemDataset(expand(paths)), preprocess, keep_images=True),
        batch_size=6,
        num_workers=1,
        collate_fn=packed,
    )
    (samples,) = list(loader)
    storages = {tuple(sample.inputs.shape): set() for sample in samples}
    for sample in samples:
        storages[tuple(sample.inputs.shape)].add(sample.inputs.untyped_storage().data_ptr())
    assert [len(blocks) for blocks in storages.values()] == [1, 1]  # one block per shape
    assert len({sample.original.untyped_storage().data_ptr() for sample in samples}) == 1
    rows = [sample.inputs for sample in samples if sample.inputs.shape == samples[1].inputs.shape]
    batch = batched(rows[:2])  # two consecutive rows of a block: the block itself
    assert batch.untyped_storage().data_ptr() == rows[0].untyped_storage().data_ptr()
    assert torch.equal(batch, torch.stack(rows[:2]))
    apart = batched([rows[0], rows[2]])  # not consecutive: a new stacked tensor
    assert torch.equal(apart, torch.stack([rows[0], rows[2]]))
