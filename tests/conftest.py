"""Shared fixtures: small models built once per session, and the shipped photos.

The tiny models that many test modules build are factories here (``conv_net``,
``tiny_vit``): each call gives a new model, so a test may change it, and the same call
gives the same weights.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets"


# The cores this test process may use: all of them, or its share under pytest-xdist.
CORES = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch (and the processes it starts: the CLI,
    torchrun, notebook kernels) uses its share of the cores only. More OpenMP threads than
    cores make libgomp stop spinning between parallel regions, and every small parallel
    region then pays for waking its team: the suite took twice the CPU time."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        torch.set_num_threads(CORES)
        os.environ["OMP_NUM_THREADS"] = str(CORES)
    # pytest-xdist hands out files in the order of the collection (below) only without its
    # own reordering, which puts the files with the most tests first: the notebooks' file
    # (21 tests, the longest) started a minute into the run, and single-test files that take
    # half a minute came last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The slowest files, slowest first (the notebooks, then the files over about 5 s on one
# core, measured on the 2-core machine on 2026-12-02): under ``-n auto --dist loadfile`` (the
# README's command) each worker takes the next file when it runs dry, so the long ones start
# at once and the run ends with short files, not with one worker finishing a long one alone.
SLOWEST_FIRST = (
    "test_notebooks.py",
    "test_app.py",
    "test_distributed_nodes.py",
    "test_cli_faults.py",
    "test_distributed.py",
    "test_cli_tasks.py",
    "test_manifest_scale.py",
    "test_readme.py",
    "test_methods_gradient.py",
    "test_compare.py",
    "test_units_cli.py",
    "test_default_layers.py",
    "test_models.py",
    "test_segmentation_video.py",
    "test_units.py",
    "test_render_pillow.py",
    "test_cli.py",
    "test_multilevel.py",
    "test_video.py",
    "test_methods_perturbation.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files in the order of :data:`SLOWEST_FIRST`, then every other file as collected."""
    rank = {name: place for place, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def cat_path() -> Path:
    return ASSETS / "chelsea.png"


@pytest.fixture(scope="session")
def coffee_path() -> Path:
    return ASSETS / "coffee.png"


_CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_POOLS = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}


def conv_net(
    *channels: int,
    classes: int | None = 3,
    in_channels: int = 3,
    kernel: int = 3,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    activation: type[nn.Module] = nn.ReLU,
    rank: int = 2,
    seed: int | None = 0,
) -> nn.Sequential:
    """A plain CNN in eval mode: ``conv -> activation`` for each entry of ``channels``, then
    global average pooling, flatten and a linear head to ``classes`` (no head when None).

    Layers are named by position: with two convs, ``"0"`` and ``"2"`` are the convs, ``"1"``
    and ``"3"`` their activations, ``"6"`` the head. ``stride`` and ``padding`` are one
    value for every conv or one per conv; ``rank`` 1 and 3 build ``Conv1d`` and ``Conv3d``
    nets. ``seed`` seeds torch's global generator first (None leaves it as it is), so the
    weights are those of the same modules built by hand after ``torch.manual_seed(seed)``.
    """
    strides = [stride] * len(channels) if isinstance(stride, int) else list(stride)
    paddings = [padding] * len(channels) if isinstance(padding, int) else list(padding)
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    widths = [in_channels, *channels]
    for (width_in, width_out), step, pad in zip(
        itertools.pairwise(widths), strides, paddings, strict=True
    ):
        layers += [
            _CONVS[rank](width_in, width_out, kernel, stride=step, padding=pad),
            activation(),
        ]
    layers += [_POOLS[rank](1), nn.Flatten()]
    if classes is not None:
        layers.append(nn.Linear(widths[-1], classes))
    return nn.Sequential(*layers).eval()


