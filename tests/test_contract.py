"""The contract every registered CAM method keeps, checked for each name in the registry.

A method added to :mod:`camviz.cams.registry` is tested here without editing this file:
its maps are finite, in ``[0, 1]`` and of the documented sizes; a batch gives the maps of
its samples explained one by one; a top-k target gives one map per rank, best first, equal
to explaining each rank's class; and the model comes back exactly as it came.

Each method runs with its default options on the first tiny model it applies to (a CNN
with 8 channels at the target layer and 24 px inputs; a vision transformer for the methods
that need one), so the methods that pay a forward pass per channel stay fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from conftest import tiny_vit
from torch import nn

import camviz
from camviz.cams import get, names

BATCH, CLASSES = 3, 5


class ContractNet(nn.Module):
    """stem (3x3 conv, stride 2) -> features (3x3 conv, stride 2, batch norm, in-place ReLU)
    -> mixer (3x3 conv and ReLU: the target, 8 channels on a 6x6 grid from 24 px) -> global
    average pooling -> linear head, 5 classes: the classic layout, which CAM needs."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
        self.features = nn.Sequential(
            nn.Conv2d(8, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6), nn.ReLU(inplace=True)
        )
        self.mixer = nn.Sequential(nn.Conv2d(6, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, CLASSES)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            norm = self.features[1]
            norm.running_mean.copy_(torch.randn(6, generator=generator) * 0.1)
            norm.running_var.copy_(torch.rand(6, generator=generator) + 0.5)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mixer(self.features(self.stem(x))).mean(dim=(2, 3)))


@dataclass(frozen=True)
class Case:
    """A tiny model (built anew by ``build``), its target layer and the sizes of the maps."""

    build: Callable[[], nn.Module]
    layer: str | None  # None: camviz's default layer
    size: int  # of the square inputs
    layer_size: int  # of the target layer's square grid


CASES = [Case(ContractNet, "mixer", 24, 6), Case(tiny_vit, None, 32, 4)]


def case_of(method: str) -> Case:
    """The first case whose model the method applies to (LeGrad needs a transformer)."""
    for case in CASES:
        if get(method).applies_to(case.build()):
            return case
    raise AssertionError(f"{method} applies to none of the contract's models")


def explain(model: nn.Module, inputs: torch.Tensor, method: str, **options) -> camviz.Explanation:
    # Methods that draw their noise seed from torch's global generator start from the same
    # state in every call, so that calls can be compared.
    torch.manual_seed(0)
    return camviz.explain(model, inputs, method, layer=case_of(method).layer, **options)


@pytest.fixture(scope="module", params=names())
def method(request) -> str:
    """Every registered method; the tests of one method run together."""
    return request.param


@pytest.fixture(scope="module")
def case(method) -> Case:
    return case_of(method)


@pytest.fixture(scope="module")
def model(case) -> nn.Module:
    return case.build()


@pytest.fixture(scope="module")
def inputs(case) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 3, case.size, case.size, generator=generator)


@pytest.fixture(scope="module")
def explained(method, model, inputs) -> camviz.Explanation:
    """The batch explained once per method (top-1), shared by the tests below."""
    return explain(model, inputs, method)


def test_maps_are_finite_in_unit_range_and_of_the_documented_sizes(
    method, case, model, inputs, explained
):
    result = explained
    layer_size = case.size if get(method).input_resolution else case.layer_size
    assert result.heatmaps.shape == (BATCH, case.size, case.size)
    assert result.layer_maps.shape == (BATCH, layer_size, layer_size)
    assert result.maps_by_layer[result.layers[0]] is result.layer_maps
    for maps in (result.heatmaps, result.layer_maps):
        assert maps.dtype == inputs.dtype and maps.isfinite().all()
        # Normalised per map, and none is empty on these models: the hottest pixel is 1.
        assert maps.amin() >= 0
        torch.testing.assert_close(maps.flatten(1).amax(1), torch.ones(BATCH))
    assert result.method == method and len(result.layers) == 1
    with torch.no_grad():
        assert result.targets.tolist() == model(inputs).argmax(1).tolist()


def test_a_batch_equals_its_samples_explained_one_by_one(method, model, inputs, explained):
    batch = explained
    singles = [explain(model, inputs[n : n + 1], method) for n in range(BATCH)]
    for field in ("heatmaps", "layer_maps", "scores"):
        alone = torch.cat([getattr(single, field) for single in singles])
        torch.testing.assert_close(getattr(batch, field), alone, atol=1e-5, rtol=0)
    assert batch.targets.tolist() == [int(single.targets[0]) for single in singles]


def test_top_k_gives_one_map_per_rank_best_first_equal_to_each_class(method, model, inputs):
    ranked = explain(model, inputs, method, target="top2")
    with torch.no_grad():
        best = model(inputs).topk(2, dim=1)
    # Documented order: sample-major, ranks best first within a sample.
    assert ranked.samples.tolist() == [0, 0, 1, 1, 2, 2]
    assert ranked.targets.view(BATCH, 2).tolist() == best.indices.tolist()
    assert ranked.heatmaps.shape[0] == ranked.layer_maps.shape[0] == 2 * BATCH
    for rank in range(2):
        single = explain(model, inputs, method, target=best.indices[:, rank])
        torch.testing.assert_close(ranked.heatmaps[rank::2], single.heatmaps, atol=1e-5, rtol=0)
        torch.testing.assert_close(ranked.layer_maps[rank::2], single.layer_maps, atol=1e-5, rtol=0)


def test_the_model_is_handed_back_exactly_as_it_came(method, case, inputs, untouched):
    model = case.build().train()
    next(model.children()).eval()  # a mixed-mode model must stay mixed
    parameters = list(model.parameters())
    parameters[-1].requires_grad_(False)
    parameters[0].grad = torch.ones_like(parameters[0])
    with untouched(model):
        expected = explain(model, inputs, method)
    with untouched(model), torch.no_grad():
        again = explain(model, inputs, method)
    torch.testing.assert_close(again.heatmaps, expected.heatmaps)
