"""The target protocol: every kind's ``prepare``, ``resolve`` and ``follow`` with numbers,
``as_target`` of every value a user may pass, a new kind added as one class, and outputs
with one element per sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from reference import min_max
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.inputs import as_inputs
from camviz.core.targets import (
    CallableTarget,
    Change,
    ClassIds,
    Context,
    Contrast,
    Nearest,
    Predicted,
    Region,
    Resolved,
    TargetObject,
    TopK,
    as_target,
    row_count,
    take_rows,
)

LOGITS = torch.tensor([[0.5, 3.0, -1.0, 2.0], [4.0, 0.0, 1.0, -2.0]])
# Another output of the same two samples, whose best classes are others (2 and 3).
OTHER = torch.tensor([[0.0, 1.0, 5.0, 2.0], [1.0, 0.0, 2.0, 6.0]])
PLAIN = Context(batch_size=2)


def scores_of(resolved: Resolved, output: Any) -> list[list[float]]:
    """Each rank's scores of ``output``, rank-major."""
    return [score(output).tolist() for score in resolved.scores]


# Class ids, top-k and the predicted class -------------------------------------------------


def test_class_ids_score_the_given_logits_and_stay_fixed_when_followed():
    target = as_target([1, 2])
    assert (
        target.prepare(nn.Identity(), as_inputs(torch.zeros(2, 3, 4, 4), nn.Identity())) is target
    )
    resolved = target.resolve(LOGITS, PLAIN)
    assert resolved.class_ids.tolist() == [[1], [2]]
    assert scores_of(resolved, LOGITS) == [[3.0, 1.0]]  # LOGITS[0, 1], LOGITS[1, 2]
    followed = target.follow(Change(resolved, (0.5, 0.5), flip_width=4.0))
    assert scores_of(followed.resolve(OTHER, PLAIN), OTHER) == [[1.0, 2.0]]
    assert resolved.reasons is None and resolved.boxes is None


def test_top_k_picks_the_best_classes_and_a_followed_pass_keeps_them():
    target = as_target("top2")
    assert target.picks_classes
    resolved = target.resolve(LOGITS, PLAIN)
    assert resolved.class_ids.tolist() == [[1, 3], [0, 2]]
    assert scores_of(resolved, LOGITS) == [[3.0, 4.0], [2.0, 1.0]]
    followed = target.follow(Change(resolved))
    again = followed.resolve(OTHER, PLAIN)  # OTHER's own top-2 would be [2, 3] and [3, 2]
    assert again.class_ids.tolist() == [[1, 3], [0, 2]]
    assert scores_of(again, OTHER) == [[1.0, 1.0], [2.0, 2.0]]


def test_the_predicted_class_is_top_1_or_the_output_itself_for_one_number_per_sample():
    predicted = as_target(None)
    resolved = predicted.resolve(LOGITS, PLAIN)
    assert resolved.class_ids.tolist() == [[1], [0]]
    assert scores_of(predicted.follow(Change(resolved)).resolve(OTHER, PLAIN), OTHER) == [
        [1.0, 1.0]
    ]
    values = torch.tensor([0.25, -3.0])
    scalar = predicted.resolve(values, PLAIN)
    assert scalar.class_ids is None and scores_of(scalar, values) == [[0.25, -3.0]]


def test_nearest_alone_explains_the_classes_scored_closest_to_the_top_class():
    resolved = Nearest(2).resolve(LOGITS, PLAIN)
    # sample 0: top 1 (3.0); |2-3| = 1 (class 3), |0.5-3| = 2.5 (class 0).
    # sample 1: top 0 (4.0); |1-4| = 3 (class 2), |0-4| = 4 (class 1).
    assert resolved.class_ids.tolist() == [[3, 0], [2, 1]]
    assert scores_of(resolved, LOGITS) == [[2.0, 1.0], [0.5, 0.0]]


# Regions and contrasts ----------------------------------------------------------------------

SEGMENTATION = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)
MASK = torch.tensor([[True, False], [False, True]])


