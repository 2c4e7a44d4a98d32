"""Hugging Face detectors and segmenters from ``--model hf:DIR``, and the default layers that
camviz's structural rule finds for the models the sources build.

Each model is built from a tiny config with random weights, saved with ``save_pretrained`` and
its image processor beside it, and read back offline (``HF_HUB_OFFLINE=1``, set by the ``cli``
fixture). Numbers are checked against Hugging Face's own post-processing or against the
model's output read by hand: boxes on the photo, the region of the predicted class, the
per-class maps of a mask classifier.
"""

# ruff: noqa: F811 - the fixtures imported from test_model_sources are the tests' parameters

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from PIL import Image
from test_model_sources import cli, explain, rows, yolo  # noqa: F401 - cli, yolo: fixtures

import camviz
from camviz.core.layers import default_target_layer

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# The processors' size: a 64 x 96 photo is not resized.
_SIZE = {"shortest_edge": 64, "longest_edge": 96}


def _backbone(*stages: str):
    return transformers.ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        out_features=list(stages),
    )


def _detr_layers() -> dict:
    return {
        "use_timm_backbone": False,
        "use_pretrained_backbone": False,
        "d_model": 32,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "num_queries": 10,
        "num_labels": 4,
        "id2label": {0: "cat", 1: "dog", 2: "fox", 3: "owl"},
        "label2id": {"cat": 0, "dog": 1, "fox": 2, "owl": 3},
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-tasks")


def _saved(folder: Path, name: str, model, processor) -> Path:
    path = folder / name
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def detr(folder) -> Path:
    """DETR: a softmax over 4 classes and "no object"."""
    torch.manual_seed(0)
    config = transformers.DetrConfig(backbone_config=_backbone("stage2"), **_detr_layers())
    processor = transformers.DetrImageProcessor(size=_SIZE)
    return _saved(folder, "detr", transformers.DetrForObjectDetection(config), processor)


@pytest.fixture(scope="module")
def conditional_detr(folder) -> Path:
    """Conditional DETR: a sigmoid for each of 4 classes."""
    torch.manual_seed(0)
    config = transformers.ConditionalDetrConfig(
        backbone_config=_backbone("stage2"), **_detr_layers()
    )
    processor = transformers.ConditionalDetrImageProcessor(size=_SIZE)
    model = transformers.ConditionalDetrForObjectDetection(config)
    return _saved(folder, "conditional-detr", model, processor)


@pytest.fixture(scope="module")
def rt_detr(folder) -> Path:
    """RT-DETR: three backbone levels, a hybrid encoder, a sigmoid per class; its processor
    squashes every photo to 64 x 64."""
    torch.manual_seed(0)
    backbone = transformers.RTDetrResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1],
        layer_type="basic", out_features=["stage2", "stage3", "stage4"],
    )  # fmt: skip
    config = transformers.RTDetrConfig(
        backbone_config=backbone, use_pretrained_backbone=False, encoder_hidden_dim=16,
        encoder_in_channels=[16, 24, 32], feat_strides=[8, 16, 32], d_model=16,
        encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, num_queries=10, num_labels=4,
        decoder_in_channels=[16, 16, 16], num_feature_levels=3, decoder_n_points=2,
    )  # fmt: skip
    processor = transformers.RTDetrImageProcessor(size={"height": 64, "width": 64})
    return _saved(folder, "rt-detr", transformers.RTDetrForObjectDetection(config), processor)


