"""Compute beside a training run without leaving a trace in it.

A training step is a function of the model, the optimiser, the gradients and the random
generators; a tracker that explains a probe batch between two steps must leave all of them
as they were, or the run with the tracker is not the run without it. :func:`untouched_run`
guards what a call of :func:`camviz.explain` could otherwise change from outside the model:

* the random generators (torch's CPU generator and every initialised CUDA device's, Python's
  ``random`` and NumPy's global one), saved and restored: a method that draws noise, or a
  model that draws in its forward pass, takes nothing from the run's sequence;
* the caller's ``torch.inference_mode()``, ``no_grad`` and ``autocast`` (Lightning validates
  under inference mode; a mixed-precision loop may call the tracker inside its autocast
  block): the block takes its own gradients in plain fp32, and tensors made in it are
  ordinary tensors, not inference tensors.

The model itself (train/eval flags, ``.grad``, ``requires_grad``, hooks, BatchNorm statistics,
which eval mode does not update) is handed back by ``camviz.explain``; the optimiser and an AMP
``GradScaler`` are never reached. ``tests/test_training.py`` checks all of it bit for bit.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["untouched_run"]


@contextlib.contextmanager
def untouched_run(device: torch.device) -> Iterator[None]:
    """Run the block with gradients on, autocast off and the random generators restored after.

    Args:
        device: The model's device; autocast is switched off for its type and the CPU's.
    """
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    torch_state = torch.get_rng_state()
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    types = {"cpu", device.type}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            for device_type in sorted(types):
                stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
