"""Maps while Lightning trains: :class:`CamvizCallback`, a Lightning ``Callback`` on
:class:`camviz.Tracker`.

>>> from camviz.integrations.lightning import CamvizCallback
>>> trainer = lightning.pytorch.Trainer(callbacks=[CamvizCallback(probes, every_n_steps=50)])

It explains the probe batch at the start of training, every ``every_n_steps`` optimiser steps
(after the step, so the maps at step ``s`` are those of the weights after ``s`` updates)
and, with ``on_validation_epoch_end``, at the end of every validation and test epoch (not
during the sanity check): under ``trainer.fit``, ``trainer.validate`` and ``trainer.test``,
where Lightning runs under ``torch.inference_mode()`` (the tracker takes its own gradients
there). It logs through the trainer's loggers: a ``TensorBoardLogger``'s ``SummaryWriter``
and a ``WandbLogger``'s run get images and scalars, a ``CSVLogger`` gets the plain files in
its ``log_dir``; with no logger it can use, the files go to ``default_root_dir/camviz``.
In a distributed run only global rank 0 explains and logs. Its history is saved in
Lightning checkpoints and continued when a run resumes from one.

Lightning is an optional extra (``pip install 'camviz[lightning]'``). The callback derives
from ``lightning.pytorch.Callback``; where only the older ``pytorch_lightning`` package is
installed, from ``pytorch_lightning.Callback`` instead.
"""

from __future__ import annotations

import contextlib
import importlib
import types
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from camviz.cams.base import CamMethod
from camviz.core.errors import CamvizError
from camviz.core.layers import Layer
from camviz.core.targets import Target
from camviz.training.record import Record
from camviz.training.tracker import Tracker

__all__ = ["CamvizCallback"]


def _lightning() -> types.ModuleType:
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise CamvizError(
        "camviz.integrations.lightning needs Lightning; install it with "
        "pip install 'camviz[lightning]'"
    )


# Typed as Any: the base class comes from whichever namespace is installed.
_Callback: Any = _lightning().Callback


class CamvizCallback(_Callback):
    """Explain a probe batch during ``fit``, ``validate`` and ``test`` (see the module doc).

    Args:
        images: The probe batch, ``(N, C, H, W)``, as the model takes it.
        targets: As :class:`camviz.Tracker`'s (``None``: each probe's predicted class).
        methods: Method names or instances, each tracked on its own.
        layers: A layer, a list of layers, or ``None`` for the default target layer.
        every_n_steps: Explain every this many optimiser steps (``trainer.global_step``).
        on_validation_epoch_end: Also explain at the end of each validation and test epoch.

    Attributes:
        tracker: The :class:`camviz.Tracker` (its ``history`` holds the records).
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: Target = None,
        methods: Sequence[str | CamMethod] | str | CamMethod = ("gradcam",),
        layers: Layer | Sequence[Layer] | None = None,
        every_n_steps: int = 50,
        on_validation_epoch_end: bool = True,
    ) -> None:
        super().__init__()
        self.tracker = Tracker(images, targets, methods, layers, every=every_n_steps)
        # Not stored under its own name: that would hide the hook of the same name.
        self._at_evaluation_end = bool(on_validation_epoch_end)

    @property
    def history(self) -> list[Record]:
        """The tracker's records, in order."""
        return self.tracker.history

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if trainer.is_global_zero:
            self.tracker.log_to(*_destinations(trainer))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._track(trainer, pl_module, force=False)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._track(trainer, pl_module, force=False)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._at_evaluation_end and not trainer.sanity_checking:
            self._track(trainer, pl_module, force=True)

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._at_evaluation_end:
            self._track(trainer, pl_module, force=True)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.tracker.close()  # before Lightning finalises (closes) its loggers

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Write what was queued; a failure to log must not replace the run's own exception.
        with contextlib.suppress(Exception):
            self.tracker.close()

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tracker.load_state_dict(state_dict)

    def _track(self, trainer: Any, pl_module: Any, force: bool) -> None:
        if trainer.is_global_zero:  # the other ranks skip at once
            self.tracker.step(pl_module, trainer.global_step, force=force)


def _destinations(trainer: Any) -> tuple[list[Any], Path | None]:
    """The trainer's loggers as the tracker's ``logger`` and ``out_dir``."""
    experiments: list[Any] = []
    out_dir: Path | None = None
    skipped = []
    for logger in trainer.loggers:
        if type(logger).__name__ == "CSVLogger":
            out_dir = Path(logger.log_dir)
            continue
        experiment = getattr(logger, "experiment", None)
        usable = hasattr(experiment, "add_image") or type(experiment).__module__.startswith("wandb")
        if usable:
            experiments.append(experiment)
        else:
            skipped.append(type(logger).__name__)
    if not experiments and out_dir is None:
        out_dir = Path(trainer.default_root_dir) / "camviz"
    if skipped:
        warnings.warn(
            f"CamvizCallback cannot log to {', '.join(skipped)} (it logs to TensorBoard, W&B "
            f"and CSV loggers); its maps go to {out_dir or 'the other loggers'}",
            stacklevel=2,
        )
    return experiments, out_dir