def test_a_region_sums_its_class_over_the_mask_and_cannot_move():
    region = Region(1, MASK)
    resolved = region.resolve({"out": SEGMENTATION}, PLAIN)
    # class 1 of sample 0 is [[4, 5], [6, 7]] -> 4 + 7; of sample 1 [[16, 17], [18, 19]].
    assert scores_of(resolved, {"out": SEGMENTATION}) == [[11.0, 35.0]]
    assert resolved.class_ids.tolist() == [[1], [1]]
    assert region.follow(Change(resolved)) is region
    assert region.cannot_move is not None
    with pytest.raises(CamvizError, match="aug_smooth cannot explain a Region target"):
        region.follow(Change(resolved, (1.0, 1.0), flip_width=2.0))


def test_a_contrast_of_a_region_and_a_class_compares_the_classes_over_the_region():
    resolved = Contrast(Region(1, MASK), 2, alpha=0.5).resolve(SEGMENTATION, PLAIN)
    # class 2 over the mask: sample 0 8 + 11 = 19, sample 1 20 + 23 = 43.
    assert scores_of(resolved, SEGMENTATION) == [[11 - 0.5 * 19, 35 - 0.5 * 43]]
    assert resolved.class_ids.tolist() == [[1], [1]]


def test_a_contrast_of_two_targets_scores_the_second_on_its_own():
    second = lambda out: out[:, 0, 0, 0]  # noqa: E731 - a target callable
    resolved = Contrast(Region(1, MASK), second).resolve(SEGMENTATION, PLAIN)
    assert scores_of(resolved, SEGMENTATION) == [[11.0 - 0.0, 35.0 - 12.0]]
    two_ranks = Contrast(TopK(2), [0, 1])  # a target of its own with two ranks
    assert len(two_ranks.resolve(LOGITS, PLAIN).scores) == 2
    with pytest.raises(CamvizError, match="b gives 2 scores for a's 1 ranks"):
        Contrast(lambda out: out[:, 0], two_ranks).resolve(LOGITS, PLAIN)


def test_a_followed_contrast_keeps_the_class_the_plain_pass_chose():
    contrast = Contrast(None, 2)
    resolved = contrast.resolve(LOGITS, PLAIN)
    assert scores_of(resolved, LOGITS) == [[3.0 - -1.0, 4.0 - 1.0]]
    followed = contrast.follow(Change(resolved))
    # OTHER's top classes are 2 and 3, but a stays 1 and 0: y_a - y_2.
    assert scores_of(followed.resolve(OTHER, PLAIN), OTHER) == [[1.0 - 5.0, 1.0 - 2.0]]


def test_aug_smooth_of_a_top_k_contrast_averages_every_rank_with_its_flipped_pass():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    ).eval()
    inputs = torch.rand(2, 3, 8, 8)
    reference = lambda out: out.mean(dim=1)  # noqa: E731 - a target callable
    smoothed = camviz.explain(
        model, inputs, layer="0", target=Contrast("top2", reference), aug_smooth=(1.0,)
    )
    chosen = Contrast(smoothed.targets.view(2, 2), reference)
    plain = camviz.explain(model, inputs, layer="0", target=chosen)
    flipped = camviz.explain(model, inputs.flip(-1), layer="0", target=chosen)
    torch.testing.assert_close(
        smoothed.heatmaps, min_max((plain.heatmaps + flipped.heatmaps.flip(-1)) / 2)
    )


def test_class_targets_become_a_nearest_contrast_and_a_contrast_stays_as_it_is():
    contrast = as_target(1).nearest_contrast(1, 0.5)
    assert scores_of(contrast.resolve(LOGITS, PLAIN), LOGITS) == [
        [3.0 - 0.5 * 2.0, 0.0 - 0.5 * 1.0]
    ]
    given = Contrast(1, 0)
    assert given.nearest_contrast(3, 1.0) is given
    assert Region(1, MASK).nearest_contrast(1, 1.0) is None
    assert as_target(lambda out: out[:, 0]).nearest_contrast(1, 1.0) is None


