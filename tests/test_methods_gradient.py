"""The gradient-based and gradient-free CAM methods.

Each method is checked three ways:

* against its paper's formula, written out in plain torch, on a tiny network whose
  activations and gradients are known in closed form;
* against pytorch-grad-cam and torchcam on a random ResNet-18, where they implement it;
* on the shipped photos: in one picture holding the cat and the cup, the cat's map falls on
  the cat and the cup's on the cup.

What every method promises (sizes, batching, top-k, the model handed back as it came) is
checked for each registered method in ``tests/test_contract.py``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from PIL import Image
from reference import leaf_activations_and_gradients, min_max, principal_projection
from torch import nn

import camviz
from camviz.cams.base import LayerData
from camviz.cams.fullgrad import full_gradients
from camviz.cams.guided import input_gradients

INPUT_METHODS = ["vanilla_gradients", "guided_backprop", "guided_gradcam", "fullgrad"]
CLASSES = [0, 2]


# --- A network whose every gradient is known ---------------------------------------------


class TinyNet(nn.Module):
    """conv (3x3, stride 2, bias) -> batch norm (eval) -> rectifier -> flatten -> linear.

    A 9x9 input gives ``z``, the batch norm's output, of shape ``(4, 5, 5)``. With ``V_c`` the
    head's row ``c`` seen as a ``(4, 5, 5)`` map, ``y_c = <V_c, rect(z)> + b_c``, so
    ``dy_c/dz = V_c * rect'(z)``, and everything below ``z`` is linear.
    """

    def __init__(self, rectifier: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.rectifier = rectifier if rectifier is not None else nn.ReLU()
        self.head = nn.Linear(4 * 5 * 5, 3)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for tensor in (
                self.conv.weight,
                self.conv.bias,
                self.norm.weight,
                self.norm.bias,
                self.norm.running_mean,
                self.head.weight,
                self.head.bias,
            ):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
            self.norm.running_var.copy_(torch.rand(4, generator=generator) + 0.5)
            self.norm.weight.mul_(4)  # so that some z exceed 6, where ReLU6 is flat
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rectifier(self.norm(self.conv(x))).flatten(1))


def closed_form(model: TinyNet, x: torch.Tensor, classes, upper: float | None = None) -> dict:
    """``z``, ``V``, the batch norm's scale and bias, and the plain and guided gradients."""
    with torch.no_grad():
        norm = model.norm
        scale = norm.weight / (norm.running_var + norm.eps).sqrt()
        shift = norm.bias - norm.running_mean * scale
        conv_out = F.conv2d(x, model.conv.weight, model.conv.bias, stride=2, padding=1)
        z = conv_out * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)
        heads = model.head.weight[torch.as_tensor(classes)].view(-1, 4, 5, 5)
        passes = (z > 0) if upper is None else (z > 0) & (z < upper)

        def to_input(grad_z: torch.Tensor) -> torch.Tensor:
            grad_conv = grad_z * scale.view(1, -1, 1, 1)
            return F.conv_transpose2d(grad_conv, model.conv.weight, stride=2, padding=1)

        grad_z = heads * passes
        guided_z = torch.relu(heads) * passes
        return {
            "z": z,
            "V": heads,
            "scale": scale,
            "shift": shift,
            "grad_z": grad_z,
            "grad_conv": grad_z * scale.view(1, -1, 1, 1),
            "grad_x": to_input(grad_z),
            "guided_x": to_input(guided_z),
        }


# --- The papers' formulas, written out ----------------------------------------------------


# a: activations A^k_ij, g: gradients dy^c/dA^k_ij, both (N, C, h, w).


def gradcam_pp(a, g, moments=None):
    """moments: (D_1, D_2, D_3), the averaged powers of g (Smooth Grad-CAM++)."""
    d1, d2, d3 = (g, g**2, g**3) if moments is None else moments
    alpha = d2 / (2 * d2 + a.sum(dim=(2, 3), keepdim=True) * d3)
    alpha = torch.nan_to_num(alpha)  # 0 / 0 where the gradient is zero
    weights = (alpha * torch.relu(d1)).sum(dim=(2, 3), keepdim=True)
    return (weights * a).sum(1)


def xgradcam(a, g):
    weights = (a / a.sum(dim=(2, 3), keepdim=True) * g).sum(dim=(2, 3), keepdim=True)
    return (weights * a).sum(1)


PAPER_FORMULAS = {
    "gradcam++": gradcam_pp,
    "xgradcam": xgradcam,
    "layercam": lambda a, g: (torch.relu(g) * a).sum(1),
    "hirescam": lambda a, g: (g * a).sum(1),
    "gradcam_elementwise": lambda a, g: torch.relu(g * a).sum(1),
    "eigencam": lambda a, g: principal_projection(a),
    "eigen_gradcam": lambda a, g: principal_projection(g * a),
}


@pytest.fixture(scope="module")
def tiny_inputs() -> torch.Tensor:
    return torch.randn(2, 3, 9, 9, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method", list(PAPER_FORMULAS))
def test_layer_methods_equal_the_paper_formula(method, tiny_inputs):
    model = TinyNet()
    known = closed_form(model, tiny_inputs, CLASSES)
    result = camviz.explain(model, tiny_inputs, method=method, layer="norm", target=CLASSES)
    expected = min_max(torch.relu(PAPER_FORMULAS[method](known["z"], known["grad_z"])))
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=1e-4)


