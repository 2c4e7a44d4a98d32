"""Progress and cancel for one explanation, seen from the model's passes.

Perturbation methods (Score-CAM, SS-CAM, IS-CAM, Ablation-CAM) run the model on chunks of
perturbed copies, one chunk per pass (:class:`camviz.cams.perturbation.Chunks`). A forward
hook on the model counts the rows of each pass's output: rows done over the copies the
method makes (the layer's channels, times its ``num_samples``) is the progress, and a
cancel asked for between two passes stops the call at the next one, by raising
:class:`CancelledError` from the hook. camviz's own cleanup runs as for any error, so the model
comes back as it came; the hook is removed in the same way.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from camviz.cams.perturbation import PerturbationMethod
from camviz.cams.registry import get
from camviz.core.errors import CamvizError
from camviz.core.hooks import tensors_in
from camviz.core.modelstate import HookSet

__all__ = ["CancelledError", "copies", "watched"]

#: ``report(fraction, text)``: where the progress goes (the page's progress bar).
Report = Callable[[float, str], None]


class CancelledError(CamvizError):
    """The user cancelled the explanation; the previous map stays."""


def copies(method: str, options: dict[str, Any], channels: int | None) -> int | None:
    """How many perturbed copies of one image ``method`` scores at a layer of ``channels``
    channels, or ``None`` for a method that makes none (one pass: nothing to follow) or
    when the channels are not known (a layer of several outputs)."""
    cls = get(method)
    if not issubclass(cls, PerturbationMethod) or channels is None:
        return None
    defaults = inspect.signature(cls).parameters
    samples = options.get("num_samples")
    if samples is None and "num_samples" in defaults:
        samples = defaults["num_samples"].default
    return channels * int(samples or 1)


@contextlib.contextmanager
def watched(
    model: nn.Module,
    cancel: threading.Event,
    expected: int | None,
    report: Report | None,
    what: str,
) -> Iterator[None]:
    """Follow the passes of ``model`` in the block: report the rows done out of
    ``expected`` (when known) and raise :class:`CancelledError` once ``cancel`` is set."""
    done = 0

    def after_pass(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal done
        if cancel.is_set():
            raise CancelledError(f"cancelled {what}; the map shown is the previous one")
        if expected is None or report is None:
            return
        done += _rows(output)
        report(min(1.0, done / expected), f"{what}: {min(done, expected)}/{expected} copies")

    with HookSet() as hooks:
        hooks.add(model.register_forward_hook(after_pass))
        yield


def _rows(output: Any) -> int:
    """Rows of a pass: images of a detector's list of dicts, else the first tensor's dim 0."""
    if isinstance(output, (list, tuple)) and output and isinstance(output[0], dict):
        return len(output)
    first = next(tensors_in(output), None)
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1
