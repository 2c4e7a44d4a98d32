"""Methods that wrap a base method: Finer-CAM (a contrastive target), RefineCAM (maps of
several layers multiplied) and SESS (sliding windows at several scales). Each is checked
against its formula written out, and against pytorch-grad-cam and torchcam where they
implement it, on a tiny CNN."""

from __future__ import annotations

import copy

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from conftest import conv_net
from reference import min_max
from torch import nn

import camviz
from camviz.core.errors import CamvizError
from camviz.core.targets import Contrast, Nearest, score_fns

CLASSES = [1, 3]


def small_cnn() -> nn.Module:
    """conv -> ReLU -> conv (stride 2) -> ReLU -> global average pool -> linear, 10 classes."""
    return conv_net(8, 8, classes=10, stride=(1, 2), padding=1)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return small_cnn()


@pytest.fixture(scope="module")
def inputs() -> torch.Tensor:
    return torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))


# --- Finer-CAM ----------------------------------------------------------------------------


def test_contrast_with_nearest_references_on_hand_logits():
    logits = torch.tensor([[0.0, 5.0, 4.5, 1.0, 6.0], [3.0, 2.0, 9.0, 2.9, -1.0]])
    # sample 0 explains class 1 (5.0): nearest 4.5 (class 2) and 6.0 (class 4);
    # sample 1 explains class 0 (3.0): nearest 2.9 (class 3) and 2.0 (class 1).
    (score,), ids = score_fns(Contrast([1, 0], Nearest(2), alpha=0.5), logits)
    expected = torch.tensor([5.0 - 0.5 * (4.5 + 6.0) / 2, 3.0 - 0.5 * (2.9 + 2.0) / 2])
    torch.testing.assert_close(score(logits), expected)
    assert ids.tolist() == [[1], [0]]
    (by_hand,), _ = score_fns(Contrast([1, 0], [[2, 4], [3, 1]], alpha=0.5), logits)
    torch.testing.assert_close(by_hand(logits), expected)
    with pytest.raises(CamvizError, match=r"Nearest\(k\) needs 1 <= k <= 4"):
        score_fns(Contrast(0, Nearest(5)), logits)


def test_finercam_is_gradcam_of_the_class_minus_alpha_times_its_nearest_classes(model, inputs):
    # A = the second ReLU's output; y = W mean_ij(A) + b, so dy~/dA = (W_c - alpha mean_t
    # W_d) / (h w) everywhere, and Grad-CAM's weights are that vector.
    alpha, references = 0.6, 3
    with camviz.capture(model, "3") as seen, torch.no_grad():
        logits = model(inputs)
    activations = seen.activations["3"]
    weights = model[6].weight.detach()
    maps = []
    for sample, c in enumerate(CLASSES):
        distance = (logits[sample] - logits[sample, c]).abs()
        distance[c] = float("inf")
        nearest = distance.argsort()[:references]
        direction = weights[c] - alpha * weights[nearest].mean(0)
        maps.append(torch.einsum("k,khw->hw", direction, activations[sample]) / 64)
    expected = min_max(torch.relu(torch.stack(maps)))
    result = camviz.explain(model, inputs, "finercam", layer="3", target=CLASSES)
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=0)
    assert result.targets.tolist() == CLASSES
    plain = camviz.explain(model, inputs, "gradcam", layer="3", target=CLASSES)
    assert (plain.layer_maps - result.layer_maps).abs().max() > 0.05


@pytest.mark.parametrize(("base", "peer_base"), [("gradcam", "GradCAM"), ("layercam", "LayerCAM")])
def test_finercam_matches_torchcam(model, inputs, base, peer_base):
    from torchcam import methods

    peer_model = copy.deepcopy(model)
    with methods.FinerCAM(
        peer_model, "3", input_shape=(3, 16, 16), base_method=getattr(methods, peer_base)
    ) as extractor:
        theirs = extractor(CLASSES, peer_model(inputs))[0]
    ours = camviz.explain(model, inputs, "finercam", layer="3", target=CLASSES, base=base)
    # torchcam divides by (max + 1e-8) when it normalises, and this random network's raw
    # maps peak at about 6e-4: a shift of about 2e-5.
    torch.testing.assert_close(ours.layer_maps, theirs, atol=1e-4, rtol=0)


def test_finercam_matches_pytorch_grad_cam_with_one_reference(model, inputs):
    from pytorch_grad_cam import FinerCAM

    # pytorch-grad-cam weighs several references by their softmax probabilities (see
    # camviz.cams.wrappers.FinerCAM); with one reference the weight cancels.
    peer_model = copy.deepcopy(model)
    with FinerCAM(peer_model, [peer_model[3]]) as peer:
        theirs = torch.from_numpy(peer(inputs, alpha=0.7, comparison_categories=[1]))
    ours = camviz.explain(model, inputs, "finercam", layer="3", alpha=0.7, references=1)
    torch.testing.assert_close(min_max(ours.heatmaps), theirs, atol=1e-5, rtol=0)


