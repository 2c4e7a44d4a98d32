"""The model's forward compiled for the repeated passes of a perturbation method
(``compile_rest=True``), as a :class:`~camviz.core.modelstate.ModelChange`.

Score-CAM, SS-CAM and IS-CAM run the whole network once per channel on masked copies of the
input, thousands of passes of one shape: ``torch.compile`` (inductor) pays for its
compilation there (``benchmarks/bench_compile.py``, README *Compiled models*).
:class:`CompiledForward` hands the model, for one block, a ``forward`` that runs the
original one through ``torch.compile``; the model's own hooks (camviz's precision hooks
among them) stay outside the compiled code and run eagerly, and the model's ``__call__``,
parameters and modules are untouched. What the design takes care of:

* **Nothing left behind.** The compiled function is built on a fresh copy of a private code
  object each time, so the compiled graphs that dynamo attaches to it die with the block; the
  whole forward must compile as one graph (``fullgraph=True``), so dynamo attaches nothing to
  the model's own code either. At the end the instance attribute ``forward`` is removed again
  (or the one the model had is put back).
* **One shape, one compilation.** Passes of one row (Score-CAM's first, measured, pass and
  its blank image) run eagerly; larger passes are padded to the largest row count seen so
  far, by repeating their last row, and the padding rows are dropped from the output, so a
  shorter last chunk costs no second compilation.
* **Eager when it does not compile.** A model that does not compile as one graph, or a
  machine where inductor cannot build its kernels, runs its passes eagerly after one warning
  that says why; the maps are the same either way.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from camviz.core.errors import first_line
from camviz.core.modelstate import CHANNELS_LAST_FORMATS, InstanceForward
from camviz.core.targets import take_rows

#: The ``torch.compile`` backend of the masked passes (the tests use ``"aot_eager"``: the same
#: capture in a second, where inductor's C++ kernels take 20 s for the tiniest CNN).
BACKEND = "inductor"


def _forward_call(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The code that is compiled: the model's original ``forward`` on its inputs."""
    return forward(*args, **kwargs)


@dataclass(eq=False)
class _CompiledPasses:
    """The ``forward`` a model has during the block (see the module docstring).

    Attributes:
        forward: The model's original forward (bound).
        compiled: ``_forward_call`` on a fresh code object, through ``torch.compile``;
            ``None`` once it failed to compile.
        rows: The row count the compiled graph was built for (0: none yet).
    """

    forward: Callable[..., Any]
    compiled: Callable[..., Any] | None = None
    rows: int = 0

    def __post_init__(self) -> None:
        code = _forward_call.__code__.replace()  # a copy: dynamo's caches die with it
        fresh = types.FunctionType(code, _forward_call.__globals__, "camviz_compiled_forward")
        self.compiled = torch.compile(fresh, backend=BACKEND, fullgraph=True, dynamic=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        count = _rows(args, kwargs)
        if self.compiled is None or count is None or count <= 1:
            return self.forward(*args, **kwargs)
        self.rows = max(self.rows, count)
        padded_args = tuple(_padded(value, count, self.rows) for value in args)
        padded_kwargs = {key: _padded(value, count, self.rows) for key, value in kwargs.items()}
        try:
            output = self.compiled(self.forward, *padded_args, **padded_kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            self.compiled = None
            warnings.warn(
                "compile_rest: the model's forward does not compile as one graph "
                f"({type(error).__name__}: {first_line(error)[:160]}); its passes run eagerly",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.forward(*args, **kwargs)
        if count == self.rows:
            return output
        return take_rows(output, torch.arange(count))


@dataclass(frozen=True)
class CompiledForward(InstanceForward):
    """The model's ``forward`` run through ``torch.compile`` for the block (see the module
    docstring); the model's hooks run eagerly around it."""

    def replacement(self, model: nn.Module) -> Callable[..., Any]:
        return _CompiledPasses(model.forward)


def _rows(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """The batch size of a call: the rows of its first tensor with a batch axis."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def _padded(value: Any, count: int, rows: int) -> Any:
    """``value`` with its last row repeated up to ``rows`` rows, if it is a batch of
    ``count`` rows; anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != count:
        return value
    if count == rows:
        return value
    extra = value[-1:].expand(rows - count, *value.shape[1:])
    # The same memory format as a full chunk's (a channels-last input stays one), so that
    # the compiled graph's stride guards hold.
    layout = CHANNELS_LAST_FORMATS.get(value.dim())
    if layout is None or value.is_contiguous() or not value.is_contiguous(memory_format=layout):
        layout = torch.contiguous_format
    return torch.cat([value, extra]).contiguous(memory_format=layout)
