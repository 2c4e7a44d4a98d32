"""``camviz explain``: heatmap overlays, panels and a manifest for image files."""

from __future__ import annotations

import argparse

from camviz.cli.options import add_model_options


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="explain images with a CAM method",
        description="Write, per image, a heatmap overlay at the photo's size and a panel "
        "(image | heatmap | overlay), and a manifest.json with the top-5 predictions, the "
        "explained class and the files written.",
    )
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files")
    add_model_options(parser)
    parser.add_argument("--layer", default=None, help="target layer (see `camviz layers`)")
    parser.add_argument(
        "--target",
        default="top1",
        help="class id, top1 (default) or topK (one map for each of the K best classes)",
    )
    parser.add_argument(
        "--method", default="gradcam", help="CAM method (see `camviz methods`; default gradcam)"
    )
    parser.add_argument("--out", default="camviz-out", metavar="DIR", help="output folder")
    parser.add_argument(
        "--alpha", type=float, default=0.5, help="heatmap weight in the overlay, 0..1"
    )
    parser.add_argument("--colormap", default="jet", help="matplotlib colour map name")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from camviz.cli.options import load_model
    from camviz.files import RenderOptions, explain_files
    from camviz.render import check_render_options

    check_render_options(args.alpha, args.colormap)
    target = int(args.target) if args.target.lstrip("-").isdigit() else args.target
    loaded = load_model(args)
    manifest = explain_files(
        args.images,
        args.out,
        loaded,
        method=args.method,
        layer=args.layer,
        target=target,
        render=RenderOptions(alpha=args.alpha, colormap=args.colormap),
    )
    for entry in manifest["images"]:
        best = entry["explained"][0]
        print(f"{entry['input']}: {best['name']} -> {args.out}/{best['files']['overlay']}")
    return 0
