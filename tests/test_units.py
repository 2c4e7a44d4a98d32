"""What a unit sees: receptive fields against the chain rule of kernels and strides, top-k
scans against a brute-force pass that keeps everything, and feature visualisation against
the real-photo folder, a fixed seed and plain pixel ascent."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TensorImages, conv_net, tiny_vit
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset

import camviz
from camviz.core.errors import CamvizError
from camviz.core.layers import default_target_layer
from camviz.core.targets.unit import Unit, parse_channels, parse_unit
from camviz.io.images import Preprocess
from camviz.io.pictures import overlay, select_channels
from camviz.units.fields import receptive_field
from camviz.units.gallery import example_maps
from camviz.units.heaps import TopHeaps
from camviz.units.scan import top_examples
from camviz.units.visualize import visualize_unit

# Receptive fields ---------------------------------------------------------------------------


def conv_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 5, stride=2, padding=2),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, dilation=2),
    ).eval()


def test_the_receptive_field_of_a_conv_stack_is_the_chain_rule_of_its_kernels_and_strides():
    field = receptive_field(conv_stack(), torch.zeros(1, 3, 64, 64), "6")
    # size: 1 + 2*1 (3x3) + 4*1 (5x5) + 1*2 (pool, after stride 2) + 2*2*4 (dilated 3x3)
    # jump: 1 -> 1 -> 2 -> 4 -> 4; start: 0 - 1 (pad 1) - 2 (pad 2) - 0 - 0
    assert (field.how, field.size, field.stride, field.start) == (
        "analytic",
        (25, 25),
        (4.0, 4.0),
        (-3.0, -3.0),
    )
    assert field.grid == (12, 12)
    assert field.box((0, 0)) == ((0, 22), (0, 22))  # -3 .. 21, clipped at the top left
    assert field.box((5, 2)) == ((17, 42), (5, 30))


def test_a_measured_receptive_field_is_where_the_input_gradient_is_not_zero():
    model = conv_stack()
    measured = receptive_field(model, torch.zeros(1, 3, 64, 64), "6", how="measured")
    analytic = receptive_field(model, torch.zeros(1, 3, 64, 64), "6")
    assert measured.how == "measured"
    for location in [(0, 0), (5, 2), (11, 11)]:
        assert measured.box(location) == analytic.box(location)
    # A skip connection joins two branches: no chain rule, the gradient says.
    resnet = __import__("torchvision").models.resnet18().eval()
    field = receptive_field(resnet, torch.zeros(1, 3, 96, 96), "layer2")
    assert field.how == "measured" and field.stride == (8.0, 8.0)
    with pytest.raises(CamvizError, match="not a chain of convolutions and pools"):
        receptive_field(resnet, torch.zeros(1, 3, 96, 96), "layer2", how="analytic")


# Top-k scans --------------------------------------------------------------------------------


def brute_force(values: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each unit's k best images of an ``(N, U)`` table, by a stable sort of everything."""
    return [
        [
            (i, values[i, unit].item())
            for i in sorted(range(len(values)), key=lambda i: -values[i, unit])[:k]
        ]
        for unit in range(values.shape[1])
    ]


