"""Faithfulness metrics against values worked out by hand on a 4x4 image and a linear model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.evaluation import metrics

# Pixel weights 1..16 in raster order: the logit of class 0 is sum_ij W_ij * x_ij.
WEIGHTS = torch.arange(1.0, 17.0).view(4, 4)


def linear_model(weights: torch.Tensor = WEIGHTS, scale: float = 1.0) -> nn.Module:
    """Flatten -> Linear(16, 2): logit 0 = scale * sum(W * x), logit 1 = 0."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 2, bias=False))
    with torch.no_grad():
        model[1].weight.copy_(torch.stack([weights.flatten() * scale, torch.zeros(16)]))
    return model.eval()


def sigmoid(value: float) -> float:
    """Softmax probability of class 0 when the logits are (value, 0)."""
    return 1 / (1 + math.exp(-value))


ONES = torch.ones(1, 1, 4, 4)
FAITHFUL = WEIGHTS.view(1, 4, 4) / 16  # ranks the pixels as the model weighs them


def test_deletion_curve_and_auc_by_hand():
    # Remove the 4 highest-ranked pixels per step (16, 15, 14, 13 first): 136 -> 78 -> 36
    # -> 10 -> 0. Trapezoid over x = 0, 1/4, ..., 1: (136/2 + 78 + 36 + 10 + 0/2) / 4 = 48.
    curve = metrics.deletion(linear_model(), ONES, FAITHFUL, target=0, steps=4, score="logit")
    torch.testing.assert_close(curve.fractions, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    torch.testing.assert_close(curve.scores, torch.tensor([[136.0, 78.0, 36.0, 10.0, 0.0]]))
    torch.testing.assert_close(curve.auc, torch.tensor([48.0]))


def test_insertion_reveals_the_top_pixels_first():
    # Canvas of zeros; reveal 16..13, then 12..9, ...: 0 -> 58 -> 100 -> 126 -> 136.
    # (0/2 + 58 + 100 + 126 + 136/2) / 4 = 88.
    curve = metrics.insertion(
        linear_model(), ONES, FAITHFUL, target=0, steps=4, baseline=0.0, score="logit"
    )
    torch.testing.assert_close(curve.scores, torch.tensor([[0.0, 58.0, 100.0, 126.0, 136.0]]))
    torch.testing.assert_close(curve.auc, torch.tensor([88.0]))


def test_an_unfaithful_map_scores_worse_on_both_curves():
    reversed_map = 1 - FAITHFUL  # lowest weights first: 136 -> 126 -> 100 -> 58 -> 0
    model = linear_model()
    deleted = metrics.deletion(model, ONES, reversed_map, target=0, steps=4, score="logit")
    inserted = metrics.insertion(
        model, ONES, reversed_map, target=0, steps=4, baseline=0.0, score="logit"
    )
    torch.testing.assert_close(deleted.scores, torch.tensor([[136.0, 126.0, 100.0, 58.0, 0.0]]))
    torch.testing.assert_close(deleted.auc, torch.tensor([88.0]))
    torch.testing.assert_close(inserted.auc, torch.tensor([48.0]))


def test_probability_scores_and_uneven_steps():
    # Logit = 0.01 * sum(W * x); 3 steps over 16 pixels remove floor(16k/3) = 0, 5, 10, 16:
    # the sums left are 136, 136 - (16+15+14+13+12) = 66, 66 - (11+10+9+8+7) = 21, 0.
    curve = metrics.deletion(linear_model(scale=0.01), ONES, FAITHFUL, target=0, steps=3)
    torch.testing.assert_close(curve.fractions, torch.tensor([0.0, 5 / 16, 10 / 16, 1.0]))
    expected = [sigmoid(0.01 * left) for left in (136, 66, 21, 0)]
    torch.testing.assert_close(curve.scores, torch.tensor([expected]))
    fractions = [0.0, 5 / 16, 10 / 16, 1.0]
    area = sum(
        (fractions[k + 1] - fractions[k]) * (expected[k] + expected[k + 1]) / 2 for k in range(3)
    )
    torch.testing.assert_close(curve.auc, torch.tensor([area]))


def test_mean_and_tensor_baselines():
    # An image with values 0..15: its mean is 7.5, so deleting pixels 15 (weight 16) and 14
    # (weight 15) to the mean changes the logit by 16 * (7.5 - 15) + 15 * (7.5 - 14).
    image = torch.arange(16.0).view(1, 1, 4, 4)
    model = linear_model()
    full = float((WEIGHTS.flatten() * torch.arange(16.0)).sum())
    mean = metrics.deletion(model, image, FAITHFUL, 0, steps=8, baseline="mean", score="logit")
    assert mean.scores[0, 1].item() == pytest.approx(full + 16 * (7.5 - 15) + 15 * (7.5 - 14))
    tensor = metrics.deletion(
        model, image, FAITHFUL, 0, steps=8, baseline=torch.tensor(-1.0), score="logit"
    )
    assert tensor.scores[0, 1].item() == pytest.approx(full + 16 * (-1 - 15) + 15 * (-1 - 14))


def test_blur_baseline_is_the_blurred_image():
    # On a constant image blurring changes nothing, so insertion on a blurred canvas is flat.
    curve = metrics.insertion(linear_model(), ONES * 2, FAITHFUL, 0, steps=4, score="logit")
    torch.testing.assert_close(curve.scores, torch.full((1, 5), 272.0))


def test_batches_targets_and_batch_size_do_not_change_the_curves():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16, 5)).eval()
    images, maps = torch.randn(3, 3, 4, 4), torch.rand(3, 2, 2)  # maps upsampled to 4x4
    targets = torch.tensor([4, 0, 2])
    together = metrics.deletion(model, images, maps, targets, steps=5, batch_size=100)
    for index in range(3):
        alone = metrics.deletion(
            model, images[index : index + 1], maps[index : index + 1], int(targets[index]),
            steps=5, batch_size=1,
        )  # fmt: skip
        torch.testing.assert_close(together.scores[index : index + 1], alone.scores)