def test_smooth_gradcam_pp_averages_derivatives_over_seeded_noise(tiny_inputs):
    model = TinyNet()
    samples, noise, seed = 6, 0.3, 7
    result = camviz.explain(
        model,
        tiny_inputs,
        method="smooth_gradcam++",
        layer="norm",
        target=CLASSES,
        samples=samples,
        noise=noise,
        seed=seed,
    )
    # The same draws: each image draws one standard normal image per noisy copy from its own
    # generator seeded alike, scaled by noise * (max - min) of the image.
    generators = [torch.Generator().manual_seed(seed) for _ in tiny_inputs]
    low, high = tiny_inputs.flatten(1).aminmax(dim=1)
    sigma = (noise * (high - low)).view(-1, 1, 1, 1)
    open_fraction = torch.zeros(2, 4, 5, 5)
    for _ in range(samples):
        draws = [torch.randn(tiny_inputs.shape[1:], generator=g) for g in generators]
        noisy = tiny_inputs + sigma * torch.stack(draws)
        open_fraction += (closed_form(model, noisy, CLASSES)["z"] > 0).float() / samples
    assert ((open_fraction > 0) & (open_fraction < 1)).any(), "the noise must flip some units"
    # dy/dz = V * 1[z > 0] at each noisy input, so D_p = V^p * (fraction of draws open),
    # and A is the clean input's z.
    known = closed_form(model, tiny_inputs, CLASSES)
    moments = [known["V"] ** p * open_fraction for p in (1, 2, 3)]
    formula = gradcam_pp(known["z"], None, moments)
    torch.testing.assert_close(result.layer_maps, min_max(torch.relu(formula)))
    plain = camviz.explain(model, tiny_inputs, method="gradcam++", layer="norm", target=CLASSES)
    assert (result.layer_maps - plain.layer_maps).abs().max() > 1e-2


def test_smooth_gradcam_pp_without_noise_is_gradcam_pp(tiny_inputs):
    model = TinyNet()
    smooth = camviz.explain(
        model, tiny_inputs, "smooth_gradcam++", "norm", CLASSES, samples=2, noise=0.0
    )
    plain = camviz.explain(model, tiny_inputs, "gradcam++", "norm", CLASSES)
    torch.testing.assert_close(smooth.layer_maps, plain.layer_maps)


def test_eigencam_projection_of_a_rank_one_map_is_positive_where_activations_are_strong():
    # A^k_ij = u_k * m_ij + c_k: centred, the matrix is rank one, its first principal
    # component is u / |u| up to sign, and the projection is (m - mean m) * |u|. With
    # sum(u) > 0, strong activations (large channel sum) are where m is large.
    m = torch.tensor([[0.0, 1.0, 4.0], [2.0, 9.0, 3.0]])
    u = torch.tensor([2.0, -1.0, 0.5, 3.0])
    c = torch.tensor([5.0, 1.0, -2.0, 0.0])
    activations = (u.view(4, 1, 1) * m + c.view(4, 1, 1)).unsqueeze(0)
    data = LayerData("layer", activations, None, nn.Identity(), torch.zeros(1), None, None)
    projection = camviz.cams.get("eigencam")().layer_map(data)
    torch.testing.assert_close(projection[0], (m - m.mean()) * u.norm())
    # Negating the activations makes the other end strong: the sign follows.
    data.activations = -activations
    flipped = camviz.cams.get("eigencam")().layer_map(data)
    torch.testing.assert_close(flipped[0], -(m - m.mean()) * u.norm())


def test_eigencam_is_class_agnostic(tiny_inputs):
    model = TinyNet()
    first = camviz.explain(model, tiny_inputs, method="eigencam", layer="norm", target=0)
    second = camviz.explain(model, tiny_inputs, method="eigencam", layer="norm", target=2)
    assert torch.equal(first.heatmaps, second.heatmaps)


# --- Input-gradient methods ---------------------------------------------------------------


RECTIFIERS = {
    "nn.ReLU": (nn.ReLU(), None),
    "nn.ReLU inplace": (nn.ReLU(inplace=True), None),
    "F.relu": (F.relu, None),
    "F.relu inplace": (partial(F.relu, inplace=True), None),
    "torch.relu": (torch.relu, None),
    "torch.relu_": (torch.relu_, None),
    "Tensor.relu": (torch.Tensor.relu, None),
    "Tensor.relu_": (torch.Tensor.relu_, None),
    "nn.ReLU6": (nn.ReLU6(), 6.0),
    "F.relu6 inplace": (partial(F.relu6, inplace=True), 6.0),
    "nn.Hardtanh(0, 6)": (nn.Hardtanh(0.0, 6.0), 6.0),
}


