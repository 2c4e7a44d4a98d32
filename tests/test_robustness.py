"""What goes wrong around a method rather than inside it: a model whose flags cannot be set,
wrong-type arguments, NaN and Inf, maps that are all zero, empty batches, inference mode,
torch.compile."""

from __future__ import annotations

import pytest
import torch
from conftest import conv_net, tiny_vit
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.modelstate import eval_mode


def small_cnn() -> nn.Module:
    """conv -> ReLU -> conv -> ReLU -> mean -> linear: 3 classes from (N, 3, 8, 8) inputs."""
    return conv_net(4, 4, padding=1)


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


# --- NaN and Inf, and maps that are all zero ------------------------------------------------


class Log(nn.Module):
    """``log(x)``: NaN wherever ``x < 0``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def cnn_with_a_log() -> nn.Module:
    model = small_cnn()
    model[1] = Log()  # the first conv's output has negative values
    return model


@pytest.mark.parametrize("method", ["gradcam", "eigencam", "scorecam", "vanilla_gradients"])
def test_nan_in_the_model_names_the_first_layer_that_made_it(method):
    with pytest.raises(CamvizError, match="layer '1' is the first to output NaN or Inf") as error:
        camviz.explain(cnn_with_a_log(), torch.rand(2, 3, 8, 8), method, layer="2")
    assert "\n" not in str(error.value)


def test_nan_made_by_the_target_is_named_as_such():
    def log_score(out: torch.Tensor) -> torch.Tensor:
        return torch.log(out[:, 0] - 1e6)

    with pytest.raises(CamvizError, match="every layer's output is finite, so the target"):
        camviz.explain(small_cnn(), torch.rand(2, 3, 8, 8), layer="2", target=log_score)


class UnusedBranch(nn.Module):
    """A classifier that also computes a spatial map it never uses (last in call order), as
    the default layer would be; ``weight`` 0 keeps the branch in the graph with no effect."""

    def __init__(self, weight: float | None) -> None:
        super().__init__()
        self.body = small_cnn()
        self.branch = nn.Conv2d(3, 2, 3, padding=1)
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        branch = self.branch(x)
        return logits if self.weight is None else logits + self.weight * branch.mean()


# Ablation-CAM's batch of copies meets the unused branch's one row: it warns and re-runs.
@pytest.mark.filterwarnings("ignore:ablationcam. the layers after")
@pytest.mark.parametrize(("method", "weight"), [("gradcam", 0.0), ("ablationcam", None)])
def test_the_default_layer_is_one_the_score_depends_on_not_an_unused_branch(method, weight):
    model = UnusedBranch(weight)
    inputs = torch.rand(2, 3, 8, 8)
    chosen = camviz.explain(model, inputs, method)  # the dry run differentiates the score
    assert chosen.layers != ["branch"] and chosen.layers[0].startswith("body")
    signed = camviz.explain(model, inputs, method, relu=False)  # the score moves with it
    assert signed.layers == chosen.layers and signed.heatmaps.abs().amax() > 0
    named = camviz.explain(model, inputs, method, layer="branch")  # asked for: zeros, no error
    assert not named.heatmaps.any()


# --- Empty batches, inference mode, torch.compile -------------------------------------------


def model_for(method: str) -> tuple[nn.Module, int]:
    """A model ``method`` explains, and its input size: a CNN with five classes (so that
    Finer-CAM finds three nearest classes for each of the top 2), or, for LeGrad, which
    explains vision transformers only, a tiny ViT."""
    cnn = conv_net(4, 4, classes=5, padding=1)
    model, size = (cnn, 8) if method in camviz.cams.names(cnn) else (tiny_vit(), 32)
    assert method in camviz.cams.names(model)
    return model, size


@pytest.mark.parametrize("method", camviz.cams.names())
def test_every_method_explains_an_empty_batch_at_a_named_layer_as_an_empty_result(method):
    model, size = model_for(method)
    full = camviz.explain(model, torch.rand(1, 3, size, size), method, target="top2")
    assert full.heatmaps.shape == (2, size, size)  # the method works on this model
    empty = torch.rand(0, 3, size, size)
    result = camviz.explain(model, empty, method, layer=full.layers, target="top2")
    assert result.heatmaps.shape == (0, size, size)
    assert result.targets.shape == result.scores.shape == result.samples.shape == (0,)
    assert result.layers == full.layers


@pytest.mark.parametrize("method", camviz.cams.names())
def test_an_empty_batch_without_a_layer_is_refused_in_one_line_by_every_method(method):
    """The default layer is found by running a sample; refused before that run, and also
    once the layer is remembered, so that the answer does not depend on earlier calls."""
    model, size = model_for(method)
    empty = torch.rand(0, 3, size, size)
    expected = r"^the batch is empty, .* pass layer=NAME to explain an empty batch$"
    with pytest.raises(CamvizError, match=expected):
        camviz.explain(model, empty, method, target="top2")
    camviz.explain(model, torch.rand(1, 3, size, size), method, target="top2")
    with pytest.raises(CamvizError, match=expected):
        camviz.explain(model, empty, method, target="top2")


def test_a_target_refused_on_a_full_batch_is_refused_on_an_empty_one_in_the_same_words():
    # Three classes leave two others, fewer than Finer-CAM's three nearest.
    expected = r"^Nearest\(k\) needs 1 <= k <= 2 \(the other classes\), got 3$"
    for images in (torch.rand(1, 3, 8, 8), torch.rand(0, 3, 8, 8)):
        with pytest.raises(CamvizError, match=expected):
            camviz.explain(small_cnn(), images, "finercam", layer="3", target="top2")


@pytest.mark.parametrize(
    "method", ["vanilla_gradients", "guided_backprop", "guided_gradcam", "fullgrad"]
)
def test_input_gradient_methods_work_under_inference_mode(method):
    model, inputs = small_cnn(), torch.rand(2, 3, 8, 8)
    expected = camviz.explain(model, inputs, method, layer="2", target=[0, 2]).heatmaps
    with torch.inference_mode():
        made_here = inputs.clone()  # an inference tensor
        result = camviz.explain(model, made_here, method, layer="2", target=[0, 2])
    torch.testing.assert_close(result.heatmaps, expected)


def test_a_compiled_model_that_already_ran_is_explained_through_its_module():
    model, inputs = small_cnn(), torch.rand(2, 3, 8, 8)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(inputs)  # compiled code without camviz's hooks
    expected = camviz.explain(model, inputs, layer="2", target=[0, 2])
    result = camviz.explain(compiled, inputs, layer="2", target=[0, 2])
    torch.testing.assert_close(result.heatmaps, expected.heatmaps)
