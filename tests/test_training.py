"""camviz.Tracker: maps of a probe batch while a model trains, without changing the run.

Checked with numbers: a run with the tracker ends with the very parameters, buffers,
optimiser and scaler state of the run without it (bit for bit, CPU), and every gradient is
unchanged by each call; the maps of a step are ``camviz.explain``'s on a copy of the model
at that step; the numbers follow their formulas (computed here with numpy); TensorBoard, W&B
(offline) and the files hold those maps and numbers under the keys of issue 24.
"""

from __future__ import annotations

import copy
import io
import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from conftest import tiny_cnn
from PIL import Image

import camviz
from camviz.cams import create
from camviz.training.change import correlation, top_overlap
from camviz.training.isolation import untouched_run

LAYER = "features.3"
SERIES = f"gradcam/{LAYER}"


def probes(count: int = 3) -> torch.Tensor:
    return torch.rand(count, 3, 16, 16, generator=torch.Generator().manual_seed(5))


def probe_masks() -> torch.Tensor:
    masks = torch.zeros(3, 16, 16, dtype=torch.bool)
    masks[0, 2:9, 3:10] = True
    masks[1, 8:, 8:] = True
    masks[2, :, :5] = True
    return masks


def training_step(model, optimiser, scaler, step, tracker=None, copies=None):
    """One step that draws from torch's, Python's and NumPy's generators (data, dropout),
    with the tracker called between the backward pass and the optimiser step, where the
    gradients are live; ``copies`` gets a copy of the model at each step that it explained."""
    images = torch.rand(8, 3, 16, 16)
    images = images + torch.from_numpy(np.random.normal(0, 0.1, images.shape)).float()
    if random.random() < 0.5:
        images = images.flip(-1)
    loss = F.cross_entropy(model(images), torch.randint(0, 3, (8,)))
    scaler.scale(loss).backward()
    if tracker is not None:
        gradients = [parameter.grad.clone() for parameter in model.parameters()]
        record = tracker.step(model, step)
        assert all(
            torch.equal(before, parameter.grad)
            for before, parameter in zip(gradients, model.parameters(), strict=True)
        )
        if record is not None and copies is not None:
            copies[step] = copy.deepcopy(model)
    scaler.step(optimiser)
    scaler.update()
    optimiser.zero_grad()


def train(steps: int, tracker=None):
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    model = tiny_cnn()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    for step in range(steps):
        training_step(model, optimiser, scaler, step, tracker)
    return model, optimiser, scaler


@pytest.mark.filterwarnings("ignore::camviz.ZeroMapWarning")  # the random baseline's maps
def test_a_run_with_the_tracker_equals_the_run_without_it_bit_for_bit():
    plain = train(5)
    # The random baseline draws its weights from torch's global generator: without the
    # restored generators, the next batch and dropout mask would differ.
    methods = ("gradcam", create("random", seed=None))
    tracker = camviz.Tracker(probes(), methods=methods, layers=LAYER, every=2)
    tracked = train(5, tracker)
    assert [record.step for record in tracker.history] == [0, 2, 4]
    assert list(tracker.history[0].maps) == [SERIES, f"random/{LAYER}"]
    (model, optimiser, scaler), (other, other_optimiser, other_scaler) = plain, tracked
    assert other.training and all(module.training for module in other.modules())
    for (name, value), (_, other_value) in zip(
        model.state_dict().items(), other.state_dict().items(), strict=True
    ):
        assert torch.equal(value, other_value), name  # weights and BatchNorm statistics
    momenta = [state["momentum_buffer"] for state in optimiser.state_dict()["state"].values()]
    others = [state["momentum_buffer"] for state in other_optimiser.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(momenta, others, strict=True))
    assert scaler.state_dict() == other_scaler.state_dict()