@pytest.mark.parametrize("rectifier", list(RECTIFIERS))
def test_guided_backprop_gradients_for_every_way_of_writing_a_relu(rectifier, tiny_inputs):
    function, upper = RECTIFIERS[rectifier]
    model = TinyNet(function)
    known = closed_form(model, tiny_inputs, CLASSES, upper)

    def score(logits):
        return logits[torch.arange(2), torch.as_tensor(CLASSES)]

    guided = input_gradients(model, tiny_inputs, score, guided=True)
    plain = input_gradients(model, tiny_inputs, score)
    torch.testing.assert_close(guided, known["guided_x"])
    torch.testing.assert_close(plain, known["grad_x"])
    assert (guided - plain).abs().max() > 1e-3
    if upper is not None:
        assert (known["z"] > upper).any(), "some units must be clamped at the top"


def silu_slope(z: torch.Tensor) -> torch.Tensor:
    sigma = torch.sigmoid(z)
    return sigma * (1 + z * (1 - sigma))


def gelu_slope(z: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    return cdf + z * torch.exp(-(z**2) / 2) / math.sqrt(2 * math.pi)


def hardswish_slope(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z < -3, 0.0, torch.where(z > 3, 1.0, (2 * z + 3) / 6))


SMOOTH_ACTIVATIONS = {
    "nn.SiLU": (nn.SiLU(), silu_slope),
    "nn.SiLU inplace": (nn.SiLU(inplace=True), silu_slope),
    "nn.GELU": (nn.GELU(), gelu_slope),
    "nn.Hardswish": (nn.Hardswish(), hardswish_slope),
}


@pytest.mark.parametrize("activation", list(SMOOTH_ACTIVATIONS))
def test_guided_backprop_through_smooth_activations_passes_positive_gradients_where_x_is_positive(
    activation, tiny_inputs
):
    # dL/dz = ReLU(dL/dy) * f'(z) * 1[z > 0], against the derivatives written out by hand.
    function, slope = SMOOTH_ACTIVATIONS[activation]
    model = TinyNet(function)
    known = closed_form(model, tiny_inputs, CLASSES)
    z, heads = known["z"], known["V"]

    def to_input(grad_z: torch.Tensor) -> torch.Tensor:
        grad_conv = grad_z * known["scale"].view(1, -1, 1, 1)
        return F.conv_transpose2d(grad_conv, model.conv.weight, stride=2, padding=1)

    def score(logits):
        return logits[torch.arange(2), torch.as_tensor(CLASSES)]

    guided = input_gradients(model, tiny_inputs, score, guided=True)
    plain = input_gradients(model, tiny_inputs, score)
    torch.testing.assert_close(guided, to_input(torch.relu(heads) * slope(z) * (z > 0)))
    torch.testing.assert_close(plain, to_input(heads * slope(z)))
    assert (guided - plain).abs().max() > 1e-2


def test_guided_relus_are_undone_when_the_forward_pass_fails():
    class Failing(nn.Module):
        def forward(self, x):
            F.relu(x)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        input_gradients(Failing(), torch.ones(1, 1), lambda output: output)
    x = torch.tensor([1.0], requires_grad=True)
    (gradient,) = torch.autograd.grad(-F.relu(x).sum(), x)
    assert gradient.item() == -1.0  # a guided ReLU would pass 0


def test_only_the_models_relus_are_guided_not_the_targets():
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[2.0, -3.0]]))
        model.bias.fill_(10.0)

    def score(output):
        return -F.relu(output[:, 0])  # a guided ReLU here would block the gradient -1

    guided = input_gradients(model, torch.ones(1, 2), score, guided=True)
    torch.testing.assert_close(guided, torch.tensor([[-2.0, 3.0]]))


def channel_sum(terms: torch.Tensor, size=(9, 9)) -> torch.Tensor:
    """sum_c psi(terms_c): |.|, min-max per channel, bilinear upsampling."""
    flat = terms.abs().flatten(2)
    low = flat.min(-1, keepdim=True).values
    high = flat.max(-1, keepdim=True).values
    scaled = ((flat - low) / (high - low)).view_as(terms).sum(1, keepdim=True)
    return F.interpolate(scaled, size=size, mode="bilinear", align_corners=False)[:, 0]


def expected_input_map(method: str, model: TinyNet, x: torch.Tensor) -> torch.Tensor:
    known = closed_form(model, x, CLASSES)
    if method == "vanilla_gradients":
        return known["grad_x"].abs().amax(1)
    if method == "guided_backprop":
        return known["guided_x"].abs().amax(1)
    if method == "guided_gradcam":
        weights = known["grad_z"].mean(dim=(2, 3), keepdim=True)
        cam = torch.relu((weights * known["z"]).sum(1, keepdim=True))
        upsampled = F.interpolate(cam, size=(9, 9), mode="bilinear", align_corners=False)
        return (known["guided_x"] * upsampled).abs().amax(1)
    return (
        channel_sum(x * known["grad_x"])
        + channel_sum(model.conv.bias.detach().view(1, -1, 1, 1) * known["grad_conv"])
        + channel_sum(known["shift"].view(1, -1, 1, 1) * known["grad_z"])
    )


@pytest.mark.parametrize("method", INPUT_METHODS)
def test_input_gradient_methods_equal_the_paper_formula(method, tiny_inputs):
    model = TinyNet()
    result = camviz.explain(model, tiny_inputs, method=method, layer="norm", target=CLASSES)
    expected = min_max(expected_input_map(method, model, tiny_inputs))
    assert result.layer_maps.shape == (2, 9, 9)
    torch.testing.assert_close(result.layer_maps, expected)
    torch.testing.assert_close(result.heatmaps, expected)


