"""``compile_rest=True``: Score-CAM's masked passes run through ``torch.compile``, with the
eager maps, one compilation for every chunk (the last, shorter one padded), and the model
handed back with no compiled forward and no dynamo cache on its own code.

Inductor builds C++ kernels: 20 s of CPU for the tiniest CNN, too slow for the suite. The
tests compile with the ``aot_eager`` backend instead, the same capture (dynamo's graph,
AOTAutograd) without code generation, so they check everything camviz does (one graph, the
padding and its rows dropped, the eager fallback, the model handed back); inductor's own
numbers are ``benchmarks/bench_compile.py``'s (scores within 4.3e-6 of eager).
"""

from __future__ import annotations

import pytest
import torch
from conftest import conv_net
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

import camviz
from camviz.cams.settings import ExplainSettings
from camviz.core import compiling
from camviz.core.errors import CamvizError

LAYER = "2"


@pytest.fixture(scope="module", autouse=True)
def without_code_generation():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiling, "BACKEND", "aot_eager")
        yield


@pytest.fixture(scope="module")
def compiled_run():
    """The tiny CNN, its input, the eager explanation and the compiled one, with the number
    of graphs dynamo compiled for it."""
    model = conv_net(4, 7, padding=1)
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    # 3 copies per pass: 14 masked images make chunks of 3, 3, 3, 3 and 2 (padded).
    options = {"batch_size": 3}
    eager = camviz.explain(model, images, "scorecam", LAYER, **options)
    graphs = counters["stats"]["unique_graphs"]
    compiled = camviz.explain(model, images, "scorecam", LAYER, compile_rest=True, **options)
    return model, eager, compiled, counters["stats"]["unique_graphs"] - graphs


def test_compiled_masked_passes_give_the_eager_maps_from_one_graph(compiled_run):
    _, eager, compiled, graphs = compiled_run
    assert graphs == 1  # the shorter last chunk was padded, not compiled again
    weights = eager.weights[LAYER]
    assert torch.allclose(compiled.weights[LAYER], weights, rtol=1e-4, atol=1e-6)
    assert (compiled.heatmaps - eager.heatmaps).abs().max() < 1e-5
    assert torch.equal(compiled.targets, eager.targets)


def test_the_model_comes_back_uncompiled(compiled_run):
    model, *_ = compiled_run
    assert "forward" not in vars(model)
    assert model._compiled_call_impl is None  # as nn.Module.compile() would have left it
    for module in model.modules():
        assert _debug_get_cache_entry_list(type(module).forward.__code__) == []
    images = torch.rand(2, 3, 16, 16)
    graphs = counters["stats"]["unique_graphs"]
    model(images)  # an ordinary call runs eagerly: nothing is compiled or looked up
    assert counters["stats"]["unique_graphs"] == graphs


class Branching(nn.Module):
    """A CNN whose forward branches on a tensor's value: no single graph."""

    def __init__(self) -> None:
        super().__init__()
        self.net = conv_net(4, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        scores = self.net(images)
        return scores if float(scores.sum()) > -1e9 else -scores


def test_a_forward_that_does_not_compile_runs_eagerly_after_one_warning():
    model = Branching().eval()
    images = torch.rand(1, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    eager = camviz.explain(model, images, "scorecam", "net.0", batch_size=2)
    with pytest.warns(RuntimeWarning, match="does not compile as one graph") as warned:
        compiled = camviz.explain(
            model, images, "scorecam", "net.0", batch_size=2, compile_rest=True
        )
    assert len([w for w in warned if "compile" in str(w.message)]) == 1
    assert torch.equal(compiled.heatmaps, eager.heatmaps)
    assert "forward" not in vars(model)


def test_job_settings_give_compile_rest_to_the_methods_that_take_it():
    model = conv_net(4)
    settings = ExplainSettings(method="scorecam", compile_rest=True)
    options = settings.method_options(model, ["scorecam", "gradcam", "sscam"])
    assert [name for name, given in options.items() if given.get("compile_rest")] == [
        "scorecam",
        "sscam",
    ]
    with pytest.raises(CamvizError, match=r"compile_rest .* scorecam, sscam and iscam"):
        ExplainSettings(method="gradcam", compile_rest=True).method_options(model)
