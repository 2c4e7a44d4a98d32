"""Options that several subcommands share, defined once."""

from __future__ import annotations

import argparse
import ast
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from camviz.io.models import LoadedModel
    from camviz.pipeline.distributed import Context

# Device types that hold data a model can run on (``meta`` holds none).
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")

# Bounds of the sizes and counts the subcommands take: beyond them a run asks for more
# memory or time than any machine has (a 10000-pixel input is 100 megapixels per image).
MAX_INPUT_SIZE = 4096
MAX_TILE = 1024
MAX_STEPS = 1000


def input_size(text: str) -> int:
    """``--input-size``: 1 to :data:`MAX_INPUT_SIZE` pixels (an argparse ``type=``)."""
    return whole_number(text, 1, MAX_INPUT_SIZE, " pixels")


def tile_size(text: str) -> int:
    """``features --tile``: 1 to :data:`MAX_TILE` pixels."""
    return whole_number(text, 1, MAX_TILE, " pixels")


def curve_steps(text: str) -> int:
    """``compare --steps``: 1 to :data:`MAX_STEPS`."""
    return whole_number(text, 1, MAX_STEPS)


def worker_count(text: str) -> int:
    """``--workers``: 0 to the CPUs of this machine (more only compete for the same cores)."""
    return whole_number(text, 0, os.cpu_count() or 1, " (the CPUs of this machine)")


