"""Model sources from the command line and from Python: a user's own factory, Hugging Face
folders, Ultralytics YOLO files; each bad input is one line and a non-zero exit.

Every model is tiny and saved to a temporary folder (``save_pretrained`` with its processor,
a ``.py`` factory, a YOLO ``.yaml`` with a state_dict, a pickled ``.pt``). The CLI runs in
this process (``camviz.cli.main``). Numbers are checked against an independent path: the
model's own library (the Hugging Face processor and model, Ultralytics' letterbox, NMS and
box scaling) or autograd by hand.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import camviz
from camviz.cli import build_parser, main
from camviz.cli.options import model_argument
from camviz.io.sources.ultralytics import import_ultralytics

FACTORY = """
import torch
from torch import nn


def small(classes=3, width=6):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes),
    )


def grey():
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())


class Seeing(nn.Sequential):  # remembers the size of every input it is given
    def forward(self, x):
        self.seen.append(tuple(x.shape[2:]))
        return super().forward(x)


def seeing():
    model = Seeing(nn.Conv2d(3, 2, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    model.seen = []
    return model


def not_a_model():
    return [1, 2]


def broken():
    return undefined_name
"""

# A two-level YOLO detector, small enough to build in a blink.
YOLO_YAML = """
nc: 3
backbone:
  - [-1, 1, Conv, [8, 3, 2]]
  - [-1, 1, Conv, [16, 3, 2]]
  - [-1, 1, Conv, [16, 3, 2]]
  - [-1, 1, Conv, [16, 3, 2]]
head:
  - [[2, 3], 1, Detect, [nc]]
"""


class _Marker:
    """Unpickling this creates a file: the code a pickle can run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("sources")


@pytest.fixture(scope="module")
def photo(folder) -> Path:
    path = folder / "photo.png"
    pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def factory_file(folder) -> Path:
    path = folder / "nets.py"
    path.write_text(textwrap.dedent(FACTORY))
    return path


@pytest.fixture(scope="module")
def hf_vit(folder) -> Path:
    transformers = pytest.importorskip("transformers")
    path = folder / "vit"
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        id2label={0: "cat", 1: "dog", 2: "fox"},
        label2id={"cat": 0, "dog": 1, "fox": 2},
    )
    torch.manual_seed(0)
    transformers.ViTForImageClassification(config).save_pretrained(path)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def yolo(folder) -> tuple[Path, Path]:
    """The YOLO ``.yaml`` and a state_dict whose heads give distinct scores and small boxes."""
    tasks = import_ultralytics()  # without its patches of Pillow and torch
    yaml = folder / "tiny.yaml"
    yaml.write_text(YOLO_YAML)
    torch.manual_seed(0)
    network = tasks.DetectionModel(str(yaml), verbose=False)
    head = network.model[-1]
    with torch.no_grad():
        for classes, boxes in zip(head.cv3, head.cv2, strict=True):
            classes[-1].weight.mul_(4)
            classes[-1].bias.normal_(-0.5, 0.5)
            boxes[-1].bias.view(4, -1)[:, 1] = 6  # about one stride from each anchor
    weights = folder / "tiny_sd.pt"
    torch.save(network.state_dict(), weights)
    return yaml, weights


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli(*arguments)``: ``(status, stdout, stderr)`` of ``camviz`` in this process, with
    the Hugging Face hub offline (its setting is read when it is imported)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "huggingface_hub" in sys.modules:
        monkeypatch.setattr(sys.modules["huggingface_hub"].constants, "HF_HUB_OFFLINE", True)

    def run(*arguments: object) -> tuple[int, str, str]:
        capsys.readouterr()
        status = main([str(argument) for argument in arguments])
        captured = capsys.readouterr()
        return status, captured.out, captured.err

    return run


def explain(cli, photo: Path, out: Path, *options: object) -> tuple[int, str, str]:
    return cli("explain", photo, "--out", out, "--workers", 0, "--quiet", *options)


def one_line_error(error: str, *fragments: str) -> None:
    assert error.startswith("camviz: error: ") and error.count("\n") == 1, error
    for fragment in fragments:
        assert fragment in error, error


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


# --- A factory of the user's own ------------------------------------------------------------


def test_a_factory_file_with_arguments_and_weights_explains_as_in_python(
    cli, photo, factory_file, folder, tmp_path
):
    spec = f"{factory_file}:small"
    built = camviz.load_model(spec, model_args={"classes": 4, "width": 5})
    torch.nn.init.normal_(built.model[6].weight)  # the weights file is not the factory's
    weights = tmp_path / "sd.pt"
    torch.save(built.model.state_dict(), weights)

    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", spec, "--model-arg", "classes=4",
        "--model-arg", "width=5", "--weights", weights, "--heatmap", "npz", "--no-panel",
    )  # fmt: skip

    assert status == 0, error
    (row,) = rows(tmp_path / "out")
    # No preprocessing options: the photo as it is, in [0, 1].
    image = torch.from_numpy(np.array(Image.open(photo))).permute(2, 0, 1) / 255
    expected = camviz.explain(built.model, image[None], "gradcam", layer=built.default_layer)
    assert row["prediction"]["id"] == int(expected.targets[0])
    assert row["prediction"]["name"] == f"class {row['prediction']['id']}"
    saved = np.load(tmp_path / "out" / row["explained"][0]["files"]["heatmap"])["heatmap"]
    np.testing.assert_allclose(saved, expected.heatmaps[0].numpy(), atol=1e-5)


