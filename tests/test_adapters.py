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


def test_a_followed_set_prediction_is_found_again_in_a_rescaled_input() -> None:
    from camviz.core.inputs import as_inputs
    from camviz.core.targets import Change, Context

    output = _set_output()
    model = nn.Identity()
    target = camviz.Detection(0, adapter=camviz.SetPredictions()).prepare(
        model, as_inputs(torch.zeros(1, 3, 32, 48), model)
    )
    plain = target.resolve(output, Context(batch_size=1))
    (score,) = target.follow(Change(plain, factors=(2.0, 2.0))).resolve(output, Context()).scores
    # Relative boxes in an input twice the size: the object is the same query, found by IoU.
    torch.testing.assert_close(score(output), plain.scores[0](output))
    assert float(score(output)) > 0


def _segmenter(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, classes, 4, 4))


def test_a_region_mask_may_be_given_at_the_input_size() -> None:
    model = _segmenter().eval()  # (N, 3, 32, 32) -> (N, 3, 8, 8) logits
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    weights = torch.rand(8, 8, generator=torch.Generator().manual_seed(3))
    at_input = weights.repeat_interleave(4, 0).repeat_interleave(4, 1)  # 4 x 4 blocks
    mask = weights > 0.5
    for small, large in [(weights, at_input), (mask, at_input > 0.5)]:
        # Bilinear (and nearest) resizing of 4 x 4 blocks by 4 gives the blocks back exactly.
        expected = camviz.explain(model, images, layer="1", target=camviz.Region(1, small))
        given = camviz.explain(model, images, layer="1", target=camviz.Region(1, large))
        torch.testing.assert_close(given.scores, expected.scores)
        torch.testing.assert_close(given.heatmaps, expected.heatmaps)
    with pytest.raises(CamvizError, match=r"at the output's grid or the input's size"):
        camviz.explain(model, images, layer="1", target=camviz.Region(1, torch.ones(16, 16)))


def test_a_region_of_a_volume_sums_the_logits_over_its_voxels() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 2, 1)).eval()
    volumes = torch.randn(2, 1, 6, 8, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 6, 8, 8, dtype=torch.bool)
    mask[0, 1:3, 2:5, 2:6] = True
    mask[1, 3:, :4, 5:] = True
    result = camviz.explain(model, volumes, layer="1", target=camviz.Region(1, mask))
    with torch.no_grad():
        logits = model(volumes)
    torch.testing.assert_close(result.scores, (logits[:, 1] * mask).sum((1, 2, 3)))


def test_a_pair_of_probabilities_and_logits_is_read_as_the_logits() -> None:
    from camviz.core.targets import as_logits

    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(as_logits((logits.softmax(-1), logits)), logits)
    other = torch.randn(2, 5)
    torch.testing.assert_close(as_logits((other, logits)), other)  # not its softmax: first


def test_similarity_finds_the_embedding_of_a_hugging_face_output() -> None:
    embeds, pooled = torch.randn(2, 4), torch.randn(2, 6)
    similarity = camviz.Similarity(torch.randn(4))
    torch.testing.assert_close(
        similarity.embedding({"image_embeds": embeds, "text_embeds": torch.randn(2, 4)}), embeds
    )
    torch.testing.assert_close(
        similarity.embedding({"last_hidden_state": torch.randn(2, 3, 6), "pooler_output": pooled}),
        pooled,
    )
    with pytest.raises(CamvizError, match="which one holds the embedding that the score"):
        similarity.embedding({"a": embeds, "b": pooled})


class PerImageDetections(nn.Module):
    """A detector's eval output as torchvision gives it: one dict of boxes per image."""

    def __init__(self, threshold: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 2, 3, padding=1)
        self.threshold = threshold

    def forward(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        scores = self.conv(images).sigmoid().mean((2, 3))  # (N, 2): one box per class
        boxes = torch.tensor([[0.0, 0, 4, 4], [2, 2, 8, 8]])
        return [
            {
                "boxes": boxes[row > self.threshold],
                "scores": row[row > self.threshold],
                "labels": torch.arange(2)[row > self.threshold],
            }
            for row in scores
        ]


def test_a_detector_without_a_detection_target_is_pointed_to_detection() -> None:
    images = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(CamvizError, match=r"detector .* target=camviz\.Detection\(0\)"):
        camviz.explain(PerImageDetections(), images, layer="conv")
    explained = camviz.explain(
        PerImageDetections(), images, layer="conv", target=camviz.Detection(0)
    )
    assert explained.scores.shape == (1,)


def test_an_image_without_a_detection_says_so_and_how_to_lower_the_threshold() -> None:
    images = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(CamvizError) as error:
        camviz.explain(PerImageDetections(1.0), images, layer="conv", target=camviz.Detection(0))
    message = str(error.value)
    assert "image 0 has no detection to explain" in message and "score_threshold=" in message
