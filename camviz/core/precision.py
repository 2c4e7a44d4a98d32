"""Reduced precision and channels-last memory format for the model's forward passes only.

``explain(..., precision="bf16", channels_last=True)`` runs every call of the model (the
plain pass and the perturbed passes of Score-CAM, SS-CAM and Ablation-CAM) under
``torch.autocast`` and hands it a channels-last copy of its input, through a forward
pre-hook and a forward hook on the model itself. The maps, the channel weights and the
normalisation run outside those calls, so they stay in float32: the engine up-casts what
the passes recorded (:func:`at_least_fp32`). Autocast leaves float64 tensors alone, so a
float64 model or input keeps float64 throughout.

Nothing of the model is converted: its parameters keep their dtype and memory format
(a convolution that receives a channels-last input computes channels-last on its own), and
the caller's input tensor is never modified, so both come back exactly as they came.

The tools that run a model once (:func:`camviz.features`, :func:`camviz.inspect`,
:func:`camviz.find_first_nonfinite`, :func:`camviz.core.layers.layer_shapes`) take the same
two arguments through :func:`model_precision`, which checks the request on the model's
device and returns the same :func:`forward_precision` block.

Reduced precision is only offered where the hardware computes it natively: on a CPU
without AVX-512 BF16 / AMX (or fp16 support), PyTorch emulates it, and a ResNet-18 forward
pass runs 5 to 30 times *slower* than in float32. Such a request is refused with one line
(:func:`check_precision`) rather than run silently slowly; setting the environment variable
``CAMVIZ_EMULATED_PRECISION=1`` runs it anyway, with a warning (to measure its accuracy).

The jobs over many images (the folder job, the unit scan) take ``channels_last=None`` to
mean "channels-last on a CPU, unless the model fails on them" (:class:`ChannelsLastChoice`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from camviz.core.errors import CamvizError, first_line
from camviz.core.inputs import model_device
from camviz.core.modelstate import ForwardPrecision, changed

Precision = Literal["fp32", "bf16", "fp16"]

_Result = TypeVar("_Result")

#: The dtype of each precision's autocast (``None``: no autocast).
DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}

#: Set to ``1`` to run a precision the hardware only emulates (slowly), with a warning.
EMULATED_VARIABLE = "CAMVIZ_EMULATED_PRECISION"


def check_precision(
    precision: str, device: torch.device, *, used: bool = True
) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device`` (``None`` for fp32), checked.

    With ``used=False`` (a method that always scores in float32) only the name is checked
    and the answer is ``None``.

    Raises:
        CamvizError: An unknown precision, or one that ``device`` does not compute natively
            (unless ``CAMVIZ_EMULATED_PRECISION=1``, which warns instead).
    """
    if precision not in DTYPES:
        raise CamvizError(f"precision must be one of fp32, bf16, fp16, not {precision!r}")
    dtype = DTYPES[precision] if used else None
    if dtype is None or native(device, dtype):
        return dtype
    message = (
        f"{precision} is not computed natively on this {device.type.upper()} "
        f"({_missing(device, dtype)}), so it would run slower than fp32"
    )
    if os.environ.get(EMULATED_VARIABLE) == "1":
        warnings.warn(f"{message}; running it anyway ({EMULATED_VARIABLE}=1)", stacklevel=3)
        return dtype
    raise CamvizError(
        f"{message}; use precision fp32 (channels-last still applies), or set "
        f"{EMULATED_VARIABLE}=1 to run it anyway"
    )


def native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``device`` computes ``dtype`` convolutions and matrix products natively."""
    if device.type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        mkldnn = torch.ops.mkldnn
        if dtype == torch.bfloat16:
            return bool(mkldnn._is_mkldnn_bf16_supported())
        return bool(mkldnn._is_mkldnn_fp16_supported())
    return True  # other accelerators: autocast itself says what it does not support


def _missing(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return "a GPU older than Ampere has no bf16 units"
    if dtype == torch.bfloat16:
        return "it needs AVX-512 BF16 or AMX"
    return "it needs AVX-512 FP16 or AMX-FP16"


@contextlib.contextmanager
def forward_precision(
    model: nn.Module, dtype: torch.dtype | None, channels_last: bool, device: torch.device
) -> Iterator[None]:
    """Run every call of ``model`` in the block under autocast to ``dtype`` (``None``: none),
    with a channels-last copy of each image or volume input if ``channels_last``
    (:class:`~camviz.core.modelstate.ForwardPrecision`).

    The hooks come off and any autocast a failed call left open is closed when the block
    ends, errors included.
    """
    if dtype is None and not channels_last:
        yield
        return
    with changed(model, ForwardPrecision(dtype, channels_last, device)):
        yield


def model_precision(
    model: nn.Module, precision: Precision, channels_last: bool
) -> contextlib.AbstractContextManager[None]:
    """:func:`forward_precision` for ``precision`` on the model's device (the CPU for a model
    without parameters), checked now, before the block is entered.

    Raises:
        CamvizError: As :func:`check_precision`.
    """
    device = model_device(model) or torch.device("cpu")
    return forward_precision(model, check_precision(precision, device), channels_last, device)


def at_least_fp32(value: Any) -> Any:
    """``value`` with every bf16 / fp16 tensor in it (tuples, lists, dicts) as float32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
    if isinstance(value, (tuple, list)):
        return type(value)(at_least_fp32(item) for item in value)
    if isinstance(value, dict):
        return {key: at_least_fp32(item) for key, item in value.items()}
    return value


class ChannelsLastChoice:
    """Whether a job's batches go to the model channels-last: as asked, or, when asked
    ``None``, chosen for image batches on a CPU, whose convolutions over a batch of
    channels-last images run up to three times faster (see the README's figures).

    A chosen (not asked-for) channels-last is on trial for the first batch: a model that
    calls ``.view`` on a convolution's output cannot take it, so if that batch fails and
    succeeds on contiguous inputs, the rest of the job gets contiguous ones, and one
    warning says so.

    Args:
        asked: ``True``, ``False``, or ``None`` to choose.
        device: Where the model runs.
        images: Whether the batches are images (``(N, C, H, W)``); volumes and clips stay
            as they come unless asked (3-D channels-last convolutions were not measured).
    """

    def __init__(self, asked: bool | None, device: torch.device, *, images: bool = True) -> None:
        self.value = (device.type == "cpu" and images) if asked is None else asked
        self.on_trial = asked is None and self.value

    def run(
        self, attempt: Callable[[bool], _Result], failed: Callable[[BaseException], bool]
    ) -> _Result:
        """``attempt(channels_last)`` for one batch. On trial, an error that ``failed``
        accepts (the model failed on these inputs) is tried once more on contiguous inputs;
        if that fails too, the memory format was not the cause: channels-last stays and the
        first error is raised."""
        if not self.on_trial:
            return attempt(self.value)
        self.on_trial = False
        try:
            return attempt(True)
        except Exception as error:  # ``failed`` tells which to retry
            if not failed(error):
                raise
            first = error
        try:
            result = attempt(False)
        except Exception as again:
            if not failed(again):
                raise
        else:
            self.value = False
            warnings.warn(
                f"channels-last inputs, chosen on a CPU, did not work: {first_line(first)}; "
                "the model gets contiguous ones instead (--no-channels-last or "
                "channels_last=False asks for them from the start)",
                stacklevel=3,
            )
            return result
        raise first
