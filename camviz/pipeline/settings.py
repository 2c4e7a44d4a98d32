"""The settings of a folder job: one frozen object, what it checks, and what a folder records.

:class:`JobSettings` holds everything :func:`camviz.explain_files` is asked (the method,
layer and target, how pictures are drawn, which files are written, batches, workers, the
settings of detection and video models); ``camviz explain`` builds one from its options.
:meth:`JobSettings.check` refuses, before any work, what no input could succeed with (an
unknown method or layer, a bad budget or precision, an output the model's task cannot
have), and :meth:`JobSettings.recorded` is what the output folder's ``manifest.json`` keeps:
the settings that decide the results, which a resumed run must match.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from camviz.cams.settings import ExplainSettings
from camviz.core.errors import CamvizError
from camviz.core.layers import Layer, resolve_layers
from camviz.core.taps import spot_keys
from camviz.core.targets import Target
from camviz.io.models import LoadedModel
from camviz.pipeline.tasks import TaskOptions
from camviz.pipeline.volumes import VolumeOptions

__all__ = ["HeatmapFormat", "JobSettings", "Outputs", "RenderOptions"]

HeatmapFormat = Literal["npz", "png16"]


@dataclass(frozen=True)
class RenderOptions:
    """How heatmaps are drawn: blend weight of the heatmap and matplotlib colour map."""

    alpha: float = 0.5
    colormap: str = "jet"


@dataclass(frozen=True)
class Outputs:
    """Which files are written per image (the manifest rows always are).

    Attributes:
        overlay: The heatmap over the photo (for videos, also the overlay video).
        panel: Image | heatmap | overlay with the class and probability (images only).
        heatmap: The raw map as ``"npz"`` (float32) or ``"png16"`` (16-bit PNG), or None.
    """

    overlay: bool = True
    panel: bool = True
    heatmap: HeatmapFormat | None = None

    def __post_init__(self) -> None:
        if self.heatmap not in (None, "npz", "png16"):
            raise CamvizError(f"heatmap must be 'npz', 'png16' or None, not {self.heatmap!r}")


@dataclass(frozen=True)
class JobSettings(ExplainSettings):
    """Everything a folder job is asked, besides its inputs, folder and model.

    The attributes of :class:`~camviz.cams.settings.ExplainSettings` (``method``, ``layer``,
    ``precision``, ``channels_last``, ``memory_budget``), and:

    Attributes:
        channels_last: Channels-last inputs for the model; ``None`` (the default) chooses
            them for images (not video clips or volumes) on a CPU, where the job runs faster
            so, unless the model fails on them (see
            :func:`~camviz.pipeline.dataset.explain_dataset`).
        target: What to explain (class id, ``"top1"``, ``"top3"``, ...).
        render: Colour map and blend weight of the overlays.
        outputs: Which files to write per image.
        batch_size: Images per forward pass.
        workers: DataLoader processes that decode and preprocess images beside the model;
            0: on a CPU, the writer threads read them between the model's passes, taking
            turns with it (:mod:`camviz.pipeline.threads`), elsewhere this thread does.
        every: For videos, explain every ``every``-th frame.
        writers: Threads that draw and write the files; taking turns with the model on a
            CPU, at least as many as the model's threads, to have every core between passes.
        threads: Torch threads of the model's passes; ``None``: torch's setting, or with
            ``workers`` on a CPU in a process that keeps its freed memory, one fewer,
            leaving a core to the workers and writers (:mod:`camviz.pipeline.threads`).
        progress: A progress bar on stderr: ``True``, ``False``, or ``None`` (on a terminal).
        task_options: For detectors (``min_score``, ``max_objects``) and video models
            (``clip_len``, ``stride``).
        input_size: Scale images (frames) to this many pixels on their shorter side instead
            of the model's size (for a detector: its own resize).
        volumes: For NIfTI volumes: the intensity window and the sliding windows.
    """

    channels_last: bool | None = None
    target: Target = None
    render: RenderOptions = RenderOptions()
    outputs: Outputs = Outputs()
    batch_size: int = 16
    workers: int = 0
    every: int = 1
    writers: int = 2
    threads: int | None = None
    progress: bool | None = False
    task_options: TaskOptions = field(default_factory=TaskOptions)
    input_size: int | None = None
    volumes: VolumeOptions = field(default_factory=VolumeOptions)

    def check(self, loaded: LoadedModel) -> dict[str, Any]:
        """Refuse, before any work, settings that no input could succeed with; returns the
        keywords of :func:`camviz.explain` for the method (precision, memory budget).

        The layer is checked here, not when the first map is made: a detector that finds no
        object above ``min_score`` in any image would otherwise never look at it, and the
        folder would record a layer the model does not have.

        Raises:
            CamvizError: An unknown method or layer, a bad memory budget or precision, an
                output the model's task cannot have, a class target for an embedding, or
                fewer than one thread.
        """
        if self.threads is not None and self.threads < 1:
            raise CamvizError(f"threads must be at least 1, not {self.threads}")
        (options,) = self.method_options(loaded.model, [self.method]).values()
        if self.layer is not None:
            spot_keys(loaded.model, self.layer, "output")
        if loaded.task == "embedding" and (self.target is None or isinstance(self.target, str)):
            raise CamvizError(
                f"{loaded.name} answers an image embedding, not classes; explain why each input "
                "looks like another image: --similar-to IMAGE (target=camviz.Similarity(...) in "
                "Python)"
            )
        if loaded.task == "video" and self.outputs.heatmap == "png16":
            raise CamvizError(
                f"{loaded.name} is a video model: its maps have a time axis, which a 16-bit "
                "PNG cannot hold; use --heatmap npz"
            )
        return options

    def recorded(self, loaded: LoadedModel, clips: tuple[int, int] | None) -> dict[str, Any]:
        """What decides the results, as the folder's ``manifest.json`` stores it (JSON).

        The tasks' own settings appear only for the tasks that have them (none for a
        classifier at its own size), so that folders of earlier releases still match.
        """
        settings: dict[str, Any] = {
            "model": loaded.name,
            "classes": len(loaded.categories),
            "method": self.method,
            "layer": _layer_setting(loaded.model, self.layer),
            "target": _target_text(self.target),
            "alpha": self.render.alpha,
            "colormap": self.render.colormap,
            "overlay": self.outputs.overlay,
            "panel": self.outputs.panel,
            "heatmap": self.outputs.heatmap,
            "precision": self.precision,
        }
        if self.input_size is not None:
            settings["input_size"] = self.input_size
        if self.layout is not None:
            settings["layout"] = self.layout
        if loaded.task != "classification":
            settings["task"] = loaded.task
        if loaded.task == "detection":
            options = self.task_options
            settings.update(min_score=options.min_score, max_objects=options.max_objects)
        if clips is not None:
            settings.update(clip_len=clips[0], stride=clips[1])
        if self.volumes.recorded():
            settings["volumes"] = self.volumes.recorded()
        return json.loads(json.dumps(settings))


def _target_text(target: Target) -> int | str | None:
    return target if isinstance(target, (int, str, type(None))) else repr(target)


def _layer_setting(
    model: torch.nn.Module, layer: Layer | Sequence[Layer] | None
) -> str | list[str] | None:
    """``layer`` as JSON: names and patterns as given, a submodule by its name in ``model``."""

    def named(one: Layer) -> str:
        return one if isinstance(one, str) else next(iter(resolve_layers(model, one)))

    if layer is None:
        return None
    if isinstance(layer, (str, torch.nn.Module)):
        return named(layer)
    return [named(one) for one in layer]
