"""Score-CAM, SS-CAM and Ablation-CAM: the papers' formulas written out in plain torch, the
exact shortcuts against the naive computation, and pytorch-grad-cam and torchcam."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from reference import min_max
from torch import nn

import camviz
from camviz.cams import LayerData, get, layer_pass
from camviz.core.errors import CamvizError
from camviz.core.grids import layout_of
from camviz.core.maps import normalize


class TinyNet(nn.Module):
    """Fixed float64 weights: stride-2 conv to 4 channels + ReLU (4x4 maps from 8x8 inputs),
    mean over the grid, linear head to 3 classes.

    Channel 2 is zero everywhere (bias -100 before the ReLU) and channel 3 is the constant
    0.5 (zero weights, bias 0.5): both have constant Score-CAM masks.
    """

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 2, stride=2), nn.ReLU())
        self.head = nn.Linear(4, 3)
        with torch.no_grad():
            conv = self.features[0]
            conv.weight.copy_(torch.randn(4, 3, 2, 2, generator=generator))
            conv.weight[3] = 0
            conv.bias.copy_(torch.tensor([0.1, 0.2, -100.0, 0.5]))
            self.head.weight.copy_(torch.randn(3, 4, generator=generator))
            self.head.bias.copy_(torch.tensor([2.0, 1.0, 3.0]))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class ResidualNet(TinyNet):
    """TinyNet with ``stem -> body (target) -> body += stem`` in place, as in a ResNet block."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = self.features
        self.body = nn.Conv2d(4, 4, 1).double()
        with torch.no_grad():
            self.body.weight.copy_(torch.eye(4).view(4, 4, 1, 1) * 2 - 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.stem(x)
        out = self.body(stem)
        out += stem
        return self.head(torch.relu(out).mean(dim=(2, 3)))


class ConcatNet(ResidualNet):
    """The layers after ``body`` concatenate its output with the earlier ``stem`` output."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = self.stem(x)
        both = torch.cat([stem, self.body(stem)], dim=1)
        return self.head(both.mean(dim=(2, 3)))


def output_of(model: nn.Module, layer: str, inputs: torch.Tensor) -> torch.Tensor:
    with camviz.capture(model, layer) as seen, torch.no_grad():
        model(inputs)
    return seen.activations[layer]


def paper_scorecam(
    model, inputs, layer, classes, noise=None, scales=None, probability=False, torchcam=False
) -> torch.Tensor:
    """Score-CAM, Algorithm 1 of Wang et al. 2020, one image and one channel at a time.

    ``noise[n][k]`` (a list per draw) turns it into SS-CAM: the mean score over the draws.
    ``scales`` turns it into IS-CAM: the mean score over the masks scaled by each.
    ``probability``: the weights are the class probabilities of the masked inputs (the
    authors' code) instead of a softmax over channels of their logits.
    ``torchcam``: masks normalised before upsampling, as torchcam makes them.
    A constant map normalises to the zero mask.
    """
    activations = output_of(model, layer, inputs)
    maps = []
    for n, cls in enumerate(classes):
        scores = []
        for k, channel in enumerate(activations[n]):
            varies = channel.amax() > channel.amin()
            if torchcam:  # normalised first (with torchcam's 1e-8), then upsampled
                channel = (channel - channel.min()) / (channel.max() - channel.min() + 1e-8)
            upsampled = F.interpolate(
                channel[None, None], size=inputs.shape[-2:], mode="bilinear", align_corners=False
            )[0, 0]
            mask = upsampled if torchcam else torch.zeros_like(upsampled)
            if varies and not torchcam:
                mask = (upsampled - upsampled.min()) / (upsampled.max() - upsampled.min())
            draws = [mask] if noise is None else [mask + draw[n][k] for draw in noise]
            if scales is not None:
                draws = [scale * mask for scale in scales]
            with torch.no_grad():
                outputs = [model(inputs[n : n + 1] * d)[0] for d in draws]
                if probability:
                    outputs = [torch.softmax(output, dim=0) for output in outputs]
                scores.append(torch.stack([output[cls] for output in outputs]))
        alpha = torch.stack(scores).mean(1)
        if not probability:
            alpha = torch.softmax(alpha, dim=0)
        maps.append(torch.relu(torch.einsum("k,khw->hw", alpha, activations[n])))
    return min_max(torch.stack(maps))


def paper_ablationcam(model, inputs, layer, classes) -> torch.Tensor:
    """Ablation-CAM, Desai and Ramaswamy 2020: w_k = (y - y_k) / y, one channel at a time."""
    module = dict(model.named_modules())[layer]
    activations = output_of(model, layer, inputs)
    maps = []
    with torch.no_grad():
        for n, cls in enumerate(classes):
            single = inputs[n : n + 1]
            original = model(single)[0, cls]
            weights = []
            for k in range(activations.shape[1]):

                def zero(mod, args, output, k=k):
                    output = output.clone()
                    output[:, k] = 0
                    return output

                handle = module.register_forward_hook(zero)
                try:
                    weights.append((original - model(single)[0, cls]) / original)
                finally:
                    handle.remove()
            maps.append(torch.relu(torch.einsum("k,khw->hw", torch.stack(weights), activations[n])))
    return min_max(torch.stack(maps))


@pytest.fixture
def tiny_inputs() -> torch.Tensor:
    torch.manual_seed(2)
    return torch.rand(3, 3, 8, 8, dtype=torch.float64) - 0.3


class RowCounter:
    """Counts forward passes and rows seen by a module."""

    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        self.rows = 0
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        self.calls += 1
        self.rows += args[0].shape[0]


# The papers' formulas ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "layer"), [(TinyNet(), "features"), (ResidualNet(), "body")], ids=["tiny", "residual"]
)
def test_scorecam_equals_the_paper_formula(model, layer, tiny_inputs, untouched):
    with untouched(model):
        result = camviz.explain(model, tiny_inputs, "scorecam", layer=layer, target=[0, 2, 0])
    expected = paper_scorecam(model, tiny_inputs, layer, [0, 2, 0])
    torch.testing.assert_close(result.layer_maps, expected)


@pytest.mark.parametrize(
    ("model", "layer"), [(TinyNet(), "features"), (ResidualNet(), "body")], ids=["tiny", "residual"]
)
def test_ablationcam_equals_the_paper_formula(model, layer, tiny_inputs, untouched):
    with untouched(model), warnings.catch_warnings():
        warnings.simplefilter("error")  # the broadcast shortcut must be taken, no fallback
        result = camviz.explain(model, tiny_inputs, "ablationcam", layer=layer, target=[0, 2, 0])
    expected = paper_ablationcam(model, tiny_inputs, layer, [0, 2, 0])
    torch.testing.assert_close(result.layer_maps, expected)


def test_sscam_equals_the_paper_formula_with_the_same_noise(tiny_inputs, untouched):
    model, draws, std = TinyNet(), 3, 0.3
    # Each image draws from its own generator seeded alike: draw by draw, channel by channel,
    # in float32 whatever the model's dtype (this one is float64).
    generators = [torch.Generator().manual_seed(7) for _ in tiny_inputs]
    noise = [
        [[std * torch.randn(8, 8, generator=g).double() for _ in range(4)] for g in generators]
        for _ in range(draws)
    ]
    with untouched(model):
        result = camviz.explain(
            model,
            tiny_inputs,
            "sscam",
            layer="features",
            target=[0, 2, 0],
            batch_size=5,  # chunks that split an image's channels change nothing
            num_samples=draws,
            std=std,
            seed=7,
        )
    expected = paper_scorecam(model, tiny_inputs, "features", [0, 2, 0], noise)
    torch.testing.assert_close(result.layer_maps, expected)


def test_iscam_equals_its_formula_with_growing_masks(tiny_inputs, untouched):
    # torchcam's IS-CAM: step i of M scales the mask by sum_{j<=i} j / M.
    model, steps = TinyNet(), 4
    scales = [sum(j / steps for j in range(1, i + 1)) for i in range(1, steps + 1)]
    with untouched(model):
        result = camviz.explain(
            model, tiny_inputs, "iscam", layer="features", target=[0, 2, 0], num_samples=steps
        )
    expected = paper_scorecam(model, tiny_inputs, "features", [0, 2, 0], scales=scales)
    torch.testing.assert_close(result.layer_maps, expected)
    plain = camviz.explain(model, tiny_inputs, "scorecam", layer="features", target=[0, 2, 0])
    assert (plain.layer_maps - result.layer_maps).abs().max() > 1e-2


@pytest.mark.parametrize("method", ["scorecam", "iscam"])
def test_probability_weighting_equals_the_authors_code(method, tiny_inputs):
    model = TinyNet()
    options = {"num_samples": 2} if method == "iscam" else {}
    scales = [0.5, 1.5] if method == "iscam" else None
    result = camviz.explain(
        model, tiny_inputs, method, "features", [0, 2, 0], weighting="probability", **options
    )
    expected = paper_scorecam(
        model, tiny_inputs, "features", [0, 2, 0], scales=scales, probability=True
    )
    torch.testing.assert_close(result.layer_maps, expected)
    softmax = camviz.explain(model, tiny_inputs, method, "features", [0, 2, 0], **options)
    assert (softmax.layer_maps - result.layer_maps).abs().max() > 1e-2


def test_probability_weighting_needs_a_target_with_logits(tiny_inputs):
    with pytest.raises(CamvizError, match="not a callable"):
        camviz.explain(
            TinyNet(),
            tiny_inputs,
            "scorecam",
            "features",
            lambda out: out[:, 0],
            weighting="probability",
        )
    with pytest.raises(CamvizError, match="weighting='softmax' or 'probability'"):
        camviz.cams.get("scorecam")(weighting="logits")


# Exact shortcuts -------------------------------------------------------------------------


def test_scorecam_scores_all_constant_channels_with_one_blank_image(tiny_inputs):
    model = TinyNet()
    counter = RowCounter(model.features)
    try:
        camviz.explain(model, tiny_inputs, "scorecam", layer="features", target=0, batch_size=4)
    finally:
        counter.handle.remove()
    # 1 plain pass of 3 images; 3 images x 2 varying channels masked; 1 blank image.
    assert counter.rows == 3 + 3 * 2 + 1
    assert counter.calls == 1 + 2 + 1  # 6 masked images in chunks of 4, then the blank


def test_ablationcam_runs_the_layers_before_the_target_once_per_chunk(tiny_inputs):
    model = ResidualNet()
    counter = RowCounter(model.stem)
    try:
        camviz.explain(model, tiny_inputs, "ablationcam", layer="body", target=0, batch_size=3)
    finally:
        counter.handle.remove()
    # The plain pass (3 rows), then one row per chunk: 4 channels in chunks of 3 is 2 chunks
    # per image (the first one also carries the unablated check row, after the stem).
    assert (counter.calls, counter.rows) == (1 + 3 * 2, 3 + 3 * 2)


def test_ablationcam_falls_back_to_full_passes_when_the_later_layers_reject_a_batch(tiny_inputs):
    model = ConcatNet()
    with pytest.warns(RuntimeWarning, match="re-running the whole network per channel"):
        result = camviz.explain(model, tiny_inputs, "ablationcam", layer="body", target=[1, 0, 2])
    expected = paper_ablationcam(model, tiny_inputs, "body", [1, 0, 2])
    torch.testing.assert_close(result.layer_maps, expected)


def test_ablationcam_broadcast_shortcut_is_exact_on_resnet_in_place_residuals(resnet18):
    """``layer4.1.bn2`` is followed by ``out += identity`` with ``identity`` from before it:
    the ablated scores of the shortcut equal full forward passes with one channel zeroed."""
    torch.manual_seed(5)
    inputs = torch.randn(1, 3, 64, 64)
    layer = "layer4.1.bn2"
    recorded = layer_pass(resnet18, inputs, [layer], 4, gradients=False)
    output = recorded.activations[layer]
    data = LayerData(
        layer=layer,
        activations=output,
        gradients=None,
        model=resnet18,
        inputs=inputs,
        score_fn=recorded.score_fns[0],
        class_ids=recorded.class_ids[:, 0],
        scores=recorded.scores[:, 0],
        layout=layout_of(output.shape, layer, inputs.shape[-2:]),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ablated = get("ablationcam")(batch_size=128).ablated_scores([data])[0, 0]
    channels = torch.randperm(512)[:24]
    keep = torch.ones(24, 512, 1, 1)
    keep[torch.arange(24), channels] = 0
    handle = resnet18.layer4[1].bn2.register_forward_hook(lambda module, args, out: out * keep)
    try:
        with torch.no_grad():
            expected = resnet18(inputs.expand(24, -1, -1, -1))[:, 4]
    finally:
        handle.remove()
    torch.testing.assert_close(ablated[channels], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["scorecam", "ablationcam"])
def test_top_k_ranks_share_the_perturbed_passes(method, tiny_inputs):
    model = TinyNet()
    counter = RowCounter(model.head)
    try:
        ranked = camviz.explain(model, tiny_inputs, method, layer="features", target="top2")
        rows_for_two = counter.rows
        counter.rows = 0
        single = camviz.explain(model, tiny_inputs, method, layer="features", target=None)
    finally:
        counter.handle.remove()
    assert rows_for_two == counter.rows
    second = camviz.explain(
        model, tiny_inputs, method, layer="features", target=ranked.targets.view(3, 2)[:, 1]
    )
    torch.testing.assert_close(ranked.layer_maps[0::2], single.layer_maps)
    torch.testing.assert_close(ranked.layer_maps[1::2], second.layer_maps)


# Targets in perturbed batches --------------------------------------------------------------


@pytest.mark.parametrize("method", ["scorecam", "ablationcam"])
def test_a_row_wise_callable_target_equals_the_class_target(method, tiny_inputs):
    model = TinyNet()
    by_class = camviz.explain(model, tiny_inputs, method, layer="features", target=2)
    by_callable = camviz.explain(
        model, tiny_inputs, method, layer="features", target=lambda out: out[:, 2]
    )
    torch.testing.assert_close(by_callable.layer_maps, by_class.layer_maps)


def test_a_callable_that_does_not_score_row_by_row_is_explained():
    model = TinyNet()
    # Channels 0 and 1 vary in both images: 4 masked images, so the passes after the first,
    # measured one (3 rows) hold more than the two rows that out[:2] happens to fit.
    seeded = torch.Generator().manual_seed(0)
    inputs = torch.rand(2, 3, 8, 8, dtype=torch.float64, generator=seeded) - 0.3
    with pytest.raises(CamvizError, match="must score each row on its own"):
        camviz.explain(model, inputs, "scorecam", layer="features", target=lambda out: out[:2, 0])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_size": 0}, "batch_size >= 1"),
        ({"batch_size": 2.5}, "batch_size >= 1"),
    ],
)
def test_bad_batch_sizes_are_refused(options, message):
    for method in ("scorecam", "sscam", "ablationcam"):
        with pytest.raises(CamvizError, match=message):
            camviz.cams.get(method)(**options)
    with pytest.raises(CamvizError, match="num_samples >= 1"):
        camviz.cams.get("sscam")(num_samples=0)


# The peers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peer_batch() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 64, 64)


@pytest.mark.peers
def test_ablationcam_matches_pytorch_grad_cam(resnet18, peer_batch, untouched):
    """Tolerance 1e-4: float rounding only. ``layer1`` ends with a ReLU, so pytorch-grad-cam
    ablates with zero as the paper does; it normalises again after resizing, hence the
    ``normalize`` of camviz's heatmaps."""
    from pytorch_grad_cam import AblationCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    with untouched(resnet18):
        result = camviz.explain(resnet18, peer_batch, "ablationcam", layer="layer1", target=[3, 7])
    with AblationCAM(resnet18, [resnet18.layer1]) as cam:
        theirs = cam(peer_batch, [ClassifierOutputTarget(3), ClassifierOutputTarget(7)])
    torch.testing.assert_close(
        normalize(result.heatmaps), torch.from_numpy(theirs), rtol=0, atol=1e-4
    )


@pytest.mark.peers
def test_scorecam_matches_pytorch_grad_cam_and_torchcam(resnet18, peer_batch, untouched):
    """Tolerances from the documented differences in how masks are made (see ScoreCAM):
    5e-2 against pytorch-grad-cam (``align_corners=True``), 1e-2 against torchcam
    (normalisation before upsampling); measured 1.4e-2 and 4e-3."""
    from pytorch_grad_cam import ScoreCAM as GradCamScoreCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
    from torchcam.methods import ScoreCAM as TorchcamScoreCAM

    with untouched(resnet18):
        result = camviz.explain(resnet18, peer_batch, "scorecam", layer="layer1", target=[3, 7])
    with GradCamScoreCAM(resnet18, [resnet18.layer1]) as cam:
        theirs = cam(peer_batch, [ClassifierOutputTarget(3), ClassifierOutputTarget(7)])
    torch.testing.assert_close(
        normalize(result.heatmaps), torch.from_numpy(theirs), rtol=0, atol=5e-2
    )
    with TorchcamScoreCAM(resnet18, "layer1", input_shape=(3, 64, 64)) as extractor:
        (torchcam_maps,) = extractor([3, 7], resnet18(peer_batch))
    torch.testing.assert_close(result.layer_maps, torchcam_maps, rtol=0, atol=1e-2)


@pytest.mark.peers
def test_iscam_matches_torchcam(tiny_inputs, untouched):
    """torchcam normalises each channel before upsampling it into a mask (camviz after, as
    the paper): with that order, the formula gives torchcam's maps; the two orders differ by
    up to 2e-2 here. On the tiny network, because IS-CAM costs num_samples times Score-CAM."""
    from torchcam.methods import ISCAM as TorchcamISCAM  # noqa: N811 - named after its library

    model, inputs = TinyNet().float(), tiny_inputs.float()
    with untouched(model):
        result = camviz.explain(
            model, inputs, "iscam", layer="features", target=[0, 2, 1], num_samples=3
        )
    with TorchcamISCAM(model, "features", input_shape=(3, 8, 8), num_samples=3) as extractor:
        (torchcam_maps,) = extractor([0, 2, 1], model(inputs))
    scales = [1 / 3, 1, 2]  # the running sums of 1/3, 2/3, 3/3
    expected = paper_scorecam(model, inputs, "features", [0, 2, 1], scales=scales, torchcam=True)
    torch.testing.assert_close(torchcam_maps, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(result.layer_maps, torchcam_maps, rtol=0, atol=5e-2)


@pytest.mark.peers
def test_sscam_matches_torchcam(resnet18, peer_batch, untouched):
    """Tolerance 5e-2 (measured up to 1.3e-2 over three seeds): besides the mask order of
    Score-CAM, each library draws its own noise, so with 2 draws the averaged scores differ a
    little."""
    from torchcam.methods import SSCAM as TorchcamSSCAM  # noqa: N811 - named after its library

    with untouched(resnet18):
        result = camviz.explain(
            resnet18,
            peer_batch,
            "sscam",
            layer="layer1",
            target=[3, 7],
            num_samples=2,
            std=0.2,
            seed=0,
        )
    torch.manual_seed(5)
    with TorchcamSSCAM(
        resnet18, "layer1", input_shape=(3, 64, 64), num_samples=2, std=0.2
    ) as extractor:
        (torchcam_maps,) = extractor([3, 7], resnet18(peer_batch))
    torch.testing.assert_close(result.layer_maps, torchcam_maps, rtol=0, atol=5e-2)


PER_SAMPLE = torch.tensor([0, 2, 1])
# Chunk sizes that make a chunk of re-run rows as long as the batch of 3 (Ablation-CAM's
# first chunk carries an extra unablated row).
BATCH_OF_THREE = [("scorecam", 3), ("ablationcam", 2)]


@pytest.mark.parametrize(("method", "batch_size"), BATCH_OF_THREE)
def test_a_target_that_takes_rows_scores_each_row_for_its_own_input(
    method, batch_size, tiny_inputs
):
    model = TinyNet()
    by_class = camviz.explain(
        model, tiny_inputs, method, layer="features", target=PER_SAMPLE, batch_size=batch_size
    )
    by_rows = camviz.explain(
        model,
        tiny_inputs,
        method,
        layer="features",
        target=lambda out, rows: out[torch.arange(len(rows)), PER_SAMPLE[rows]],
        batch_size=batch_size,
    )
    torch.testing.assert_close(by_rows.layer_maps, by_class.layer_maps)
    torch.testing.assert_close(by_rows.scores, by_class.scores)


# Ablation-CAM warns that it retries without its shortcut before the error.
@pytest.mark.filterwarnings("ignore:ablationcam. the layers after")
@pytest.mark.parametrize(("method", "batch_size"), BATCH_OF_THREE)
def test_a_one_argument_per_sample_callable_is_refused_not_misread(method, batch_size, tiny_inputs):
    def per_sample(out: torch.Tensor) -> torch.Tensor:
        return out[torch.arange(len(out)), PER_SAMPLE]

    with pytest.raises(CamvizError, match="or take the rows, fn\\(output, rows\\)"):
        camviz.explain(
            TinyNet(),
            tiny_inputs,
            method,
            layer="features",
            target=per_sample,
            batch_size=batch_size,
        )
