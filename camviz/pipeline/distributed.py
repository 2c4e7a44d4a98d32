"""Share one job between the processes that ``torchrun`` starts.

``torchrun --nproc_per_node=N -m camviz explain ...`` starts N copies of the command with
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set (``--nnodes`` spreads them over machines).
Each process reads the same inputs in the same order, takes its own shard with
``DistributedSampler``, and writes its own results; the processes meet only at barriers.
No tensors are exchanged, so the gloo backend serves CPUs and GPUs alike, and a process
group the caller already set up (any backend) is used as it is.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from camviz.core.errors import CamvizError


@dataclass(frozen=True)
class Context:
    """Where this process stands in a distributed run (rank 0 of 1 when run alone).

    Attributes:
        rank: This process's number, 0 to ``world_size - 1``.
        world_size: How many processes share the job.
        local_rank: Its number on this machine (which GPU it uses).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Whether this process does the job's final step (rank 0)."""
        return self.rank == 0


def from_environment() -> Context:
    """The context that ``torchrun`` describes in ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``.

    Raises:
        CamvizError: The variables are not whole numbers, or the rank is out of range.
    """
    try:
        context = Context(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )
    except ValueError:
        raise CamvizError(
            "RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers; start the processes with "
            "torchrun, or unset them"
        ) from None
    if not 0 <= context.rank < context.world_size:
        raise CamvizError(
            f"RANK {context.rank} is outside WORLD_SIZE {context.world_size}; start the "
            "processes with torchrun"
        )
    return context


@contextlib.contextmanager
def session() -> Iterator[Context]:
    """This process's context, with a gloo process group while the block runs.

    A group that is already initialised (by the caller's own script) is used and left
    open; one started here is destroyed on exit.
    """
    context = from_environment()
    started = context.world_size > 1 and not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")
    try:
        yield context
    finally:
        if started:
            dist.destroy_process_group()


def barrier(context: Context) -> None:
    """Wait until every process gets here."""
    if context.world_size > 1:
        dist.barrier()


def total(value: int, context: Context) -> int:
    """The sum of ``value`` over every process."""
    if context.world_size == 1:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    summed = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(summed)
    return int(summed.item())


def shard(indices: Sequence[int], context: Context) -> list[int]:
    """This process's share of ``indices``, taken with ``DistributedSampler``.

    The sampler deals positions round-robin (rank ``r`` gets ``r``, ``r + world_size``,
    ...) and pads the list by repeating its start so every rank gets as many; the padding is
    dropped here, because explaining an image twice would only write the same files twice.
    """
    sampler: DistributedSampler[int] = DistributedSampler(
        range(len(indices)),  # type: ignore[arg-type]  # it only takes len(); typed as Dataset
        num_replicas=context.world_size,
        rank=context.rank,
        shuffle=False,
        drop_last=False,
    )
    own = len(range(context.rank, len(indices), context.world_size))
    return [indices[position] for position in itertools.islice(sampler, own)]


def device(context: Context) -> torch.device:
    """The device this process should run the model on: its GPU if there is one."""
    if torch.cuda.is_available():
        return torch.device("cuda", context.local_rank % torch.cuda.device_count())
    return torch.device("cpu")