# Similarities, detections and callables -----------------------------------------------------


def test_a_similarity_embeds_its_reference_and_scores_the_cosine():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    torch.manual_seed(0)
    reference, queries = torch.rand(1, 3, 2, 2), torch.rand(2, 3, 2, 2)
    prepared = camviz.Similarity(reference).prepare(model, as_inputs(queries, model))
    resolved = prepared.resolve(model(queries), PLAIN)
    expected = F.cosine_similarity(model(queries), model(reference), dim=-1)
    torch.testing.assert_close(resolved.scores[0](model(queries)), expected)
    assert resolved.class_ids is None and prepared.follow(Change(resolved)) is prepared
    with pytest.raises(CamvizError, match="must be embedded by the model first"):
        camviz.Similarity(reference).resolve(model(queries), PLAIN)


def detections(box: list[float], score: float, label: int) -> list[dict[str, torch.Tensor]]:
    return [
        {
            "boxes": torch.tensor([box]),
            "scores": torch.tensor([score]),
            "labels": torch.tensor([label]),
        }
    ]


def test_a_detection_is_followed_into_a_flipped_image_by_its_flipped_box():
    plain = detections([10.0, 4, 30, 8], 0.9, 1)
    target = camviz.Detection(0)
    resolved = target.resolve(plain, PLAIN)
    assert resolved.class_ids.tolist() == [[1]]
    torch.testing.assert_close(resolved.boxes, torch.tensor([[[10.0, 4, 30, 8]]]))
    followed = target.follow(Change(resolved, (1.0, 1.0), flip_width=100.0))
    # x0' = 100 - x1, x1' = 100 - x0; y unchanged.
    torch.testing.assert_close(
        followed.resolve(plain, PLAIN).boxes, torch.tensor([[[70.0, 4, 90, 8]]])
    )
    mirrored = detections([71.0, 4, 91, 8], 0.7, 1)  # the object in the flipped image
    assert scores_of(followed.resolve(mirrored, PLAIN), mirrored) == [[pytest.approx(0.7)]]
    twice = followed.follow(Change(resolved, (2.0, 0.5)))  # then scaled: y by 2, x by 0.5
    torch.testing.assert_close(
        twice.resolve(plain, PLAIN).boxes, torch.tensor([[[35.0, 8, 45, 16]]])
    )


def test_callables_with_and_without_rows_are_scored_as_given():
    plain = as_target(lambda out: out[:, 3])
    assert isinstance(plain, CallableTarget)
    resolved = plain.resolve(LOGITS, PLAIN)
    assert resolved.class_ids is None and scores_of(resolved, LOGITS) == [[2.0, -2.0]]
    assert plain.follow(Change(resolved)) is plain
    ids = torch.tensor([2, 0])
    with_rows = as_target(lambda out, rows: out[torch.arange(len(rows)), ids[rows]])
    assert scores_of(with_rows.resolve(LOGITS, PLAIN), LOGITS) == [[-1.0, 4.0]]
    rerun = with_rows.resolve(LOGITS, PLAIN).scores[0](LOGITS[[1, 1, 0]], torch.tensor([1, 1, 0]))
    assert rerun.tolist() == [4.0, 4.0, -1.0]


def test_as_target_converts_every_value_a_user_may_pass():
    similarity = camviz.Similarity(torch.ones(3))
    detection = camviz.Detection(0)
    function = lambda out: out[:, 0]  # noqa: E731 - a target callable
    assert as_target(None) == Predicted()
    assert as_target(3) == ClassIds(3)
    assert as_target("top3") == TopK(3) and as_target(" Top1 ") == TopK(1)
    assert as_target([1, 2]).ids == [1, 2]
    ids = torch.tensor([[1, 2], [0, 3]])
    assert as_target(ids).resolve(LOGITS, PLAIN).class_ids.tolist() == ids.tolist()
    assert as_target(function).fn is function
    for target in (similarity, detection, TopK(2), Region(0, MASK), Contrast(1, 2), Nearest(1)):
        assert as_target(target) is target
    with pytest.raises(CamvizError, match="unknown target 'best'"):
        as_target("best")
    with pytest.raises(CamvizError, match="must be class ids"):
        as_target(1.5).resolve(LOGITS, PLAIN)


