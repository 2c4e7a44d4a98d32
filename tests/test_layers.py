"""Layers given as names, patterns or the submodules themselves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.layers import resolve_layers


def test_a_submodule_is_named_as_named_modules_names_it(resnet18: nn.Module) -> None:
    resolved = resolve_layers(resnet18, [resnet18.layer4, "layer3.*.conv1", resnet18.fc])
    assert list(resolved) == ["layer4", "layer3.0.conv1", "layer3.1.conv1", "fc"]
    assert resolved["layer4"] is resnet18.layer4


def test_explaining_a_module_equals_explaining_its_name(
    resnet18: nn.Module, small_batch: torch.Tensor
) -> None:
    by_module = camviz.explain(resnet18, small_batch, layer=resnet18.layer3, target=[1, 2])
    by_name = camviz.explain(resnet18, small_batch, layer="layer3", target=[1, 2])
    assert by_module.layers == ["layer3"]
    torch.testing.assert_close(by_module.heatmaps, by_name.heatmaps, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (nn.Conv2d(3, 3, 1), "Conv2d given as layer is not a submodule of this model"),
        (3, "a layer must be a name, a wildcard pattern or a submodule of the model, not int 3"),
        ([3], "not int 3"),
        ([nn.Linear(2, 2)], "Linear given as layer is not a submodule"),
    ],
)
def test_a_layer_of_the_wrong_kind_is_one_line(resnet18: nn.Module, layer, message) -> None:
    with pytest.raises(CamvizError, match=message) as error:
        camviz.explain(resnet18, torch.randn(1, 3, 32, 32), layer=layer)
    assert "\n" not in str(error.value)
