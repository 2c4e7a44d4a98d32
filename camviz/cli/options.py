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


def load_model(args: argparse.Namespace) -> LoadedModel:
    """The model named by ``--model``/``--weights``."""
    from camviz.io.models import load

    return load(args.model, weights=args.weights)