@pytest.mark.parametrize(
    ("statistic", "channels_last"), [("max", None), ("mean", None), ("max", False)]
)
def test_top_examples_equal_a_brute_force_pass_that_keeps_everything(statistic, channels_last):
    model = conv_net(4, 6, classes=3)
    images = torch.rand(60, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    channels = [0, 3, 5]
    tops = top_examples(
        model,
        TensorImages(images),
        Unit("2", channel=channels),
        k=5,
        statistic=statistic,
        batch_size=7,
        channels_last=channels_last,
    )
    # The default on a CPU is channels-last images, whose convolutions round differently.
    layout = torch.contiguous_format if channels_last is False else torch.channels_last
    with torch.no_grad():
        grid = model[:3](images.contiguous(memory_format=layout))[:, channels]
    width, activations = grid.shape[-1], grid.flatten(2)
    values = activations.amax(2) if statistic == "max" else activations.mean(2)
    for unit, top in enumerate(tops):
        assert top.unit.channels == (channels[unit],)
        expected = brute_force(values, 5)[unit]
        assert [example.index for example in top.examples] == [i for i, _ in expected]
        assert [example.value for example in top.examples] == pytest.approx(
            [v for _, v in expected]
        )
        for example in top.examples:  # the location of the image's maximum
            flat = activations[example.index, unit].argmax().item()
            assert example.location == divmod(flat, width)


def test_the_scan_stops_after_the_unit_and_leaves_the_model_untouched(untouched):
    model = conv_net(4, 6, classes=3)
    heads = []
    model[-1].register_forward_hook(lambda *args: heads.append(1))
    images = torch.rand(9, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    neuron = Unit("2", neuron=(1, 3, 4))
    with untouched(model):
        (top,) = top_examples(model, TensorImages(images), neuron, k=2)
    assert heads == []  # the head never ran
    with torch.no_grad():
        values = model[:3](images)[:, 1, 3, 4]
    assert [e.index for e in top.examples] == values.argsort(descending=True)[:2].tolist()
    assert {e.location for e in top.examples} == {(3, 4)}


def test_heaps_of_shards_merge_into_the_heaps_of_everything_and_keep_an_image_once():
    values = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [3.0, 5.0], [0.5, 0.0]])
    where = torch.zeros(5, 2, 1, dtype=torch.long)
    whole = TopHeaps(2, 3)
    whole.add(values, where, range(5))
    even, odd = TopHeaps(2, 3), TopHeaps(2, 3)
    even.add(values[0::2], where[0::2], [0, 2, 4])
    odd.add(values[1::2], where[1::2], [1, 3])
    odd.add(values[1::2], where[1::2], [1, 3])  # a batch scanned again after a crash
    even.merge(odd)
    assert [[e.index for e in unit] for unit in even.best()] == [[1, 3, 2], [3, 0, 1]]
    assert even.best() == whole.best()
    assert TopHeaps.from_state(even.state()).best() == whole.best()


def test_the_gallery_crops_each_top_image_to_its_field_with_the_units_own_map():
    model = conv_net(4, 6, classes=3)
    generator = np.random.default_rng(5)
    photos = [  # 32 x 48 photos, preprocessed to 16 x 24: the crops scale by 2
        Image.fromarray(generator.integers(0, 256, (32, 48, 3), dtype=np.uint8)) for _ in range(6)
    ]
    preprocess = Preprocess(size=16, mean=(0, 0, 0), std=(1, 1, 1))
    units = Unit("2", channel=[0, 3])
    tops = top_examples(model, TensorImages(photos), units, k=2, preprocess=preprocess)
    field = receptive_field(model, torch.zeros(1, 3, 16, 24), "2")
    drawn = example_maps(model, tops, field, lambda example: photos[example.index], preprocess)
    for top, maps in zip(tops, drawn, strict=True):
        assert maps.values == [example.value for example in top.examples]
        for rank, example in enumerate(top.examples):
            photo = photos[example.index]
            (upper, lower), (left, right) = field.box(example.location, (16, 24))
            box = (2 * left, 2 * upper, 2 * right, 2 * lower)
            inputs = preprocess(photo).unsqueeze(0)
            # The unit's own Grad-CAM, at the layer before it, one channel at a time.
            alone = camviz.explain(model, inputs, layer="1", target=top.unit).heatmaps[0]
            assert np.array_equal(np.asarray(maps.crops[rank]), np.asarray(photo.crop(box)))
            expected = np.asarray(overlay(photo, alone).crop(box), dtype=np.int16)
            assert np.abs(np.asarray(maps.overlays[rank], dtype=np.int16) - expected).max() <= 1


# Units as targets ---------------------------------------------------------------------------


def hand_gradcam(activations: torch.Tensor, gradients: torch.Tensor) -> torch.Tensor:
    """Grad-CAM of ``(N, C, *grid)`` activations and gradients, min-max normalised per map."""
    weights = gradients.flatten(2).mean(dim=2)
    cam = torch.relu(torch.einsum("nc,nc...->n...", weights, activations)).detach()
    low = cam.flatten(1).amin(1).view(-1, *[1] * (cam.dim() - 1))
    high = cam.flatten(1).amax(1).view(-1, *[1] * (cam.dim() - 1))
    return (cam - low) / (high - low)