def test_a_module_factory_is_imported_with_the_current_folder_first(
    cli, photo, factory_file, monkeypatch, tmp_path
):
    monkeypatch.chdir(factory_file.parent)
    monkeypatch.delitem(sys.modules, "nets", raising=False)
    path = list(sys.path)
    classes = tmp_path / "classes.txt"
    classes.write_text("red\n\ngreen\nblue\n")

    status, out, error = cli("layers", "--model", "nets:small", "--size", 8)
    assert status == 0, error
    assert "<- default target layer" in out
    assert sys.path == path  # the folder was first only while the model was built

    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", "nets:small", "--classes", classes, "--no-panel"
    )
    assert status == 0, error
    assert rows(tmp_path / "out")[0]["prediction"]["name"] in ("red", "green", "blue")


def test_model_arguments_are_python_literals_or_text():
    assert model_argument("depth=3") == ("depth", 3)
    assert model_argument("widths=[8, 16]") == ("widths", [8, 16])
    assert model_argument("norm='batch'") == ("norm", "batch")
    assert model_argument("norm=batch") == ("norm", "batch")
    assert model_argument("flag=True") == ("flag", True)


def test_grey_images_with_one_mean_and_std(factory_file, photo):
    loaded = camviz.load_model(f"{factory_file}:grey", channels=1, mean=0.5, std=0.25)
    grey = torch.from_numpy(np.array(Image.open(photo).convert("L"))).float() / 255
    tensor = loaded.preprocess(camviz.load_image(photo))
    torch.testing.assert_close(tensor, ((grey - 0.5) / 0.25)[None])
    assert loaded.default_layer == "0"


def test_the_dry_runs_of_a_load_run_at_the_input_size_asked_for(factory_file, yolo):
    loaded = camviz.load_model(f"{factory_file}:seeing", input_size=20)
    assert loaded.model.seen and set(loaded.model.seen) == {(20, 20)}
    assert loaded.default_layer == "1" and loaded.categories == ["class 0", "class 1"]

    yaml, weights = yolo
    tasks = import_ultralytics()
    letterboxed: list[tuple[int, ...]] = []

    def seen(module, args):
        if isinstance(module, tasks.DetectionModel):
            letterboxed.append(tuple(args[0].shape[2:]))

    hook = torch.nn.modules.module.register_module_forward_pre_hook(seen)
    try:
        camviz.load_model(f"yolo:{yaml}", weights=weights, input_size=32)
    finally:
        hook.remove()
    assert letterboxed and set(letterboxed) == {(32, 32)}  # not Ultralytics' own 640