def test_finercam_refuses_targets_without_classes(model, inputs):
    with pytest.raises(CamvizError, match="finercam compares class scores"):
        camviz.explain(model, inputs, "finercam", layer="3", target=lambda out: out[:, 0])


# --- RefineCAM ----------------------------------------------------------------------------


def test_refinecam_multiplies_the_base_maps_of_every_layer(model, inputs):
    layers = ["1", "3"]
    result = camviz.explain(model, inputs, "refinecam", layer=layers, target=CLASSES)
    product = torch.ones(2, 16, 16)
    for layer in layers:
        base = camviz.explain(model, inputs, "gradcam++", layer=layer, target=CLASSES)
        product = (
            product
            * F.interpolate(
                base.layer_maps.unsqueeze(1), size=(16, 16), mode="bilinear", align_corners=False
            )[:, 0]
        )
    torch.testing.assert_close(result.heatmaps, min_max(product), atol=1e-5, rtol=0)
    with pytest.raises(CamvizError, match="refinecam combines layers by 'product'"):
        camviz.explain(model, inputs, "refinecam", layer=layers, fuse="mean")


def test_refinecam_matches_pytorch_grad_cam(model, inputs):
    from pytorch_grad_cam import GradCAM, RefineCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    peer_model = copy.deepcopy(model)
    peer = RefineCAM(peer_model, [peer_model[1], peer_model[3]], base_method=GradCAM)
    theirs = torch.from_numpy(peer(inputs, [ClassifierOutputTarget(c) for c in CLASSES]))
    ours = camviz.explain(
        model, inputs, "refinecam", layer=["1", "3"], target=CLASSES, base="gradcam"
    )
    # pytorch-grad-cam min-max normalises each layer's map again after resizing it.
    assert torch.corrcoef(torch.stack([ours.heatmaps.flatten(), theirs.flatten()]))[0, 1] > 0.98


# --- SESS ---------------------------------------------------------------------------------


def sess_reference(model, x, c, window, stride, sizes, pre_filter, pool):
    """SESS for one image, written out with OpenCV, NumPy and camviz's Grad-CAM per window."""
    height, width = x.shape[-2:]
    windows = []
    for shorter in sizes:
        size = (int(shorter * height / width), shorter)  # the width is the shorter side
        resized = F.interpolate(x, size=size, mode="bilinear", antialias=True)
        tops = [*range(0, max(size[0] - window, 0), stride), max(size[0] - window, 0)]
        lefts = [*range(0, max(size[1] - window, 0), stride), max(size[1] - window, 0)]
        for top in tops:
            for left in lefts:
                windows.append(
                    (resized[:, :, top : top + window, left : left + window], top, left, size)
                )
    with torch.no_grad():
        scores = np.array([float(model(w[0]).softmax(-1)[0, c]) for w in windows])
    order = np.argsort(scores)[int(len(scores) * pre_filter) :]
    total = np.zeros((height, width), np.float32)
    counts = np.zeros((height, width), np.float32)
    for index in order:
        patch, top, left, size = windows[index]
        cam = camviz.explain(model, patch, "gradcam", layer="3", target=c).heatmaps[0].numpy()
        canvas = np.zeros(size, np.float32)
        canvas[top : top + window, left : left + window] = cam * scores[index] / scores[order[-1]]
        pasted = cv2.resize(canvas, (width, height), interpolation=cv2.INTER_LINEAR)
        if pool == "max":
            total = np.maximum(total, pasted)
        else:
            total += np.where(pasted > 0, pasted, 0)
            counts += pasted > 0
    fused = total if pool == "max" else np.divide(total, np.maximum(counts, 1))
    return cv2.GaussianBlur(fused, (11, 11), 5.0)


@pytest.mark.parametrize(("pre_filter", "pool"), [(0.0, "mean"), (0.5, "max")])
def test_sess_equals_its_steps_written_out(model, inputs, pre_filter, pool):
    x = inputs[:1, :, :, :12]  # 16 x 12: windows slide along the height
    expected = sess_reference(model, x, 3, 8, 4, [8, 10], pre_filter, pool)
    result = camviz.explain(
        model,
        x,
        "sess",
        layer="3",
        target=3,
        window=8,
        stride=4,
        scales=2,
        step_ratio=0.25,
        pre_filter=pre_filter,
        pool=pool,
    )
    torch.testing.assert_close(
        result.heatmaps[0], min_max(torch.from_numpy(expected)[None])[0], atol=1e-5, rtol=0
    )


def test_sess_matches_pytorch_grad_cam(model, inputs, untouched):
    from pytorch_grad_cam import SESS, GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    peer_model = copy.deepcopy(model)
    with SESS(peer_model, [peer_model[3]], base_method=GradCAM, num_scales=2, step_size=8) as peer:
        theirs = torch.from_numpy(peer(inputs, [ClassifierOutputTarget(c) for c in CLASSES]))
    with untouched(model):
        ours = camviz.explain(model, inputs, "sess", layer="3", target=CLASSES, scales=2, stride=8)
    torch.testing.assert_close(ours.heatmaps, theirs, atol=1e-5, rtol=0)
