"""camviz.inspect and find_first_nonfinite: hand-computed rows, call order, exports, the CLI."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from torch import nn

import camviz.cli
from camviz.core.errors import CamvizError
from camviz.core.hooks import capture
from camviz.debug.layerstats import find_first_nonfinite, inspect, tensor_stats


def hand_model() -> nn.Sequential:
    """conv (2x2 kernel [[1, 1], [0, 0]], bias -3) -> ReLU -> flatten -> linear [1, -1, 1, -1]."""
    conv = nn.Conv2d(1, 1, kernel_size=2)
    linear = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([[[[1.0, 1.0], [0.0, 0.0]]]]))
        conv.bias.fill_(-3.0)
        linear.weight.copy_(torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), linear).eval()


HAND_INPUT = torch.arange(1.0, 10.0).view(1, 1, 3, 3)  # [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_rows_equal_hand_computed_statistics(untouched):
    # conv: x[i, j] + x[i, j + 1] - 3 = [[1+2-3, 2+3-3], [4+5-3, 5+6-3]] = [[0, 2], [6, 8]]
    # mean 4, unbiased std sqrt((16 + 4 + 4 + 16) / 3), min 0, max 8, one zero in four.
    # linear: 0 - 2 + 6 - 8 = -4.
    model = hand_model()
    with untouched(model):
        table = inspect(model, HAND_INPUT)
    assert [row.name for row in table] == ["0", "1", "2", "3"]
    assert [row.type for row in table] == ["Conv2d", "ReLU", "Flatten", "Linear"]
    conv = table["0"]
    assert conv.shape == (1, 1, 2, 2)
    assert (conv.mean, conv.min, conv.max, conv.zeros) == (4.0, 0.0, 8.0, 0.25)
    assert conv.std == pytest.approx(math.sqrt(40 / 3), rel=1e-6)
    assert (conv.nans, conv.infs, conv.grad_norm) == (0, 0, None)
    assert table["2"].shape == (1, 4)
    assert (table["3"].mean, table["3"].min, table["3"].max) == (-4.0, -4.0, -4.0)
    assert math.isnan(table["3"].std)  # one value: no spread, as torch.std says


def test_gradient_norms_equal_hand_computed_values(untouched):
    # score = the linear output (the only class): d/d(linear) = 1; d/d(flatten) and
    # d/d(ReLU) = [1, -1, 1, -1], norm 2; d/d(conv) = [1, -1, 1, -1] * relu'([0, 2, 6, 8])
    # = [0, -1, 1, -1] (torch's ReLU has slope 0 at 0), norm sqrt(3).
    model = hand_model()
    with untouched(model):
        table = inspect(model, HAND_INPUT, backward=True)
    norms = [row.grad_norm for row in table]
    assert norms == pytest.approx([math.sqrt(3), 2.0, 2.0, 1.0], rel=1e-6)
    assert "grad norm" in str(table)


def test_backward_works_under_no_grad_on_a_training_model_and_restores_it(untouched):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 2), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))
    model.train().requires_grad_(False)
    x = torch.randn(1, 1, 3, 3)
    with untouched(model), torch.no_grad():
        table = inspect(model, x, backward=True, target=1)
    # The last layer's output gradient for target 1 is the one-hot (0, 1); before it, W[1].
    assert table["3"].grad_norm == 1.0
    assert table["2"].grad_norm == pytest.approx(float(model[3].weight[1].norm()))
    with torch.no_grad():
        expected = model.eval()(x)
    model.train()
    assert table["3"].mean == pytest.approx(float(expected.mean()))  # eval-mode BatchNorm


def test_nan_and_inf_are_counted_and_left_out_of_the_statistics():
    values = torch.tensor([-1.0, 0.0, 1.0, math.e]).log()  # [nan, -inf, 0, 1]
    mean, std, low, high, zeros, nans, infs = tensor_stats(values).tolist()
    assert (nans, infs, zeros) == (1, 1, 0.25)
    assert (mean, low, high) == pytest.approx((0.5, 0.0, 1.0))
    assert std == pytest.approx(math.sqrt(0.5))


def test_statistics_match_torch_on_a_real_network(resnet18, small_batch, untouched):
    with untouched(resnet18):
        table = inspect(resnet18, small_batch, layers=["layer2.0.bn1", "layer3"], backward=True)
    with capture(resnet18, ["layer2.0.bn1", "layer3"], gradients=True, inputs=False) as record:
        logits = resnet18(small_batch)
        logits.gather(1, logits.argmax(1, keepdim=True)).sum().backward()
    resnet18.zero_grad(set_to_none=True)
    for name in ("layer2.0.bn1", "layer3"):
        row, output = table[name], record.activations[name]
        expected = [
            float(stat) for stat in (output.mean(), output.std(), output.min(), output.max())
        ]
        assert [row.mean, row.std, row.min, row.max] == pytest.approx(expected, rel=1e-5)
        assert row.zeros == pytest.approx(float((output == 0).float().mean()))
        # bn1 is followed by an in-place ReLU: its row must hold the values before it.
        assert row.grad_norm == pytest.approx(float(record.gradients[name].norm()), rel=1e-5)
    assert table["layer2.0.bn1"].zeros == 0.0


def test_rows_follow_call_order_and_name_repeated_calls():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.block(self.act(x)))

    table = inspect(Shared(), torch.tensor([[-1.0, 2.0]]))
    assert [row.name for row in table] == ["act", "block.0", "block.1", "block", "act#2"]
    assert table["act"].zeros == 0.5  # relu([-1, 2]) = [0, 2]


def test_exports_round_trip(tmp_path):
    table = inspect(hand_model(), HAND_INPUT, backward=True)
    with open(table.to_csv(tmp_path / "t.csv"), newline="") as file:
        lines = list(csv.DictReader(file))
    assert [line["name"] for line in lines] == ["0", "1", "2", "3"]
    assert lines[0]["shape"] == "1x1x2x2"
    assert float(lines[0]["std"]) == table["0"].std
    assert float(lines[1]["grad_norm"]) == table["1"].grad_norm
    rows = json.loads((table.to_json(tmp_path / "t.json")).read_text())
    assert rows[0]["shape"] == [1, 1, 2, 2] and rows[0]["zeros"] == 0.25
    assert rows[3]["std"] is None  # NaN is not JSON
    html = table._repr_html_()
    assert html.count("<tr") == 5 and "grad_norm" in html
    text = str(table).splitlines()
    assert len(text) == 6 and text[0].split()[:3] == ["name", "type", "shape"]


def test_tables_highlight_non_finite_rows(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    with torch.no_grad():
        model[0].weight.fill_(math.inf)
    table = inspect(model, torch.ones(1, 2))
    assert table[0].infs == 2 and not table[0].finite
    assert "background" in table._repr_html_()


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.log()


def negating_linear() -> nn.Linear:
    linear = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        linear.weight.copy_(-torch.eye(3))
    return linear


def test_finder_names_the_layer_that_made_the_nan(untouched):
    # Positive inputs, negated by "1", then log: "2" is the first layer to output NaN.
    model = nn.Sequential(nn.Identity(), negating_linear(), Log(), nn.Linear(3, 2)).eval()
    with untouched(model):
        report = find_first_nonfinite(model, torch.tensor([[1.0, 2.0, 3.0]]))
    assert report.layer.name == "2" and report.layer.type == "Log"
    assert report.layer.nans == 3
    assert report.input_was_finite and report.parameters_finite and not report.is_container
    assert (report.input.min, report.input.max) == (-3.0, -1.0)
    assert report.previous == "1"
    assert "its input was finite" in str(report) and "'2' (Log)" in str(report)


def test_finder_points_between_layers_when_the_input_was_already_bad():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.negate = negating_linear()
            self.head = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.negate(x).sqrt())  # sqrt of negatives, outside any module

    model = nn.Sequential(Block())
    report = find_first_nonfinite(model, torch.ones(1, 3))
    assert report.layer.name == "0.head"
    assert not report.input_was_finite and report.input.nans == 3
    assert "between '0.negate' and it" in str(report)
    bad_input = find_first_nonfinite(model, torch.tensor([[math.nan, 1.0, 1.0]]))
    assert bad_input.layer.name == "0.negate" and "the model's input" in str(bad_input)


def test_finder_blames_non_finite_weights_and_containers():
    broken = nn.Linear(2, 2)
    with torch.no_grad():
        broken.weight[0, 0] = math.nan
    report = find_first_nonfinite(nn.Sequential(nn.ReLU(), broken), torch.ones(1, 2))
    assert report.layer.name == "1" and not report.parameters_finite
    assert "own parameters hold NaN/Inf" in str(report)

    class Overflow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Linear(1, 1, bias=False)
            nn.init.constant_(self.scale.weight, 100.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.scale(x).exp()  # exp(100) overflows float32

    report = find_first_nonfinite(nn.Sequential(Overflow()), torch.ones(1, 1))
    assert report.layer.name == "0" and report.is_container and report.layer.infs == 1
    assert "its own forward code" in str(report)
    assert find_first_nonfinite(nn.Sequential(nn.Linear(2, 2)), torch.ones(1, 2)) is None


def test_unknown_layer_is_refused():
    with pytest.raises(CamvizError, match="no layer named 'conv'"):
        inspect(hand_model(), HAND_INPUT, layers="conv")


def test_inspect_cli_prints_the_table_and_writes_exports(tmp_path, capsys, tiny_checkpoint):
    csv_path, json_path = tmp_path / "layers.csv", tmp_path / "layers.json"
    arguments = ["inspect", "--model", "resnet18", "--weights", tiny_checkpoint, "--backward"]
    arguments += ["--layer", "layer4*", "--csv", str(csv_path), "--json", str(json_path)]
    assert camviz.cli.main(arguments) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[-2:] == ["grad", "norm"]
    assert printed[2].split()[:3] == ["layer4.0.conv1", "Conv2d", "1x512x7x7"]
    rows = json.loads(json_path.read_text())
    assert [row["name"] for row in rows][-1] == "layer4"
    with open(csv_path, newline="") as file:
        assert [line["name"] for line in csv.DictReader(file)] == [row["name"] for row in rows]
    # No image: a seeded random one, so two runs print the same numbers.
    assert camviz.cli.main(arguments) == 0
    assert capsys.readouterr().out.splitlines() == printed
