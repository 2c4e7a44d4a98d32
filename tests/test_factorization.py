"""Deep Feature Factorization: NMF recovers planted concepts (up to order and scale), agrees
with pytorch-grad-cam's DFF on the same activations, finds class scores only behind a
verified pooled linear head, and draws one colour per concept."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

import camviz
from camviz.cams.factorization import nmf
from camviz.core.errors import CamvizError
from camviz.io.render import concept_overlay

K = 3


def planted() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``A = sum_j strength_j (x) H_j`` on a 6 x 6 grid of 2 images and 8 channels.

    Each concept covers its own region of each image and owns two channels: with pure
    locations and pure channels the factorisation is unique up to order and scale.
    """
    generator = torch.Generator().manual_seed(0)
    support = torch.zeros(2, K, 6, 6)
    support[0, 0, :3], support[0, 1, 3:, :3], support[0, 2, 3:, 3:] = 1, 1, 1
    support[1, 0, :, :2], support[1, 1, :, 2:4], support[1, 2, :, 4:] = 1, 1, 1
    strength = support * (0.5 + torch.rand(2, K, 6, 6, generator=generator))
    concepts = torch.rand(K, 8, generator=generator)
    concepts[:, :6] *= torch.eye(K).repeat_interleave(2, dim=1)
    return torch.einsum("nkhw,kc->nchw", strength, concepts), strength, concepts


def pooled_classifier() -> nn.Module:
    """The planted activations are the input; global average pooling and a linear head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Identity(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)
    ).eval()


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def best_match(found: torch.Tensor, truth: torch.Tensor) -> list[float]:
    """Correlation of each true concept map with its found one, under the best permutation."""

    def matched(order):
        return [correlation(found[:, j], truth[:, i]) for i, j in enumerate(order)]

    return max((matched(order) for order in itertools.permutations(range(K))), key=sum)


def test_factorize_recovers_planted_concepts_and_scores_them_with_the_head(untouched):
    activations, strength, _ = planted()
    model = pooled_classifier()
    with untouched(model):
        concepts = camviz.factorize(model, activations, layer="0", k=K)
    assert min(best_match(concepts.maps, strength)) > 0.999
    assert concepts.error < 0.01
    assert concepts.maps.shape == (2, K, 6, 6) and concepts.heatmaps.shape == (2, K, 6, 6)
    assert float(concepts.maps.amax(dim=(0, 2, 3)).min()) == pytest.approx(1.0)
    # W H reconstructs the activations; each embedding is the activation of a pure location.
    rebuilt = torch.einsum("nkhw,kc->nchw", concepts.maps, concepts.embeddings)
    torch.testing.assert_close(rebuilt, activations, atol=0.05, rtol=0)
    # class scores: the model's logits for an input filled with each concept's embedding.
    filled = concepts.embeddings.view(K, 8, 1, 1).expand(K, 8, 6, 6)
    torch.testing.assert_close(concepts.class_scores, model(filled).detach())
    torch.testing.assert_close(concepts.top_classes(2), model(filled).topk(2).indices)


def test_factorize_agrees_with_pytorch_grad_cam_dff_on_the_same_activations():
    from pytorch_grad_cam.feature_factorization.deep_feature_factorization import dff

    activations, _, _ = planted()
    embeddings, theirs = dff(activations.numpy().copy(), n_components=K)  # sklearn's NMF
    ours = camviz.factorize(pooled_classifier(), activations, layer="0", k=K)
    assert min(best_match(ours.maps, torch.from_numpy(theirs))) > 0.98
    # Both reconstruct the activations. pytorch-grad-cam factorises V - min_c(V), also where
    # the minimum is positive (the two shared channels here), which adds a rank-one term that
    # three concepts cannot hold exactly; V ~ (concepts - min) H + min.
    low = activations.amin(dim=(0, 2, 3)).double()
    loadings = torch.from_numpy(theirs).double()
    directions = torch.from_numpy(embeddings).double() - low[:, None]
    rebuilt = torch.einsum("nkhw,ck->nchw", loadings, directions) + low.view(1, -1, 1, 1)
    residual = torch.linalg.norm(rebuilt.float() - activations)
    their_error = float(residual / torch.linalg.norm(activations - low.float().view(1, -1, 1, 1)))
    assert ours.error < 0.01 and their_error < 0.1


def test_nmf_never_increases_the_error_and_is_seeded():
    matrix = planted()[0].permute(0, 2, 3, 1).reshape(-1, 8)
    errors = [torch.linalg.norm(matrix - w @ h) for w, h in (nmf(matrix, K, n) for n in (1, 5, 50))]
    assert errors[0] >= errors[1] >= errors[2]
    first, again = nmf(matrix, K, 20, seed=3), nmf(matrix, K, 20, seed=3)
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], nmf(matrix, K, 20)[0])


def test_no_class_scores_without_a_pooled_linear_head():
    activations, _, _ = planted()
    flat_head = nn.Sequential(nn.Identity(), nn.Flatten(), nn.Linear(8 * 36, 5)).eval()
    concepts = camviz.factorize(flat_head, activations, layer="0", k=K)
    assert concepts.class_scores is None
    with pytest.raises(CamvizError, match="not a linear layer after global average pooling"):
        concepts.top_classes()
    with pytest.raises(CamvizError, match=r"factorize needs 1 <= k <= 8"):
        camviz.factorize(flat_head, activations, layer="0", k=9)


def test_concept_overlay_paints_each_pixel_in_its_strongest_concepts_colour():
    maps = torch.zeros(2, 2, 2)
    maps[0, :, 0] = 1.0  # concept 0 on the left column
    maps[1, :, 1] = 0.5  # concept 1 on the right column, at its own maximum
    image = Image.new("RGB", (2, 2), (0, 0, 0))
    painted = np.asarray(concept_overlay(image, maps, alpha=1.0, colormap="tab10"))
    tab10 = np.array([[31, 119, 180], [255, 127, 14]])  # tab10's first two colours
    assert np.abs(painted[:, 0].astype(int) - tab10[0]).max() <= 1
    assert np.abs(painted[:, 1].astype(int) - tab10[1]).max() <= 1
