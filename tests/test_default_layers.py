"""One default-layer rule: ``camviz.models.load(name).default_layer`` and the layer that
``camviz.explain(model, x, layer=None)`` explains are the same, and for every family that
camviz 0.2's name table covered (``_DEFAULT_LAYERS`` in ``io/models.py``), the table's layer.

The table is copied here as it was; the structural rules in :mod:`camviz.core.layers` must
pick what it picked. Models are torchvision's own (random weights). The smallest model of
each family is explained on the CPU; ``load`` is checked on a copy built on the meta device
(shapes only, no arithmetic: the rule reads module types and shapes; RegNet's constructor
needs real numbers), which also covers the larger VGGs, each a pattern of the table,
without building 100 M random weights each.
"""

from __future__ import annotations

import fnmatch

import pytest
import timm
import torch
import torchvision
from conftest import conv_net
from torch import nn

import camviz
from camviz.io import models

# GoogLeNet and Inception-v3 warn that their random initialisation will change.
pytestmark = pytest.mark.filterwarnings("ignore:The default weight initialization:FutureWarning")

# camviz 0.2's table, pattern by pattern, and the offline model's layer beside it.
TABLE = {
    "resnet*": "layer4",
    "resnext*": "layer4",
    "wide_resnet*": "layer4",
    "alexnet": "features.11",
    "vgg11": "features.19",
    "vgg11_bn": "features.27",
    "vgg13": "features.23",
    "vgg13_bn": "features.33",
    "vgg16": "features.29",
    "vgg16_bn": "features.42",
    "vgg19": "features.35",
    "vgg19_bn": "features.51",
    "densenet*": "features",
    "efficientnet_*": "features",
    "mobilenet_*": "features",
    "mnasnet*": "layers",
    "convnext_*": "features",
    "regnet_*": "trunk_output",
    "shufflenet_*": "conv5",
    "squeezenet*": "features",
    "googlenet": "inception5b",
    "inception_v3": "Mixed_7c",
}
OFFLINE_LAYER = "bn2"

# The smallest model of each family, explained on the CPU, at the input size it takes
# (Inception-v3's last stage is 1 x 1 below about 100 px).
EXPLAINED = {
    "resnet18": 64,
    "alexnet": 64,
    "vgg11": 64,
    "densenet121": 64,
    "efficientnet_b0": 64,
    "mobilenet_v3_small": 64,
    "mnasnet0_5": 64,
    "convnext_tiny": 64,
    "regnet_x_400mf": 64,
    "shufflenet_v2_x0_5": 64,
    "squeezenet1_0": 64,
    "googlenet": 64,
    "inception_v3": 107,
}
# For load(): the explained ones, one model for each pattern they leave out, and a second
# model of the families whose variants differ in structure.
LOADED = [
    *EXPLAINED,
    "resnext50_32x4d",
    "wide_resnet50_2",
    "vgg11_bn",
    "vgg13",
    "vgg13_bn",
    "vgg16",
    "vgg16_bn",
    "vgg19",
    "vgg19_bn",
    "mobilenet_v2",
    "squeezenet1_1",
    "regnet_y_400mf",
]


def table_layer(name: str) -> str:
    patterns = [pattern for pattern in TABLE if fnmatch.fnmatchcase(name, pattern)]
    assert patterns, f"{name} is in no pattern of the table"
    return TABLE[patterns[0]]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None).eval()


def test_every_pattern_of_the_table_is_covered():
    covered = {
        pattern for name in LOADED for pattern in TABLE if fnmatch.fnmatchcase(name, pattern)
    }
    assert covered == set(TABLE)


@pytest.mark.parametrize("name", list(EXPLAINED))
def test_explain_uses_the_tables_layer(name):
    model = build(name)
    size = EXPLAINED[name]
    inputs = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(1))

    result = camviz.explain(model, inputs, layer=None, target=0, relu=False)

    assert result.layers == [table_layer(name)]
    assert result.layer_maps.abs().amax() > 0  # a real map of that layer, not a zero one


@pytest.mark.parametrize("name", LOADED)
def test_load_gives_the_layer_explain_uses(name, monkeypatch):
    with torch.device("cpu" if name.startswith("regnet") else "meta"):  # RegNet's needs numbers
        model = build(name)
    monkeypatch.setattr(torchvision.models, "get_model", lambda *args, **kwargs: model)

    loaded = models.load(name)

    assert loaded.model is model  # the architecture load() knows, with these weights
    assert loaded.default_layer == table_layer(name)


def test_the_offline_model_keeps_its_layer(offline_model):
    torch.manual_seed(0)
    fresh = timm.create_model("tf_efficientnet_lite0", pretrained=False).eval()
    inputs = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))

    result = camviz.explain(fresh, inputs, layer=None, target=0, relu=False)

    assert offline_model.default_layer == OFFLINE_LAYER
    assert result.layers == [OFFLINE_LAYER]


def test_the_dry_run_is_paid_once_per_model_input_rank_and_kind_of_target():
    model = conv_net(4, 6, classes=3)
    passes: list[int] = []
    model.register_forward_hook(lambda *_: passes.append(1))

    def runs(size: int, target: object) -> tuple[int, list[str]]:
        before = len(passes)
        images = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(size))
        result = camviz.explain(model, images, target=target)
        return len(passes) - before, result.layers

    assert runs(16, 0) == (2, ["3"])  # the dry run, then the explaining pass
    assert runs(24, 2) == (1, ["3"])  # another size and class: the same rank and kind
    # A unit's score is read at its layer: another kind of target, another dry run.
    assert runs(16, camviz.Unit("2", channel=1)) == (2, ["1"])
    assert runs(24, camviz.Unit("2", channel=0)) == (1, ["1"])