def _photo(path: Path, height: int, width: int, seed: int = 0) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def test_a_detr_folder_explains_one_map_per_object_on_the_photo(cli, detr, tmp_path):
    photo = _photo(tmp_path / "photo.png", 64, 96)  # the processor's size: no resize
    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", f"hf:{detr}", "--min-score", 0,
        "--max-objects", 2,
    )  # fmt: skip
    assert status == 0, error

    # Hugging Face's processor and post-processing: per query, the best class of a softmax
    # without its "no object" column, boxes on the photo.
    model = transformers.DetrForObjectDetection.from_pretrained(detr).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(detr)
    with torch.no_grad():
        output = model(**processor(Image.open(photo), return_tensors="pt"))
    (found,) = processor.post_process_object_detection(output, 0.0, target_sizes=[(64, 96)])
    best = found["scores"].argsort(descending=True)[:2]
    (row,) = rows(tmp_path / "out")
    assert [entry["name"] for entry in row["explained"]] == [
        model.config.id2label[int(label)] for label in found["labels"][best]
    ]
    for entry, index in zip(row["explained"], best.tolist(), strict=True):
        np.testing.assert_allclose(entry["box"], found["boxes"][index].tolist(), atol=0.006)
        assert entry["score"] == pytest.approx(float(found["scores"][index]), abs=1e-4)  # rounded
        assert (tmp_path / "out" / entry["files"]["overlay"]).is_file()


def test_a_sigmoid_detector_on_a_resized_photo(conditional_detr):
    """Conditional DETR scores each class with a sigmoid; the photo is resized inside the
    model as the processor does, and the boxes come back in the photo's pixels."""
    loaded = camviz.load_model(f"hf:{conditional_detr}")
    network = transformers.ConditionalDetrForObjectDetection.from_pretrained(conditional_detr)
    photo = torch.rand(1, 3, 40, 60)  # shorter side 40 -> 64, longer 60 -> 96
    mean = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    normalised = (photo - mean) / std
    with loaded.applied() as model, torch.no_grad():
        model.score_thresh = 0.0
        (found,) = model(normalised)
        resized = F.interpolate(normalised, size=(64, 96), mode="bilinear", align_corners=False)
        output = network.eval()(pixel_values=resized)

    scores, labels = output.logits[0].sigmoid().max(-1)
    order = scores.argsort(descending=True)
    cx, cy, w, h = output.pred_boxes[0, order].unbind(-1)
    boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
    torch.testing.assert_close(found["scores"], scores[order])
    torch.testing.assert_close(found["labels"], labels[order])
    torch.testing.assert_close(found["boxes"], boxes * torch.tensor([60, 40, 60, 40]))
    torch.testing.assert_close(loaded.preprocess.mean, (0.485, 0.456, 0.406))
    assert (loaded.task, loaded.categories) == ("detection", ["cat", "dog", "fox", "owl"])
    # --input-size is the resize's shorter side, the longer one limited in proportion.
    smaller = camviz.load_model(f"hf:{conditional_detr}", input_size=32)
    with smaller.applied() as model:
        assert model.resize.size(40, 60) == (32, 48)
        assert model.resize.size(20, 80) == (12, 48)  # the longer side at its limit
    assert smaller.model.resize.size(40, 60) == (64, 96)  # put back after the block


@pytest.mark.parametrize(
    ("detector", "layer"),
    [
        # The encoder's output: the backbone's map flattened (the decoder's queries are no
        # grid).
        ("conditional_detr", "model.model.encoder.layers.0"),
        # The projection of the finest encoder level that the decoder reads (the encoder's
        # own box head scores proposals, not the explained query).
        ("rt_detr", "model.model.decoder_input_proj.2"),
    ],
)
def test_a_detectors_default_layer_is_the_one_its_score_depends_on(detector, layer, request):
    """The default layer the load finds is the one an explained object's gradient picks."""
    loaded = camviz.load_model(f"hf:{request.getfixturevalue(detector)}")
    photo = torch.rand(1, 3, 64, 96)
    with loaded.applied() as model:
        model.score_thresh = 0.0
        picked = default_target_layer(model, photo, camviz.Detection(0))
    assert loaded.default_layer == picked == layer


def test_a_yolo_default_layer_is_the_input_of_its_detect_head(yolo):
    """No source names the layer: the structural rule finds the head's input levels, the
    last maps the boxes' scores depend on (the head's own box bins are no grid)."""
    yaml, weights = yolo
    loaded = camviz.load_model(f"yolo:{yaml}", weights=weights, input_size=64)
    with loaded.applied() as model:
        picked = default_target_layer(model, torch.rand(1, 3, 48, 64), camviz.Detection(0))
    assert loaded.default_layer == picked == "network.model.4:input"


