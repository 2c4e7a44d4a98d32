"""Reading a unit's layer spot during a pass: the tensor the rest of the network got, and
its ``(N, C, *grid)`` view (tokens: the patch tokens on their grid)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.grids import as_spatial, patch_size
from camviz.core.inputs import as_inputs
from camviz.core.layouts import spot_reading
from camviz.core.taps import edit_spots

__all__ = ["outputs_at", "spatial_view"]


class _PassStoppedError(Exception):
    """Raised from a hook once every spot asked for has run: the rest of the pass is not
    needed."""


def outputs_at(
    model: nn.Module, inputs: torch.Tensor, spots: Sequence[str], *, finish: bool = False
) -> tuple[dict[str, torch.Tensor], Any]:
    """The tensors at ``spots`` for ``inputs`` (as the rest of the network gets them, in the
    graph when grad mode is on), and the model's output when ``finish``. Without
    ``finish`` the pass stops once the last spot has run: the layers after it are not
    computed, and the output is ``None``.

    Raises:
        CamvizError: A spot did not run, or holds no tensor.
    """
    seen: dict[str, torch.Tensor] = {}

    def keeper(spot: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def keep(tensor: torch.Tensor) -> torch.Tensor:
            seen.setdefault(spot, tensor)
            if len(seen) == len(spots) and not finish:
                raise _PassStoppedError
            return tensor

        return keep

    output = None
    try:
        with edit_spots(model, {spot: keeper(spot) for spot in spots}):
            output = model(inputs)
    except _PassStoppedError:
        pass
    missing = [spot for spot in spots if spot not in seen]
    if missing:
        raise CamvizError(
            f"layer {missing[0]!r} did not run in the forward pass; pick a layer that the "
            "model uses (`camviz layers` lists them with shapes)"
        )
    return seen, output


def spatial_view(
    model: nn.Module, spot: str, tensor: torch.Tensor, inputs: torch.Tensor
) -> torch.Tensor:
    """``tensor`` (the output or input at ``spot`` for the batch ``inputs``) as
    ``(N, C, *grid)``: channels first as it is, channels last moved, tokens on their patch
    grid without the leading tokens. The layout is told as the engine tells it, from the
    module, or from the module calls of one dry pass (:func:`camviz.core.layouts.spot_reading`).
    """
    told = spot_reading(model, spot, as_inputs(inputs, model))
    return as_spatial(tensor, spot, inputs.shape[2:], patch_size(model), told.kind, told.tokens)