# A new kind is one class --------------------------------------------------------------------


class UnitModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.features = nn.Conv2d(3, 4, 3, padding=1)
        self.inner = nn.Conv2d(4, 5, 1)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.inner(torch.relu(self.features(x)))
        return self.head(torch.relu(inner).mean(dim=(2, 3)))


@dataclass(frozen=True, eq=False)
class ChannelMean(TargetObject):
    """A kind the tests add: the mean of one channel of an inner layer's output."""

    spot: str
    channel: int

    @property
    def spots(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.spot,)

    def resolve(self, output: Any, context: Context) -> Resolved:
        values = context.spots[self.spot][:, self.channel]
        return Resolved((lambda output, rows=None: values.mean(dim=(-2, -1)),))

    def follow(self, change: Change) -> TargetObject:
        return self


def test_a_new_target_kind_is_explained_end_to_end_like_a_hand_gradcam():
    model = UnitModel().eval()
    inputs = torch.rand(2, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    result = camviz.explain(model, inputs, layer="features", target=ChannelMean("inner", 3))
    activations = model.features(inputs).detach().requires_grad_()
    unit = model.inner(torch.relu(activations))[:, 3].mean(dim=(-2, -1))
    (gradients,) = torch.autograd.grad(unit.sum(), activations)
    cam = torch.relu((gradients.mean(dim=(2, 3), keepdim=True) * activations).sum(1)).detach()
    low, high = cam.flatten(1).amin(1).view(-1, 1, 1), cam.flatten(1).amax(1).view(-1, 1, 1)
    torch.testing.assert_close(result.layer_maps, (cam - low) / (high - low))
    torch.testing.assert_close(result.scores, unit.detach())
    assert result.targets.tolist() == [-1, -1]


# Outputs with one element per sample ------------------------------------------------------


class PerSample(nn.Module):
    """A small CNN whose output is one dict of scores per sample (torchcam's structured
    model), or with ``plain`` the same scores as an ``(N, 2)`` tensor."""

    def __init__(self, plain: bool) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(4, 2)
        self.plain = plain

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.head(self.features(x).mean(dim=(2, 3)))
        if self.plain:
            return logits
        return [{"primary": row[0], "secondary": row[1]} for row in logits]


def test_a_list_with_one_dict_per_sample_is_a_batch_of_rows():
    output = PerSample(plain=False)(torch.rand(3, 3, 4, 4))
    assert row_count(output) == (3, torch.device("cpu"))
    rows = take_rows(output, torch.tensor([2, 2, 0]))
    assert [row["primary"] for row in rows] == [output[2]["primary"]] * 2 + [output[0]["primary"]]
    batched = [{"logits": torch.zeros(3, 2)}]  # one dict of batched tensors: not rows
    assert row_count(batched) == (3, torch.device("cpu"))
    assert take_rows(batched, torch.tensor([1]))[0]["logits"].shape == (1, 2)


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("scorecam", {}),
        ("sscam", {"num_samples": 2, "seed": 0}),
        ("iscam", {"num_samples": 2}),
        ("ablationcam", {}),
        ("smooth_gradcam++", {"samples": 2}),
        ("gradcam", {"aug_smooth": True}),
    ],
)
def test_outputs_with_one_dict_per_sample_explain_like_the_plain_tensor(method, options):
    inputs = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    structured = camviz.explain(
        PerSample(plain=False),
        inputs,
        method,
        layer="features",
        target=lambda out: torch.stack([row["primary"] for row in out]),
        **options,
    )
    plain = camviz.explain(
        PerSample(plain=True),
        inputs,
        method,
        layer="features",
        target=lambda out: out[:, 0],
        **options,
    )
    torch.testing.assert_close(structured.heatmaps, plain.heatmaps)
    torch.testing.assert_close(structured.scores, plain.scores)