def test_full_gradients_are_complete(tiny_inputs):
    # For a ReLU network, y = sum(x * dy/dx) + sum of all bias-gradients (+ the head's bias).
    model = TinyNet()
    logits = model(tiny_inputs)

    def score(output):
        return output[torch.arange(2), torch.as_tensor(CLASSES)]

    decomposition = full_gradients(model, tiny_inputs, score)
    assert len(decomposition.bias_gradients) == 2  # the convolution and the batch norm
    total = (tiny_inputs * decomposition.input_gradients).sum(dim=(1, 2, 3))
    total = total + sum(bias.sum(dim=(1, 2, 3)) for bias in decomposition.bias_gradients)
    total = total + model.head.bias[torch.as_tensor(CLASSES)]
    torch.testing.assert_close(total, score(logits).detach())


def test_full_gradients_find_biases_inside_fused_norm_and_activation_layers():
    # timm's BatchNormAct2d applies its ReLU inside the module, so the module's output is
    # not where its bias acts; the bias is found at the batch-norm call itself.
    from timm.layers import BatchNormAct2d

    torch.manual_seed(3)
    norm = BatchNormAct2d(4, act_layer=nn.ReLU)
    with torch.no_grad():
        norm.running_mean.normal_()
        norm.bias.normal_()
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), norm, nn.Flatten(), nn.Linear(64, 2)
    ).eval()
    x = torch.randn(2, 3, 4, 4)

    def score(output):
        return output[:, 1]

    decomposition = full_gradients(model, x, score)
    total = (x * decomposition.input_gradients).sum(dim=(1, 2, 3)) + model[3].bias[1]
    total = total + sum(bias.sum(dim=(1, 2, 3)) for bias in decomposition.bias_gradients)
    torch.testing.assert_close(total, score(model(x)).detach())


# --- The peers, on a random ResNet-18 -----------------------------------------------------


def pytorch_grad_cam_maps(peer_class, model, inputs, layer, classes, **options):
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    # pytorch-grad-cam writes parameter .grad fields and switches modes: give it a copy.
    model = copy.deepcopy(model)
    target_layers = [dict(model.named_modules())[layer]] if layer else []
    with peer_class(model=model, target_layers=target_layers, **options) as peer:
        maps = peer(inputs, targets=[ClassifierOutputTarget(c) for c in classes])
    return torch.from_numpy(maps)


def renormalised(result) -> torch.Tensor:
    # pytorch-grad-cam min-max normalises again after resizing; camviz normalises at the
    # layer's resolution only, so a peak between two layer cells stays a little below 1.
    return min_max(result.heatmaps)


@pytest.mark.peers
@pytest.mark.parametrize("layer", ["layer4", "layer3"])
@pytest.mark.parametrize(
    ("method", "peer"),
    [
        ("xgradcam", "XGradCAM"),
        ("layercam", "LayerCAM"),
        ("hirescam", "HiResCAM"),
        ("gradcam_elementwise", "GradCAMElementWise"),
    ],
)
def test_matches_pytorch_grad_cam(resnet18, small_batch, method, peer, layer):
    import pytorch_grad_cam

    theirs = pytorch_grad_cam_maps(
        getattr(pytorch_grad_cam, peer), resnet18, small_batch, layer, [3, 7]
    )
    ours = camviz.explain(resnet18, small_batch, method=method, layer=layer, target=[3, 7])
    # Same formula, same bilinear resize (OpenCV's matches align_corners=False); their
    # 1e-7 in divisions is the only difference.
    torch.testing.assert_close(renormalised(ours), theirs, atol=1e-5, rtol=0)


@pytest.mark.peers
def test_gradcam_pp_matches_pytorch_grad_cam_up_to_its_epsilon(resnet18, small_batch):
    from pytorch_grad_cam import GradCAMPlusPlus

    # pytorch-grad-cam adds 1e-6 to alpha's denominator 2 g^2 + sum(A) g^3. With this random
    # network's gradients (|g| ~ 1e-2, g^2 ~ 3e-5) that shifts the maps by up to 7e-3; with
    # the head scaled by 100 the epsilon is negligible and the two agree to 1e-4.
    scaled = copy.deepcopy(resnet18)
    with torch.no_grad():
        scaled.fc.weight.mul_(100)
    theirs = pytorch_grad_cam_maps(GradCAMPlusPlus, scaled, small_batch, "layer4", [3, 7])
    ours = camviz.explain(scaled, small_batch, method="gradcam++", layer="layer4", target=[3, 7])
    torch.testing.assert_close(renormalised(ours), theirs, atol=1e-4, rtol=0)


