"""``camviz inspect``: per-layer output statistics of a model for one image."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from camviz.cli.options import add_model_options, add_precision_options

if TYPE_CHECKING:
    from PIL import Image


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="print every layer's output statistics",
        description="Run the model once and print, per layer in call order, the output "
        "shape, mean, std, min, max, fraction of zeros and NaN/Inf counts (with --backward "
        "also the norm of the top-1 logit's gradient). If a NaN or Inf appears, the first "
        "layer that produced it is named.",
    )
    parser.add_argument(
        "image",
        nargs="?",
        metavar="IMAGE",
        help="an image file; without one, random pixels (see --seed) at the model's size",
    )
    add_model_options(parser)
    parser.add_argument(
        "--layer",
        action="append",
        default=None,
        metavar="NAME",
        help="only these layers (names or patterns, repeatable; default: all)",
    )
    parser.add_argument("--backward", action="store_true", help="also report output-gradient norms")
    parser.add_argument("--csv", default=None, metavar="PATH", help="also write the table as CSV")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random image used without IMAGE"
    )
    add_precision_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from camviz.cli.options import load_model
    from camviz.cli.text import echo
    from camviz.debug.layerstats import find_first_nonfinite, inspect
    from camviz.io.images import load_image

    loaded = load_model(args)
    image = load_image(args.image) if args.image else _random_image(loaded.preprocess, args.seed)
    inputs = loaded.preprocess(image).unsqueeze(0)
    as_asked = {"precision": args.precision, "channels_last": args.channels_last}
    table = inspect(loaded.model, inputs, layers=args.layer, backward=args.backward, **as_asked)
    echo(*str(table).splitlines())
    for path, write in ((args.csv, table.to_csv), (args.json, table.to_json)):
        if path:
            echo(f"wrote {write(path)}")
    if not all(row.finite for row in table):
        echo(*str(find_first_nonfinite(loaded.model, inputs, **as_asked)).splitlines())
    return 0


def _random_image(preprocess: object, seed: int) -> Image.Image:
    """Uniform random pixels, square, at the preprocessing's size (224 if it has none)."""
    import torch
    from PIL import Image

    side = getattr(preprocess, "size", 224)
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (side, side, 3), dtype=torch.uint8, generator=generator)
    return Image.fromarray(pixels.numpy())