@pytest.fixture(scope="module")
def segformer(folder) -> Path:
    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=32, num_labels=3,
    )  # fmt: skip
    processor = transformers.SegformerImageProcessor(size={"height": 32, "width": 32})
    model = transformers.SegformerForSemanticSegmentation(config)
    return _saved(folder, "segformer", model, processor)


def test_a_segformer_folder_explains_its_largest_region(cli, segformer, tmp_path):
    photo = _photo(tmp_path / "photo.png", 32, 32, seed=3)
    status, _, error = explain(
        cli, photo, tmp_path / "out", "--model", f"hf:{segformer}", "--heatmap", "npz",
        "--no-panel",
    )  # fmt: skip
    assert status == 0, error

    model = transformers.SegformerForSemanticSegmentation.from_pretrained(segformer).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(segformer)
    pixels = processor(Image.open(photo), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        predicted = model(pixel_values=pixels).logits.argmax(1)[0]  # at a quarter: 8 x 8
    chosen = int(torch.bincount(predicted.flatten(), minlength=3).argmax())
    (row,) = rows(tmp_path / "out")
    (entry,) = row["explained"]
    assert entry["id"] == chosen
    expected = camviz.explain(model, pixels, target=camviz.Region(chosen, predicted == chosen))
    saved = np.load(tmp_path / "out" / entry["files"]["heatmap"])["heatmap"]
    np.testing.assert_allclose(saved, expected.heatmaps[0].numpy(), atol=1e-4)
    assert row["layers"] == expected.layers


@pytest.fixture(scope="module")
def maskformer(folder) -> Path:
    torch.manual_seed(0)
    swin = transformers.SwinConfig(
        image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
        window_size=2, out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    decoder = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "num_queries": 10}
    decoder |= {"encoder_attention_heads": 2, "decoder_attention_heads": 2}
    decoder |= {"encoder_ffn_dim": 32, "decoder_ffn_dim": 32}
    config = transformers.MaskFormerConfig(
        backbone_config=swin, fpn_feature_size=32, mask_feature_size=32, num_queries=10,
        num_labels=3, decoder_config=decoder,
    )  # fmt: skip
    processor = transformers.MaskFormerImageProcessor(size={"shortest_edge": 64})
    model = transformers.MaskFormerForInstanceSegmentation(config)
    return _saved(folder, "maskformer", model, processor)


def test_a_maskformer_segments_through_its_queries(cli, maskformer, tmp_path):
    """The per-class maps are Hugging Face's semantic post-processing at the input's size;
    the command line explains the region of the class they predict most."""
    loaded = camviz.load_model(f"hf:{maskformer}")
    network = transformers.MaskFormerForInstanceSegmentation.from_pretrained(maskformer).eval()
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        output = network(pixel_values=pixels)
        classes = output.class_queries_logits.softmax(-1)[..., :-1]
        masks = F.interpolate(output.masks_queries_logits, size=(64, 64), mode="bilinear")
        expected = (classes[..., None, None] * masks.sigmoid()[:, :, None]).sum(1)
        torch.testing.assert_close(loaded.model(pixels), expected)
    assert loaded.task == "segmentation"

    photo = _photo(tmp_path / "photo.png", 64, 64, seed=4)
    status, _, error = explain(cli, photo, tmp_path / "out", "--model", f"hf:{maskformer}")
    assert status == 0, error
    tensor = loaded.preprocess(camviz.load_image(photo))[None]
    with torch.no_grad():
        predicted = loaded.model(tensor).argmax(1)[0]
    (row,) = rows(tmp_path / "out")
    (entry,) = row["explained"]
    assert entry["id"] == int(torch.bincount(predicted.flatten(), minlength=3).argmax())
    assert (tmp_path / "out" / entry["files"]["overlay"]).is_file()
    # The last map the region's score depends on: the backbone's last level, projected for
    # the decoder (its queries are no grid).
    assert row["layers"] == ["model.model.transformer_module.input_projection"]