@pytest.mark.peers
@pytest.mark.parametrize(
    ("method", "peer"), [("eigencam", "EigenCAM"), ("eigen_gradcam", "EigenGradCAM")]
)
@pytest.mark.parametrize("layer", ["layer4", "layer3"])
def test_eigen_methods_match_pytorch_grad_cam_up_to_its_random_sign(
    resnet18, small_batch, method, peer, layer
):
    import pytorch_grad_cam
    from pytorch_grad_cam.utils.svd_on_activations import get_2d_projection

    from camviz.cams.engine import layer_pass

    recorded = layer_pass(resnet18, small_batch, [layer], [3, 7])
    features = recorded.activations[layer]
    if method == "eigen_gradcam":
        features = features * recorded.gradients[layer][0]
    theirs_raw = torch.from_numpy(get_2d_projection(features.numpy()))
    ours = camviz.explain(resnet18, small_batch, method=method, layer=layer, target=[3, 7])
    theirs = pytorch_grad_cam_maps(
        getattr(pytorch_grad_cam, peer), resnet18, small_batch, layer, [3, 7]
    )
    for sample in range(2):
        # The same projection up to sign; where their SVD returned the other sign, their map
        # is the ReLU of the inverted projection.
        agrees = torch.allclose(renormalised(ours)[sample], theirs[sample], atol=1e-5)
        data = LayerData(layer, features[sample : sample + 1], None, resnet18, None, None, None)
        projection = camviz.cams.get("eigencam")().layer_map(data)[0]
        sign = 1.0 if agrees else -1.0
        torch.testing.assert_close(sign * projection, theirs_raw[sample], atol=1e-4, rtol=1e-4)


@pytest.mark.peers
def test_fullgrad_matches_pytorch_grad_cam(resnet18, small_batch):
    from pytorch_grad_cam import FullGrad

    theirs = pytorch_grad_cam_maps(FullGrad, resnet18, small_batch, None, [3, 7])
    ours = camviz.explain(resnet18, small_batch, method="fullgrad", layer="layer4", target=[3, 7])
    # ResNet's convolutions have no bias; its batch norms are found by both.
    torch.testing.assert_close(renormalised(ours), theirs, atol=1e-5, rtol=0)


@pytest.mark.peers
def test_guided_backprop_matches_pytorch_grad_cam(resnet18, small_batch):
    from pytorch_grad_cam import GuidedBackpropReLUModel

    # pytorch-grad-cam swaps the model's ReLU modules (and puts back non-in-place ones):
    # give it a copy. It takes one image at a time.
    peer = GuidedBackpropReLUModel(copy.deepcopy(resnet18), device="cpu")
    for sample, class_id in enumerate([3, 7]):
        image = small_batch[sample : sample + 1].clone()
        theirs = torch.from_numpy(peer(image, class_id)).permute(2, 0, 1)
        ours = input_gradients(
            resnet18,
            small_batch[sample : sample + 1],
            lambda logits, c=class_id: logits[:, c],
            guided=True,
        )[0]
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-4)


@pytest.mark.peers
@pytest.mark.parametrize(("method", "peer"), [("xgradcam", "XGradCAM"), ("layercam", "LayerCAM")])
@pytest.mark.parametrize("layer", ["layer4", "layer3"])
def test_matches_torchcam(resnet18, small_batch, method, peer, layer):
    from torchcam import methods

    model = copy.deepcopy(resnet18)
    with getattr(methods, peer)(model, target_layer=layer, input_shape=(3, 64, 64)) as extractor:
        theirs = extractor([3, 7], model(small_batch))[0]
    ours = camviz.explain(resnet18, small_batch, method=method, layer=layer, target=[3, 7])
    # torchcam normalises at the layer's resolution too, dividing by (max + 1e-8).
    torch.testing.assert_close(ours.layer_maps, theirs, atol=1e-5, rtol=0)


@pytest.mark.peers
def test_torchcam_gradcam_pp_leaves_alpha_at_g_squared(resnet18, small_batch):
    from torchcam.methods import GradCAMpp

    from camviz.cams.engine import layer_pass

    model = copy.deepcopy(resnet18)
    with GradCAMpp(model, target_layer="layer4", input_shape=(3, 64, 64)) as extractor:
        theirs = extractor([3, 7], model(small_batch))[0]
    recorded = layer_pass(resnet18, small_batch, ["layer4"], [3, 7])
    a, g = recorded.activations["layer4"], recorded.gradients["layer4"][0]
    # torchcam 0.5 divides a boolean-indexed copy of alpha, so alpha stays g^2 ...
    without_division = min_max(
        torch.relu(((g**2 * torch.relu(g)).sum((2, 3), keepdim=True) * a).sum(1))
    )
    torch.testing.assert_close(theirs, without_division, atol=1e-3, rtol=0)
    # ... which is far from the paper's Grad-CAM++.
    ours = camviz.explain(resnet18, small_batch, method="gradcam++", layer="layer4", target=[3, 7])
    assert (ours.layer_maps - theirs).abs().max() > 0.1