def test_every_subcommand_with_a_model_takes_the_sources_options(factory_file, photo):
    shared = ["--model", f"{factory_file}:small", "--model-arg", "classes=2", "--input-size"]
    shared += ["16", "--mean", "0.5", "--std", "0.2,0.2,0.2", "--task", "classification"]
    for command in (
        ["explain", str(photo)],
        ["layers"],
        ["inspect", str(photo), "--channels", "3"],
        ["features", str(photo), "--layer", "0", "--input-channels", "3"],
        ["compare", str(photo)],
    ):
        args = build_parser().parse_args([*command, *shared])
        assert (args.model_arg, args.input_size, args.mean) == ([("classes", 2)], 16, (0.5,))


@pytest.mark.parametrize(
    ("factory", "fragments"),
    [
        ("nets.py:smal", ("has no 'smal'", "did you mean small")),
        ("nets.py:not_a_model", ("returned list, not a torch.nn.Module",)),
        ("nets.py:broken", ("NameError", "nets.py:")),
        ("missing.py:small", ("missing.py does not exist",)),
        ("no_such_package.nets:small", ("cannot import no_such_package.nets",)),
    ],
)
def test_a_bad_factory_is_one_line(cli, photo, factory_file, tmp_path, factory, fragments):
    spec = factory.replace("nets.py", str(factory_file))
    status, _, error = explain(cli, photo, tmp_path / "out", "--model", spec)
    assert status == 1
    one_line_error(error, *fragments)
    assert not (tmp_path / "out").exists()


def test_a_factory_argument_it_does_not_take_is_one_line(cli, photo, factory_file, tmp_path):
    spec = f"{factory_file}:small"
    status, _, error = explain(cli, photo, tmp_path / "out", "--model", spec, "--model-arg", "x=1")
    assert status == 1
    one_line_error(error, "unexpected keyword argument 'x'", "classes, width")


# --- Hugging Face ---------------------------------------------------------------------------


def test_a_hugging_face_folder_classifies_as_its_processor_and_labels_say(cli, hf_vit, tmp_path):
    transformers = pytest.importorskip("transformers")
    photo = tmp_path / "small.png"  # the processor's size: both sides skip the resize
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), np.uint8)).save(photo)

    status, _, error = explain(cli, photo, tmp_path / "out", "--model", f"hf:{hf_vit}")

    assert status == 0, error
    model = transformers.ViTForImageClassification.from_pretrained(hf_vit).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(hf_vit)
    with torch.no_grad():
        logits = model(**processor(Image.open(photo), return_tensors="pt")).logits[0]
    (row,) = rows(tmp_path / "out")
    assert row["prediction"]["name"] == ["cat", "dog", "fox"][int(logits.argmax())]
    assert row["prediction"]["score"] == pytest.approx(float(logits.max()), abs=1e-4)


def test_a_dual_encoder_answers_its_image_embedding(folder):
    transformers = pytest.importorskip("transformers")
    path = folder / "clip"
    config = transformers.CLIPConfig(
        text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "intermediate_size": 32, "vocab_size": 64, "max_position_embeddings": 8,
                     "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={"image_size": 32, "patch_size": 8, "hidden_size": 16,
                       "num_hidden_layers": 2, "num_attention_heads": 2,
                       "intermediate_size": 32},
        projection_dim=8,
    )  # fmt: skip
    clip = transformers.CLIPModel(config).eval()
    clip.save_pretrained(path)
    transformers.CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(path)

    loaded = camviz.load_model(f"hf:{path}")

    pixels = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        expected = clip.get_image_features(pixel_values=pixels)
        expected = getattr(expected, "pooler_output", expected)
        torch.testing.assert_close(loaded.model(pixels), expected)
    assert (loaded.task, loaded.preprocess.size, loaded.preprocess.resize) == (
        "embedding",
        32,
        "square",
    )


