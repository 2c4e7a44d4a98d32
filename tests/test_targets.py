"""Targets: class ids, regions of segmentation outputs, contrasts, callables, and the adapter
that finds the scores inside tuple, dict and ``.logits`` outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.targets import Contrast, Region, TopK, as_logits, class_ids, score_fns

LOGITS = torch.tensor([[0.5, 3.0, -1.0, 2.0], [4.0, 0.0, 1.0, -2.0]])


class LinearHead(nn.Module):
    """1x1 conv features -> mean over the grid -> linear; ``wrap`` shapes the output."""

    def __init__(self, wrap=lambda logits: logits) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.features = nn.Conv2d(3, 4, 1)
        self.head = nn.Linear(4, 5)
        self.wrap = wrap

    def forward(self, x: torch.Tensor):
        return self.wrap(self.head(self.features(x).mean(dim=(2, 3))))


class Segmenter(nn.Module):
    """A 1x1 conv ``features`` then a 1x1 conv to 3 class logits per pixel, in a dict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.features = nn.Conv2d(3, 4, 1)
        self.classifier = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.classifier(torch.relu(self.features(x))), "aux": x.mean(1)}


def gradcam_of(model: nn.Module, inputs: torch.Tensor, score) -> torch.Tensor:
    """Grad-CAM of ``score(model(x))`` at ``features``, written out with a plain hook."""
    saved = {}

    def to_leaf(module, args, output):
        saved["A"] = output.detach().requires_grad_()
        return saved["A"]

    handle = model.features.register_forward_hook(to_leaf)
    try:
        (gradients,) = torch.autograd.grad(score(model(inputs)).sum(), saved["A"])
    finally:
        handle.remove()
    cam = torch.relu((gradients.mean(dim=(2, 3), keepdim=True) * saved["A"]).sum(1)).detach()
    low = cam.flatten(1).amin(1).view(-1, 1, 1)
    high = cam.flatten(1).amax(1).view(-1, 1, 1)
    return (cam - low) / (high - low)


# Class ids ------------------------------------------------------------------------------


def test_a_single_class_applies_to_every_sample_and_a_list_gives_one_each():
    assert class_ids(3, LOGITS).tolist() == [[3], [3]]
    assert class_ids([1, 0], LOGITS).tolist() == [[1], [0]]
    assert class_ids(torch.tensor([2, 3]), LOGITS).tolist() == [[2], [3]]


def test_top_k_gives_one_rank_per_column_best_first():
    assert class_ids(None, LOGITS).tolist() == [[1], [0]]
    assert class_ids("top2", LOGITS).tolist() == [[1, 3], [0, 2]]
    assert class_ids(TopK(3), LOGITS).tolist() == [[1, 3, 0], [0, 2, 1]]


def test_an_n_by_k_tensor_gives_k_given_classes_per_sample():
    assert class_ids(torch.tensor([[0, 2], [3, 1]]), LOGITS).tolist() == [[0, 2], [3, 1]]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ([1, 2, 3], "got 3 target classes for a batch of 2"),
        ([1], "got 1 target classes for a batch of 2"),
        (4, "class id 4 is out of range: the model has 4 classes"),
        ([0, -1], "class id -1 is out of range"),
        (1.5, "must be class ids"),
        ([0, True], "class ids \\(ints\\), not \\[0, True\\] \\(it holds a bool\\)"),
        (True, "must be class ids"),
        ("top5", "top-k needs 1 <= k <= 4"),
        ("best", "unknown target 'best'"),
    ],
)
def test_bad_class_targets_say_what_is_wrong(target, message):
    with pytest.raises(CamvizError, match=message):
        class_ids(target, LOGITS)


def test_explain_rejects_a_list_whose_length_is_not_the_batch():
    with pytest.raises(CamvizError, match="got 3 target classes for a batch of 2"):
        camviz.explain(LinearHead(), torch.rand(2, 3, 4, 4), layer="features", target=[0, 1, 2])


