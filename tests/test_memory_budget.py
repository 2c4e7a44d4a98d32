"""The perturbation methods' memory budget: chunks sized from what one copy costs the rest of
the network (measured), maps that do not depend on the chunking, and the budget's plumbing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import camviz
from camviz.cams import LayerData, create
from camviz.cams.perturbation import BUDGET_FILL, budget_option
from camviz.cli import main
from camviz.core.errors import CamvizError
from camviz.core.memory import (
    CPU_BUDGET,
    LiveTensorBytes,
    default_budget,
    parse_bytes,
    peak_bytes,
)
from camviz.io.models import LoadedModel

# The decoder's upsampled maps: 8 channels of 64 x 64 float64 values, 256 KiB a copy.
UPSAMPLED_BYTES = 8 * 64 * 64 * 8


class Decoder(nn.Module):
    """A 16 x 16 input, a small target layer ``body`` (8 x 16 x 16), then layers that need
    far more per copy: a 4x upsampling and a convolution at 64 x 64 (float64).

    With ``concat`` the head also takes the ``stem`` output from before the target, which a
    batch of ablated copies of one sample cannot broadcast against (Ablation-CAM's
    whole-network fallback).
    """

    def __init__(self, concat: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.concat = concat
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.body = nn.Conv2d(8, 8, 1)
        self.decoder = nn.Sequential(
            nn.Upsample(scale_factor=4), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(16 if concat else 8, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.stem(x)
        pooled = self.decoder(self.body(stem)).mean(dim=(2, 3))
        if self.concat:
            pooled = torch.cat([pooled, stem.mean(dim=(2, 3))], dim=1)
        return self.head(pooled)


class Encoder(nn.Module):
    """The converse of :class:`Decoder`: a 4x upsampling and a convolution at 64 x 64
    before the target layer ``body``, then only the head (float64)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Upsample(scale_factor=4), nn.Conv2d(3, 8, 3, padding=1), nn.AvgPool2d(4)
        )
        self.body = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 3)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean(dim=(2, 3)))


class PassRows:
    """The rows of every forward pass of ``module`` (a pre-hook)."""

    def __init__(self, module: nn.Module) -> None:
        self.rows: list[int] = []
        self.handle = module.register_forward_pre_hook(
            lambda module, args: self.rows.append(args[0].shape[0])
        )