def test_unit_gradcam_equals_a_hand_autograd_of_the_channel_mean_in_a_cnn(untouched):
    model = conv_net(4, 6, 5, classes=3)
    inputs = torch.rand(2, 3, 20, 20, generator=torch.Generator().manual_seed(7))
    channels = [1, 3]
    with untouched(model):
        result = camviz.explain(model, inputs, layer="1", target=Unit("4", channel=channels))
    activations = model[:2](inputs).detach().requires_grad_()
    unit_layer = model[2:5](activations)
    expected, scores = [], []
    for channel in channels:  # sample-major: sample 0's channels, then sample 1's
        score = unit_layer[:, channel].mean(dim=(1, 2))
        (gradients,) = torch.autograd.grad(score.sum(), activations, retain_graph=True)
        expected.append(hand_gradcam(activations, gradients))
        scores.append(score.detach())
    expected_maps = torch.stack(expected, dim=1).flatten(0, 1)
    torch.testing.assert_close(result.layer_maps, expected_maps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.scores, torch.stack(scores, 1).flatten(), rtol=1e-5, atol=0)
    assert result.targets.tolist() == [-1] * 4  # a unit is no class
    # A neuron and a direction are read from the same layer.
    neuron = camviz.explain(model, inputs, layer="1", target=Unit("4", neuron=(2, 5, 7)))
    torch.testing.assert_close(neuron.scores, unit_layer[:, 2, 5, 7].detach())
    direction = torch.tensor([0.5, -1.0, 0.0, 2.0, 0.0])
    along = camviz.explain(model, inputs, layer="1", target=Unit("4", direction=direction))
    projected = torch.einsum("nchw,c->n", unit_layer, direction) / unit_layer[0, 0].numel()
    torch.testing.assert_close(along.scores, projected.detach(), rtol=1e-5, atol=1e-6)


def test_unit_gradcam_equals_a_hand_autograd_on_the_patch_tokens_of_a_vit():
    model = tiny_vit()
    inputs = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    first, second = "encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"
    result = camviz.explain(model, inputs, layer=first, target=Unit(second, channel=3))
    kept: dict[str, torch.Tensor] = {}

    def replace(module, args, output):
        kept["A"] = output.detach().requires_grad_()
        return kept["A"]

    def keep(module, args, output):
        kept["B"] = output

    handles = [
        model.get_submodule(first).register_forward_hook(replace),
        model.get_submodule(second).register_forward_hook(keep),
    ]
    model(inputs)
    for handle in handles:
        handle.remove()
    score = kept["B"][:, 1:, 3].mean(dim=1)  # the patch tokens only, not the class token
    (gradients,) = torch.autograd.grad(score.sum(), kept["A"])
    on_grid = lambda tokens: tokens[:, 1:].unflatten(1, (4, 4)).movedim(-1, 1)  # noqa: E731
    expected = hand_gradcam(on_grid(kept["A"]), on_grid(gradients))
    torch.testing.assert_close(result.layer_maps, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(result.scores, score.detach(), rtol=1e-5, atol=0)
    # A neuron (channel, patch row, patch column): the patch after the class token.
    neuron = camviz.explain(model, inputs, layer=first, target=Unit(second, neuron=(3, 1, 2)))
    torch.testing.assert_close(neuron.scores, kept["B"][:, 1 + 1 * 4 + 2, 3].detach())


def test_the_default_layer_of_a_unit_is_the_last_map_before_its_layer():
    import torchvision

    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=4).eval()
    inputs = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(9))
    unit = Unit("layer3", channel=[5, 9])
    assert default_target_layer(resnet, inputs, unit) == "layer2"
    assert default_target_layer(resnet, inputs, Unit("layer1.0.conv2", channel=0)) == (
        "layer1.0.relu"
    )
    assert default_target_layer(resnet, inputs) == "layer4"  # the classes' own default
    default = camviz.explain(resnet, inputs, target=unit)
    named = camviz.explain(resnet, inputs, layer="layer2", target=unit)
    assert default.layers == ["layer2"]
    torch.testing.assert_close(default.heatmaps, named.heatmaps)
    vit = tiny_vit()
    block = Unit("encoder.layers.encoder_layer_1", channel=2)
    assert default_target_layer(vit, torch.rand(1, 3, 32, 32), block) == (
        "encoder.layers.encoder_layer_0"
    )


def test_a_moved_neuron_is_refused_in_one_line():
    model = conv_net(4, 6, classes=3)
    inputs = torch.rand(1, 3, 16, 16)
    with pytest.raises(CamvizError, match="aug_smooth cannot explain a Unit neuron"):
        camviz.explain(
            model, inputs, layer="1", target=Unit("2", neuron=(0, 1, 1)), aug_smooth=True
        )