@pytest.mark.peers
def test_smooth_gradcam_pp_matches_torchcam_as_the_noise_vanishes(resnet18, small_batch):
    from torchcam.methods import SmoothGradCAMpp

    # torchcam's noise has a fixed std and its weights use the last noisy gradient, so only
    # the noiseless limit is comparable: there both are Grad-CAM++ (torchcam adds 1e-8 to the
    # denominator; the head is scaled so that this is negligible).
    scaled = copy.deepcopy(resnet18)
    with torch.no_grad():
        scaled.fc.weight.mul_(100)
    model = copy.deepcopy(scaled)
    with SmoothGradCAMpp(
        model, target_layer="layer4", num_samples=2, std=1e-12, input_shape=(3, 64, 64)
    ) as extractor:
        model(small_batch)
        theirs = extractor([3, 7])[0]
    ours = camviz.explain(
        scaled, small_batch, "smooth_gradcam++", "layer4", [3, 7], samples=2, noise=0.0
    )
    torch.testing.assert_close(ours.layer_maps, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", list(PAPER_FORMULAS))
def test_correct_on_a_layer_whose_output_is_changed_in_place(resnet18, small_batch, method):
    # ResNet's `out = bn2(out); out += identity; out = relu(out)` overwrites bn2's output.
    a, g = leaf_activations_and_gradients(resnet18, small_batch, "layer4.1.bn2", [3, 7])
    result = camviz.explain(
        resnet18, small_batch, method=method, layer="layer4.1.bn2", target=[3, 7]
    )
    expected = min_max(torch.relu(PAPER_FORMULAS[method](a, g)))
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.peers
def test_pytorch_grad_cam_reads_the_overwritten_bn2_output(resnet18, small_batch):
    from pytorch_grad_cam import LayerCAM

    # What the peers get wrong on layer4.1.bn2: their stored activation is a view of bn2's
    # output, which `+= identity` and the in-place ReLU turn into layer4's output.
    model = copy.deepcopy(resnet18)
    with LayerCAM(model=model, target_layers=[model.layer4[1].bn2]) as peer:
        theirs = torch.from_numpy(peer(small_batch, targets=None))
        stored = peer.activations_and_grads.activations[0]
    with camviz.capture(resnet18, ["layer4", "layer4.1.bn2"]) as cap, torch.no_grad():
        resnet18(small_batch)
    torch.testing.assert_close(stored, cap.activations["layer4"])
    assert not torch.allclose(stored, cap.activations["layer4.1.bn2"])
    ours = camviz.explain(resnet18, small_batch, method="layercam", layer="layer4.1.bn2")
    assert (renormalised(ours) - theirs).abs().max() > 0.1


# --- The shipped photos -------------------------------------------------------------------

CUP = 967  # espresso
CAT_CLASSES = [281, 282, 283, 284, 285]  # tabby, tiger cat, Persian, Siamese, Egyptian cat
CLASS_DISCRIMINATIVE = [
    "gradcam",
    "ablationcam",
    "gradcam++",
    "smooth_gradcam++",
    "xgradcam",
    "layercam",
    "hirescam",
    "gradcam_elementwise",
    "eigen_gradcam",
    "guided_gradcam",
]


@pytest.fixture(scope="module")
def cat_and_cup(offline_model, cat_path, coffee_path):
    """The cat (left) and the cup (right) side by side at height 224, preprocessed, twice,
    with the cat's best class and the width of the cat half."""
    height = 224
    halves = []
    for path in (cat_path, coffee_path):
        with Image.open(path) as image:
            rgb = image.convert("RGB")
        halves.append(rgb.resize((round(rgb.width * height / rgb.height), height)))
    picture = Image.new("RGB", (halves[0].width + halves[1].width, height))
    picture.paste(halves[0], (0, 0))
    picture.paste(halves[1], (halves[0].width, 0))
    inputs = offline_model.preprocess(picture).unsqueeze(0)
    with torch.no_grad():
        logits = offline_model.model(inputs)[0]
    cat = CAT_CLASSES[int(logits[CAT_CLASSES].argmax())]
    return inputs.repeat(2, 1, 1, 1), cat, halves[0].width


def share_on_the_cat(heatmap: torch.Tensor, split: int) -> float:
    return float(heatmap[..., :split].sum() / heatmap.sum())


def explain_cat_and_cup(offline_model, cat_and_cup, method):
    inputs, cat, split = cat_and_cup
    options = {"samples": 4} if method == "smooth_gradcam++" else {}
    result = camviz.explain(
        offline_model.model,
        inputs,
        method=method,
        layer=offline_model.default_layer,
        target=[cat, CUP],
        **options,
    )
    return [share_on_the_cat(heatmap, split) for heatmap in result.heatmaps]


@pytest.mark.parametrize("method", CLASS_DISCRIMINATIVE)
def test_the_cat_map_is_on_the_cat_and_the_cup_map_on_the_cup(offline_model, cat_and_cup, method):
    cat_share, cup_share = explain_cat_and_cup(offline_model, cat_and_cup, method)
    assert cat_share > 0.6
    assert 1 - cup_share > 0.6


@pytest.mark.parametrize("method", ["vanilla_gradients", "guided_backprop", "fullgrad"])
def test_input_gradient_maps_move_towards_the_explained_object(offline_model, cat_and_cup, method):
    # Pixel-level gradient maps are not class-discriminative in the Grad-CAM sense (edges of
    # both objects light up for any class), but the class still moves the mass.
    cat_share, cup_share = explain_cat_and_cup(offline_model, cat_and_cup, method)
    assert cat_share > cup_share + 0.05


# --- Options and second-order methods ------------------------------------------------------


# The terms W^k (*) A^k whose channel sum is each channel-map method's map.
WEIGHTED_ACTIVATIONS = {
    "gradcam": lambda a, g: g.mean(dim=(2, 3), keepdim=True) * a,
    "hirescam": lambda a, g: g * a,
    "layercam": lambda a, g: torch.relu(g) * a,
    "gradcam_elementwise": lambda a, g: torch.relu(g * a),
    "xgradcam": lambda a, g: (a / a.sum(dim=(2, 3), keepdim=True) * g).sum((2, 3), True) * a,
}


@pytest.mark.parametrize("method", list(WEIGHTED_ACTIVATIONS))
def test_eigen_smooth_is_the_principal_component_of_the_weighted_activations(method, tiny_inputs):
    model = TinyNet()
    known = closed_form(model, tiny_inputs, CLASSES)
    result = camviz.explain(model, tiny_inputs, method, "norm", CLASSES, eigen_smooth=True)
    terms = WEIGHTED_ACTIVATIONS[method](known["z"], known["grad_z"])
    expected = min_max(torch.relu(principal_projection(terms)))
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=1e-4)
    plain = camviz.explain(model, tiny_inputs, method, "norm", CLASSES)
    assert (plain.layer_maps - result.layer_maps).abs().max() > 0.05


