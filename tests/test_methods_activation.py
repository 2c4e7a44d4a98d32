"""CAM, FEM, KPCA-CAM and the random baseline: the methods that read the activations (and
the classifier's weights) but no gradient.

Each against its formula written out in plain torch on hand-sized tensors, and against
torchcam or pytorch-grad-cam on a random ResNet-18 where they have it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from reference import min_max
from torch import nn

import camviz
from camviz.cams import LayerData
from camviz.core.errors import CamvizError
from camviz.core.maps import normalize
from camviz.core.targets import Contrast


def layer_data(activations: torch.Tensor) -> LayerData:
    """What a method sees for these activations alone (no model, no gradients)."""
    return LayerData("layer", activations, None, nn.Identity(), torch.zeros(1), None, None)


class PooledNet(nn.Module):
    """conv (3x3, stride 2) -> ReLU (``features``, 4 x 5 x 5 for a 9 x 9 input) -> global
    average pooling -> linear head to 3 classes: the structure CAM is defined for."""

    def __init__(self, between: nn.Module | None = None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU())
        self.between = between or nn.Identity()
        self.fc = nn.Linear(4, 3)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.between(self.features(x).mean(dim=(2, 3))))


@pytest.fixture(scope="module")
def tiny_inputs() -> torch.Tensor:
    return torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(1))


def peer_maps(peer_class, model, inputs, layer, classes, **options) -> torch.Tensor:
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model = copy.deepcopy(model)  # pytorch-grad-cam switches modes and writes .grad
    with peer_class(
        model=model, target_layers=[dict(model.named_modules())[layer]], **options
    ) as cam:
        return torch.from_numpy(cam(inputs, targets=[ClassifierOutputTarget(c) for c in classes]))


# --- CAM ----------------------------------------------------------------------------------


def test_cam_equals_the_paper_formula(tiny_inputs, untouched):
    model = PooledNet()
    with torch.no_grad():
        a = model.features(tiny_inputs)
    weights = model.fc.weight.detach()
    with untouched(model):
        result = camviz.explain(model, tiny_inputs, "cam", layer="features", target=[0, 2])
        contrast = camviz.explain(model, tiny_inputs, "cam", "features", Contrast(0, 1))
    expected = torch.einsum("nk,nkhw->nhw", weights[[0, 2]], a)
    torch.testing.assert_close(result.layer_maps, min_max(torch.relu(expected)), atol=1e-5, rtol=0)
    # y_0 - y_1 is linear in the pooled features too: its weights are W[0] - W[1].
    expected = torch.einsum("k,nkhw->nhw", weights[0] - weights[1], a)
    torch.testing.assert_close(
        contrast.layer_maps, min_max(torch.relu(expected)), atol=1e-5, rtol=0
    )


def test_cam_is_gradcam_on_a_pooled_linear_classifier(tiny_inputs):
    # dy_c/dA^k_ij = W[c, k] / (h w) everywhere: Grad-CAM's weights are CAM's over h w.
    model = PooledNet()
    cam = camviz.explain(model, tiny_inputs, "cam", layer="features", target=[1, 0])
    gradcam = camviz.explain(model, tiny_inputs, "gradcam", layer="features", target=[1, 0])
    torch.testing.assert_close(cam.layer_maps, gradcam.layer_maps, atol=1e-6, rtol=0)


def test_cam_is_gradcam_on_a_timm_model_whose_classifier_it_finds(offline_model):
    # EfficientNet-Lite0: bn2 -> global pool -> classifier, found by timm's get_classifier().
    inputs = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    model, layer = offline_model.model, offline_model.default_layer
    cam = camviz.explain(model, inputs, "cam", layer=layer, target=281)
    gradcam = camviz.explain(model, inputs, "gradcam", layer=layer, target=281)
    torch.testing.assert_close(cam.layer_maps, gradcam.layer_maps, atol=1e-5, rtol=0)


@pytest.mark.peers
def test_cam_matches_torchcam(resnet18, small_batch):
    from torchcam.methods import CAM

    model = copy.deepcopy(resnet18)
    with CAM(model, target_layer="layer4", fc_layer="fc", input_shape=(3, 64, 64)) as extractor:
        with torch.no_grad():
            model(small_batch)
        (theirs,) = extractor([3, 7], normalized=False)
    # torchcam normalises the map without a ReLU first; camviz applies it, as the paper does.
    ours = camviz.explain(resnet18, small_batch, "cam", layer="layer4", target=[3, 7])
    torch.testing.assert_close(ours.layer_maps, min_max(torch.relu(theirs)), atol=1e-5, rtol=0)


def test_cam_works_under_inference_mode(resnet18, small_batch):
    expected = camviz.explain(resnet18, small_batch, "cam", layer="layer4", target=[3, 7])
    with torch.inference_mode():
        result = camviz.explain(resnet18, small_batch, "cam", layer="layer4", target=[3, 7])
    torch.testing.assert_close(result.layer_maps, expected.layer_maps)


@pytest.mark.parametrize(
    ("model", "layer", "message"),
    [
        (PooledNet(nn.LayerNorm(4)), "features", "is not \\(another layer sits between them\\)"),
        (PooledNet(), "features.0", "is not"),  # before the ReLU: same channels, other values
        (nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).eval(), "0", "no Linear"),
    ],
    ids=["norm before the head", "layer before the pooled one", "no linear layer"],
)
def test_cam_refuses_models_without_pooling_into_one_linear_layer(model, layer, message):
    inputs = torch.randn(1, 3, 9, 9)
    with pytest.raises(CamvizError, match=message) as error:
        camviz.explain(model, inputs, "cam", layer=layer, target=lambda out: out.flatten(1)[:, 0])
    assert "\n" not in str(error.value)


def test_cam_names_the_classifier_when_the_layer_has_other_channels(resnet18, small_batch):
    with pytest.raises(CamvizError, match=r"'fc'.*256 channels.*takes 512"):
        camviz.explain(resnet18, small_batch, "cam", layer="layer3", target=3)


# --- FEM ----------------------------------------------------------------------------------


FEM_EXAMPLE = torch.tensor(
    [
        [[1.0, 0.0, 9.0], [0.0, 0.0, 0.0]],  # one spike: above mean + 2 std there
        [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]],  # spread out: nothing above mean + 2 std
        [[0.0, 5.0, 5.0], [0.0, 0.0, 0.0]],
    ]
).unsqueeze(0)


def test_fem_is_the_papers_masks_weighted_by_channel_means():
    a = FEM_EXAMPLE
    result = camviz.cams.get("fem")().layer_map(layer_data(a))
    # mean + 2 * std per channel (population std): 10/6 + 2 * 3.300 = 8.27, 3.5 + 2 * 1.708
    # = 6.92, 10/6 + 2 * 2.357 = 6.38; only channel 0's 9 exceeds it, and its mask counts
    # its mean, 10/6, there (not 9 / 6 as the activation-weighted variant gives).
    expected = torch.zeros(1, 2, 3)
    expected[0, 0, 2] = 10 / 6
    torch.testing.assert_close(result, expected)
    lower = camviz.cams.get("fem")(k_sigma=0.5).layer_map(layer_data(a))
    # mean + std / 2: 3.32, 4.35, 2.84 -> masks {9}, {5, 6}, {5, 5} with means 10/6, 3.5, 10/6.
    expected = torch.tensor([[[0.0, 10 / 6, 10 / 6 + 10 / 6], [0.0, 3.5, 3.5]]])
    torch.testing.assert_close(lower, expected)


def test_fem_pgc_weighs_the_activations_by_the_share_of_each_mask():
    a = FEM_EXAMPLE
    result = camviz.cams.get("fem_pgc")().layer_map(layer_data(a))
    # The same masks as above: channel 0 has 1 of 6 locations, so w = (1/6, 0, 0).
    torch.testing.assert_close(result, a[:, 0] / 6)
    lower = camviz.cams.get("fem_pgc")(k_sigma=0.5).layer_map(layer_data(a))
    torch.testing.assert_close(lower, (a[:, 0] + 2 * a[:, 1] + 2 * a[:, 2]) / 6)


@pytest.mark.peers
@pytest.mark.parametrize("layer", ["layer3", "layer2"])
def test_fem_pgc_matches_pytorch_grad_cam(resnet18, small_batch, layer):
    from pytorch_grad_cam import FEM

    theirs = peer_maps(FEM, resnet18, small_batch, layer, [3, 7])
    ours = camviz.explain(resnet18, small_batch, "fem_pgc", layer=layer, target=[3, 7])
    assert theirs.amax() > 0
    torch.testing.assert_close(normalize(ours.heatmaps), theirs, atol=1e-5, rtol=0)
    papers = camviz.explain(resnet18, small_batch, "fem", layer=layer, target=[3, 7])
    assert (normalize(papers.heatmaps) - theirs).abs().amax() > 0.1


# --- KPCA-CAM -----------------------------------------------------------------------------


def kernel_pca(features: torch.Tensor, kernel: str, gamma: float) -> torch.Tensor:
    """The first kernel principal component of each map's locations, written out: K on the
    centred observations, J K J with J = I - 1/n, sqrt(lambda_1) times its eigenvector,
    signed to correlate with the channel sum."""
    x = features.double().flatten(2).transpose(1, 2)
    x = x - x.mean(1, keepdim=True)
    dot = x @ x.transpose(1, 2)
    squared = dot.diagonal(dim1=1, dim2=2)
    kernels = {
        "sigmoid": lambda: torch.tanh(gamma * dot + 1),
        "rbf": lambda: torch.exp(-gamma * (squared[:, :, None] + squared[:, None] - 2 * dot)),
        "poly": lambda: (gamma * dot + 1) ** 3,
        "linear": lambda: dot,
        "cosine": lambda: dot / (squared[:, :, None] * squared[:, None]).sqrt(),
    }
    n = x.shape[1]
    centring = torch.eye(n, dtype=x.dtype) - 1 / n
    values, vectors = torch.linalg.eigh(centring @ kernels[kernel]() @ centring)
    projection = vectors[..., -1] * values[..., -1:].sqrt()
    sign = torch.sign((projection * features.double().flatten(2).sum(1)).sum(1, keepdim=True))
    return (sign * projection).view(features.shape[0], *features.shape[2:]).float()


@pytest.mark.parametrize("kernel", ["sigmoid", "rbf", "poly", "linear", "cosine"])
def test_kpcacam_equals_kernel_pca_written_out(kernel):
    features = torch.rand(2, 4, 2, 3, generator=torch.Generator().manual_seed(3))
    result = camviz.cams.get("kpcacam")(kernel=kernel, gamma=0.7).layer_map(layer_data(features))
    torch.testing.assert_close(result, kernel_pca(features, kernel, 0.7), atol=1e-5, rtol=1e-5)


@pytest.mark.peers
@pytest.mark.parametrize("kernel", ["sigmoid", "rbf"])
def test_kpcacam_matches_pytorch_grad_cam_up_to_its_sign(resnet18, small_batch, kernel):
    from pytorch_grad_cam.utils.svd_on_activations import get_2d_projection_kernel

    from camviz.cams import layer_pass

    # pytorch-grad-cam's KPCA_CAM is scikit-learn's KernelPCA on these centred activations,
    # with gamma = 1 / C by default, and the sign scikit-learn picks (largest entry positive).
    activations = layer_pass(resnet18, small_batch, ["layer3"], gradients=False).activations
    features = activations["layer3"]
    theirs = torch.from_numpy(get_2d_projection_kernel(features.numpy(), kernel))
    ours = camviz.cams.get("kpcacam")(kernel=kernel).layer_map(layer_data(features))
    for sample in range(2):
        sign = torch.sign((ours[sample] * theirs[sample]).sum())
        torch.testing.assert_close(sign * ours[sample], theirs[sample], atol=1e-4, rtol=1e-4)


# --- The random baseline ------------------------------------------------------------------


def random_weights(method, channels: int = 5, batch: int = 1) -> torch.Tensor:
    """The channel weights themselves: with A^k the indicator of location k, the map's value
    at location k is w_k."""
    a = torch.eye(channels).view(1, channels, 1, channels).repeat(batch, 1, 1, 1)
    return method.layer_map(layer_data(a))[:, 0]


def test_random_weights_are_uniform_in_minus_one_to_one_and_seeded():
    make = camviz.cams.get("random")
    weights = random_weights(make(seed=4), channels=1000)
    assert -1 <= weights.min() < -0.9 and 0.9 < weights.max() < 1
    assert abs(float(weights.mean())) < 0.1  # U(-1, 1) has mean 0, std 0.58 / sqrt(1000)
    torch.testing.assert_close(random_weights(make(seed=4), channels=1000), weights, rtol=0, atol=0)
    assert (random_weights(make(seed=5), channels=1000) - weights).abs().amax() > 0.5
    default = random_weights(make())
    torch.testing.assert_close(random_weights(make(seed=0)), default, rtol=0, atol=0)


def test_random_maps_of_a_batch_are_those_of_its_samples_one_by_one(resnet18, small_batch):
    batch = camviz.explain(resnet18, small_batch, "random", layer="layer3", target=[3, 7])
    for sample, target in enumerate([3, 7]):
        alone = camviz.explain(
            resnet18, small_batch[sample : sample + 1], "random", layer="layer3", target=target
        )
        torch.testing.assert_close(alone.layer_maps[0], batch.layer_maps[sample])
    other = camviz.explain(resnet18, small_batch, "random", "layer3", [3, 7], seed=1)
    assert (other.layer_maps - batch.layer_maps).abs().amax() > 0.1


# --- Seeded draws -------------------------------------------------------------------------

DRAWING = {
    "random": {},
    "smooth_gradcam++": {"samples": 3},
    "sscam": {"num_samples": 2, "std": 0.5},
}


@pytest.mark.parametrize("method", list(DRAWING))
def test_seeded_draws_give_the_same_maps_in_float32_and_float64(method, tiny_inputs):
    model = PooledNet()
    twin = copy.deepcopy(model).double()
    options = DRAWING[method]
    single = camviz.explain(model, tiny_inputs, method, "features.0", [0, 2], **options)
    double = camviz.explain(twin, tiny_inputs.double(), method, "features.0", [0, 2], **options)
    assert single.layer_maps.amax() > 0
    # The weights or noise are drawn in float32 from the seeded generators, then cast: the
    # two models differ only by their rounding.
    torch.testing.assert_close(double.layer_maps.float(), single.layer_maps, atol=1e-5, rtol=0)
    # The default seed (0, sscam's too) gives the same maps again, another seed other maps.
    again = camviz.explain(model, tiny_inputs, method, "features.0", [0, 2], **options)
    torch.testing.assert_close(again.layer_maps, single.layer_maps, atol=0, rtol=0)
    other = camviz.explain(model, tiny_inputs, method, "features.0", [0, 2], seed=3, **options)
    assert (other.layer_maps - single.layer_maps).abs().amax() > 1e-3
