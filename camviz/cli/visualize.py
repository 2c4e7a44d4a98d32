"""``camviz visualize``: images optimised to excite a unit (feature visualisation)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from camviz.cli.options import add_model_options, add_precision_options
from camviz.cli.text import printable

if TYPE_CHECKING:
    from camviz.core.targets.unit import Unit


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "visualize",
        help="draw what a channel, neuron or class responds to, by optimisation",
        description="Optimise images to excite each --target (a decorrelated Fourier-space "
        "image, moved, scaled and rotated at random at each step; Olah et al., Distill 2017) "
        "and write one PNG per target and image into --out. The same --seed gives the same "
        "images.",
    )
    add_model_options(parser)
    parser.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="UNIT",
        help="unit:LAYER@CHANNELS (unit:blocks.5@7, unit:blocks.5@0-7: one picture per "
        "channel), unit:LAYER@C,I,J for one neuron, or a class id (repeat for several)",
    )
    parser.add_argument("--out", default="camviz-visualize", metavar="DIR", help="output folder")
    parser.add_argument("--size", type=int, default=128, metavar="PX", help="image side (128)")
    parser.add_argument("--steps", type=int, default=256, help="optimisation steps (256)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (0.05)")
    parser.add_argument("--batch", type=int, default=1, help="images per target (1)")
    parser.add_argument(
        "--diversity",
        type=float,
        default=0.0,
        help="weight of the penalty on similar images in a batch (0: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    parser.add_argument(
        "--device",
        default=None,
        help="where the model runs (cpu, cuda, cuda:1); by default the GPU if any",
    )
    add_precision_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from camviz.cli.options import load_model, model_device_option
    from camviz.core.errors import CamvizError
    from camviz.core.targets.unit import parse_unit
    from camviz.io.output import save
    from camviz.pipeline import distributed
    from camviz.units.visualize import visualize_unit

    targets: list[tuple[str, Unit | int]] = []
    for text in args.target:
        if text.isdigit():
            targets.append((f"class_{int(text)}", int(text)))
        elif text.startswith("unit:"):
            unit = parse_unit(text)
            targets += [(_file_stem(single), single) for single in unit.ranked()]
        else:
            raise CamvizError(
                f"cannot read the target {text!r}; give unit:LAYER@CHANNELS or a class id"
            )
    loaded = load_model(args)
    loaded.model.to(model_device_option(args.device, distributed.from_environment()))
    out = Path(args.out)
    for stem, target in targets:
        images = visualize_unit(
            loaded,
            target,
            size=args.size,
            steps=args.steps,
            lr=args.lr,
            batch=args.batch,
            diversity=args.diversity,
            seed=args.seed,
            precision=args.precision,
            channels_last=args.channels_last,
        )
        for number, image in enumerate(images):
            suffix = f"_{number}" if len(images) > 1 else ""
            path = save(image, out / f"{stem}{suffix}.png")
            print(printable(str(path)))
    return 0


def _file_stem(unit: Unit) -> str:
    """``layer3.1@42`` as ``layer3.1_42``, a file name."""
    return unit.label.replace("@", "_").replace(":", "-").replace(",", "-").replace("/", "-")
