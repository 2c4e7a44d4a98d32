"""camviz.GradientMonitor: norms per step against autograd's own, bounds, flags, cleanup."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.errors import CamvizError
from camviz.debug.monitor import GradientMonitor, GradientWarning


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(5, 4, generator=generator), torch.randint(0, 3, (5,), generator=generator))
        for _ in range(count)
    ]


def test_parameter_norms_equal_p_grad_norm_after_each_step():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    with GradientMonitor(model) as monitor:
        for x, y in batches(6):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            expected.append([p.grad.norm() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()  # before step(): the monitor already has the norms
            monitor.step()
    history = monitor.history
    assert history.steps.tolist() == list(range(6))
    assert list(history.params) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    recorded = torch.stack(list(history.params.values()), dim=1)
    assert torch.equal(recorded, torch.tensor(expected))
    assert history.layers == {} and history.tensors == {}


def test_layer_norms_equal_the_analytic_gradient_of_cross_entropy():
    # d(mean cross-entropy)/d(logits) = (softmax(logits) - onehot(y)) / N.
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected = []
    with GradientMonitor(model, layers="2", params=False, optimizer=optimizer) as monitor:
        for x, y in batches(4):
            optimizer.zero_grad()
            logits = model(x)
            F.cross_entropy(logits, y).backward()
            analytic = (logits.detach().softmax(-1) - F.one_hot(y, 3)) / len(y)
            expected.append(analytic.norm())
            optimizer.step()  # ends the monitor's step: no monitor.step() needed
    torch.testing.assert_close(monitor.history.layers["2"], torch.stack(expected))
    assert monitor.steps_recorded == 4


def test_accumulated_steps_combine_norms():
    model = mlp()
    (x1, y1), (x2, y2) = batches(2)
    with GradientMonitor(model, layers=["0", "2"]) as monitor:
        logits1 = model(x1)
        F.cross_entropy(logits1, y1).backward()
        logits2 = model(x2)
        F.cross_entropy(logits2, y2).backward()
        accumulated = model[2].weight.grad.norm()
        monitor.step()
    first = (logits1.detach().softmax(-1) - F.one_hot(y1, 3)) / 5
    second = (logits2.detach().softmax(-1) - F.one_hot(y2, 3)) / 5
    # Two outputs, one step: the norm of both gradients together.
    expected = torch.cat([first, second]).norm()
    torch.testing.assert_close(monitor.history.layers["2"], expected[None])
    assert monitor.history.params["2.weight"].item() == accumulated.item()


def test_history_is_a_ring_buffer_of_the_last_steps():
    model = mlp()
    norms = []
    with GradientMonitor(model, history=3) as monitor:
        for x, y in batches(7):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            norms.append(model[0].bias.grad.norm())
            monitor.step()
    assert monitor.steps_recorded == 7
    assert monitor.history.steps.tolist() == [4, 5, 6]
    assert torch.equal(monitor.history.params["0.bias"], torch.stack(norms[4:]))
    assert monitor._norms.shape[0] == 3  # memory is that of 3 steps, not 7


def test_thresholds_flag_and_warn_once():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.fill_(-1.0)  # positive inputs -> negative -> ReLU is dead
        model[0].bias.zero_()
    x = torch.ones(3, 2)
    monitor = GradientMonitor(model, layers=["1", "2"], exploding=100.0)
    with pytest.warns(GradientWarning) as caught, monitor:
        for scale in (1e4, 1e4):
            model.zero_grad()
            (scale * model(x).sum()).backward()
            monitor.step()
        model.zero_grad()
        (model(x).sum() * math.nan).backward()
        monitor.step()
    kinds = {(flag.step, flag.kind, flag.source, flag.name) for flag in monitor.flags}
    # d/d(ReLU output) = 1e4 * w2 per sample: large; d/d(linear "2") = 1e4 per sample.
    assert (0, "exploding", "layer", "2") in kinds and (1, "exploding", "layer", "2") in kinds
    # The dead ReLU passes nothing to the first layer's weight: a zero gradient.
    assert (0, "vanishing", "param", "0.weight") in kinds
    assert (2, "nonfinite", "layer", "2") in kinds
    messages = [str(warning.message) for warning in caught]
    assert (
        sum("layer '2' is 1.732e+04" in m and "exploding (above 100)" in m for m in messages) == 1
    )
    assert sum("param '0.weight'" in m and "vanishing" in m for m in messages) == 1
    assert len(messages) == len({m.split(":")[0] + m.split(":")[1] for m in messages})
    model.zero_grad(set_to_none=True)


def test_watch_records_the_gradient_of_a_non_leaf_tensor():
    # a = x + y; c = a * z: dc/da = z.
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = torch.tensor([3.0, 4.0], requires_grad=True)
    z = torch.tensor([5.0, -6.0], requires_grad=True)
    with GradientMonitor(nn.Linear(1, 1), params=False) as monitor:
        a = monitor.watch(x + y, "a")
        c = a * z
        c.backward(torch.ones_like(c))
        monitor.step()
        hooks_during_the_step = len(monitor._watches)
        with pytest.raises(CamvizError, match="not a tensor that requires grad"):
            monitor.watch(torch.ones(2), "b")
    assert torch.equal(monitor.last_gradients["a"], z.detach())
    assert monitor.history.tensors["a"].tolist() == [pytest.approx(math.hypot(5.0, 6.0))]
    assert hooks_during_the_step == 0  # a watch ends with its step
    assert not a._backward_hooks


def test_everything_comes_off_on_exit(untouched):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1)[0]
    with untouched(model):
        with GradientMonitor(model, layers="*", optimizer=optimizer) as monitor:
            logits = model(x)  # its graph outlives the block
        assert len(optimizer._optimizer_step_post_hooks) == 0
        F.cross_entropy(logits, y).backward()  # hooks on that graph no longer record
        model.zero_grad(set_to_none=True)
    assert monitor.steps_recorded == 0
    with pytest.raises(CamvizError, match="inside the monitor's with-block"):
        monitor.step()


def test_hooks_come_off_when_training_raises(untouched):
    model = mlp()
    with untouched(model), pytest.raises(ZeroDivisionError), GradientMonitor(model, layers="*"):
        model(torch.ones(1, 4))
        _ = 1 / 0


def test_plot_draws_one_line_per_layer_on_a_log_scale():
    model = mlp()
    with GradientMonitor(model, layers=["0", "2"]) as monitor:
        for x, y in batches(3):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            monitor.step()
    model.zero_grad(set_to_none=True)
    figure = monitor.plot()
    layers_axes, params_axes = figure.axes[:2]
    assert layers_axes.get_yscale() == "log" and params_axes.get_yscale() == "log"
    lines = {line.get_label(): line for line in layers_axes.get_lines()}
    assert set(lines) >= {"0", "2"}
    assert lines["2"].get_ydata().tolist() == monitor.history.layers["2"].tolist()
    assert lines["2"].get_xdata().tolist() == [0, 1, 2]
    assert len(params_axes.get_lines()) >= 4


def test_bad_arguments_are_refused():
    with pytest.raises(CamvizError, match="history must be at least 1"):
        GradientMonitor(mlp(), history=0)
    with pytest.raises(CamvizError, match="vanishing < exploding"):
        GradientMonitor(mlp(), vanishing=1.0, exploding=0.5)
    with pytest.raises(CamvizError, match="no layer named 'layer1'"):
        GradientMonitor(mlp(), layers="layer1")


def test_no_warning_when_norms_are_normal():
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradientWarning)
        with GradientMonitor(model, layers="*") as monitor:
            x, y = batches(1)[0]
            F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    assert monitor.steps_recorded == 1  # the step still open at exit is recorded
    assert monitor.flags == []