class TensorImages(torch.utils.data.Dataset):
    """Preprocessed ``(C, H, W)`` images as a ``Dataset`` of tensors (not pairs), as a
    scan over a user's dataset reads them."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index]


def tiny_vit() -> nn.Module:
    """A random torchvision ViT for 32 px inputs: 8 px patches (a 4 x 4 grid), 2 blocks of
    2 heads, 16 channels, 5 classes; eval mode. A new model each call."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        num_classes=5,
    )
    nn.init.normal_(model.heads.head.weight)  # torchvision starts it at zero
    return model.eval()


@pytest.fixture(scope="session")
def resnet18() -> nn.Module:
    """A randomly initialised torchvision ResNet-18 (in-place ReLUs and ``+=``), eval mode."""
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).eval()


@pytest.fixture(scope="session")
def offline_model():
    """The shipped, ImageNet-pretrained EfficientNet-Lite0 with preprocessing and class names."""
    from camviz.io.models import load

    return load("efficientnet_lite0")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """A random ResNet-18 state_dict with 5 classes: ``--model resnet18 --weights PATH``
    runs the CLI offline and fast."""
    import torchvision

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("weights") / "resnet18.pt"
    torch.save(torchvision.models.resnet18(num_classes=5).state_dict(), path)
    return str(path)


@pytest.fixture
def small_batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 64, 64)


def _model_state(model: nn.Module) -> dict:
    """Everything camviz promises to leave as it was: hooks, modes, flags, grads, values."""
    return {
        "modules": [
            (
                name,
                type(module),
                getattr(module, "inplace", None),
                module.training,
                len(module._forward_hooks),
                len(module._forward_pre_hooks),
                len(module._backward_hooks),
                len(module._backward_pre_hooks),
            )
            for name, module in model.named_modules()
        ],
        "parameters": [
            (
                name,
                parameter.requires_grad,
                None if parameter.grad is None else parameter.grad.clone(),
                len(parameter._backward_hooks or {}),
                len(getattr(parameter, "_post_accumulate_grad_hooks", None) or {}),
            )
            for name, parameter in model.named_parameters()
        ],
        "values": {key: value.clone() for key, value in model.state_dict().items()},
    }


def _assert_same_state(before: dict, after: dict) -> None:
    assert after["modules"] == before["modules"], "modules, hooks or train/eval flags changed"
    for old, new in zip(before["parameters"], after["parameters"], strict=True):
        assert old[0] == new[0]
        assert old[1] == new[1], f"requires_grad of {old[0]} changed"
        assert (old[2] is None) == (new[2] is None), f".grad of {old[0]} appeared or vanished"
        assert old[2] is None or torch.equal(old[2], new[2]), f".grad of {old[0]} changed"
        assert old[3:] == new[3:], f"tensor hooks left on {old[0]}"
    for key, value in before["values"].items():
        assert value.dtype == after["values"][key].dtype, f"dtype of {key} changed"
        assert torch.equal(value, after["values"][key]), f"{key} changed"


@pytest.fixture
def untouched():
    """``with untouched(model): ...`` fails if the block leaves any trace on the model.

    Checked: the modules (type, ``inplace`` flag, train/eval flag, hooks), hooks on every
    parameter, ``requires_grad``, ``.grad``, and every parameter and buffer's dtype and value
    (BatchNorm running statistics too).
    """

    @contextlib.contextmanager
    def check(model: nn.Module) -> Iterator[nn.Module]:
        before = _model_state(model)
        yield model
        _assert_same_state(before, _model_state(model))

    return check


@pytest.fixture(scope="session")
def tiny_mobilenet(tmp_path_factory) -> str:
    """A random MobileNetV3-Small state_dict with 5 classes, for tests of the batch plumbing:
    ``--model mobilenet_v3_small --weights PATH`` explains a 224 px image in ~15 ms.

    Its BatchNorm statistics are measured on noise first: with the initial ones (mean 0,
    variance 1) the activations shrink layer by layer and every logit is about 1e-11.
    """
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(num_classes=5)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None  # a plain average over the calibration batches
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(8, 3, 96, 96))
    path = tmp_path_factory.mktemp("weights") / "mobilenet_v3_small.pt"
    torch.save(model.state_dict(), path)
    return str(path)