def test_a_target_that_takes_rows_scores_each_perturbed_image_for_its_own_input():
    # steps=2 gives 3 images per input: a batch of 3 rows can be all of one input.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16, 5)).eval()
    images, maps = torch.randn(3, 3, 4, 4), torch.rand(3, 4, 4)
    targets = torch.tensor([4, 0, 2])
    by_class = metrics.deletion(model, images, maps, targets, steps=2, batch_size=3, score="logit")
    by_rows = metrics.deletion(
        model, images, maps, lambda out, rows: out[torch.arange(len(rows)), targets[rows]],
        steps=2, batch_size=3, score="logit",
    )  # fmt: skip
    torch.testing.assert_close(by_rows.scores, by_class.scores)
    with pytest.raises(CamvizError, match="or take the rows"):
        metrics.deletion(
            model, images, maps, lambda out: out[torch.arange(len(out)), targets],
            steps=2, batch_size=3, score="logit",
        )  # fmt: skip


def test_confidence_average_drop_and_increase_by_hand():
    # Image 1 (logit 0.01 * sum(W) = 1.36): a map of 1/2 everywhere halves the logit to 0.68,
    # so the probability falls. Image 2: weights +0.1 on the left half and -0.1 on the right
    # (logit 0); the map keeps only the left half, so the logit rises to 8 * 0.1.
    weights = torch.cat([torch.ones(4, 2), -torch.ones(4, 2)], dim=1) * 0.1
    model = linear_model(weights)
    images = torch.ones(2, 1, 4, 4)
    maps = torch.stack(
        [torch.full((4, 4), 0.5), torch.cat([torch.ones(4, 2), torch.zeros(4, 2)], 1)]
    )
    model_one = linear_model(scale=0.01)
    first = metrics.confidence(model_one, images[:1], maps[:1], target=0)
    assert first.original.item() == pytest.approx(sigmoid(1.36))
    assert first.explained.item() == pytest.approx(sigmoid(0.68))
    second = metrics.confidence(model, images[1:], maps[1:], target=0)
    assert second.original.item() == pytest.approx(0.5)
    assert second.explained.item() == pytest.approx(sigmoid(0.8))
    both = metrics.Confidence(
        original=torch.cat([first.original, second.original]),
        explained=torch.cat([first.explained, second.explained]),
    )
    drop = (sigmoid(1.36) - sigmoid(0.68)) / sigmoid(1.36)
    torch.testing.assert_close(both.drop, torch.tensor([drop, 0.0]))
    assert both.average_drop == pytest.approx(100 * drop / 2)
    assert both.increase_in_confidence == pytest.approx(50.0)


