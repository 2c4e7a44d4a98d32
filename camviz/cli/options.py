"""Options that several subcommands share, defined once."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from camviz.io.models import LoadedModel


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--weights``."""
    parser.add_argument(
        "--model",
        default=None,
        help="torchvision model name (resnet50), timm:NAME, or omitted for the offline "
        "pretrained efficientnet_lite0",
    )
    parser.add_argument(
        "--weights",
        default=None,
        metavar="PATH",
        help="a local checkpoint (state_dict) to load into --model instead of downloading",
    )


def add_precision_options(parser: argparse.ArgumentParser) -> None:
    """``--precision`` and ``--channels-last`` (see :mod:`camviz.core.precision`)."""
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="dtype of the model's forward passes (autocast; maps stay float32). bf16 and "
        "fp16 need hardware that computes them natively: AVX-512 BF16 / AMX CPUs, GPUs",
    )
    parser.add_argument(
        "--channels-last",
        action="store_true",
        help="hand the model channels-last inputs (faster convolutions on most hardware)",
    )


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model named by ``--model``/``--weights``."""
    from camviz.io.models import load

    return load(args.model, weights=args.weights)