class _Head(nn.Module):
    """A head that takes a list of feature maps (as Ultralytics' ``Detect`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, levels: list[torch.Tensor]) -> torch.Tensor:
        return self.linear(torch.cat([level.mean((2, 3)) for level in levels], 1))


class _LevelsNet(nn.Module):
    """Two feature maps, fine and coarse, both handed to :class:`_Head`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fine = nn.Conv2d(3, 4, 3, padding=1)
        self.coarse = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.head = _Head()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        fine = self.fine(images).relu()
        return self.head([fine, self.coarse(fine).relu()])


def test_a_unit_of_a_heads_input_levels_reads_the_first_level_and_names_the_others():
    model = _LevelsNet().eval()
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning) as caught:
        whole = camviz.explain(model, images, layer="fine", target=Unit("head:input", channel=1))
    (message,) = [str(warning.message) for warning in caught]
    assert "holds 2 feature maps" in message and "'head:input[0][0]'" in message
    assert "'head:input[0][1]' for another" in message
    with torch.no_grad():
        fine = model.fine(images).relu()
    torch.testing.assert_close(whole.scores, fine[:, 1].mean((1, 2)))
    coarse = camviz.explain(model, images, layer="fine", target=Unit("head:input[0][1]", 1))
    torch.testing.assert_close(coarse.scores, model.coarse(fine).relu()[:, 1].mean((1, 2)))
    with pytest.warns(UserWarning, match="holds 2 feature maps"):
        (top,) = top_examples(model, TensorDataset(images), Unit("head:input", 1), k=2)
    assert top.unit.layer == "head:input[0][0]"
    best = fine[:, 1].flatten(1).amax(1).sort(descending=True)
    assert [example.index for example in top.examples] == best.indices.tolist()
    assert [example.value for example in top.examples] == pytest.approx(best.values.tolist())


# Units --------------------------------------------------------------------------------------


def test_a_unit_reads_channels_neurons_and_directions_from_the_layer_output():
    spatial = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)
    assert Unit("x", channel=[2, 0]).scores(spatial).tolist() == [[9.5, 1.5], [21.5, 13.5]]
    assert Unit("x", neuron=(1, 0, 1)).scores(spatial).tolist() == [[5.0], [17.0]]
    direction = Unit("x", direction=[1.0, 0.0, -2.0])
    assert direction.scores(spatial).tolist() == [[1.5 - 2 * 9.5], [13.5 - 2 * 21.5]]
    with pytest.raises(CamvizError, match="channel 7 is out of range"):
        Unit("x", channel=7).scores(spatial)
    with pytest.raises(CamvizError, match="does not lie on layer 'x'"):
        Unit("x", neuron=(0, 2, 0)).scores(spatial)
    with pytest.raises(CamvizError, match="exactly one of"):
        Unit("x", channel=1, neuron=(1, 0, 0))


def test_units_from_the_command_line():
    assert parse_unit("unit:layer3.1@42").channels == (42,)
    assert parse_unit("unit:model.22:input@0-3").channels == (0, 1, 2, 3)
    assert parse_unit("unit:model.22:input@0-3").layer == "model.22:input"
    neuron = parse_unit("unit:layer4@12,3,5")
    assert neuron.neuron == (12, 3, 5) and neuron.label == "layer4@12,3,5"
    assert parse_channels("0-2,7") == [0, 1, 2, 7]
    assert Unit("a", channel=[0, 1, 2, 7]).label == "a@0-2,7"
    for bad in ("unit:layer3", "unit:layer3@x", "unit:layer3@5-2"):
        with pytest.raises(CamvizError):
            parse_unit(bad)


# Feature visualisation ----------------------------------------------------------------------


