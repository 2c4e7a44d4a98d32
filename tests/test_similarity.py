"""Outputs that are not class scores: one number per sample, embeddings explained by their
cosine similarity with a reference (camviz.Similarity), and `camviz explain --similar-to`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import camviz
from camviz.cli import main
from camviz.core.errors import CamvizError


class Embedder(nn.Module):
    """A small CNN that ends in an L2-normalised embedding, as retrieval models do."""

    def __init__(self, normalise: bool = True) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3))
        self.project = nn.Linear(8, 6)
        self.normalise = normalise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.project(torch.relu(self.features(x)).mean(dim=(2, 3)))
        return F.normalize(embedding, dim=1) if self.normalise else embedding


@pytest.fixture
def embedder():
    torch.manual_seed(0)
    return Embedder().eval(), torch.randn(3, 3, 12, 12), torch.randn(2, 3, 12, 12)


@pytest.mark.parametrize("method", ["gradcam", "scorecam", "ablationcam"])
def test_similarity_to_a_vector_equals_the_cosine_by_hand(embedder, method):
    model, query, _ = embedder
    vector = torch.randn(6)
    by_hand = camviz.explain(
        model,
        query,
        method,
        layer="features.2",
        target=lambda out: (out @ vector) / vector.norm() / out.norm(dim=1),
        relu=False,
        normalize=False,
    )
    ours = camviz.explain(
        model,
        query,
        method,
        layer="features.2",
        target=camviz.Similarity(vector),
        relu=False,
        normalize=False,
    )
    torch.testing.assert_close(ours.layer_maps, by_hand.layer_maps, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(ours.scores, F.cosine_similarity(ours.output, vector[None], dim=1))


def test_similarity_to_reference_inputs_runs_them_through_the_model(embedder, untouched):
    model, query, references = embedder
    with torch.no_grad():
        reference = model(references[:1])[0]
    by_hand = camviz.explain(
        model,
        query,
        layer="features.2",
        target=lambda out: F.cosine_similarity(out, reference[None], dim=1),
    )
    with untouched(model):
        ours = camviz.explain(
            model, query, layer="features.2", target=camviz.Similarity(references[:1])
        )
    torch.testing.assert_close(ours.heatmaps, by_hand.heatmaps)
    # One reference per sample: sample n against reference n.
    pairs = camviz.explain(
        model, query[:2], layer="features.2", target=camviz.Similarity(references)
    )
    with torch.no_grad():
        expected = F.cosine_similarity(model(query[:2]), model(references), dim=1)
    torch.testing.assert_close(pairs.scores, expected)


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        (
            torch.randn(5),
            r"reference has shape \(1, 5\), but the model embeds each of the 3 inputs in 6 values",
        ),
        (torch.randn(2, 6), r"reference has shape \(2, 6\)"),
        (torch.randn(2, 3, 12, 12), r"reference has shape \(2, 6\)"),
    ],
)
def test_a_reference_of_the_wrong_size_gets_one_line(embedder, untouched, reference, message):
    model, query, _ = embedder
    with untouched(model), pytest.raises(CamvizError, match=message) as error:
        camviz.explain(model, query, layer="features.2", target=camviz.Similarity(reference))
    assert "\n" not in str(error.value)


def test_an_embedding_is_not_explained_as_a_class_without_a_word(embedder):
    model, query, _ = embedder
    with pytest.raises(CamvizError, match=r"looks like an embedding .*camviz\.Similarity"):
        camviz.explain(model, query, layer="features.2")


@pytest.mark.parametrize("shape", [(), (1,)])
def test_one_number_per_sample_is_explained_as_it_is(shape):
    torch.manual_seed(0)
    model = Embedder(normalise=False).eval()
    model.project = nn.Linear(8, 1)
    regressor = nn.Sequential(model, nn.Flatten(0) if shape == () else nn.Identity()).eval()
    inputs = torch.randn(2, 3, 12, 12)
    result = camviz.explain(regressor, inputs, layer="0.features.2", relu=False, normalize=False)
    by_hand = camviz.explain(
        regressor,
        inputs,
        layer="0.features.2",
        target=lambda out: out.reshape(-1),
        relu=False,
        normalize=False,
    )
    torch.testing.assert_close(result.layer_maps, by_hand.layer_maps)
    with torch.no_grad():
        torch.testing.assert_close(result.scores, regressor(inputs).reshape(-1))


def test_cli_similar_to_writes_the_similarity_map(tmp_path, cat_path, coffee_path, tiny_checkpoint):
    from camviz.io.images import load_image
    from camviz.io.models import load

    out = tmp_path / "out"
    arguments = ["explain", str(cat_path), "--model", "resnet18", "--weights", tiny_checkpoint]
    options = [
        "--input-size",
        "64",
        "--similar-to",
        str(coffee_path),
        "--heatmap",
        "npz",
        "--no-panel",
        "--no-channels-last",  # the memory format of the explain() call below
        "--out",
        str(out),
    ]
    assert main([*arguments, *options, "--quiet"]) == 0
    written = np.load(out / "chelsea_heatmap.npz")["heatmap"]
    loaded = load("resnet18", weights=tiny_checkpoint, input_size=64)
    query = loaded.preprocess(load_image(cat_path))
    reference = loaded.preprocess(load_image(coffee_path))
    expected = camviz.explain(
        loaded.model, query, layer=loaded.default_layer, target=camviz.Similarity(reference[None])
    ).heatmaps[0]
    np.testing.assert_allclose(written, expected.numpy(), atol=1e-5)
    assert written.max() == pytest.approx(1.0)
