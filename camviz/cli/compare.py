"""``camviz compare``: several methods on several images, measured, in one HTML page."""

from __future__ import annotations

import argparse
import sys

from camviz.cli.options import (
    MAX_STEPS,
    add_compile_option,
    add_layout_option,
    add_memory_budget_option,
    add_model_options,
    add_precision_options,
    curve_steps,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="compare CAM methods on images: faithfulness numbers, timings, one HTML page",
        description="Explain each image with each method for the model's top-1 class, measure "
        "each map (deletion and insertion AUC, average drop, increase in confidence, win "
        "rate) and time it; write a self-contained report.html (opens from disk), "
        "metrics.csv (per image and method) and summary.csv (per method).",
    )
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files")
    add_model_options(parser)
    parser.add_argument(
        "--methods",
        default="gradcam,gradcam++,xgradcam,layercam,eigencam,fullgrad",
        help="comma-separated CAM methods (see `camviz methods`), or all; the default is "
        "the quick gradient family, since perturbation methods (scorecam, sscam, ablationcam) "
        "take seconds to minutes per image on a CPU",
    )
    parser.add_argument("--layer", default=None, help="target layer (see `camviz layers`)")
    parser.add_argument("--out", default="camviz-compare", metavar="DIR", help="output folder")
    parser.add_argument(
        "--steps",
        type=curve_steps,
        default=20,
        help=f"steps of the deletion and insertion curves, 1 to {MAX_STEPS}",
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="perturbed images per forward pass"
    )
    add_precision_options(parser)
    add_memory_budget_option(parser)
    add_compile_option(parser)
    add_layout_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from camviz import cams
    from camviz.cams.settings import ExplainSettings
    from camviz.cli.options import explain_settings, load_model
    from camviz.cli.text import echo
    from camviz.core.errors import CamvizError
    from camviz.evaluation.report import compare, write_report
    from camviz.pipeline.job import check_out_dir

    methods = [] if args.methods == "all" else _split(args.methods)
    for method in methods:
        cams.get(method)  # an unknown name fails before the model loads
    if args.batch_size < 1:
        raise CamvizError("--batch-size must be a positive integer")
    check_out_dir(Path(args.out))  # before minutes of work, not after
    loaded = load_model(args)
    if args.methods == "all":
        methods = cams.names(loaded.model)  # those that apply to this model
    comparison = compare(
        args.images,
        loaded,
        methods,
        steps=args.steps,
        batch_size=args.batch_size,
        progress=lambda line: echo(line, stream=sys.stderr),
        bar=None,
        settings=ExplainSettings(**explain_settings(args)),
    )
    written = write_report(comparison, args.out)
    echo(
        "| method | deletion AUC | insertion AUC | average drop % | win rate % | ms / image |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {row['method']} | {row['deletion_auc']:.3f} | {row['insertion_auc']:.3f} | "
            f"{row['average_drop']:.1f} | {row['win_rate']:.1f} | {row['ms_per_image']:.0f} |"
            for row in comparison.summary()
        ),
        f"wrote {written['report']}, {written['metrics']} and {written['summary']}",
    )
    return 0


def _split(methods: str) -> list[str]:
    return [name.strip() for name in methods.split(",") if name.strip()]
