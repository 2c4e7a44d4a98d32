"""Method options given to ``camviz.explain`` by name: checked, and ``eigen_smooth`` offered
by every channel-map method and applied to that method's own weighted activations."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import conv_net
from reference import min_max, principal_projection
from torch import nn

import camviz
from camviz.cams import ChannelMapMethod
from camviz.core.errors import CamvizError

CHANNEL_MAP_METHODS = [
    "ablationcam",
    "cam",
    "fem",
    "fem_pgc",
    "gradcam",
    "gradcam++",
    "smooth_gradcam++",
    "hirescam",
    "gradcam_elementwise",
    "layercam",
    "random",
    "scorecam",
    "sscam",
    "iscam",
    "shapleycam",
    "xgradcam",
]
# The perturbation methods' costs, cut down for a test.
CHEAP = {
    "sscam": {"num_samples": 2},
    "iscam": {"num_samples": 2},
    "smooth_gradcam++": {"samples": 2},
}


def pooled_net() -> nn.Module:
    """conv -> SiLU (the target, ``1``: 4 x 4 x 4 for an 8 x 8 input) -> mean -> linear."""
    return conv_net(4, stride=2, padding=1, activation=nn.SiLU)


def test_an_unknown_option_is_a_one_line_error_naming_the_options():
    with pytest.raises(
        CamvizError, match="eigencam has no option 'centre'; it takes center"
    ) as err:
        camviz.explain(pooled_net(), torch.rand(1, 3, 8, 8), "eigencam", "1", centre=False)
    assert "\n" not in str(err.value)
    with pytest.raises(
        CamvizError, match="vanilla_gradients has no option 'eigen_smooth'; it takes none"
    ):
        camviz.explain(pooled_net(), torch.rand(1, 3, 8, 8), "vanilla_gradients", eigen_smooth=True)


def test_options_with_a_method_instance_are_refused():
    method = camviz.cams.get("gradcam")()
    with pytest.raises(CamvizError, match="set them on the method instance"):
        camviz.explain(pooled_net(), torch.rand(1, 3, 8, 8), method, "1", eigen_smooth=True)


def test_eigen_smooth_is_offered_by_exactly_the_channel_map_methods():
    offering = [
        name
        for name in camviz.cams.names()
        if "eigen_smooth" in inspect.signature(camviz.cams.get(name)).parameters
    ]
    assert sorted(offering) == sorted(CHANNEL_MAP_METHODS)
    with pytest.raises(CamvizError, match="eigen_smooth=True or False"):
        camviz.cams.create("gradcam", eigen_smooth="yes")


@pytest.mark.parametrize("method", CHANNEL_MAP_METHODS)
def test_eigen_smooth_is_the_principal_component_of_the_methods_terms(method, monkeypatch):
    # The plain map is the channel sum of the terms (each method's formula test checks it);
    # eigen_smooth must take the principal component of those same terms instead.
    seen = []
    combine = ChannelMapMethod.combine

    def spy(self, weighted):
        seen.append(weighted)
        return combine(self, weighted)

    monkeypatch.setattr(ChannelMapMethod, "combine", spy)
    model, inputs = pooled_net(), torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    options = CHEAP.get(method, {})
    smooth = camviz.explain(model, inputs, method, "1", [0, 2], eigen_smooth=True, **options)
    (terms,) = seen
    expected = min_max(torch.relu(principal_projection(terms)))
    torch.testing.assert_close(smooth.layer_maps, expected, atol=1e-5, rtol=1e-4)
    plain = camviz.explain(model, inputs, method, "1", [0, 2], **options)
    torch.testing.assert_close(
        plain.layer_maps, min_max(torch.relu(seen[1].sum(dim=1))), atol=1e-5, rtol=1e-4
    )
    assert (plain.layer_maps - smooth.layer_maps).abs().amax() > 0.05
