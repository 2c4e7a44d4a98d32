"""Ready-made edits for camviz.edit: exact values, and what they do to a prediction."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import conv_net
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.hooks import capture, edit
from camviz.debug.edits import add_noise, clamp, keep_channels, spatial_mask, zero_channels
from camviz.debug.layerstats import inspect


def tiny_cnn() -> nn.Sequential:
    """Convs ``0`` (4 channels) and ``2`` (6), a mean and the head ``6``, 3 classes."""
    return conv_net(4, 6)


def test_zeroing_every_channel_of_the_last_conv_leaves_the_bias_only_logits(untouched):
    model = tiny_cnn()
    x = torch.randn(2, 3, 12, 12)
    with untouched(model), edit(model, {"2": zero_channels(range(6))}), torch.no_grad():
        logits = model(x)
    # relu(0) = 0, the average of zeros is 0, and 0 @ W.T + b is exactly b.
    assert torch.equal(logits, model[6].bias.detach().expand(2, -1))
    with torch.no_grad():
        assert not torch.equal(model(x), logits)  # the edit came off


def test_switching_off_one_channel_of_resnet_layer4(resnet18, small_batch, untouched):
    # layer4 -> global average -> fc: the logits lose exactly fc.weight[:, 17] * mean(A_17).
    with untouched(resnet18), capture(resnet18, "layer4") as record, torch.no_grad():
        full = resnet18(small_batch)
        channel = record.activations["layer4"][:, 17].mean(dim=(1, 2))
        with edit(resnet18, {"layer4": zero_channels([17])}):
            without = resnet18(small_batch)
        with edit(resnet18, {"layer4": keep_channels(17)}):
            only = resnet18(small_batch)
    weight, bias = resnet18.fc.weight.detach()[:, 17], resnet18.fc.bias.detach()
    torch.testing.assert_close(without, full - channel[:, None] * weight)
    torch.testing.assert_close(only, bias + channel[:, None] * weight)
    with edit(resnet18, {"layer4": keep_channels([17])}):
        table = inspect(resnet18, small_batch, layers="layer4")
    assert table["layer4"].zeros >= 511 / 512


def test_channel_edits_set_exactly_the_named_channels():
    output = torch.arange(24.0).view(1, 4, 2, 3) + 1
    zeroed = zero_channels([1, -1])(output)
    assert torch.equal(zeroed[:, [0, 2]], output[:, [0, 2]])
    assert zeroed[:, [1, 3]].abs().sum() == 0
    kept = keep_channels([1, -1])(output)
    assert torch.equal(kept, output - zeroed)
    tokens = torch.ones(1, 5, 3)
    assert keep_channels([2], dim=-1)(tokens).sum(dim=(0, 1)).tolist() == [0.0, 0.0, 5.0]


def test_keep_channels_does_not_turn_a_removed_inf_into_nan():
    output = torch.tensor([[math.inf, 1.0]]).view(1, 2, 1, 1)
    assert keep_channels([1])(output).flatten().tolist() == [0.0, 1.0]


def test_channel_edits_check_their_indices():
    with pytest.raises(CamvizError, match=r"lie in 0\.\.3 .* got \[4\]"):
        zero_channels([0, 4])(torch.ones(1, 4, 2, 2))
    with pytest.raises(CamvizError, match="got none"):
        keep_channels([])(torch.ones(1, 4, 2, 2))


def test_channel_edits_keep_the_gradient_path():
    output = torch.ones(1, 3, 2, 2, requires_grad=True)
    keep_channels([0])(output).sum().backward()
    assert output.grad[:, 0].sum() == 4 and output.grad[:, 1:].sum() == 0


def test_spatial_mask_is_applied_at_the_layers_resolution():
    output = torch.full((2, 3, 2, 2), 2.0)
    same_size = torch.tensor([[1.0, 0.0], [0.5, 0.0]])
    assert torch.equal(spatial_mask(same_size)(output), output * same_size)
    # An 8x8 mask with ones in rows 0-3 and columns 0-2 covers 12 of the 16 pixels of the
    # top-left 4x4 cell and none of the others.
    fine = torch.zeros(8, 8)
    fine[:4, :3] = 1.0
    masked = spatial_mask(fine)(output)
    expected = torch.tensor([[0.75, 0.0], [0.0, 0.0]]) * 2.0
    torch.testing.assert_close(masked, expected.expand_as(output))
    per_sample = torch.stack([torch.ones(2, 2), torch.zeros(2, 2)])
    assert spatial_mask(per_sample)(output)[1].sum() == 0
    with pytest.raises(CamvizError, match="does not fit"):
        spatial_mask(torch.ones(3, 2, 2))(output)
    with pytest.raises(CamvizError, match=r"must be \(H, W\)"):
        spatial_mask(torch.ones(5))


def test_noise_is_seedable_and_leaves_the_global_generator_alone():
    output = torch.zeros(100_000)
    state = torch.random.get_rng_state()
    first = add_noise(0.5, seed=3)
    noisy = first(output)
    assert torch.equal(torch.random.get_rng_state(), state)
    expected = 0.5 * torch.randn(100_000, generator=torch.Generator().manual_seed(3))
    assert torch.equal(noisy, expected)
    assert torch.equal(add_noise(0.5, seed=3)(output), noisy)  # a fresh edit repeats it
    assert not torch.equal(first(output), noisy)  # the same edit draws on
    assert float(noisy.std()) == pytest.approx(0.5, rel=0.02)
    with pytest.raises(CamvizError, match="zero or positive"):
        add_noise(-1.0)


def test_clamp_limits_values():
    values = torch.tensor([-2.0, 0.5, 9.0])
    assert clamp(min=0.0, max=6.0)(values).tolist() == [0.0, 0.5, 6.0]
    assert clamp(max=0.0)(values).tolist() == [-2.0, 0.0, 0.0]
    with pytest.raises(CamvizError, match="min=, max= or both"):
        clamp()
    with pytest.raises(CamvizError, match="min <= max"):
        clamp(min=1.0, max=0.0)