def as_peer_map(raw: torch.Tensor, size) -> torch.Tensor:
    """ReLU, normalise, upsample, normalise: how both libraries turn a raw map into a heatmap."""
    from camviz.core.maps import normalize, upsample

    return min_max(upsample(normalize(torch.relu(raw)), size))


@pytest.mark.peers
@pytest.mark.parametrize(
    ("method", "peer", "layer"),
    [("gradcam", "GradCAM", "layer4"), ("layercam", "LayerCAM", "layer3")],
)
def test_eigen_smooth_matches_pytorch_grad_cam_up_to_its_random_sign(
    resnet18, small_batch, method, peer, layer
):
    import pytorch_grad_cam
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model = copy.deepcopy(resnet18)
    module = dict(model.named_modules())[layer]
    with getattr(pytorch_grad_cam, peer)(model=model, target_layers=[module]) as cam:
        targets = [ClassifierOutputTarget(3), ClassifierOutputTarget(7)]
        theirs = torch.from_numpy(cam(small_batch, targets=targets, eigen_smooth=True))
    a, g = leaf_activations_and_gradients(resnet18, small_batch, layer, [3, 7])
    data = LayerData(layer, a, g, resnet18, small_batch, None, None)
    raw = camviz.cams.get(method)(eigen_smooth=True).layer_map(data)
    ours = camviz.explain(resnet18, small_batch, method, layer, [3, 7], eigen_smooth=True)
    torch.testing.assert_close(as_peer_map(raw, (64, 64)), renormalised(ours))
    for sample in range(2):
        # pytorch-grad-cam keeps the SVD's sign: its map is one of the two signed projections.
        candidates = [as_peer_map(sign * raw[sample : sample + 1], (64, 64))[0] for sign in (1, -1)]
        assert min((theirs[sample] - c).abs().max() for c in candidates) < 1e-4


def test_eigencam_without_centring_projects_on_the_top_singular_vector(tiny_inputs):
    model = TinyNet()
    z = closed_form(model, tiny_inputs, CLASSES)["z"].double()
    observations = z.flatten(2).transpose(1, 2)  # (N, h w, C), not centred
    _, vectors = torch.linalg.eigh(observations.transpose(1, 2) @ observations)
    projection = (observations @ vectors[..., -1:]).squeeze(-1)
    projection = projection * torch.sign((projection * observations.sum(-1)).sum(-1, keepdim=True))
    expected = min_max(torch.relu(projection.view(2, 5, 5).float()))
    result = camviz.explain(model, tiny_inputs, "eigencam", "norm", CLASSES, center=False)
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=1e-4)
    centred = camviz.explain(model, tiny_inputs, "eigencam", "norm", CLASSES)
    assert (centred.layer_maps - result.layer_maps).abs().max() > 0.05


