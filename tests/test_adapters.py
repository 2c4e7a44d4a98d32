"""Output adapters that check what they get: dense heads read by their shape, mask
coefficients dropped, set predictions (DETR), and the map input of a processor's dict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import camviz
from camviz.core.errors import CamvizError


def _dense(anchors: int, classes: int, seed: int = 0) -> torch.Tensor:
    """``(1, anchors, 4 + classes)`` predictions: cx, cy, w, h in pixels and class scores."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.rand(1, anchors, 2, generator=generator) * 64
    sizes = 4 + torch.rand(1, anchors, 2, generator=generator) * 12
    scores = torch.rand(1, anchors, classes, generator=generator)
    return torch.cat([centres, sizes, scores], dim=-1)


def _same(found: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(found) == len(expected)
    for mine, theirs in zip(found, expected, strict=True):
        assert set(mine) == set(theirs)
        for key in theirs:
            torch.testing.assert_close(mine[key], theirs[key])


@pytest.mark.parametrize(
    ("anchors", "classes"),
    [(64, 4), (2100, 80)],  # the synthetic detector's (N, 64, 8); a YOLOv8 at 320 px
)
def test_dense_detections_tell_the_anchor_axis_from_the_shape(anchors: int, classes: int) -> None:
    raw = _dense(anchors, classes)
    by_rows = camviz.DenseDetections(channels_last=True)(raw)
    assert len(by_rows[0]["scores"]) > 1
    _same(camviz.DenseDetections()(raw), by_rows)
    # Ultralytics' layout: (N, 4 + classes, anchors).
    _same(camviz.DenseDetections()(raw.transpose(1, 2)), by_rows)
    _same(camviz.DenseDetections(channels_last=False)(raw.transpose(1, 2)), by_rows)


def test_dense_detections_ask_for_channels_last_when_the_shape_does_not_tell() -> None:
    with pytest.raises(CamvizError, match="channels_last=") as error:
        camviz.DenseDetections()(_dense(20, 8))  # (1, 20, 12): neither axis 4x the other
    assert "\n" not in str(error.value)


def test_dense_detections_drop_the_mask_coefficients_of_a_segment_head() -> None:
    raw = _dense(400, 3)
    coefficients = torch.randn(1, 400, 32, generator=torch.Generator().manual_seed(3))
    with_masks = torch.cat([raw, coefficients], dim=-1).transpose(1, 2)  # (1, 4 + 3 + 32, A)
    prototypes = torch.randn(1, 32, 16, 16)
    expected = camviz.DenseDetections()(raw)
    # Ultralytics' -seg output: [predictions, prototypes] first, then the raw levels.
    _same(camviz.DenseDetections()([[with_masks, prototypes], {}]), expected)
    _same(camviz.DenseDetections(mask_coefficients=32)(with_masks), expected)
    # Without the prototypes to count them, the coefficients would be read as 32 classes.
    assert camviz.DenseDetections()(with_masks)[0]["labels"].max() > 2
    with pytest.raises(CamvizError, match="mask_coefficients"):
        camviz.DenseDetections(mask_coefficients=-1)


def _set_output() -> dict[str, torch.Tensor]:
    """Three queries of a DETR with 2 classes and "no object", boxes relative (cx, cy, w, h)."""
    return {
        "logits": torch.tensor([[[0.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 1.0, 4.0]]]),
        "pred_boxes": torch.tensor(
            [[[0.5, 0.5, 0.5, 0.5], [0.25, 0.25, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0]]]
        ),
    }


def test_set_predictions_read_detr_outputs_best_first_in_input_pixels() -> None:
    output = _set_output()
    probabilities = output["logits"][0].softmax(-1)[:, :2]  # "no object" dropped
    best, labels = probabilities.max(-1)
    order = best.argsort(descending=True)
    (found,) = camviz.SetPredictions().for_input((32, 48))(output)
    torch.testing.assert_close(found["scores"], best[order])
    assert found["labels"].tolist() == labels[order].tolist() == [0, 1, 1]
    # Query 1 (cx 0.25, cy 0.25, w 0.5, h 0.5) of a 32 x 48 image: x 0..24, y 0..16.
    torch.testing.assert_close(found["boxes"][0], torch.tensor([0.0, 0.0, 24.0, 16.0]))
    (kept,) = camviz.SetPredictions(score_threshold=0.8)(output)
    assert kept["labels"].tolist() == [0]  # only query 1 scores 0.8 or more


def test_set_predictions_with_sigmoid_logits() -> None:
    output = _set_output()
    (found,) = camviz.SetPredictions(activation="sigmoid")(output)
    best, labels = output["logits"][0].sigmoid().max(-1)
    order = best.argsort(descending=True)
    torch.testing.assert_close(found["scores"], best[order])
    assert found["labels"].tolist() == labels[order].tolist() == [2, 0, 1]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: camviz.SetPredictions()({"scores": torch.zeros(1, 3, 3)}), "logits= and boxes="),
        (lambda: camviz.SetPredictions(activation="relu"), "activation must be"),
        (
            lambda: camviz.SetPredictions()(
                {"logits": torch.zeros(1, 3, 1), "pred_boxes": torch.zeros(1, 3, 4)}
            ),
            "activation='sigmoid'",
        ),
        (
            lambda: camviz.SetPredictions()(
                {"logits": torch.zeros(1, 3, 3), "pred_boxes": torch.zeros(1, 2, 4)}
            ),
            "(N, queries, 4)",
        ),
    ],
)
def test_set_predictions_refuse_what_they_cannot_read_in_one_line(call, message: str) -> None:
    with pytest.raises(CamvizError) as error:
        call()
    assert message in str(error.value) and "\n" not in str(error.value)


class TextAndImage(nn.Module):
    """A two-input model that takes a processor's dict: token ids and images."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 4)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        text = self.embedding(input_ids).mean(1)  # (N, 4)
        image = self.conv(pixel_values).relu().mean((2, 3))  # (N, 4)
        return image * text


def test_the_map_input_of_a_dict_with_input_ids_first_is_its_image() -> None:
    model = TextAndImage().eval()
    inputs = {
        "input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]]),
        "pixel_values": torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)),
    }
    found = camviz.explain(model, inputs, layer="conv", target=1)
    named = camviz.explain(model, inputs, layer="conv", target=1, map_input="pixel_values")
    assert found.heatmaps.shape == (2, 8, 8)
    torch.testing.assert_close(found.heatmaps, named.heatmaps)
    with pytest.raises(CamvizError, match="map_input="):
        camviz.explain(model, {**inputs, "pixel_mask": inputs["pixel_values"]}, layer="conv")