def test_a_hugging_face_folder_without_its_processor(cli, photo, hf_vit, folder, tmp_path):
    bare = folder / "vit-without-processor"
    bare.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((hf_vit / name).read_bytes())

    status, _, error = explain(cli, photo, tmp_path / "out", "--model", f"hf:{bare}")
    assert status == 1
    one_line_error(error, "no image processor", "--input-size, --mean and --std")

    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", f"hf:{bare}", "--input-size", "32",
        "--mean", "0.5", "--std", "0.5", "--no-panel",
    )  # fmt: skip
    assert status == 0, error


def test_hugging_face_names_that_cannot_be_read_are_one_line(cli, photo, folder, tmp_path):
    pytest.importorskip("transformers")
    empty = folder / "empty"
    empty.mkdir(exist_ok=True)
    status, _, error = explain(cli, photo, tmp_path / "out", "--model", f"hf:{empty}")
    assert status == 1
    one_line_error(error, "not a Hugging Face model folder", "save_pretrained")

    status, _, error = explain(cli, photo, tmp_path / "out", "--model", "hf:org/not-here")
    assert status == 1
    one_line_error(error, "pass the local folder: --model hf:DIR")

    status, _, error = explain(cli, photo, tmp_path / "out", "--model", "org/not-here")
    assert status == 1
    one_line_error(error, "did you mean `hf:org/not-here`")


def test_a_missing_extra_names_its_pip_install(monkeypatch, hf_vit):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(camviz.CamvizError, match=r"pip install 'camviz\[hf\]'"):
        camviz.load_model(f"hf:{hf_vit}")


# --- Ultralytics ------------------------------------------------------------------------------


def test_yolo_boxes_are_ultralytics_own_on_the_photo(yolo):
    """Letterbox, NMS and boxes mapped back, against Ultralytics' own functions."""
    from ultralytics.data.augment import LetterBox
    from ultralytics.utils import ops
    from ultralytics.utils.nms import non_max_suppression

    yaml, weights = yolo
    loaded = camviz.load_model(f"yolo:{yaml}", weights=weights, input_size=64)
    photo = np.random.default_rng(2).integers(0, 256, (40, 70, 3), dtype=np.uint8)
    boxed = torch.from_numpy(LetterBox(64, auto=False)(image=photo)).permute(2, 0, 1)[None]
    with torch.no_grad():
        expected = non_max_suppression(loaded.model.network(boxed / 255), 0.25, 0.7)[0]
        expected[:, :4] = ops.scale_boxes((64, 64), expected[:, :4], photo.shape[:2])
        with loaded.applied() as model:
            (found,) = model(torch.from_numpy(photo).permute(2, 0, 1)[None] / 255)

    assert len(expected) > 1 and len(found["boxes"]) == len(expected)
    # Random weights score many boxes alike, so the two orders may differ: match each of
    # ours to the nearest of theirs (box, label), one to one. Their letterbox resizes 8-bit
    # pixels, ours floats: scores differ in the third decimal.
    ours = torch.cat([found["boxes"], 1e3 * found["labels"][:, None]], 1)
    theirs = torch.cat([expected[:, :4], 1e3 * expected[:, 5:6]], 1)
    nearest = (ours[:, None] - theirs[None]).abs().amax(-1).min(1)
    assert nearest.values.max() < 0.2
    assert sorted(nearest.indices.tolist()) == list(range(len(expected)))
    torch.testing.assert_close(found["scores"], expected[nearest.indices, 4], atol=1e-2, rtol=0)
    assert os.environ["YOLO_OFFLINE"] == "1" and os.environ["YOLO_AUTOINSTALL"] == "False"
    assert Image.open.__module__ == "PIL.Image" and torch.save.__module__ == "torch.serialization"