def whole_number(text: str, low: int, high: int, unit: str = "") -> int:
    """``text`` as a whole number from ``low`` to ``high``, else an argparse error (one line
    that says the range)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be between {low} and {high}{unit}")
    return value


def add_model_options(parser: argparse.ArgumentParser, channels_flag: str = "--channels") -> None:
    """``--model`` with its sources' options, and the preprocessing options.

    ``channels_flag`` names the option of the images' channels (``camviz features`` has a
    ``--channels`` of its own, the channels to draw)."""
    group = parser.add_argument_group("the model")
    group.add_argument(
        "--model",
        default=None,
        help="torchvision model name (resnet50), timm:NAME, hf:NAME_OR_DIR (Hugging Face; a "
        "folder made by save_pretrained works offline), yolo:FILE.yaml or yolo:FILE.pt "
        "(Ultralytics), package.module:factory or path/to/file.py:factory (a function of "
        "yours that returns the model: the file runs as your own code), or omitted for the "
        "offline pretrained efficientnet_lite0",
    )
    group.add_argument(
        "--weights",
        default=None,
        metavar="PATH",
        help="a local checkpoint (state_dict, read without running code) to load into "
        "--model instead of its published weights",
    )
    group.add_argument(
        "--model-arg",
        action="append",
        type=model_argument,
        default=[],
        metavar="KEY=VALUE",
        help="a keyword argument of a factory (repeatable); VALUE is read as a Python "
        "literal (3, 0.5, 'a', [1, 2], True), else kept as text",
    )
    group.add_argument(
        "--trust-pickle",
        action="store_true",
        help="load a yolo:FILE.pt, a pickled whole model: unpickling runs code from the "
        "file, so only for files you trust",
    )
    preprocessing = parser.add_argument_group(
        "preprocessing (default: the model's own; for a factory, the images as they are)"
    )
    preprocessing.add_argument(
        "--input-size",
        type=input_size,
        default=None,
        metavar="PIXELS",
        help="scale each image's shorter side to PIXELS instead of the model's size (for a "
        "detector: its own resize)",
    )
    preprocessing.add_argument(
        "--mean",
        type=_numbers,
        default=None,
        metavar="M[,M,M]",
        help="per-channel mean after scaling to 0..1 (0.485,0.456,0.406), or one for all",
    )
    preprocessing.add_argument(
        "--std",
        type=_numbers,
        default=None,
        metavar="S[,S,S]",
        help="per-channel standard deviation (0.229,0.224,0.225), or one for all",
    )
    preprocessing.add_argument(
        channels_flag,
        dest="input_channels",
        type=int,
        choices=(1, 3),
        default=None,
        help="1 for a model of grey (or medical) images, 3 for RGB",
    )
    preprocessing.add_argument(
        "--classes",
        default=None,
        metavar="FILE",
        help="the class names, one per line (default: the model's, or class 0, class 1, ...)",
    )
    preprocessing.add_argument(
        "--task",
        default=None,
        metavar="TASK",
        help="classification, segmentation, detection, video, volume or embedding, when it "
        "cannot be told from the model",
    )


def model_argument(text: str) -> tuple[str, object]:
    """``--model-arg KEY=VALUE``: ``(KEY, VALUE)``, the value a Python literal if it reads as
    one (``ast.literal_eval``), else the text itself."""
    key, equals, value = text.partition("=")
    key = key.strip()
    if not equals or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (KEY a Python name)")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return key, value


def _numbers(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not numbers separated by commas (0.485,0.456,0.406)"
        ) from None


def add_precision_options(parser: argparse.ArgumentParser, *, job: bool = False) -> None:
    """``--precision`` and ``--channels-last`` (see :mod:`camviz.core.precision`); for the
    jobs over many images (``job=True``: the folder job, the unit scan) also
    ``--no-channels-last``, since they choose channels-last inputs on a CPU by themselves
    (``channels_last=None``)."""
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="dtype of the model's forward passes (autocast; maps stay float32). bf16 and "
        "fp16 need hardware that computes them natively: AVX-512 BF16 / AMX CPUs, GPUs",
    )
    parser.add_argument(
        "--channels-last",
        action=argparse.BooleanOptionalAction if job else "store_true",
        default=None if job else False,
        help="hand the model channels-last inputs (faster convolutions on most hardware)"
        + ("; the default on a CPU, unless the model fails on them" if job else ""),
    )


def add_memory_budget_option(parser: argparse.ArgumentParser) -> None:
    """``--memory-budget``: the ``memory_budget`` of the perturbation methods."""
    parser.add_argument(
        "--memory-budget",
        type=_byte_count,
        default=None,
        metavar="BYTES",
        help="memory the perturbed passes of scorecam, sscam, iscam and ablationcam may add "
        "(e.g. 512MiB, 2GB; default 1 GiB, on a GPU half its free memory up to 8 GiB); "
        "other methods ignore it",
    )


def add_compile_option(parser: argparse.ArgumentParser) -> None:
    """``--compile``: the ``compile_rest`` of Score-CAM, SS-CAM and IS-CAM."""
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run the masked passes of scorecam, sscam and iscam through torch.compile: "
        "minutes of compilation per call, then faster passes (README, Compiled models)",
    )


def add_layout_option(parser: argparse.ArgumentParser) -> None:
    """``--layout``: the ``layout=`` of :func:`camviz.explain`, for layers whose layout or
    patch tokens the pass cannot tell."""
    parser.add_argument(
        "--layout",
        type=_layout,
        default=None,
        metavar="LAYOUT",
        help="how the target layer lays out its output, where camviz cannot tell: "
        "channels_first, channels_last, tokens (the grid from the token count), or "
        "tokens[START:STOP] (the patch tokens, e.g. tokens[1:197])",
    )


def _layout(text: str) -> str:
    from camviz.core.errors import CamvizError
    from camviz.core.layouts import layout_kind

    try:
        layout_kind(text)
    except CamvizError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _byte_count(text: str) -> int:
    from camviz.core.errors import CamvizError
    from camviz.core.memory import parse_bytes

    try:
        return parse_bytes(text, option="--memory-budget")
    except CamvizError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def explain_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings that ``camviz explain`` and ``camviz compare`` share, as the keywords of
    :class:`camviz.cams.settings.ExplainSettings` (and so of ``JobSettings``)."""
    return {
        "layer": args.layer,
        "precision": args.precision,
        "channels_last": args.channels_last,
        "memory_budget": args.memory_budget,
        "layout": args.layout,
        "compile_rest": args.compile,
    }


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model named by ``--model``, with the options of :func:`add_model_options`."""
    from camviz.io.models import load

    return load(
        args.model,
        weights=args.weights,
        model_args=dict(args.model_arg),
        trust_pickle=args.trust_pickle,
        input_size=args.input_size,
        mean=args.mean,
        std=args.std,
        channels=args.input_channels,
        classes=args.classes,
        task=args.task,
    )


def model_device_option(name: str | None, context: Context) -> torch.device:
    """The device ``--device`` names, checked to exist here (else one line saying so); without
    it, this process's GPU if there is one (:func:`camviz.pipeline.distributed.device`)."""
    import torch

    from camviz.core.errors import CamvizError, first_line
    from camviz.pipeline import distributed

    if name is None:
        return distributed.device(context)
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CamvizError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type not in _DEVICE_TYPES:
        raise CamvizError(
            f"camviz cannot run a model on the {device.type!r} device; use cpu, cuda or cuda:N"
        )
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as error:
        raise CamvizError(
            f"device {name!r} is not available here ({first_line(error)}); use --device cpu, "
            "or leave --device out to use a GPU when there is one"
        ) from None
    return device