@pytest.fixture(scope="session")
def make_photos(cat_path, coffee_path):
    """``make_photos(folder, {"a.png": (40, 30), ...})`` writes small, distinct crops of the
    shipped photos (alternately flipped) at the given sizes and returns their paths."""
    from PIL import Image, ImageOps

    def make(folder: Path, sizes: dict[str, tuple[int, int]]) -> list[Path]:
        paths = []
        for number, (name, size) in enumerate(sizes.items()):
            with Image.open(cat_path if number % 2 == 0 else coffee_path) as photo:
                rgb = photo.convert("RGB")
            left, top = 10 * number, 5 * number
            crop = rgb.crop((left, top, left + 300, top + 250)).resize(size)
            if number % 3 == 1:
                crop = ImageOps.mirror(crop)
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            crop.save(path)
            paths.append(path)
        return paths

    return make


@pytest.fixture(scope="session")
def real_photos(tmp_path_factory) -> Path:
    """A folder of 300 real photos, 128 px square: crops and flips of the photos that
    scikit-image and scikit-learn ship (:func:`camviz.evaluation.photos.photo_folder`)."""
    from camviz.evaluation.photos import photo_folder

    folder = tmp_path_factory.mktemp("photos")
    photo_folder(folder, count=300, size=128)
    return folder


@pytest.fixture(scope="session")
def manifest_rows():
    """``manifest_rows(out)``: the rows of a job's ``manifest.jsonl``, in order."""
    import json

    def read(out: Path) -> list[dict]:
        return [
            json.loads(line) for line in (Path(out) / "manifest.jsonl").read_text().splitlines()
        ]

    return read


@pytest.fixture(scope="session")
def assert_rows_match():
    """``assert_rows_match(rows, expected)``: the same manifest rows, apart from the timing
    (``seconds``) and float noise in the last bits (from batches of other sizes)."""

    def close(got: object, want: object) -> bool:
        if isinstance(want, float):
            return isinstance(got, float) and abs(got - want) <= 1e-4 * max(1.0, abs(want))
        if isinstance(want, dict):
            return (
                isinstance(got, dict)
                and got.keys() == want.keys()
                and all(close(got[key], want[key]) for key in want if key != "seconds")
            )
        if isinstance(want, list):
            return (
                isinstance(got, list)
                and len(got) == len(want)
                and all(close(g, w) for g, w in zip(got, want, strict=True))
            )
        return got == want

    def check(rows: list[dict], expected: list[dict]) -> None:
        assert len(rows) == len(expected)
        for got, want in zip(rows, expected, strict=True):
            assert close(got, want), (got, want)

    return check


@pytest.fixture(scope="session")
def synthetic_classifier():
    """The shipped synthetic CNN as a loaded model for folder jobs: 32 px images in ``[0, 1]``
    (it normalises them itself), its four classes, its ``features`` layer. A job through it
    costs milliseconds per image."""
    from camviz.evaluation import synthetic
    from camviz.io.images import Preprocess
    from camviz.io.models import LoadedModel

    return LoadedModel(
        model=synthetic.load_model(),
        preprocess=Preprocess(size=32, mean=(0, 0, 0), std=(1, 1, 1)),
        categories=list(synthetic.CLASSES),
        name="synthetic-cnn",
        default_layer=synthetic.TARGET_LAYER,
    )


def tiny_cnn(seed: int = 0) -> nn.Module:
    """A random CNN for 16 px RGB images with 3 classes, in train mode: BatchNorm (running
    statistics), Dropout (draws from torch's generator while training) and the layer
    ``"features.3"``, an 8-channel 8 x 8 convolution, before the head. A new model each call."""
    from collections import OrderedDict

    torch.manual_seed(seed)
    features = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, padding=1, stride=2),
        nn.ReLU(),
    )
    layers = OrderedDict(
        features=features,
        dropout=nn.Dropout(0.2),
        pool=nn.AdaptiveAvgPool2d(1),
        flatten=nn.Flatten(),
        head=nn.Linear(8, 3),
    )
    return nn.Sequential(layers).train()