def test_a_yolo_map_lies_on_the_photo_through_the_letterbox(yolo):
    """Grad-CAM of one box at one level, by hand on the letterboxed square, cropped back."""
    yaml, weights = yolo
    loaded = camviz.load_model(f"yolo:{yaml}", weights=weights, input_size=64)
    photo = torch.rand(1, 3, 48, 64)  # fits 64 x 64 at scale 1: rows 8 to 56 hold the photo
    with loaded.applied() as model:
        explanation = camviz.explain(
            model, photo, layer="network.model.2", target=camviz.Detection(0)
        )
        (found,) = model(photo)

    network, recorded = loaded.model.network, {}
    handle = network.model[2].register_forward_hook(lambda m, i, o: recorded.update(a=o))
    boxed = torch.nn.functional.pad(photo, (0, 0, 8, 8), value=114 / 255)
    predictions = network(boxed)[0][:, :7]
    handle.remove()
    scores = predictions[0, 4:]  # the best detection is the best anchor's best class
    best = scores.max(0).values.max()
    torch.testing.assert_close(best, found["scores"][0])
    (gradient,) = torch.autograd.grad(best, recorded["a"])
    cam = torch.relu((gradient.mean((2, 3), keepdim=True) * recorded["a"]).sum(1))
    laid = torch.nn.functional.interpolate(cam[None], (64, 64), mode="bilinear")[0, :, 8:56]
    laid = (laid - laid.min()) / (laid.max() - laid.min())
    torch.testing.assert_close(explanation.heatmaps[0], laid[0].detach(), atol=1e-5, rtol=0)


def test_yolo_from_the_command_line_one_map_per_box(cli, photo, yolo, tmp_path):
    yaml, weights = yolo
    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", f"yolo:{yaml}", "--weights", weights,
        "--input-size", 64, "--min-score", 0.3, "--max-objects", 2,
    )  # fmt: skip
    assert status == 0, error
    (row,) = rows(tmp_path / "out")
    assert len(row["explained"]) == 2
    for explained in row["explained"]:
        x0, y0, x1, y1 = explained["box"]
        assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 48  # on the photo, not the square
        assert (tmp_path / "out" / explained["files"]["overlay"]).is_file()


def test_a_pickled_yolo_loads_only_when_trusted(cli, photo, yolo, folder, tmp_path):
    tasks = import_ultralytics()
    yaml, weights = yolo
    network = tasks.DetectionModel(str(yaml), verbose=False)
    network.load_state_dict(torch.load(weights, weights_only=True))
    pickled = folder / "tiny.pt"
    torch.save({"model": network}, pickled)

    status, _, error = explain(cli, photo, tmp_path / "refused", "--model", f"yolo:{pickled}")
    assert status == 1
    one_line_error(error, "unpickling it runs code", "--trust-pickle")
    assert not (tmp_path / "refused").exists()

    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", f"yolo:{pickled}", "--trust-pickle",
        "--input-size", 64, "--min-score", 0.3, "--max-objects", 1, "--no-panel",
    )  # fmt: skip
    assert status == 0, error
    assert len(rows(tmp_path / "out")[0]["explained"]) == 1

    status, _, error = explain(cli, photo, tmp_path / "bare", "--model", pickled)
    assert status == 1
    one_line_error(error, f"did you mean `yolo:{pickled}`")


def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(cli, photo, folder, tmp_path):
    marker = tmp_path / "ran"
    evil = folder / "evil.pt"
    torch.save({"model": _Marker(marker)}, evil)

    status, _, error = explain(cli, photo, tmp_path / "out", "--model", f"yolo:{evil}")
    assert status == 1
    one_line_error(error, "--trust-pickle")
    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", "resnet18", "--weights", evil
    )
    assert status == 1
    one_line_error(error, "not a plain state_dict")
    assert not marker.exists()


def test_trust_pickle_with_any_other_source_is_refused(cli, photo, factory_file, yolo, tmp_path):
    yaml, _ = yolo
    for model in (f"{factory_file}:small", f"yolo:{yaml}", "resnet18"):
        status, _, error = explain(cli, photo, tmp_path / "out", "--model", model, "--trust-pickle")
        assert status == 1
        one_line_error(error, "--trust-pickle", "only for a pickled Ultralytics model")
