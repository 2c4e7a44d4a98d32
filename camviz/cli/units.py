"""``camviz units``: the images of a folder that excite each channel of a layer most."""

from __future__ import annotations

import argparse

from camviz.cli.options import add_model_options, add_precision_options
from camviz.cli.text import printable


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "units",
        help="find the images that excite each channel of a layer most",
        description="Scan the inputs once, keeping for each channel of --layer the --k images "
        "with its highest activation (a heap per channel, never all activations), then write "
        "for each channel channel_NNNN.png (its top images cropped to the layer's receptive "
        "field, with the channel's Grad-CAM map under each), index.html showing them all, "
        "units.json (values, files, locations, the receptive field and how it was found) and "
        "a manifest. Running again with the same --out resumes; under torchrun "
        "(torchrun --nproc_per_node=N -m camviz units ...) the processes share the inputs.",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="image files, folders (searched recursively), glob patterns, .txt path lists",
    )
    add_model_options(parser, channels_flag="--input-channels")
    parser.add_argument(
        "--layer", required=True, help="the layer whose channels are ranked (`camviz layers`)"
    )
    parser.add_argument(
        "--channels",
        default=None,
        metavar="LIST",
        help="channels to rank: 42, 0-63 or 0-7,12 (default: all)",
    )
    parser.add_argument("--k", type=int, default=9, help="top images per channel (default 9)")
    parser.add_argument(
        "--statistic",
        choices=("max", "mean"),
        default="max",
        help="rank images by the channel's maximum over the grid, or its mean",
    )
    parser.add_argument("--out", default="camviz-units", metavar="DIR", help="output folder")
    parser.add_argument("--batch-size", type=int, default=32, metavar="N", help="images per batch")
    parser.add_argument(
        "--workers", type=int, default=0, metavar="N", help="processes that decode images"
    )
    parser.add_argument(
        "--device",
        default=None,
        help="where the model runs (cpu, cuda, cuda:1); by default this process's GPU if any",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_precision_options(parser, job=True)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from camviz.cli.options import load_model, model_device_option
    from camviz.pipeline import distributed
    from camviz.units.job import INDEX, scan_units

    context = distributed.from_environment()
    loaded = load_model(args)
    loaded.model.to(model_device_option(args.device, context))
    results = scan_units(
        args.inputs,
        args.out,
        loaded,
        args.layer,
        args.channels,
        k=args.k,
        statistic=args.statistic,
        batch_size=args.batch_size,
        workers=args.workers,
        progress=False if args.quiet else None,
        precision=args.precision,
        channels_last=args.channels_last,
    )
    if context.is_main:
        count = len(results["channels"])
        field = results["receptive_field"]["text"]
        print(
            printable(
                f"{count} channels of {args.layer}; {field} -> {os.path.join(args.out, INDEX)}"
            )
        )
    return 0
