"""How the jobs over many inputs ask for their maps: one settings object, checked in one place.

The folder job (:func:`camviz.explain_files`, ``camviz explain``) and the comparison report
(:func:`camviz.evaluation.report.compare`, ``camviz compare``) take the same settings of
:func:`camviz.explain`: the method, the layer, the precision and memory format of the model's
passes and the perturbation methods' memory budget. :class:`ExplainSettings` holds them, and
:meth:`ExplainSettings.method_options` checks them before any model work (an unknown method,
a bad budget, a precision the hardware does not compute natively) and turns them into the
keywords of :func:`camviz.explain` for each method. The jobs take either such an object or
their keyword arguments (:func:`settings_or_keywords`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch
from torch import nn

from camviz.cams.perturbation import budget_option
from camviz.cams.registry import get
from camviz.core.errors import CamvizError
from camviz.core.inputs import model_device
from camviz.core.layers import Layer
from camviz.core.precision import Precision, check_precision

__all__ = ["ExplainSettings", "settings_or_keywords"]


@dataclass(frozen=True)
class ExplainSettings:
    """The settings of :func:`camviz.explain` that a job over many inputs shares.

    Attributes:
        method: A CAM method name (``camviz methods`` lists them).
        layer: Target layer name(s); ``None`` uses the model's known default or finds one.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` forward passes.
        channels_last: Channels-last inputs for the model; ``None`` lets the folder job
            choose (channels-last on a CPU, see
            :func:`~camviz.pipeline.dataset.explain_dataset`), contiguous ones elsewhere.
        memory_budget: Bytes (or ``"512MiB"``) that the perturbed passes of Score-CAM,
            SS-CAM, IS-CAM and Ablation-CAM may add; other methods ignore it. ``None``: the
            methods' default.
        layout: The ``layout=`` of :func:`camviz.explain` as text (``"channels_last"``,
            ``"tokens[1:197]"``); ``None``: told by the pass.
        compile_rest: Run the masked passes of Score-CAM, SS-CAM and IS-CAM through
            ``torch.compile`` (their ``compile_rest`` option); refused for a job whose
            methods have none of them.
    """

    method: str = "gradcam"
    layer: Layer | Sequence[Layer] | None = None
    precision: Precision = "fp32"
    channels_last: bool | None = False
    memory_budget: int | str | None = None
    layout: str | None = None
    compile_rest: bool = False

    def method_options(
        self, model: nn.Module, methods: Sequence[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        """The keywords of :func:`camviz.explain` for each method, by its registry name.

        Args:
            model: The model, on the device it runs on (the precision is checked there).
            methods: The methods to run; ``None``: :attr:`method`.

        Raises:
            CamvizError: An unknown method, a bad memory budget, a precision the model's
                device does not compute natively (for a method that uses it), or
                ``compile_rest`` for methods that do not compile their passes.
        """
        classes = [get(name) for name in (methods if methods is not None else [self.method])]
        compiling = [c for c in classes if _takes(c, "compile_rest")]
        if self.compile_rest and not compiling:
            raise CamvizError(
                f"compile_rest (--compile) compiles the masked passes of scorecam, sscam and "
                f"iscam; {', '.join(c.name for c in classes)} has none: leave it out"
            )
        device = model_device(model) or torch.device("cpu")
        check_precision(self.precision, device, used=any(c.reduced_precision for c in classes))
        common: dict[str, Any] = {"precision": self.precision, "channels_last": self.channels_last}
        if self.layout is not None:
            common["layout"] = self.layout
        compiled = {"compile_rest": True} if self.compile_rest else {}
        return {
            c.name: {
                **common,
                **budget_option(c, self.memory_budget),
                **(compiled if c in compiling else {}),
            }
            for c in classes
        }

    def forward_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype of a plain pass of the model for :attr:`method` (``None``:
        float32), as :func:`camviz.explain` runs it; checked as in :meth:`method_options`."""
        return check_precision(self.precision, device, used=get(self.method).reduced_precision)


Settings = TypeVar("Settings", bound=ExplainSettings)


def settings_or_keywords(settings: Settings | None, keywords: Settings) -> Settings:
    """``settings`` when given, else ``keywords`` (the settings a job built from its keyword
    arguments); both at once is refused, so that no keyword is silently ignored.

    Raises:
        CamvizError: ``settings`` is not of the job's kind, or it is given and a keyword
            differs from its default.
    """
    if settings is None:
        return keywords
    kind = type(keywords)
    if not isinstance(settings, kind):
        raise CamvizError(f"settings must be a {kind.__name__}, not {type(settings).__name__}")
    defaults = kind()
    given = [
        one.name
        for one in fields(kind)
        if not _same(getattr(keywords, one.name), getattr(defaults, one.name))
    ]
    if given:
        raise CamvizError(
            f"pass either settings= or keyword arguments, not both (given: {', '.join(given)})"
        )
    return settings


def _takes(method: type, option: str) -> bool:
    """Whether ``method``'s constructor takes ``option``."""
    return option in inspect.signature(method).parameters


def _same(value: object, default: object) -> bool:
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or type(value) is not type(default):
        return False
    return bool(value == default)
