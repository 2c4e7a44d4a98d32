"""A DataLoader batch of decoded samples packed into shared memory in the worker.

A worker hands the main process its samples one by one, and every tensor in them crosses as
its own block of shared memory (one file descriptor sent over a socket, and one copy into it,
each). The folder job's inputs and originals were two blocks per image, and the main process
then copied the inputs once more to stack a batch. :func:`packed`, the loader's collate
function, instead stacks the inputs of each shape into one shared tensor (as PyTorch's own
collate does) and copies the originals into one shared buffer, so that a batch crosses as a
few blocks; :func:`batched` then takes a batch whose inputs are the consecutive rows of one
stacked tensor as that tensor, without a copy (a folder of photos of one shape, the common
case), and stacks any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch.utils.data import get_worker_info


class Sample(Protocol):
    """What is packed: a decoded sample's model inputs and original pixels (either may be
    ``None``)."""

    inputs: torch.Tensor | None
    original: torch.Tensor | None


def packed(samples: list[Sample]) -> list[Sample]:
    """``samples``, their inputs and originals made views of a few shared tensors (in a
    DataLoader worker; in the main process they stay as they are)."""
    if get_worker_info() is None:
        return samples
    by_kind: dict[tuple[tuple[int, ...], torch.dtype], list[tuple[Sample, torch.Tensor]]] = {}
    for sample in samples:
        if sample.inputs is not None:
            key = (tuple(sample.inputs.shape), sample.inputs.dtype)
            by_kind.setdefault(key, []).append((sample, sample.inputs))
    for group in by_kind.values():
        stacked = _shared((len(group), *group[0][1].shape), group[0][1].dtype)
        torch.stack([inputs for _, inputs in group], out=stacked)
        for row, (sample, _) in enumerate(group):
            sample.inputs = stacked[row]
    _pack_originals(samples)
    return samples


def _pack_originals(samples: Sequence[Sample]) -> None:
    """The originals (uint8 pixels of any shapes) copied into one shared buffer."""
    originals = [(sample, sample.original) for sample in samples if sample.original is not None]
    if not originals:
        return
    buffer = _shared((sum(original.numel() for _, original in originals),), torch.uint8)
    start = 0
    for sample, original in originals:
        view = buffer[start : start + original.numel()].view(original.shape)
        sample.original = view.copy_(original)
        start += original.numel()


def _shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor in shared memory, which crosses to the main process without a copy."""
    return torch.empty(shape, dtype=dtype).share_memory_()


def batched(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One ``(N, ...)`` batch of ``inputs``: the tensor they are the consecutive rows of,
    when they are (no copy), else a new stacked tensor."""
    first = inputs[0]
    storage = first.untyped_storage()
    step = first.numel()
    consecutive = first.is_contiguous() and all(
        tensor.untyped_storage().data_ptr() == storage.data_ptr()
        and tensor.shape == first.shape
        and tensor.dtype == first.dtype
        and tensor.is_contiguous()
        and tensor.storage_offset() == first.storage_offset() + row * step
        for row, tensor in enumerate(inputs)
    )
    if not consecutive:
        return torch.stack(list(inputs))
    shape, strides = (len(inputs), *first.shape), (step, *first.stride())
    return first.new_empty(0).set_(storage, first.storage_offset(), shape, strides)
