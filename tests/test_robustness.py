"""What goes wrong around a method rather than inside it: a model whose flags cannot be set,
wrong-type arguments, NaN and Inf, maps that are all zero, empty batches, inference mode,
torch.compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.modelstate import eval_mode


def small_cnn() -> nn.Module:
    """conv -> ReLU -> conv -> ReLU -> mean -> linear: 3 classes from (N, 3, 8, 8) inputs."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


class RefusesEval(nn.Linear):
    """A module whose ``train(False)`` fails, after its parent has set its own flag."""

    def train(self, mode: bool = True) -> nn.Module:
        if not mode:
            raise RuntimeError("cannot leave training mode")
        return super().train(mode)


def test_eval_mode_hands_the_flags_back_when_eval_itself_fails():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(), RefusesEval(2, 2)).train()
    model[1].eval()  # a mixed model: the dropout is frozen
    with pytest.raises(RuntimeError, match="cannot leave training mode"), eval_mode(model):
        pass
    assert [module.training for module in model.modules()] == [True, True, False, True]


@pytest.mark.parametrize("method", [3, None, nn.ReLU()])
def test_a_method_of_the_wrong_type_is_one_line(method):
    with pytest.raises(CamvizError, match="method must be a method name") as error:
        camviz.explain(small_cnn(), torch.rand(1, 3, 8, 8), method)
    assert "\n" not in str(error.value)