def test_untouched_run_restores_every_generator_and_the_callers_modes():
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        states = torch.get_rng_state(), random.getstate(), np.random.get_state()
        with untouched_run(torch.device("cpu")):
            assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            assert not torch.is_autocast_enabled("cpu")
            torch.rand(3), random.random(), np.random.rand(3)
        assert torch.is_inference_mode_enabled() and torch.is_autocast_enabled("cpu")
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    numpy_state = np.random.get_state()
    assert np.array_equal(numpy_state[1], states[2][1]) and numpy_state[2:] == states[2][2:]


def test_the_tracker_explains_inside_inference_mode_no_grad_and_autocast(untouched):
    model = tiny_cnn()
    with torch.inference_mode():
        inference_probes = probes()  # an inference tensor, as Lightning's validation makes
    tracker = camviz.Tracker(inference_probes, layers=LAYER, every=1)
    with untouched(model):
        with torch.inference_mode():
            inside = tracker.step(model, 0)
        with torch.no_grad():
            quiet = tracker.step(model, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = tracker.step(model, 2)
    expected = camviz.explain(model, probes(), layer=LAYER).heatmaps
    for record in (inside, quiet, mixed):
        maps = record.maps[SERIES].heatmaps
        assert torch.equal(maps, expected) and not maps.is_inference()
    assert quiet.maps[SERIES].numbers["corr_prev"].tolist() == pytest.approx([1.0] * 3)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Five training steps tracked every 2 steps into TensorBoard, W&B (offline) and files,
    with a copy of the model at each logged step."""
    folder = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"MODE": "offline", "DIR": str(folder), "SILENT": "true"}.items():
            patch.setenv(f"WANDB_{name}", value)
        import wandb
        from torch.utils.tensorboard import SummaryWriter

        run = wandb.init(project="camviz-tests", dir=folder)
        writer = SummaryWriter(folder / "tensorboard")
        tracker = camviz.Tracker(
            probes(),
            layers=LAYER,
            every=2,
            masks=probe_masks(),
            logger=[writer, run],
            out_dir=folder / "files",
        )
        torch.manual_seed(2)
        model = tiny_cnn()
        optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        copies: dict[int, torch.nn.Module] = {}
        for step in range(5):
            training_step(model, optimiser, scaler, step, tracker, copies)
        tracker.close()
        writer.close()
        run.finish()
    return SimpleNamespace(folder=folder, tracker=tracker, copies=copies, run=Path(run.dir).parent)


def expected_explanations(logged) -> dict[int, camviz.Explanation]:
    return {
        step: camviz.explain(model, probes(), layer=LAYER) for step, model in logged.copies.items()
    }


def expected_maps(logged) -> dict[int, torch.Tensor]:
    return {step: explained.heatmaps for step, explained in expected_explanations(logged).items()}


def expected_overlay(probe: int, heatmap: torch.Tensor) -> np.ndarray:
    pixels = (probes()[probe] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return np.asarray(camviz.overlay(Image.fromarray(pixels), heatmap))


def test_the_maps_of_a_step_are_explain_on_a_copy_of_the_model_at_that_step(logged):
    history = logged.tracker.history
    assert [record.step for record in history] == [0, 2, 4]
    explained = expected_explanations(logged)
    for record in history:
        tracked = record.maps[SERIES]
        assert torch.equal(tracked.heatmaps, explained[record.step].heatmaps)
        assert torch.equal(tracked.targets, explained[record.step].targets)  # predicted classes
        assert torch.equal(tracked.numbers["score"], explained[record.step].scores)
    # Training moved the maps: a test of equality that cannot pass by accident.
    assert not torch.equal(history[0].maps[SERIES].heatmaps, history[-1].maps[SERIES].heatmaps)


def numpy_numbers(maps: dict[int, torch.Tensor], step: int, probe: int) -> dict[str, float]:
    """The numbers of one probe at one step, from their definitions."""

    def corr(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])

    def top(a: np.ndarray) -> np.ndarray:
        flat = a.ravel()
        return flat >= np.sort(flat)[-round(0.15 * flat.size)]

    def overlap(a: np.ndarray, b: np.ndarray) -> float:
        return 2 * float((top(a) & top(b)).sum()) / (top(a).sum() + top(b).sum())

    steps = sorted(maps)
    now = maps[step][probe].double().numpy()
    first = maps[steps[0]][probe].double().numpy()
    numbers = {
        "corr_first": corr(now, first),
        "top15_first": overlap(now, first),
        "inside": float((now * probe_masks()[probe].numpy()).sum() / now.sum()),
    }
    if step != steps[0]:
        previous = maps[steps[steps.index(step) - 1]][probe].double().numpy()
        numbers.update(corr_prev=corr(now, previous), top15_prev=overlap(now, previous))
    return numbers


def test_the_numbers_follow_their_formulas_and_fill_the_json_lines_log(logged):
    maps = expected_maps(logged)
    rows = [
        json.loads(line)
        for line in (logged.folder / "files" / "camviz_tracker.jsonl").read_text().splitlines()
    ]
    assert [(row["step"], row["probe"]) for row in rows] == [
        (step, probe) for step in (0, 2, 4) for probe in range(3)
    ]
    for row in rows:
        record = next(r for r in logged.tracker.history if r.step == row["step"])
        numbers = record.maps[SERIES].numbers
        assert row["method"] == "gradcam" and row["layer"] == LAYER
        assert row["target"] == int(record.maps[SERIES].targets[row["probe"]])
        assert row["score"] == pytest.approx(float(numbers["score"][row["probe"]]))
        for name, value in numpy_numbers(maps, row["step"], row["probe"]).items():
            assert row[name] == pytest.approx(value, abs=1e-6), name
            assert float(numbers[name][row["probe"]]) == pytest.approx(value, abs=1e-6), name
        if row["step"] == 0:
            assert row["corr_prev"] is None and row["top15_prev"] is None


def test_the_files_hold_each_probes_overlay_at_each_step(logged):
    maps = expected_maps(logged)
    steps_folder = logged.folder / "files" / "steps"
    names = sorted(path.name for path in steps_folder.iterdir())
    assert names == sorted(f"{s}_probe{i}_gradcam.png" for s in (0, 2, 4) for i in range(3))
    for step, heatmaps in maps.items():
        for probe in range(3):
            picture = np.asarray(Image.open(steps_folder / f"{step}_probe{probe}_gradcam.png"))
            assert np.array_equal(picture, expected_overlay(probe, heatmaps[probe]))


def test_tensorboard_holds_the_images_scalars_and_strip_of_every_logged_step(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged.folder / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    probe_keys = [f"camviz/{SERIES}/probe{i}" for i in range(3)]
    assert sorted(events.Tags()["images"]) == sorted([*probe_keys, "camviz/strip"])
    maps = expected_maps(logged)
    for probe, key in enumerate(probe_keys):
        images = events.Images(key)
        assert [image.step for image in images] == [0, 2, 4]
        for image in images:
            picture = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)))
            assert np.array_equal(picture, expected_overlay(probe, maps[image.step][probe]))
        for name, steps in {"score": [0, 2, 4], "corr_prev": [2, 4], "inside": [0, 2, 4]}.items():
            scalars = events.Scalars(f"{key}/{name}")
            assert [scalar.step for scalar in scalars] == steps
            wanted = [numpy_numbers(maps, s, probe).get(name) for s in steps]
            if name == "score":
                wanted = [
                    float(r.maps[SERIES].numbers["score"][probe]) for r in logged.tracker.history
                ]
            assert [scalar.value for scalar in scalars] == pytest.approx(wanted, abs=1e-6)
    strips = events.Images("camviz/strip")
    assert [strip.step for strip in strips] == [0, 2, 4]
    last = np.asarray(Image.open(io.BytesIO(strips[-1].encoded_image_string)))
    assert np.array_equal(last, np.asarray(Image.open(logged.folder / "files" / "strip.png")))


def wandb_history(run_folder: Path) -> list[dict[str, object]]:
    """The rows ``run.log`` wrote to an offline run's ``.wandb`` file: a LevelDB-style log
    of 32 KiB blocks (7-byte record headers: CRC, length, kind) after a 7-byte file header,
    each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = next(run_folder.glob("run-*.wandb")).read_bytes()
    chunks, pending, position, block = [], b"", 7, 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = (
            int.from_bytes(data[position + 4 : position + 6], "little"),
            data[position + 6],
        )
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 2):  # a whole record, or the first part of one
            pending = chunk
        elif kind in (3, 4):  # a middle or last part
            pending += chunk
        if kind in (1, 4):
            chunks.append(pending)
    rows = []
    for chunk in chunks:
        record = Record.FromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def test_wandb_offline_runs_hold_the_logged_images_and_scalars(logged):
    rows = [row for row in wandb_history(logged.run) if "camviz/step" in row]
    assert [row["camviz/step"] for row in rows] == [0, 2, 4]
    maps = expected_maps(logged)
    for row in rows:
        step = row["camviz/step"]
        for probe in range(3):
            key = f"camviz/{SERIES}/probe{probe}"
            picture = np.asarray(Image.open(logged.run / "files" / row[f"{key}/path"]))
            assert np.array_equal(picture, expected_overlay(probe, maps[step][probe]))
            assert row[f"{key}/inside"] == pytest.approx(numpy_numbers(maps, step, probe)["inside"])
        assert row["camviz/strip/_type"] == "image-file"


