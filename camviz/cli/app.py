"""``camviz app``: the explorer, a page in the browser for one model (see :func:`camviz.app`)."""

from __future__ import annotations

import argparse

from camviz.cli.options import add_model_options, add_precision_options


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "app",
        help="explore a model in the browser (needs camviz[app])",
        description="Serve a local page to explain the model on images: pick a class, an "
        "object (a detector's box) or a region (a segmentation model's), a method and its "
        "options, a layer of the layer tree; compare panels side by side, look at the "
        "layer's channels, measure deletion and insertion, export the HTML report and the "
        "maps. Nothing is sent beyond this machine. Stop it with Ctrl-C. Needs Gradio: "
        'pip install "camviz[app]".',
    )
    parser.add_argument(
        "images",
        nargs="*",
        metavar="IMAGE",
        help="image files, folders or glob patterns to offer (more can be uploaded)",
    )
    add_model_options(parser)
    parser.add_argument(
        "--port", type=int, default=7860, help="the port to listen on; 0 picks a free one"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on; another than 127.0.0.1 lets other machines in "
        "(with a warning)",
    )
    add_precision_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from camviz.cli.options import load_model
    from camviz.explorer.framework import gradio
    from camviz.explorer.server import app

    gradio()  # a missing Gradio is said before the model is loaded
    app(
        load_model(args),
        args.images,
        port=args.port,
        host=args.host,
        block=True,
        precision=args.precision,
        channels_last=args.channels_last,
    )
    return 0
