"""All-zero maps are reported, never silently drawn as nothing.

After the ReLU of the CAM formulas, a score with only negative evidence at the layer gives a
map of zeros. ``camviz.explain`` warns in one line (``camviz.ZeroMapWarning``); the folder job marks
the row's entry ``"empty": true``, counts them in ``manifest.json`` and the CLI says so once.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import conv_net, tiny_vit
from torch import nn

import camviz
from camviz.cli.explain import _report
from camviz.io.models import LoadedModel
from camviz.pipeline.job import Outputs


def evidence_model() -> nn.Module:
    """Non-negative features; class 0 is their negated mean, class 1 their mean: class 0
    has only negative evidence, so its Grad-CAM map is all zero."""
    model = conv_net(2, classes=2, kernel=1, seed=None)  # every weight is set here
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(1.0)
        model[4].weight.copy_(torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))
        model[4].bias.zero_()
    return model


def test_explain_warns_in_one_line_of_all_zero_maps_only() -> None:
    model = evidence_model()
    images = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.warns(camviz.ZeroMapWarning) as caught:
        empty = camviz.explain(model, images, layer="1", target=0)
    assert not empty.heatmaps.any()
    (message,) = [str(record.message) for record in caught]
    assert "2 of 2 maps are all zero" in message and "relu=False" in message
    assert "\n" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", camviz.ZeroMapWarning)
        found = camviz.explain(model, images, layer="1", target=1)
        signed = camviz.explain(model, images, layer="1", target=0, relu=False)
    assert (found.heatmaps > 0).any()
    assert (signed.heatmaps < 0).any()  # the negative evidence the ReLU dropped


def test_the_folder_job_marks_empty_maps_in_the_rows_and_counts_them(
    tmp_path, make_photos, manifest_rows, capsys
) -> None:
    (photo,) = make_photos(tmp_path, {"a.png": (16, 16)})
    loaded = LoadedModel(evidence_model(), camviz.Preprocess(size=16), ["neg", "pos"], "tiny")
    for target, empty in ((0, True), (1, False)):
        out = tmp_path / f"class{target}"
        with warnings.catch_warnings():
            warnings.simplefilter("error", camviz.ZeroMapWarning)  # rows say it, not a warning
            camviz.explain_files(
                [photo], out, loaded, layer="1", target=target, outputs=Outputs(panel=False)
            )
        (row,) = manifest_rows(out)
        assert row["explained"][0].get("empty", False) is empty
        summary = json.loads((out / "manifest.json").read_text())
        assert summary["counts"]["empty_maps"] == int(empty)
        _report(summary, str(out))
        stderr = capsys.readouterr().err
        assert ("1 map(s) are all zero" in stderr) is empty


def _blind(model: nn.Module, head: nn.Linear) -> nn.Module:
    """The model with its head's weights zeroed: its scores depend on no layer at all."""
    with torch.no_grad():
        head.weight.zero_()
    return model


@pytest.mark.parametrize("family", ["cnn", "vit"])
def test_a_score_no_layer_reaches_speaks_of_class_tokens_only_for_token_models(family) -> None:
    if family == "cnn":
        model = conv_net(4, classes=3)
        model = _blind(model, model[-1])
    else:
        model = tiny_vit()
        model = _blind(model, model.heads.head)
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(camviz.CamvizError) as error:
        camviz.explain(model, images, target=1)
    message = str(error.value)
    assert "does not depend on any layer with a grid" in message and "\n" not in message
    assert ("class token" in message) == (family == "vit")
