"""What the perturbation methods (Score-CAM, SS-CAM, IS-CAM, Ablation-CAM) share.

They weigh channels by how the explained score changes when the network runs on perturbed
copies of a sample, and every rank of a top-k target is scored from the same outputs: one
perturbed forward pass serves all ranks.

Memory: the copies are scored in chunks (:class:`Chunks`) sized from a memory budget and
what one copy costs the network *from the point where the copies are made to the output*,
measured on the first passes (:func:`camviz.core.memory.peak_bytes`). The copies alone are a
poor guide: a detector's heads, or an upsampling decoder, need far more per copy than the
layer output being copied.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeVar

import torch

from camviz.cams.base import CamMethod, ChannelWeighted, LayerData
from camviz.core.errors import CamvizError
from camviz.core.memory import default_budget, format_bytes, parse_bytes, peak_bytes

Result = TypeVar("Result")

# The share of the budget that chunks of copies fill. What is measured is live tensor bytes
# (or CUDA's allocated bytes); the allocator keeps more: glibc's heap holds on to freed
# blocks, so a process's resident size grew to 1.7x the live bytes of Faster R-CNN passes
# (benchmarks/bench_memory.py), and the engine's recorded activations are held meanwhile.
# At half the budget, Ablation-CAM at Faster R-CNN's feature pyramid still peaked 5% above
# it (benchmarks/bench_detection.py --ablation), so chunks fill two fifths.
BUDGET_FILL = 0.4


class PerturbationMethod(ChannelWeighted):
    """Base of the methods that weigh channels by scoring perturbed copies.

    Subclasses implement :meth:`rank_weights`, which scores every rank of a top-k target
    from the same perturbed passes (a single rank is the one-element case); the engine
    turns each rank's ``(N, C)`` channel weights into a map.

    Args:
        batch_size: Perturbed copies per forward pass. ``None`` (default): as many as fit in
            ``memory_budget``; a number overrides the budget.
        memory_budget: The memory, in bytes (an int, or ``"512MiB"``, ``"2GB"``), that the
            perturbed passes may add at their peak. ``None``: 1 GiB, or on a GPU half of
            its free memory, at most 8 GiB (:func:`camviz.core.memory.default_budget`).
        eigen_smooth: See :class:`~camviz.cams.base.ChannelMapMethod`.

    Attributes:
        copy_bytes: What one perturbed copy cost in the last call's largest measured pass
            (its peak over its rows, see :class:`Chunks`); ``None`` before a call, or when
            ``batch_size`` is given.
    """

    uses_gradients = False

    def __init__(
        self,
        batch_size: int | None = None,
        *,
        memory_budget: int | str | None = None,
        eigen_smooth: bool = False,
    ) -> None:
        super().__init__(eigen_smooth=eigen_smooth)
        self.batch_size = (
            None if batch_size is None else checked_count(self, "batch_size", batch_size)
        )
        self.memory_budget = None if memory_budget is None else parse_bytes(memory_budget)
        self.copy_bytes: int | None = None

    def channel_weights(self, data: LayerData) -> torch.Tensor:
        return self.rank_weights([data])[0]

    def chunks(self, inputs: torch.Tensor) -> Chunks:
        """A fresh chunking of the perturbed copies of ``inputs`` (one per kind of pass)."""
        return Chunks(self, inputs.device, self.copies_cap(inputs))

    def copies_cap(self, inputs: torch.Tensor) -> int | None:
        """The most copies per pass whatever the budget allows (``None``: no cap)."""
        return None


class Chunks:
    """How many perturbed copies go in one pass: as many as the budget holds, from what the
    first passes were measured to need.

    Until a size is known, :meth:`split` scores one copy alone and measures the peak memory
    of that pass (:func:`~camviz.core.memory.peak_bytes`): everything it makes, from the
    perturbed copy through every later layer to the scores. A pass's peak over its rows,
    ``copy_bytes``, bounds what each copy costs in any larger pass: the peak grows at most
    in proportion to the rows, since part of it does not grow at all (Ablation-CAM's layers
    before its target run on one sample, whatever the copies). Chunks hold
    ``BUDGET_FILL * budget // copy_bytes`` copies, at most ``cap``; while that grows, each
    pass is measured again and the bound tightens (a pass of ``n`` copies peaks at most at
    ``n`` times the bound from a smaller pass). ``batch_size`` overrides it all. A budget
    below one copy runs one copy per pass, with a warning.
    """

    def __init__(self, method: PerturbationMethod, device: torch.device, cap: int | None) -> None:
        self.method = method
        self.device = device
        self.cap = cap
        self.size = method.batch_size
        self.measuring = method.batch_size is None
        self.measured_rows = 0
        self.copy_bytes = 0
        self.warned = False

    def measured(self, rows: int, run: Callable[[], Result]) -> Result:
        """``run()``, a pass of ``rows`` copies, measured while the chunks still grow."""
        if not self.measuring or rows <= self.measured_rows:
            return run()
        result, peak = peak_bytes(self.device, run)
        self.measured_rows = rows
        self.copy_bytes = max(1, -(-peak // rows))
        previous, self.size = self.size, None
        self.measuring = previous is None or self.chunk_size() > previous
        return result

    def split(
        self, rows: torch.Tensor, run: Callable[[torch.Tensor], Result]
    ) -> Iterator[tuple[torch.Tensor, Result]]:
        """Each chunk of ``rows`` (along dim 0) with ``run(chunk)``, in order."""
        start = 0
        while start < len(rows):
            size = self.chunk_size() if self.measured_rows or self.size else 1
            chunk = rows[start : start + size]
            yield chunk, self.measured(len(chunk), partial(run, chunk))
            start += len(chunk)

    def chunk_size(self) -> int:
        """Copies per pass, once a pass was measured (or ``batch_size`` is given)."""
        if self.size is None:
            budget = self.method.memory_budget or default_budget(self.device)
            fitting = int(budget * BUDGET_FILL) // self.copy_bytes
            if fitting < 1 and not self.warned:
                self.warned = True
                warnings.warn(
                    f"{self.method.name}: memory_budget {format_bytes(budget)} is less than "
                    f"one perturbed copy needs ({format_bytes(self.copy_bytes)}); running one "
                    "copy per pass",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self.size = max(1, min(fitting, self.cap or fitting))
            self.method.copy_bytes = self.copy_bytes
        return self.size


def budget_option(method: type[CamMethod], memory_budget: int | str | None) -> dict[str, Any]:
    """The ``memory_budget`` option for ``method``: ``{"memory_budget": bytes}`` for a
    perturbation method when a budget is given, else nothing. Jobs that run several methods,
    or any method, hand one budget to all of them this way (a bad budget fails here, once).
    """
    if memory_budget is None:
        return {}
    budget = parse_bytes(memory_budget)
    return {"memory_budget": budget} if issubclass(method, PerturbationMethod) else {}


def checked_count(method: CamMethod, option: str, value: int) -> int:
    """``value`` of a method's option if it is a positive int, else a :class:`CamvizError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CamvizError(f"{method.name} needs {option} >= 1 (an int), got {value!r}")
    return value


