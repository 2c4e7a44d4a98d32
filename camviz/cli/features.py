"""``camviz features``: every channel of named layers, as a grid image and a figure."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from camviz.cli.options import add_model_options, add_precision_options, tile_size

if TYPE_CHECKING:
    import torch


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "features",
        help="draw the channels of layers for one image",
        description="Run the model on IMAGE and write, for each --layer, NAME_grid.png (the "
        "channels tiled, each scaled to its own range) and NAME_figure.png (the channels "
        "titled with their indices, under the layer name).",
    )
    parser.add_argument("image", metavar="IMAGE", help="an image file")
    add_model_options(parser, channels_flag="--input-channels")
    parser.add_argument(
        "--layer",
        action="append",
        required=True,
        metavar="NAME",
        help="layer name or pattern such as 'layer*.0.conv1' (repeat for several; "
        "`camviz layers` lists them)",
    )
    parser.add_argument("--out", default="camviz-features", metavar="DIR", help="output folder")
    parser.add_argument(
        "--channels",
        type=int,
        default=None,
        metavar="N",
        help="draw N channels (default: all in the grid, 16 in the figure)",
    )
    parser.add_argument(
        "--order",
        choices=("first", "strongest", "weight"),
        default="first",
        help="with --channels: the first N, the N with the highest mean activation, or the N "
        "with the largest Grad-CAM weights for the image's predicted class",
    )
    parser.add_argument(
        "--colormap", default=None, help="matplotlib colour map for the grid (default grey)"
    )
    parser.add_argument(
        "--tile",
        type=tile_size,
        default=64,
        metavar="PX",
        help="enlarge small channels (nearest neighbour, by a whole factor) until the short "
        "side of each tile in the grid is at least PX pixels (1 to 1024); 1 keeps them as "
        "they are",
    )
    add_precision_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from camviz.cli.options import load_model
    from camviz.cli.text import echo
    from camviz.core.grids import as_spatial, patch_size
    from camviz.core.layerkinds import module_kind
    from camviz.core.lineage import Lineage
    from camviz.debug.extraction import features
    from camviz.io.images import load_image
    from camviz.io.render import channel_figure, channel_grid, save

    image = load_image(args.image)
    loaded = load_model(args)
    inputs = loaded.preprocess(image).unsqueeze(0)
    with Lineage(inputs) as lineage:  # where the patch tokens of a transformer layer are
        outputs = features(
            loaded.model,
            inputs,
            args.layer,
            device="cpu",
            precision=args.precision,
            channels_last=args.channels_last,
        )
    # Transformer tokens become (1, C, h, w) maps too; anything else is refused here,
    # before a file is written. The layer's module says where its channels are.
    patch = patch_size(loaded.model)
    modules = dict(loaded.model.named_modules())
    maps = {
        name: as_spatial(
            output,
            name,
            inputs.shape[-2:],
            patch,
            module_kind(modules[name], tuple(output.shape)),
            lineage.token_grid(output),
        )
        for name, output in outputs.items()
    }
    weights = _class_weights(loaded.model, inputs, list(maps)) if args.order == "weight" else {}
    out = Path(args.out)
    for name, activations in maps.items():
        grid = out / f"{name}_grid.png"
        figure = out / f"{name}_figure.png"
        channel_grid(
            _enlarged(activations, args.tile),
            grid,
            channels=args.channels,
            order=args.order,
            colormap=args.colormap,
            weights=weights.get(name),
        )
        drawn = channel_figure(
            activations,
            name,
            channels=args.channels or 16,
            order=args.order,
            weights=weights.get(name),
        )
        save(drawn, figure)
        echo(f"{name}: {tuple(activations.shape[1:])} -> {grid}, {figure}")
    return 0


def _class_weights(
    model: torch.nn.Module, inputs: torch.Tensor, layers: list[str]
) -> dict[str, torch.Tensor]:
    """Each layer's Grad-CAM channel weights for the predicted class (one explanation)."""
    from camviz.cams.engine import explain

    explained = explain(model, inputs, layer=layers)
    assert explained.weights is not None  # Grad-CAM weighs channels
    return {name: explained.weights[name][0] for name in layers}


def _enlarged(activations: torch.Tensor, tile: int) -> torch.Tensor:
    """``(1, C, h, w)`` maps repeated by a whole factor so that ``min(h, w) >= tile``.

    Each value becomes a square block, so the tile shows the map as it is (no smoothing),
    and means, hence ``--order strongest``, are unchanged.
    """
    factor = -(-tile // min(activations.shape[-2:]))  # ceiling division
    if factor <= 1:
        return activations
    return activations.repeat_interleave(factor, dim=-2).repeat_interleave(factor, dim=-1)