def test_win_rate_counts_the_lowest_drop_and_splits_ties():
    # Image 0: a wins; 1: b wins; 2: tie (half each); 3: a wins -> a 2.5/4, b 1.5/4.
    rates = metrics.win_rate(
        {"a": torch.tensor([0.1, 0.5, 0.2, 0.0]), "b": torch.tensor([0.2, 0.1, 0.2, 0.3])}
    )
    assert rates == pytest.approx({"a": 62.5, "b": 37.5})


@pytest.mark.parametrize(
    ("scores", "fractions", "area"),
    [
        ([0.0, 1.0, 1.0], None, 0.75),  # x = 0, 0.5, 1: 0.5 * 0.5 + 0.5 * 1
        ([1.0, 0.0, 0.0], [0.0, 0.1, 1.0], 0.05),
        ([2.0, 2.0], None, 2.0),
        ([0.0, 0.25, 1.0], [0.0, 0.5, 1.0], 0.375),  # y = x^2 at 3 points: 0.0625 + 0.3125
    ],
)
def test_auc_is_the_trapezoid_rule(scores, fractions, area):
    given = None if fractions is None else torch.tensor(fractions)
    assert metrics.auc(torch.tensor(scores), given).item() == pytest.approx(area)


def dense_imputation(image: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """Noisy linear imputation without noise, as an explicit dense linear system."""
    channels, height, width = image.shape
    unknown = [(i, j) for i in range(height) for j in range(width) if removed[i, j]]
    index = {pixel: k for k, pixel in enumerate(unknown)}
    matrix = torch.zeros(len(unknown), len(unknown), dtype=torch.float64)
    rhs = torch.zeros(len(unknown), channels, dtype=torch.float64)
    for k, (i, j) in enumerate(unknown):
        for di in (-1, 0, 1):
            for dj in (-1, 0, 1):
                ni, nj = i + di, j + dj
                if (di, dj) == (0, 0) or not (0 <= ni < height and 0 <= nj < width):
                    continue
                weight = 1 / 12 if di and dj else 1 / 6
                matrix[k, k] += weight
                if removed[ni, nj]:
                    matrix[k, index[(ni, nj)]] -= weight
                else:
                    rhs[k] += weight * image[:, ni, nj].double()
    filled = image.clone().double()
    solution = torch.linalg.solve(matrix, rhs)
    for k, (i, j) in enumerate(unknown):
        filled[:, i, j] = solution[k]
    return filled


def test_linear_imputation_solves_the_neighbour_system():
    generator = torch.Generator().manual_seed(3)
    images = torch.rand(2, 3, 7, 9, generator=generator, dtype=torch.float64)
    removed = torch.rand(2, 7, 9, generator=generator) < 0.6
    removed[:, 0, 0] = False  # every removed region touches a kept pixel
    filled = metrics.impute_linear(images, removed, noise=0.0, tolerance=1e-12)
    for index in range(2):
        expected = dense_imputation(images[index], removed[index])
        torch.testing.assert_close(filled[index], expected, atol=1e-9, rtol=0)


def test_linear_imputation_of_one_corner_by_hand_and_its_noise():
    image = torch.arange(16.0).view(1, 1, 4, 4)
    removed = torch.zeros(1, 4, 4, dtype=torch.bool)
    removed[0, 0, 0] = True
    # Neighbours of (0, 0): (0, 1) = 1 and (1, 0) = 4 weigh 1/6, (1, 1) = 5 weighs 1/12.
    expected = (1 / 6 + 4 / 6 + 5 / 12) / (1 / 6 + 1 / 6 + 1 / 12)
    filled = metrics.impute_linear(image, removed, noise=0.0)
    assert filled[0, 0, 0, 0].item() == pytest.approx(expected, rel=1e-4)
    assert torch.equal(filled.flatten()[1:], image.flatten()[1:])
    noisy = [
        metrics.impute_linear(image, removed, generator=torch.Generator().manual_seed(seed))
        for seed in (0, 0, 1)
    ]
    assert torch.equal(noisy[0], noisy[1]) and not torch.equal(noisy[0], noisy[2])
    assert torch.equal(noisy[0].flatten()[1:], image.flatten()[1:])


def test_road_morf_and_lerf_remove_opposite_ends():
    # One pixel of 16 (fraction 1/16): MoRF removes (3, 3), the map's maximum, LeRF (0, 0).
    image = torch.arange(16.0).view(1, 1, 4, 4)
    model = linear_model()
    full = float((WEIGHTS * image[0, 0]).sum())
    corner = {
        (3, 3): (14 / 6 + 11 / 6 + 10 / 12) / (5 / 12),  # neighbours 14, 11 and 10
        (0, 0): (1 / 6 + 4 / 6 + 5 / 12) / (5 / 12),
    }
    for order, (i, j) in (("morf", (3, 3)), ("lerf", (0, 0))):
        curve = metrics.road(
            model, image, FAITHFUL, 0, order=order, fractions=[0.0, 1 / 16], noise=0.0,
            score="logit",
        )  # fmt: skip
        changed = full + float(WEIGHTS[i, j]) * (corner[(i, j)] - float(image[0, 0, i, j]))
        torch.testing.assert_close(curve.scores, torch.tensor([[full, changed]]), rtol=1e-4, atol=0)


def test_metrics_hand_the_model_back_as_it_came(untouched):
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(16, 3)
    )
    model.train()
    model[0].weight.requires_grad_(False)
    images, maps = torch.rand(2, 3, 4, 4), torch.rand(2, 4, 4)
    with untouched(model):
        first = metrics.deletion(model, images, maps, steps=4)
        metrics.insertion(model, images, maps, steps=4)
        metrics.confidence(model, images, maps)
        metrics.road(model, images, maps, fractions=[0.5])
    # Eval mode was used: dropout off, so a second run gives the same curve.
    torch.testing.assert_close(metrics.deletion(model, images, maps, steps=4).scores, first.scores)


