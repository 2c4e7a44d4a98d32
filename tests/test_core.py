"""One check of the caller's batch, and one class-name rule, shared by every entry point."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import conv_net
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.targets import class_name

ENTRY_POINTS: dict[str, Callable[[nn.Module, torch.Tensor], object]] = {
    "explain": lambda model, x: camviz.explain(model, x, layer="0"),
    "deletion": lambda model, x: camviz.metrics.deletion(model, x, torch.rand(len(x), 8, 8)),
    "sanity": lambda model, x: camviz.sanity.cascading_randomization(model, x, layer="0"),
    "factorize": lambda model, x: camviz.factorize(model, x, layer="0", k=2),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_a_non_float_batch_in_the_same_words(entry: str) -> None:
    with pytest.raises(CamvizError) as error:
        ENTRY_POINTS[entry](conv_net(4), torch.zeros(2, 3, 8, 8, dtype=torch.uint8))
    assert str(error.value) == (
        "inputs must be a float (N, C, L), (N, C, H, W) or (N, C, D, H, W) batch or one "
        "(C, H, W) image, got torch.uint8 of shape (2, 3, 8, 8)"
    )


@pytest.mark.parametrize("entry", ["deletion", "sanity", "factorize"])
def test_functions_of_images_refuse_signals_in_one_line(entry: str) -> None:
    signal_model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.AdaptiveAvgPool1d(1), nn.Flatten())
    with pytest.raises(CamvizError, match=r"this takes image batches \(N, C, H, W\), got "):
        ENTRY_POINTS[entry](signal_model.eval(), torch.randn(2, 3, 8))


def test_class_names_come_from_the_categories_and_minus_one_is_a_custom_target() -> None:
    categories = ["cat", "cup"]
    assert [class_name(categories, i) for i in (-1, 0, 1, 2)] == [
        "custom target",
        "cat",
        "cup",
        "class 2",
    ]
    assert class_name(None, 4) == "class 4"
