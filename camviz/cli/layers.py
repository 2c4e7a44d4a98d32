"""``camviz layers``: a model's layer names with their output shapes."""

from __future__ import annotations

import argparse

from camviz.cli.options import add_model_options


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "layers",
        help="list a model's layers with output shapes",
        description="Print every layer name (usable as --layer) with its type and output "
        "shape for one input of --size pixels.",
    )
    add_model_options(parser)
    parser.add_argument(
        "--size", type=int, default=224, help="side of the square dummy input (default 224)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from camviz.cli.options import load_model
    from camviz.core.layers import layer_shapes

    loaded = load_model(args)
    inputs = torch.zeros(1, 3, args.size, args.size)
    rows = layer_shapes(loaded.model, inputs)
    width = max(len(name) for name, _, _ in rows)
    for name, kind, shape in rows:
        print(f"{name:<{width}}  {kind:<20}  {tuple(shape)}")
    return 0