# The output adapter -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "key"),
    [
        ((LOGITS, torch.zeros(2)), None),
        ([LOGITS], None),
        ((torch.zeros(2), LOGITS), 1),
        ({"logits": LOGITS, "features": torch.zeros(2, 8)}, None),
        ({"out": LOGITS, "aux": torch.zeros(2, 4)}, None),
        ({"scores": LOGITS}, None),
        ({"main": LOGITS, "aux": torch.zeros(2, 4)}, "main"),
        (SimpleNamespace(logits=LOGITS, hidden_states=None), None),
    ],
)
def test_as_logits_finds_the_scores_in_tuples_dicts_and_logits_objects(output, key):
    assert as_logits(output, key) is LOGITS


def test_as_logits_asks_for_output_key_when_the_dict_is_ambiguous_or_the_key_is_wrong():
    with pytest.raises(CamvizError, match="pass output_key="):
        as_logits({"main": LOGITS, "aux": LOGITS})
    with pytest.raises(CamvizError, match=r"no element 'cls'; pass output_key= one of \['a'\]"):
        as_logits({"a": LOGITS}, "cls")
    with pytest.raises(CamvizError, match="cannot find class scores"):
        as_logits(object())


@pytest.mark.parametrize(
    ("wrap", "key"),
    [
        (lambda logits: (logits, logits.sum()), None),
        (lambda logits: {"aux": logits * 0, "main": logits}, "main"),
        (lambda logits: SimpleNamespace(logits=logits), None),
    ],
)
def test_explain_through_the_adapter_equals_the_plain_tensor_model(wrap, key):
    inputs = torch.rand(2, 3, 6, 6)
    plain = camviz.explain(LinearHead(), inputs, layer="features", target=[1, 4])
    wrapped = camviz.explain(
        LinearHead(wrap), inputs, layer="features", target=[1, 4], output_key=key
    )
    torch.testing.assert_close(wrapped.layer_maps, plain.layer_maps)
    torch.testing.assert_close(wrapped.scores, plain.scores)


# Region -----------------------------------------------------------------------------------


def test_region_score_is_the_class_logits_summed_over_the_mask():
    logits = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)
    mask = torch.tensor([[True, False], [False, True]])
    (score,), ids = score_fns(Region(1, mask), {"out": logits})
    # class 1 of sample 0 is [[4, 5], [6, 7]] -> 4 + 7; of sample 1 is [[16, 17], [18, 19]].
    assert score({"out": logits}).tolist() == [11.0, 35.0]
    assert ids.tolist() == [[1], [1]]
    weights = torch.tensor([[[0.5, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 2.0]]])
    (weighted,), _ = score_fns(Region(2, weights), logits)
    # Per-sample float weights: 0.5 * 8 for sample 0, 2 * 23 for sample 1.
    assert weighted(logits).tolist() == [4.0, 46.0]
    # Perturbed rows take the mask of the sample they come from.
    rows = torch.stack([logits[1], logits[1], logits[0]])
    assert weighted(rows, torch.tensor([1, 1, 0])).tolist() == [46.0, 46.0, 4.0]


def test_gradcam_of_a_region_equals_gradcam_of_the_summed_logits():
    model = Segmenter()
    inputs = torch.rand(2, 3, 5, 5)
    mask = torch.zeros(5, 5, dtype=torch.bool)
    mask[1:3, 2:5] = True
    result = camviz.explain(model, inputs, layer="features", target=Region(2, mask))
    expected = gradcam_of(model, inputs, lambda out: (out["out"][:, 2] * mask).sum(dim=(1, 2)))
    torch.testing.assert_close(result.layer_maps, expected)
    assert result.targets.tolist() == [2, 2]


