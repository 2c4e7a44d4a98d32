"""``camviz layers``: a model's layer names with their output shapes."""

from __future__ import annotations

import argparse

from camviz.cli.options import add_model_options, add_precision_options, whole_number

#: The largest ``--size`` accepted: a 2048 x 2048 input already needs gigabytes of
#: activations in a large model; larger ones only exhaust memory.
MAX_SIZE = 2048


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "layers",
        help="list a model's layers with output shapes",
        description="Print every layer name (usable as --layer) with its type and output "
        "shape for one input of --size pixels, in call order; the layer used when --layer "
        "is not given is marked.",
    )
    add_model_options(parser)
    parser.add_argument(
        "--size",
        type=_size,
        default=224,
        metavar="N",
        help=f"side of the square dummy input, 1 to {MAX_SIZE} pixels",
    )
    add_precision_options(parser)
    parser.set_defaults(run=run)


def _size(text: str) -> int:
    return whole_number(text, 1, MAX_SIZE, " pixels")


def run(args: argparse.Namespace) -> int:
    import torch

    from camviz.cli.options import load_model
    from camviz.cli.text import aligned, echo
    from camviz.core.errors import CamvizError, first_line
    from camviz.core.layers import layer_shapes

    loaded = load_model(args)
    inputs = torch.zeros(1, loaded.preprocess.channels, args.size, args.size)
    try:
        rows = layer_shapes(
            loaded.model, inputs, precision=args.precision, channels_last=args.channels_last
        )
    except (RuntimeError, ValueError) as error:
        raise CamvizError(
            f"the model does not take a {args.size}x{args.size} input ({first_line(error)}); "
            "pass a --size it accepts (224 for most models)"
        ) from None
    default = loaded.default_layer or ""
    at_input = default.endswith(":input")  # a head that takes a list of levels
    default_name = default.removesuffix(":input")
    mark = "<- default target layer" + (" (its input levels)" if at_input else "")
    seen: set[str] = set()
    marked = []
    for name, kind, shape in rows:
        first = name == default_name and name not in seen
        seen.add(name)
        marked.append([name, kind, str(tuple(shape)), mark if first else ""])
    echo(*aligned(["layer", "type", "output shape", ""], marked).splitlines())
    return 0