def seg_eigen_projection(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Seg-Eigen-CAM's equations 10-13: |g| * A, centred, its top principal direction (eigh),
    the projection negated where its minimum is larger in size than its maximum."""
    observations = (g.abs() * a).double().flatten(2).transpose(1, 2)
    centred = observations - observations.mean(1, keepdim=True)
    _, vectors = torch.linalg.eigh(centred.transpose(1, 2) @ centred)
    projection = (centred @ vectors[..., -1:]).squeeze(-1)
    flip = projection.amin(1).abs() > projection.amax(1).abs()
    projection = torch.where(flip[:, None], -projection, projection)
    return projection.view(a.shape[0], *a.shape[2:]).float()


def test_segeigencam_equals_the_paper_formula(tiny_inputs):
    model = TinyNet()
    known = closed_form(model, tiny_inputs, CLASSES)
    result = camviz.explain(model, tiny_inputs, "segeigencam", "norm", CLASSES)
    expected = min_max(torch.relu(seg_eigen_projection(known["z"], known["grad_z"])))
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=1e-4)


# Spatially constant float32 features (each channel one value over a 5 x 5 grid), whose
# centred matrix is float rounding alone, and an all-zero layer.
FLAT_FEATURES = {
    "constant": (3 * torch.rand(2, 6, 1, 1, generator=torch.Generator().manual_seed(2))).expand(
        -1, -1, 5, 5
    ),
    "zero": torch.zeros(2, 6, 5, 5),
}


@pytest.mark.parametrize("features", list(FLAT_FEATURES))
@pytest.mark.parametrize("method", ["eigencam", "eigen_gradcam", "segeigencam", "kpcacam"])
def test_eigen_methods_give_zero_maps_where_the_locations_do_not_differ(method, features):
    flat = FLAT_FEATURES[features].contiguous()
    gradients = torch.ones_like(flat)
    data = LayerData("layer", flat, gradients, nn.Identity(), torch.zeros(1), None, None)
    assert torch.equal(camviz.cams.get(method)().layer_map(data), torch.zeros(2, 5, 5))
    # A pattern a tenth of the features' size is structure, not rounding: it is the map.
    pattern = torch.linspace(0, 1, 25).view(5, 5) ** 2
    channels = torch.linspace(0.5, 1.5, 6).view(1, 6, 1, 1)
    data.activations = flat + 0.1 * channels * pattern
    kept = camviz.cams.get(method)().layer_map(data)
    for sample in kept:
        both = torch.stack([sample.flatten(), pattern.flatten()])
        assert torch.corrcoef(both)[0, 1] > 0.99


def test_a_spatially_constant_layer_gives_a_zero_map_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Upsample(size=(5, 5)),  # the layer: each channel's mean over the whole grid
        nn.Flatten(),
        nn.Linear(100, 3),
    ).eval()
    inputs = torch.rand(2, 3, 9, 9, generator=torch.Generator().manual_seed(1))
    # (The gradient-weighted methods see |dy/dA| * A, which the head's weights make vary.)
    for method in ("eigencam", "kpcacam"):
        with pytest.warns(camviz.ZeroMapWarning, match="2 of 2 maps are all zero"):
            result = camviz.explain(
                model, inputs, method, layer="2", target=0, layout="channels_first"
            )
        assert not result.heatmaps.any()


@pytest.mark.peers
@pytest.mark.parametrize("layer", ["layer4", "layer3"])
def test_segeigencam_matches_pytorch_grad_cam(resnet18, small_batch, layer):
    from pytorch_grad_cam import SegEigenCAM

    theirs = pytorch_grad_cam_maps(SegEigenCAM, resnet18, small_batch, layer, [3, 7])
    ours = camviz.explain(resnet18, small_batch, "segeigencam", layer=layer, target=[3, 7])
    torch.testing.assert_close(renormalised(ours), theirs, atol=1e-5, rtol=0)


def test_shapleycam_equals_the_paper_formula_after_a_smooth_activation(tiny_inputs):
    # TinyNet with tanh: y_c = <V_c, tanh(z)> + b_c, so dy/dz = V (1 - t^2) and the Hessian
    # is diagonal, V tanh''(z) = -2 V t (1 - t^2) with t = tanh(z): H z = -2 V t (1 - t^2) z.
    model = TinyNet(torch.tanh)
    known = closed_form(model, tiny_inputs, CLASSES)
    z, heads = known["z"], known["V"]
    t = torch.tanh(z)
    gradient = heads * (1 - t**2)
    hessian_product = -2 * heads * t * (1 - t**2) * z
    weights = (gradient - 0.5 * hessian_product).mean(dim=(2, 3), keepdim=True)
    expected = min_max(torch.relu((weights * z).sum(1)))
    result = camviz.explain(model, tiny_inputs, "shapleycam", "norm", CLASSES)
    torch.testing.assert_close(result.layer_maps, expected, atol=1e-5, rtol=1e-4)
    gradcam = camviz.explain(model, tiny_inputs, "gradcam", "norm", CLASSES)
    assert (gradcam.layer_maps - result.layer_maps).abs().max() > 0.05


def test_shapleycam_is_gradcam_where_the_later_layers_are_piecewise_linear(tiny_inputs):
    model = TinyNet()  # ReLU after the target: H A = 0
    shapley = camviz.explain(model, tiny_inputs, "shapleycam", "norm", CLASSES)
    gradcam = camviz.explain(model, tiny_inputs, "gradcam", "norm", CLASSES)
    torch.testing.assert_close(shapley.layer_maps, gradcam.layer_maps)


@pytest.mark.peers
def test_shapleycam_matches_pytorch_grad_cam(tiny_inputs, untouched):
    from pytorch_grad_cam import ShapleyCAM

    model = TinyNet(torch.tanh)
    theirs = pytorch_grad_cam_maps(ShapleyCAM, model, tiny_inputs, "norm", CLASSES)
    with untouched(model):
        ours = camviz.explain(model, tiny_inputs, "shapleycam", layer="norm", target=CLASSES)
    torch.testing.assert_close(renormalised(ours), theirs, atol=1e-5, rtol=0)


def test_shapleycam_ranks_of_a_top_k_target_are_each_their_own_class(tiny_inputs):
    # One pass serves every rank: the graph kept for the Hessian must serve them all.
    model = TinyNet(torch.tanh)
    ranked = camviz.explain(model, tiny_inputs, "shapleycam", "norm", "top2")
    for rank in range(2):
        classes = ranked.targets.view(2, 2)[:, rank]
        alone = camviz.explain(model, tiny_inputs, "shapleycam", "norm", classes)
        torch.testing.assert_close(ranked.layer_maps.view(2, 2, 5, 5)[:, rank], alone.layer_maps)