@pytest.mark.parametrize(
    ("region", "message"),
    [
        (Region(3, torch.ones(5, 5)), "class id 3 is out of range: the model has 3 classes"),
        (Region(1, torch.ones(4, 5)), r"must be \(5, 5\) or \(2, 5, 5\)"),
        (Region(1, torch.ones(3, 5, 5)), r"must be \(5, 5\) or \(2, 5, 5\)"),
        (Region(1, torch.zeros(5, 5)), "selects no pixel"),
        (Region(1.0, torch.ones(5, 5)), "must be an int"),
    ],
)
def test_bad_regions_say_what_is_wrong(region, message):
    with pytest.raises(CamvizError, match=message):
        camviz.explain(Segmenter(), torch.rand(2, 3, 5, 5), layer="features", target=region)


def test_a_region_needs_a_segmentation_output_and_class_ids_need_a_classifier():
    with pytest.raises(CamvizError, match="needs a segmentation output"):
        camviz.explain(LinearHead(), torch.rand(1, 3, 4, 4), layer="features", target=Region(0, 1))
    with pytest.raises(CamvizError, match=r"use camviz\.Region"):
        camviz.explain(Segmenter(), torch.rand(1, 3, 4, 4), layer="features", target=1)


# Contrast ---------------------------------------------------------------------------------


def test_contrast_score_is_the_difference_of_the_two_logits():
    (score,), ids = score_fns(Contrast(1, 3), LOGITS)
    assert score(LOGITS).tolist() == [1.0, 2.0]
    assert ids.tolist() == [[1], [1]]
    (per_sample,), _ = score_fns(Contrast([1, 0], [0, 2]), LOGITS)
    assert per_sample(LOGITS).tolist() == [2.5, 3.0]


def test_gradcam_of_a_contrast_explains_why_a_rather_than_b():
    model = LinearHead()
    inputs = torch.rand(2, 3, 4, 4)
    result = camviz.explain(model, inputs, layer="features", target=Contrast(4, 1))
    expected = gradcam_of(model, inputs, lambda out: out[:, 4] - out[:, 1])
    torch.testing.assert_close(result.layer_maps, expected)
    torch.testing.assert_close(result.scores, (lambda out: out[:, 4] - out[:, 1])(model(inputs)))


def test_a_contrast_needs_two_different_classes_in_range():
    with pytest.raises(CamvizError, match="two different classes"):
        score_fns(Contrast(2, 2), LOGITS)
    with pytest.raises(CamvizError, match="class id 9 is out of range"):
        score_fns(Contrast(9, 2), LOGITS)


# Callables --------------------------------------------------------------------------------


def test_a_callable_target_is_scored_as_given_and_has_no_class_id():
    model = LinearHead()
    inputs = torch.rand(2, 3, 4, 4)
    result = camviz.explain(model, inputs, layer="features", target=lambda out: out[:, 2] * 2)
    by_class = camviz.explain(model, inputs, layer="features", target=2)
    torch.testing.assert_close(result.layer_maps, by_class.layer_maps)
    torch.testing.assert_close(result.scores, 2 * by_class.scores)
    assert result.targets.tolist() == [-1, -1]


# Probabilities ----------------------------------------------------------------------------


def test_probability_scores_read_the_softmax_over_classes():
    from camviz.core.targets import probability_score

    p = LOGITS.softmax(dim=1)
    (class_score,), _ = score_fns([1, 0], LOGITS)
    torch.testing.assert_close(probability_score(class_score)(LOGITS), p[[0, 1], [1, 0]])
    (contrast,), _ = score_fns(Contrast(1, 3), {"logits": LOGITS})
    expected = p[:, 1] - p[:, 3]
    torch.testing.assert_close(probability_score(contrast)({"logits": LOGITS}), expected)
    segmentation = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[True, False], [False, True]])
    (region,), _ = score_fns(Region(2, mask), segmentation)
    expected = (segmentation.softmax(dim=1)[:, 2] * mask).sum(dim=(1, 2))
    torch.testing.assert_close(probability_score(region)(segmentation), expected)
    (callable_score,), _ = score_fns(lambda out: out[:, 0], LOGITS)
    with pytest.raises(CamvizError, match="not a callable"):
        probability_score(callable_score)
