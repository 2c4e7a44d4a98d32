"""Turn layer names, patterns and modules into named modules; pick a default target layer
(the rule lives in :mod:`camviz.core.defaults`).

A layer is given as a name of ``model.named_modules()`` (``"layer4"``, ``"layer4.1.bn2"``,
``"features.8"``), a shell-wildcard pattern (``"layer*.0.conv1"``) or the submodule itself
(``model.layer4``). An unknown name is a :class:`~camviz.core.errors.CamvizError` that lists
the closest real names.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Sequence
from functools import partial
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs, as_inputs
from camviz.core.modelstate import HookSet, eval_mode, no_grad
from camviz.core.precision import Precision, model_precision

if TYPE_CHECKING:
    from camviz.core.targets import TargetObject

__all__ = [
    "Layer",
    "default_target_layer",
    "layer_shapes",
    "resolve_layers",
]

_WILDCARDS = frozenset("*?[")

Layer: TypeAlias = str | nn.Module
"""A layer: its name, a wildcard pattern, or the submodule itself."""


def resolve_layers(model: nn.Module, layers: Layer | Iterable[Layer]) -> dict[str, nn.Module]:
    """Map names, wildcard patterns or submodules to named modules, keeping the given order.

    Args:
        model: The network whose submodules are looked up.
        layers: One layer or several; each a name, a pattern such as ``"layer*.0.conv1"``,
            or a submodule of ``model`` (found by identity, named as ``named_modules`` does).

    Returns:
        An ordered ``{name: module}`` dict without duplicates.

    Raises:
        CamvizError: A name matches nothing (the message suggests the closest names), a
            module is not part of ``model``, or a layer is neither a string nor a module.
    """
    if isinstance(layers, (str, nn.Module)):
        layers = [layers]
    elif not isinstance(layers, Iterable):
        raise CamvizError(_wrong_type_message(layers))
    modules = dict(model.named_modules())
    modules.pop("", None)
    resolved: dict[str, nn.Module] = {}
    for layer in layers:
        if isinstance(layer, nn.Module):
            matches = [name for name, module in modules.items() if module is layer][:1]
            if not matches:
                raise CamvizError(
                    f"the {type(layer).__name__} given as layer is not a submodule of this "
                    "model; pass one of its submodules (model.NAME) or a layer name"
                )
        elif isinstance(layer, str):
            if _WILDCARDS.intersection(layer):
                matches = [name for name in modules if fnmatch.fnmatchcase(name, layer)]
            else:
                matches = [layer] if layer in modules else []
            if not matches:
                raise CamvizError(_unknown_layer_message(layer, list(modules)))
        else:
            raise CamvizError(_wrong_type_message(layer))
        for match in matches:
            resolved[match] = modules[match]
    if not resolved:
        raise CamvizError("no layer was named; give at least one layer name")
    return resolved


def _wrong_type_message(layer: object) -> str:
    return (
        f"a layer must be a name, a wildcard pattern or a submodule of the model, not "
        f"{type(layer).__name__} {layer!r}"
    )


def _unknown_layer_message(name: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=5, cutoff=0.5)
    if not close:
        # Fall back to names that share the last component ("conv1" -> "layer1.0.conv1").
        tail = name.rsplit(".", 1)[-1]
        close = [candidate for candidate in candidates if candidate.endswith(tail)][:5]
    listing = "`camviz layers --model NAME` lists them all"
    hint = f"did you mean {', '.join(repr(c) for c in close)}? {listing}" if close else listing
    return f"no layer named {name!r} in the model; {hint}"


def default_target_layer(
    model: nn.Module,
    inputs: torch.Tensor | Inputs,
    target: TargetObject | None = None,
    output_key: str | int | None = None,
) -> str:
    """The layer to explain when none is named, for the ``target`` to explain (by default
    each sample's top class) and where its scores are (``output_key``).

    torchvision's detectors and segmentation models get the layer of their family, every
    other model the last layer of one dry run that depends on the map input, has a grid with
    its proportions, is not the output, and that the explained score depends on
    (:mod:`camviz.core.defaults` says how each is told). The model's train/eval modes are
    left as they were.

    Raises:
        CamvizError: No layer qualifies, or the batch is empty (and the model is none of the
            families above).
    """
    from camviz.core.defaults import default_layer

    batch = inputs if isinstance(inputs, Inputs) else as_inputs(inputs, model)
    return default_layer(model, batch, target, output_key)


def patch_token_layers(model: nn.Module, inputs: Inputs) -> list[str]:
    """The last layers whose outputs are patch tokens (see
    :func:`camviz.core.defaults.patch_token_layers`)."""
    from camviz.core.defaults import patch_token_layers as found

    return found(model, inputs)


def layer_shapes(
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    precision: Precision = "fp32",
    channels_last: bool = False,
) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, type, output shape)`` of every layer, in call order, from one dry run.

    A layer called several times appears once per call. Outputs that are not tensors show
    the shape ``()``. The model's train/eval flags are left as they were. ``precision`` and
    ``channels_last`` run the dry run as :func:`camviz.explain` would (see
    :mod:`camviz.core.precision`), so a model that fails under them fails here too.
    """
    rows: list[tuple[str, str, tuple[int, ...]]] = []

    def record(name: str, module: nn.Module, args: object, output: object) -> None:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else ()
        rows.append((name, type(module).__name__, shape))

    with (
        model_precision(model, precision, channels_last),
        HookSet() as hooks,
        no_grad(),
        eval_mode(model),
    ):
        for name, module in model.named_modules():
            if name:
                hooks.add(module.register_forward_hook(partial(record, name)))
        model(inputs)
    return rows