def test_user_mistakes_are_one_line_errors():
    model = linear_model()
    with pytest.raises(CamvizError, match="one map per input"):
        metrics.deletion(model, ONES, torch.rand(2, 4, 4), 0)
    with pytest.raises(CamvizError, match="unknown baseline"):
        metrics.deletion(model, ONES, FAITHFUL, 0, baseline="zeros")
    with pytest.raises(CamvizError, match="steps"):
        metrics.deletion(model, ONES, FAITHFUL, 0, steps=0)
    with pytest.raises(CamvizError, match="score='logit'"):
        metrics.deletion(model, ONES, FAITHFUL, lambda output: output[:, 0])
    with pytest.raises(CamvizError, match="top-k"):
        metrics.deletion(model, ONES, FAITHFUL, "top2")
    with pytest.raises(CamvizError, match="fractions"):
        metrics.road(model, ONES, FAITHFUL, 0, fractions=[0.5, 1.0])


class _Weighted(nn.Module):
    """``W * x``: a one-channel feature map whose mean is the linear model's logit / 16."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return images * WEIGHTS


def test_a_unit_is_scored_at_its_layer_in_every_perturbed_pass():
    # The unit's score is the mean of W * x over the grid: the deletion curve's logits / 16.
    model = nn.Sequential(_Weighted(), nn.Flatten(), nn.Linear(16, 2)).eval()
    unit = camviz.Unit("0", channel=0)
    curve = metrics.deletion(model, ONES, FAITHFUL, target=unit, steps=4, score="logit")
    expected = torch.tensor([[136.0, 78.0, 36.0, 10.0, 0.0]]) / 16
    torch.testing.assert_close(curve.scores, expected)
    with pytest.raises(CamvizError, match="a Unit target scores no class"):
        metrics.deletion(model, ONES, FAITHFUL, target=unit, steps=4)
