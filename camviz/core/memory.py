"""Memory budgets: how much memory a piece of work needs, measured, and how much it may use.

:func:`peak_bytes` measures the extra memory one call needs at its peak. On CUDA the caching
allocator keeps that statistic (``torch.cuda.max_memory_allocated``). Elsewhere no allocator
statistic exists, so :class:`LiveTensorBytes`, a ``TorchDispatchMode``, follows every tensor
that an operator creates during the call and adds up those still alive after each operator:
exact at operator granularity, for any module or functional code (a ``torch.cat`` in a
``forward`` counts as much as a layer's output), and it only costs Python time on the one
call it watches. Scratch memory inside a single operator (a convolution's workspace) is not
seen; it is freed before the operator returns.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from camviz.core.errors import CamvizError

Result = TypeVar("Result")

# The default budget off CUDA, and on CUDA the share of the free memory (at most the cap).
CPU_BUDGET = 2**30
CUDA_FREE_SHARE = 0.5
CUDA_BUDGET_CAP = 8 * 2**30

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}
_AMOUNT = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*")


def parse_bytes(value: int | str, option: str = "memory_budget") -> int:
    """A positive number of bytes: an int, or a string such as ``"512MiB"`` or ``"2 GB"``.

    Raises:
        CamvizError: Not a positive amount with a known unit (B, kB, MB, GB, KiB, MiB, GiB).
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str):
        match = _AMOUNT.fullmatch(value.lower())
        if match and match[2] in _UNITS and float(match[1]) * _UNITS[match[2]] >= 1:
            return int(float(match[1]) * _UNITS[match[2]])
    raise CamvizError(
        f"{option} must be a positive number of bytes (an int, or a string like '512MiB' or "
        f"'2GB'), not {value!r}"
    )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` says that memory ran out: a GPU's ``torch.OutOfMemoryError``,
    Python's ``MemoryError``, or the ``RuntimeError`` of PyTorch's CPU allocator."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(
        phrase in str(error) for phrase in _OUT_OF_MEMORY
    )


# How PyTorch's allocators say that an allocation failed, when they raise a RuntimeError.
_OUT_OF_MEMORY = ("can't allocate memory", "out of memory")


def default_budget(device: torch.device) -> int:
    """The memory a method may add when none is given: 1 GiB, or on a GPU half of its free
    memory, at most 8 GiB."""
    if device.type != "cuda":
        return CPU_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(CUDA_BUDGET_CAP, int(free * CUDA_FREE_SHARE)))


def format_bytes(count: float) -> str:
    """``1.5 MiB``: a byte count for people."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} GiB"


def peak_bytes(device: torch.device, run: Callable[[], Result]) -> tuple[Result, int]:
    """``run()``'s result and the most memory it held at once beyond what existed before."""
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = run()
        return result, max(0, torch.cuda.max_memory_allocated(device) - before)
    with LiveTensorBytes() as live:
        result = run()
    return result, live.peak


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of the tensors created while it is active, and their peak.

    Each new storage an operator returns is held by a weak reference and counted in
    ``live``; when ``live`` would pass ``peak``, the storages that died are dropped first, so
    ``peak`` is the maximum of what the operators made and still existed. A result is new
    unless the operator's schema declares it an alias of an input (a view, an in-place or
    ``out=`` update), which every operator must; the schema is read once per operator, where
    comparing each result with every argument's storage cost more than the operators of a
    pass of small ones. Between those checks ``live`` may still count dead storages: it is
    never below the bytes alive, so a check it does not call for could not raise the peak.
    Storages under ``SMALL`` bytes are counted as if they never died: ``peak`` is then above
    the true peak by at most the bytes of those that did, and the weak references to scan
    are the few large ones (scanning every storage after every operator made a pass that
    creates thousands of small tensors, a detector's post-processing of hundreds of copies,
    quadratic in them).
    """

    SMALL = 4096

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo.disable by default, which
        # imports torch._dynamo (seconds) on the first operator; no compiled code runs here.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live = 0
        self.peak = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        output = func(*args, **(kwargs or {}))
        results = output if isinstance(output, tuple) else (output,)
        for fresh, result in zip(_fresh_results(func), results, strict=False):
            if fresh:
                self._count(result)
        if self.live > self.peak:
            self._forget_freed()
            self.peak = max(self.peak, self.live)
        return output

    def _count(self, result: object) -> None:
        """Count the storages of an operator's result that are not tracked yet."""
        for leaf in _tensors(result):
            key = _storage_key(leaf)
            if key is not None and key in self.storages and self.storages[key][0].expired():
                self._forget_freed()  # a new storage where a dead one was
            if key is None or key in self.storages:
                continue
            storage = leaf.untyped_storage()
            if storage.nbytes() >= self.SMALL:
                self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
            self.live += storage.nbytes()

    def _forget_freed(self) -> None:
        for key, (storage, size) in list(self.storages.items()):
            if storage.expired():
                del self.storages[key]
                self.live -= size


_FRESH: dict[Any, tuple[bool, ...]] = {}


def _fresh_results(func: Any) -> tuple[bool, ...]:
    """For each result of an ATen operator, whether it is new memory: its schema declares no
    alias of an input."""
    if func not in _FRESH:
        _FRESH[func] = tuple(result.alias_info is None for result in func._schema.returns)
    return _FRESH[func]


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors in an operator's arguments or output (tuples, lists and dicts of them):
    what ``torch.utils._pytree.tree_leaves`` finds there, at a fraction of its cost per
    operator."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _storage_key(value: object) -> int | None:
    """Where a dense tensor's memory starts (``None`` for anything else, or no memory)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.layout != torch.strided
        or value.device.type == "meta"
    ):
        return None
    storage = value.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None
