"""camviz.integrations.lightning.CamvizCallback under ``trainer.fit``, ``validate`` and ``test``.

TensorBoard event files are read back with TensorBoard's own reader: their image and scalar
tags hold the steps the callback explained, and the images are the overlays of the maps
``camviz.explain`` gives for the model at the end of the run. Validation runs under
``torch.inference_mode()`` (checked), where the callback still takes its gradients. The
history is saved in a checkpoint and continued after a resume; a ``CSVLogger`` gets the
plain files; the older ``pytorch_lightning`` package drives the same callback.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from conftest import tiny_cnn
from PIL import Image

import camviz

LAYER = "net.features.3"  # inside the LightningModule
KEY = f"camviz/gradcam/{LAYER}/probe"

pytestmark = pytest.mark.filterwarnings(
    # Lightning's own advice on a tiny run: few batches, no workers, no progress bar.
    "ignore::UserWarning:lightning",
    "ignore::UserWarning:pytorch_lightning",
    "ignore:.*LeafSpec",  # Lightning 2.6 on torch 2.14
)


def probes() -> torch.Tensor:
    return torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def lightning():
    """Lightning's package, imported by these tests only: its import takes seconds, which
    every pytest-xdist worker would pay at collection if it were imported at the top (so
    would camviz's callback, a subclass of Lightning's, :func:`camviz_callback`)."""
    import lightning.pytorch

    return lightning.pytorch


def camviz_callback(**options):
    """``CamvizCallback(probes(), layers=LAYER, **options)``."""
    from camviz.integrations.lightning import CamvizCallback

    return CamvizCallback(probes(), layers=LAYER, **options)


def classifier(framework):
    """The tiny CNN with SGD as a LightningModule of ``framework`` (``lightning.pytorch`` or
    the older ``pytorch_lightning``); records whether each validation batch ran in
    inference mode."""

    class Classifier(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_cnn()
            self.inference_mode: list[bool] = []

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.net(images)

        def training_step(self, batch, batch_index):
            images, labels = batch
            return F.cross_entropy(self(images), labels)

        def validation_step(self, batch, batch_index):
            self.inference_mode.append(torch.is_inference_mode_enabled())
            images, labels = batch
            self.log("loss", F.cross_entropy(self(images), labels))

        test_step = validation_step

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Classifier()


def batches() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(8, 3, 16, 16, generator=generator)
    labels = torch.randint(0, 3, (8,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=4)


def trainer(framework, callback, logger, **options):
    settings = {
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        **options,
    }
    return framework.Trainer(logger=logger, callbacks=[callback], **settings)


def events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    return accumulator


def test_fit_logs_every_n_steps_and_at_each_validation_epoch_end(lightning, tmp_path):
    callback = camviz_callback(every_n_steps=3)
    logger = lightning.loggers.TensorBoardLogger(tmp_path, name="fit")
    run = trainer(lightning, callback, logger, max_epochs=2)
    model = classifier(lightning)
    run.fit(model, batches(), batches())
    # 2 epochs of 2 steps: the start (0), validation ends (2, 4) and step 3.
    steps = [0, 2, 3, 4]
    assert [record.step for record in callback.history] == steps
    found = events(run.logger.log_dir)
    assert {f"{KEY}0", f"{KEY}1", "camviz/strip"} <= set(found.Tags()["images"])
    for probe in range(2):
        assert [image.step for image in found.Images(f"{KEY}{probe}")] == steps
        assert [scalar.step for scalar in found.Scalars(f"{KEY}{probe}/score")] == steps
        assert [scalar.step for scalar in found.Scalars(f"{KEY}{probe}/corr_prev")] == steps[1:]
    # The last maps are camviz.explain's on the trained model, and so are the logged images.
    final = camviz.explain(model, probes(), layer=LAYER).heatmaps
    assert torch.equal(callback.history[-1].maps[f"gradcam/{LAYER}"].heatmaps, final)
    last = found.Images(f"{KEY}1")[-1]
    picture = np.asarray(Image.open(io.BytesIO(last.encoded_image_string)))
    pixels = (probes()[1] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.array_equal(picture, np.asarray(camviz.overlay(Image.fromarray(pixels), final[1])))
    assert model.net.training  # handed back in train mode


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_validate_and_test_log_maps_under_inference_mode(lightning, tmp_path, stage):
    callback = camviz_callback()
    run = trainer(lightning, callback, lightning.loggers.TensorBoardLogger(tmp_path, name=stage))
    model = classifier(lightning)
    getattr(run, stage)(model, batches(), verbose=False)
    assert model.inference_mode and all(model.inference_mode)
    assert [record.step for record in callback.history] == [0]
    found = events(run.logger.log_dir)
    assert [image.step for image in found.Images(f"{KEY}0")] == [0]
    assert [scalar.step for scalar in found.Scalars(f"{KEY}1/score")] == [0]
    expected = camviz.explain(model, probes(), layer=LAYER).heatmaps
    assert torch.equal(callback.history[0].maps[f"gradcam/{LAYER}"].heatmaps, expected)


def test_the_history_is_saved_in_checkpoints_and_continued_after_a_resume(lightning, tmp_path):
    csv_logger = lightning.loggers.CSVLogger
    first = camviz_callback(every_n_steps=2, on_validation_epoch_end=False)
    run = trainer(lightning, first, csv_logger(tmp_path, name="csv"), max_steps=2)
    run.fit(classifier(lightning), batches())
    run.save_checkpoint(tmp_path / "two.ckpt")
    saved = torch.load(tmp_path / "two.ckpt", weights_only=True)["callbacks"]["CamvizCallback"]
    assert [entry["step"] for entry in saved["history"]] == [0, 2]

    resumed = camviz_callback(every_n_steps=2, on_validation_epoch_end=False)
    run = trainer(lightning, resumed, csv_logger(tmp_path, name="csv", version=0), max_steps=4)
    run.fit(classifier(lightning), batches(), ckpt_path=tmp_path / "two.ckpt")
    assert [record.step for record in resumed.history] == [0, 2, 4]
    series = f"gradcam/{LAYER}"
    before, after = first.history[0].maps[series].heatmaps, resumed.history[-1].maps[series]
    for probe in range(2):
        wanted = np.corrcoef(after.heatmaps[probe].double().ravel(), before[probe].double().ravel())
        assert float(after.numbers["corr_first"][probe]) == pytest.approx(wanted[0, 1])
    # The CSV logger's folder holds the plain files of both runs, one log continued.
    log_dir = tmp_path / "csv" / "version_0"
    rows = [
        json.loads(line) for line in (log_dir / "camviz_tracker.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in rows] == [0, 0, 2, 2, 4, 4]
    assert sorted(path.name for path in (log_dir / "steps").iterdir()) == [
        f"{step}_probe{probe}_gradcam.png" for step in (0, 2, 4) for probe in (0, 1)
    ]


def test_ranks_other_than_zero_skip_at_once(lightning):
    callback = camviz_callback(every_n_steps=1)
    elsewhere = SimpleNamespace(is_global_zero=False, global_step=0, sanity_checking=False)
    model = classifier(lightning)
    callback.on_train_batch_end(elsewhere, model, None, None, 0)
    callback.on_validation_epoch_end(elsewhere, model)
    assert callback.history == []
    here = SimpleNamespace(is_global_zero=True, global_step=0, sanity_checking=False)
    callback.on_train_batch_end(here, model, None, None, 0)
    assert [record.step for record in callback.history] == [0]


def test_the_older_pytorch_lightning_namespace_drives_the_same_callback(tmp_path):
    import pytorch_lightning

    callback = camviz_callback(every_n_steps=1)
    logger = pytorch_lightning.loggers.TensorBoardLogger(tmp_path, name="old")
    run = trainer(pytorch_lightning, callback, logger, max_steps=2)
    run.fit(classifier(pytorch_lightning), batches())
    assert [record.step for record in callback.history] == [0, 1, 2]
    assert [image.step for image in events(run.logger.log_dir).Images(f"{KEY}0")] == [0, 1, 2]