def rank_scores(output: Any, ranks: Sequence[LayerData], samples: torch.Tensor) -> torch.Tensor:
    """``(K, R)``: the explained score of each rank for each of the ``R`` output rows.

    Args:
        output: The model's output for a batch of ``R`` perturbed copies.
        ranks: One :class:`LayerData` per rank (their ``score`` functions are used).
        samples: ``(R,)`` index of the input each row was made from (the ``rows`` of
            :mod:`camviz.core.targets`' protocol, which every score function follows).

    Raises:
        CamvizError: A target callable does not give one score per row, or scores rows by
            their position (:func:`camviz.core.targets.call_target`).
    """
    scores = []
    for data in ranks:
        score = data.score_fn(output, samples)
        if not isinstance(score, torch.Tensor) or score.shape != samples.shape:
            shape = tuple(score.shape) if isinstance(score, torch.Tensor) else type(score).__name__
            raise CamvizError(
                f"the target must give one score per output row, shape {tuple(samples.shape)}, "
                f"got {shape}; perturbation methods score batches of perturbed copies, so a "
                "target callable must score each row on its own (e.g. lambda out: out[:, 3]) "
                "or take the rows, fn(output, rows) (see camviz.core.targets)"
            )
        scores.append(score)
    return torch.stack(scores)
