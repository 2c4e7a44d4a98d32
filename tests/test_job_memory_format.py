"""The folder job hands the model channels-last images on a CPU unless told otherwise
(``channels_last=None``, its default), and contiguous ones from the first batch on if the
model fails on channels-last ones, with one warning; the maps are the contiguous run's.
Video clips stay as they come. The unit scan chooses the same way, through the same
``ChannelsLastChoice``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from camviz.cli import build_parser
from camviz.cli import explain as explain_command
from camviz.core.errors import CamvizError
from camviz.io.images import Preprocess
from camviz.io.models import LoadedModel
from camviz.pipeline import job


def formats_seen(loaded: LoadedModel, photos, out, **keywords) -> set[str]:
    """The memory formats of the inputs that the model's first convolution got in a job
    (the model's own input is handed over before the job's hook makes it channels-last)."""
    seen: set[str] = set()

    def record(module, args):
        (tensor,) = args
        seen.add("contiguous" if tensor.is_contiguous() else "channels-last")

    first = next(one for one in loaded.model.modules() if isinstance(one, nn.Conv2d))
    handle = first.register_forward_pre_hook(record)
    try:
        manifest = job.explain_files(photos, out, loaded, **keywords)
    finally:
        handle.remove()
    assert manifest["counts"]["ok"] == len(photos)
    return seen


def test_the_job_chooses_channels_last_on_a_cpu_and_does_as_told(
    synthetic_classifier, make_photos, tmp_path
):
    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24), "b.png": (24, 32)})
    maps = job.Outputs(heatmap="npz")
    chosen = formats_seen(synthetic_classifier, photos, tmp_path / "chosen", outputs=maps)
    assert chosen == {"channels-last"}
    told = {"outputs": maps, "channels_last": False}
    assert formats_seen(synthetic_classifier, photos, tmp_path / "off", **told) == {"contiguous"}
    asked = formats_seen(synthetic_classifier, photos, tmp_path / "on", channels_last=True)
    assert asked == {"channels-last"}
    for name in ("a", "b"):  # the same maps, within float tolerance
        first = np.load(tmp_path / "chosen" / f"{name}_heatmap.npz")["heatmap"]
        second = np.load(tmp_path / "off" / f"{name}_heatmap.npz")["heatmap"]
        np.testing.assert_allclose(first, second, atol=1e-5)
        assert first.std() > 0.05  # a map, not a flat field


class ViewsItsFeatures(nn.Module):
    """A CNN that flattens its feature map with ``.view``, which a channels-last feature
    map cannot give: it fails on channels-last inputs, as some models in the wild do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(4 * 2 * 2, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(self.features(images))
        return self.head(pooled.view(len(pooled), -1))


@pytest.fixture
def viewing_model() -> LoadedModel:
    return LoadedModel(
        model=ViewsItsFeatures().eval(),
        preprocess=Preprocess(size=8, mean=(0, 0, 0), std=(1, 1, 1)),
        categories=["a", "b", "c"],
        name="views-its-features",
        default_layer="features",
    )


def test_a_model_that_fails_on_channels_last_inputs_gets_contiguous_ones(
    viewing_model, make_photos, tmp_path
):
    photos = make_photos(tmp_path / "photos", {"a.png": (16, 16), "b.png": (20, 16)})
    keywords = {"outputs": job.Outputs(heatmap="npz")}
    with pytest.warns(UserWarning, match="chosen on a CPU, did not work") as caught:
        chosen = job.explain_files(photos, tmp_path / "chosen", viewing_model, **keywords)
    assert len([one for one in caught if "channels-last" in str(one.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        told = job.explain_files(
            photos, tmp_path / "told", viewing_model, channels_last=False, **keywords
        )
    assert chosen["counts"] == told["counts"] and chosen["counts"]["ok"] == 2
    for name in ("a", "b"):
        first = np.load(tmp_path / "chosen" / f"{name}_heatmap.npz")["heatmap"]
        second = np.load(tmp_path / "told" / f"{name}_heatmap.npz")["heatmap"]
        np.testing.assert_array_equal(first, second)
    # Asked for, channels-last inputs are what the model gets, and its failure is said.
    with pytest.raises(CamvizError, match=r"none of the 2 inputs.*view size is not compatible"):
        job.explain_files(photos, tmp_path / "asked", viewing_model, channels_last=True)


def test_a_batch_that_fails_for_another_reason_keeps_channels_last_and_warns_nothing(
    synthetic_classifier, make_photos, tmp_path
):
    def one_at_a_time(module, args):  # fails on a batch in either memory format
        if len(args[0]) > 1:
            raise RuntimeError("this model takes one image at a time")

    photos = make_photos(tmp_path / "photos", {"a.png": (32, 24), "b.png": (32, 24)})
    handle = synthetic_classifier.model.register_forward_pre_hook(one_at_a_time)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no word about channels-last
            seen = formats_seen(synthetic_classifier, photos, tmp_path / "out")
    finally:
        handle.remove()
    assert seen == {"channels-last"}  # the images, one at a time, as chosen


@pytest.mark.parametrize(
    ("options", "expected"),
    [([], None), (["--channels-last"], True), (["--no-channels-last"], False)],
)
def test_the_command_lets_the_job_choose_unless_told(
    options, expected, synthetic_classifier, tmp_path
):
    args = build_parser().parse_args(["explain", str(tmp_path), *options])
    assert explain_command._settings(args, synthetic_classifier).channels_last is expected
    other = build_parser().parse_args(["compare", str(tmp_path)])  # one image: told, or not
    assert other.channels_last is False


def test_video_clips_stay_as_they_come(synthetic_classifier):
    from camviz.pipeline.dataset import _BatchExplainer

    for task, chosen in (("classification", True), ("video", False)):
        explainer = _BatchExplainer(
            synthetic_classifier.model, None, "gradcam", None, None, {"channels_last": None}, task
        )
        assert explainer.channels_last.value is chosen


class _FlattensFirst(nn.Module):
    """Reshapes its input with ``view``, which channels-last images cannot take."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        flat = images.view(len(images), -1)
        return self.conv(flat.view_as(images)).mean((2, 3))


def test_a_unit_scan_falls_back_to_contiguous_images_with_one_warning():
    from conftest import TensorImages

    from camviz.core.targets.unit import Unit
    from camviz.units.scan import top_examples

    model = _FlattensFirst()
    images = TensorImages(torch.rand(10, 3, 8, 8, generator=torch.Generator().manual_seed(0)))
    unit = Unit("conv", channel=[0, 1])
    with pytest.warns(UserWarning, match="chosen on a CPU, did not work") as caught:
        chosen = top_examples(model, images, unit, k=3, batch_size=4)
    assert len([w for w in caught if "did not work" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        contiguous = top_examples(model, images, unit, k=3, batch_size=4, channels_last=False)
    for mine, theirs in zip(chosen, contiguous, strict=True):
        assert mine.examples == theirs.examples
    with pytest.raises(RuntimeError, match="view size"):
        top_examples(model, images, unit, k=3, batch_size=4, channels_last=True)