def test_only_rank_zero_explains_and_logs(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank other than 0 explained")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("camviz.training.tracker.explain", refuse)
    tracker = camviz.Tracker(probes(), layers=LAYER, every=1, out_dir=tmp_path)
    assert tracker.step(tiny_cnn(), 0) is None and tracker.history == []
    tracker.close()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tracker.step(tiny_cnn(), 0) is not None


def test_the_summary_gives_each_steps_change_to_the_final_map_and_writes_the_picture(
    logged, tmp_path
):
    boxes = torch.tensor([[0, 0, 8, 8], [4, 4, 16, 12], [8, 0, 16, 16]])
    tracker = camviz.Tracker(probes(), layers=LAYER, every=2, boxes=boxes)
    for step, model in logged.copies.items():  # the weights of three steps of a run
        tracker.step(model, step)
    summary = tracker.summary(tmp_path / "summary.png")
    assert summary.steps == [0, 2, 4]
    table = summary.numbers[SERIES]
    last = tracker.history[-1].maps[SERIES].heatmaps
    for index, record in enumerate(tracker.history):
        maps = record.maps[SERIES].heatmaps
        for probe in range(3):
            wanted = np.corrcoef(maps[probe].double().ravel(), last[probe].double().ravel())[0, 1]
            assert float(table["corr_final"][index, probe]) == pytest.approx(wanted, abs=1e-6)
            x0, y0, x1, y1 = boxes[probe].tolist()
            share = maps[probe, y0:y1, x0:x1].sum() / maps[probe].sum()
            assert float(table["inside"][index, probe]) == pytest.approx(float(share), abs=1e-6)
    assert table["top15_final"][-1].tolist() == [1.0, 1.0, 1.0]
    written = np.asarray(Image.open(tmp_path / "summary.png"))
    assert np.array_equal(written, np.asarray(summary.picture))


def test_the_changes_of_hand_made_maps():
    one = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    other = torch.tensor([[[0.0, 1.0], [0.0, 0.0]]])
    nothing = torch.zeros(1, 2, 2)  # no evidence: every pixel ties for the top
    # Pearson of (1, 0, 0, 0) and (0, 1, 0, 0): -0.25 / 0.75.
    assert correlation(one, other).tolist() == pytest.approx([-1 / 3])
    assert correlation(one, nothing).isnan().all()
    # The top 15 % of 4 pixels is one pixel; the empty map's top is all 4: 2 * 1 / (1 + 4).
    assert top_overlap(one, other).tolist() == [0.0]
    assert top_overlap(one, one).tolist() == [1.0]
    assert top_overlap(one, nothing).tolist() == pytest.approx([0.4])


def test_a_restored_history_is_continued(logged, tmp_path):
    tracker = camviz.Tracker(probes(), layers=LAYER, every=1)
    tracker.step(logged.copies[0], 0)
    torch.save(tracker.state_dict(), tmp_path / "tracker.pt")
    resumed = camviz.Tracker(probes(), layers=LAYER, every=1)
    resumed.load_state_dict(torch.load(tmp_path / "tracker.pt", weights_only=True))
    record = resumed.step(logged.copies[4], 1)
    first = tracker.history[0].maps[SERIES].heatmaps
    now = record.maps[SERIES].heatmaps
    for probe in range(3):
        wanted = np.corrcoef(now[probe].double().ravel(), first[probe].double().ravel())[0, 1]
        for name in ("corr_prev", "corr_first"):
            assert float(record.maps[SERIES].numbers[name][probe]) == pytest.approx(wanted)
    other = camviz.Tracker(probes(2), layers=LAYER)
    with pytest.raises(camviz.CamvizError, match="same probe images"):
        other.load_state_dict(tracker.state_dict())
    other = camviz.Tracker(probes(), methods=("layercam",), layers=LAYER)
    with pytest.raises(camviz.CamvizError, match="same methods and layers"):
        other.load_state_dict(tracker.state_dict())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"images": torch.rand(3, 16, 16)}, "one float \\(N, C, H, W\\) batch"),
        ({"methods": ("gradcan",)}, "unknown CAM method 'gradcan'"),
        ({"every": 0}, "every must be a whole number"),
        ({"masks": torch.ones(3, 8, 8, dtype=torch.bool)}, "masks must be \\(3, 16, 16\\)"),
        (
            {"masks": torch.ones(3, 16, 16, dtype=torch.bool), "boxes": [[0, 0, 1, 1]] * 3},
            "not both",
        ),
        ({"logger": object()}, "cannot log to a object"),
    ],
)
def test_bad_settings_are_one_line_errors(options, message):
    settings = {"images": probes(), **options}
    with pytest.raises(camviz.CamvizError, match=message) as error:
        camviz.Tracker(**settings)
    assert "\n" not in str(error.value)


def test_all_zero_maps_are_said_once_per_tracker_and_kept(recwarn):
    model = tiny_cnn()
    with torch.no_grad():  # the layer outputs nothing: every map is all zero
        model.features[3].weight.zero_()
        model.features[3].bias.fill_(-1.0)
    tracker = camviz.Tracker(probes(), layers=LAYER, every=1)
    for step in range(3):
        tracker.step(model, step)
    said = [str(w.message) for w in recwarn if issubclass(w.category, camviz.ZeroMapWarning)]
    assert len(said) == 1 and said[0].startswith("step 0: gradcam: 3 of 3 maps are all zero")
    last = tracker.history[-1].maps[SERIES]
    assert not last.heatmaps.any() and last.numbers["corr_prev"].isnan().all()


@pytest.mark.filterwarnings("ignore::camviz.ZeroMapWarning")  # an untrained model's second class
def test_a_target_that_gives_several_maps_per_probe_is_refused():
    tracker = camviz.Tracker(probes(), targets="top2", layers=LAYER, every=1)
    with pytest.raises(camviz.CamvizError, match="one map per probe image"):
        tracker.step(tiny_cnn(), 0)
    with pytest.raises(camviz.CamvizError, match="recorded no step yet"):
        tracker.summary()