@pytest.fixture
def pass_peaks(monkeypatch) -> list[int]:
    """The peak memory of every perturbed pass (each :meth:`LayerData.run` that returns)."""
    peaks: list[int] = []
    run = LayerData.run

    def measured_run(self, inputs, rows=None):
        with LiveTensorBytes() as live:
            output = run(self, inputs, rows)
        peaks.append(live.peak)
        return output

    monkeypatch.setattr(LayerData, "run", measured_run)
    return peaks


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.rand(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def explained(model, inputs, method, **options):
    """The explanation, the method, and the rows of each pass of the head after the plain
    pass."""
    cam = create(method, **options)
    counted = PassRows(model.head)
    try:
        result = camviz.explain(model, inputs, cam, layer="body", target=0)
    finally:
        counted.handle.remove()
    return result, cam, counted.rows[1:]


@pytest.mark.filterwarnings("ignore:ablationcam. the layers after")
@pytest.mark.parametrize(
    ("method", "concat"),
    [("scorecam", False), ("ablationcam", False), ("ablationcam", True)],
    ids=["scorecam", "ablationcam", "ablationcam-fallback"],
)
def test_chunks_hold_as_many_copies_as_the_budget_allows_for_the_measured_cost(
    method, concat, inputs, pass_peaks
):
    model = Decoder(concat)
    copy = explained(model, inputs, method)[1].copy_bytes
    budget = int(3.5 * copy / BUDGET_FILL)  # chunks fill BUDGET_FILL of it: 3.5 copies
    pass_peaks.clear()
    rows = explained(model, inputs, method, memory_budget=budget)[2]
    # The first pass holds one copy (Ablation-CAM's shortcut also checks an unablated row),
    # every later one at most what the budget allows, and no pass peaks above its share.
    assert rows[0] == (2 if method == "ablationcam" and not concat else 1)
    assert max(rows) == 3
    assert max(pass_peaks) <= BUDGET_FILL * budget
    # Sized from the copies of the 8 x 16 x 16 layer output alone, one pass would hold them all.
    assert budget // (8 * 16 * 16 * 8) > sum(rows)


@pytest.mark.parametrize(
    ("method", "concat"),
    [("scorecam", False), ("sscam", False), ("ablationcam", False), ("ablationcam", True)],
    ids=["scorecam", "sscam", "ablationcam", "ablationcam-fallback"],
)
def test_maps_do_not_depend_on_the_budget(method, concat, inputs):
    model = Decoder(concat)
    options = {"num_samples": 2, "seed": 3} if method == "sscam" else {}
    maps = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's and the tiny budget's warnings
        for budget in (None, 2**22, 1):
            maps.append(explained(model, inputs, method, memory_budget=budget, **options)[0])
        maps.append(explained(model, inputs, method, batch_size=5, **options)[0])
    for other in maps[1:]:
        torch.testing.assert_close(other.layer_maps, maps[0].layer_maps, rtol=0, atol=1e-6)
        torch.testing.assert_close(other.weights, maps[0].weights, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", ["scorecam", "iscam", "ablationcam"])
def test_a_budget_below_one_copy_runs_one_copy_per_pass_and_says_so(method, inputs):
    model = Decoder()
    options = {"num_samples": 2} if method == "iscam" else {}
    with pytest.warns(RuntimeWarning, match="less than one perturbed copy needs") as caught:
        rows = explained(model, inputs, method, memory_budget="1 KiB", **options)[2]
    (warning,) = [w for w in caught if "memory_budget" in str(w.message)]
    assert "\n" not in str(warning.message)
    # Ablation-CAM's first pass carries the unablated check row.
    assert set(rows[1:] if method == "ablationcam" else rows) == {1}


def test_batch_size_overrides_the_budget(inputs):
    model = Decoder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "budget below one copy" warning
        warnings.simplefilter("ignore", camviz.ZeroMapWarning)  # the random decoder's maps
        _, cam, rows = explained(model, inputs, "ablationcam", batch_size=4, memory_budget=1)
    assert rows == [5, 4, 4, 4]  # 2 samples x 8 channels; the first pass also checks
    assert cam.copy_bytes is None


@pytest.mark.parametrize("method", ["scorecam", "ablationcam"])
def test_a_copy_costs_what_the_later_layers_hold_at_once(method, inputs):
    """At the decoder's convolution, its input and its output are alive: 512 KiB a copy.
    The target layer's output (16 KiB) and the stem are small beside it."""
    cam = explained(Decoder(), inputs, method)[1]
    assert 2 * UPSAMPLED_BYTES <= cam.copy_bytes <= 1.2 * 2 * UPSAMPLED_BYTES


def test_what_does_not_grow_with_the_copies_is_shared_by_larger_chunks(inputs, pass_peaks):
    """Ablation-CAM after :class:`Encoder`'s big layers: the first pass's peak (the encoder
    on one sample) over its two rows bounds a copy at first; larger passes, measured while
    they grow, tighten the bound, and none peaks above its share of the budget."""
    model = Encoder()
    encoder = (3 + 8) * 64 * 64 * 8  # the upsampled input and the convolution's output
    budget = int(2 * encoder / BUDGET_FILL)
    _, cam, rows = explained(model, inputs, "ablationcam", memory_budget=budget)
    # The first bound (the encoder over 2 rows) allows 3 copies; that pass's bound, more.
    assert rows[:2] == [2, 3] and max(rows) > 3
    assert cam.copy_bytes < encoder / 2
    assert max(pass_peaks) <= BUDGET_FILL * budget


def test_live_tensor_bytes_count_frees_and_functional_code():
    """A chain of three 1 MiB tensors, each freed once the next exists, peaks at two, plus
    a ``torch.cat`` of two of them (functional code, no module)."""
    size = 2**20 // 4

    def chain() -> torch.Tensor:
        first = torch.ones(size)
        second = first * 2
        del first
        third = torch.cat([second, second])  # 2 MiB while ``second`` (1 MiB) lives
        del second
        return third.sum()

    _, peak = peak_bytes(torch.device("cpu"), chain)
    assert peak == 3 * 2**20
    existing = torch.ones(size)
    _, peak = peak_bytes(torch.device("cpu"), lambda: existing.view(-1, 2).add_(1))
    assert peak == 0  # views and in-place updates of tensors made before make nothing new


@pytest.mark.parametrize(
    ("text", "count"),
    [(512, 512), ("512MiB", 512 * 2**20), ("2 GB", 2 * 10**9), ("1.5kib", 1536), ("64", 64)],
)
def test_budgets_are_read_as_bytes_or_amounts_with_units(text, count):
    assert parse_bytes(text) == count
    assert create("scorecam", memory_budget=text).memory_budget == count


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "1 XB", "lots", "0.1"])
def test_bad_budgets_are_refused_in_one_line(bad):
    with pytest.raises(CamvizError, match="memory_budget must be a positive number of bytes"):
        create("ablationcam", memory_budget=bad)


def test_the_default_budget_and_who_takes_a_budget():
    assert default_budget(torch.device("cpu")) == CPU_BUDGET == 2**30
    assert budget_option(camviz.cams.get("sscam"), "1MiB") == {"memory_budget": 2**20}
    assert budget_option(camviz.cams.get("gradcam"), "1MiB") == {}
    assert budget_option(camviz.cams.get("gradcam"), None) == {}
    with pytest.raises(CamvizError, match="memory_budget"):
        budget_option(camviz.cams.get("gradcam"), "many")


@pytest.mark.parametrize("method", ["scorecam", "gradcam"])
def test_the_folder_job_hands_the_budget_to_the_methods_that_take_it(method, tmp_path, make_photos):
    (photo,) = make_photos(tmp_path, {"a.png": (16, 16)})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 14 * 14, 3))
    loaded = LoadedModel(model, camviz.Preprocess(size=16), ["a", "b", "c"], "tiny")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = camviz.explain_files(
            [photo], tmp_path / "out", loaded, method=method, layer="0", memory_budget="1B"
        )
    assert summary["counts"]["ok"] == 1
    too_small = [w for w in caught if "less than one perturbed copy" in str(w.message)]
    assert len(too_small) == (method == "scorecam")


def test_the_cli_refuses_a_bad_budget_before_any_work(capsys):
    with pytest.raises(SystemExit) as exit_code:
        main(["explain", "missing.png", "--memory-budget", "lots"])
    assert exit_code.value.code == 2
    assert "--memory-budget must be a positive number of bytes" in capsys.readouterr().err