def unit_value(model: nn.Module, unit: Unit, pixels: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model[: int(unit.layer) + 1](pixels)[:, unit.channels[0]].mean(dim=(1, 2))


def high_frequency_share(images: torch.Tensor) -> float:
    """The share of the images' spectral energy (mean removed) above half the Nyquist rate."""
    grey = images.mean(dim=1)
    spectrum = torch.fft.fft2(grey - grey.mean(dim=(1, 2), keepdim=True)).abs() ** 2
    rows = torch.fft.fftfreq(grey.shape[1]).abs().view(-1, 1)
    columns = torch.fft.fftfreq(grey.shape[2]).abs().view(1, -1)
    high = (torch.maximum(rows, columns) > 0.25).float()
    return float((spectrum * high).sum() / spectrum.sum())


def test_an_optimised_image_excites_its_unit_more_than_every_real_photo(real_photos, untouched):
    model = conv_net(8, 8, stride=[2, 1], classes=3)
    unit = Unit("2", channel=1)
    with untouched(model):
        images = visualize_unit(model, unit, size=64, steps=48, batch=2, seed=5)
        again = visualize_unit(model, unit, size=64, steps=48, batch=2, seed=5)
    assert images.shape == (2, 3, 64, 64) and images.min() >= 0 and images.max() <= 1
    assert torch.equal(images, again)  # one seed, one result
    assert not torch.equal(images, visualize_unit(model, unit, size=64, steps=48, batch=2, seed=6))
    (best,) = top_examples(
        model,
        real_photos,
        Unit("2", channel=[1]),
        k=1,
        statistic="mean",
        preprocess=Preprocess(size=64, mean=(0, 0, 0), std=(1, 1, 1)),
    )
    photos = sorted(real_photos.iterdir())
    assert len(photos) >= 300
    assert unit_value(model, unit, images).min() > best.examples[0].value
    # Plain pixel ascent of the same unit, as long: its energy piles up at high frequencies.
    pixels = torch.full((2, 3, 64, 64), 0.5).add_(torch.randn(2, 3, 64, 64) * 0.01)
    pixels.requires_grad_()
    optimizer = torch.optim.Adam([pixels], lr=0.05)
    for _ in range(48):
        loss = -model[:3](pixels)[:, 1].mean()
        (pixels.grad,) = torch.autograd.grad(loss, [pixels])
        optimizer.step()
        pixels.data.clamp_(0, 1)
    assert high_frequency_share(images) < high_frequency_share(pixels.detach())


def test_a_pretrained_channel_is_excited_more_by_its_image_than_by_any_real_photo(
    offline_model, real_photos
):
    unit = Unit("blocks.3", channel=7)
    image = visualize_unit(offline_model, unit, size=64, steps=64)
    preprocess = offline_model.preprocess
    small = Preprocess(size=64, mean=preprocess.mean, std=preprocess.std)
    (best,) = top_examples(
        offline_model, real_photos, unit, k=1, statistic="mean", preprocess=small, batch_size=50
    )
    normalised = (image - torch.tensor(small.mean).view(1, 3, 1, 1)) / torch.tensor(small.std).view(
        1, 3, 1, 1
    )
    (value,) = top_examples(offline_model, TensorImages(normalised), unit, k=1, statistic="mean")
    assert value.examples[0].value > best.examples[0].value


def test_visualize_refuses_what_it_cannot_draw():
    model = conv_net(4, classes=3)
    with pytest.raises(CamvizError, match="one unit at a time"):
        visualize_unit(model, Unit("0", channel=[0, 1]))
    with pytest.raises(CamvizError, match="give batch=2 or more"):
        visualize_unit(model, 1, diversity=1.0)
    with pytest.raises(CamvizError, match="class id 5 is out of range"):
        visualize_unit(model, 5, size=16, steps=1)


def test_a_class_logit_with_diversity_gives_different_images_that_raise_the_logit():
    model = conv_net(4, 4, classes=3)
    images = visualize_unit(model, 2, size=32, steps=24, batch=2, diversity=2.0)
    with torch.no_grad():
        before = model(torch.full((1, 3, 32, 32), 0.5))[0, 2]
        after = model(images)[:, 2]
    assert bool((after > before).all()) and not torch.allclose(images[0], images[1])


# Channel pictures ---------------------------------------------------------------------------


def test_channels_in_the_order_of_the_explained_class_weights():
    activations = torch.rand(5, 4, 4, generator=torch.Generator().manual_seed(0))
    weights = torch.tensor([0.1, -2.0, 0.7, 0.7, 0.3])
    indices, maps = select_channels(activations, 3, order="weight", weights=weights)
    assert indices == [2, 3, 4]  # ties by lower index
    assert torch.equal(maps, select_channels(activations, [2, 3, 4])[1])
    with pytest.raises(CamvizError, match="needs weights="):
        select_channels(activations, 3, order="weight")
    with pytest.raises(CamvizError, match="weights has 2 values"):
        select_channels(activations, 3, order="weight", weights=[1.0, 2.0])


def test_photo_folder_holds_distinct_real_crops(real_photos):
    paths = sorted(real_photos.iterdir())
    first = [Image.open(path).convert("L").resize((16, 16)) for path in paths[:40]]
    pixels = torch.stack(
        [torch.from_numpy(np.asarray(image, dtype=np.float32)).flatten() for image in first]
    )
    distances = torch.cdist(pixels, pixels) + torch.eye(len(pixels)) * 1e9
    assert distances.min() > 0  # no two alike
    assert Image.open(paths[0]).size == (128, 128)
