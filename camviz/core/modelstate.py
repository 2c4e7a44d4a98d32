"""Leave the model as it came: hook handles that always come off, and modes that come back.

Everything in camviz that touches a model goes through these context managers, so the
promise "no hook left behind, same train/eval flags" is kept in one place.

:func:`exclusive` serialises the calls that hook a model: two threads that explain with
one shared model (a web service) take turns, because the hooks of one call would see the
other's forward pass and the train/eval flags one call restores would change the other's.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

from torch import nn
from torch.utils.hooks import RemovableHandle


class HookSet:
    """Hook handles registered together and removed together, on errors too.

    Example:
        >>> with HookSet() as hooks:
        ...     hooks.add(model.fc.register_forward_hook(fn))
        ...     model(x)
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        """Keep ``handle`` so that :meth:`remove` takes its hook off."""
        self._handles.append(handle)
        return handle

    def remove(self) -> None:
        """Take off every hook added so far (safe to call twice)."""
        while self._handles:
            self._handles.pop().remove()

    def __len__(self) -> int:
        return len(self._handles)

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


@contextlib.contextmanager
def exclusive(model: nn.Module) -> Iterator[nn.Module]:
    """Hold ``model`` for this thread while the block runs; other threads wait their turn.

    Re-entrant: a call that holds the model may call another that takes it again. For
    parallel work, give each thread its own copy of the model (``copy.deepcopy``).
    """
    with _locks_guard:
        lock = _locks.setdefault(model, threading.RLock())
    with lock:
        yield model


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule in eval mode for the block, then restore each one's own flag.

    ``model.train(previous)`` would not do: a model may mix modes (frozen BatchNorm layers
    in eval inside a model in train mode), and those must come back unchanged.
    """
    modes = [(module, module.training) for module in model.modules()]
    try:
        model.eval()  # inside the try: a module whose train() raises leaves the others set
        yield model
    finally:
        for module, training in modes:
            module.training = training


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside a ``torch.compile`` wrapper, or ``model`` itself.

    Code compiled before camviz adds its hooks does not run them (a compiled model called
    once under ``no_grad`` keeps that graph), so camviz hooks and runs the original module,
    which shares the wrapper's parameters. Layer names are then the original module's
    (``"layer4"``, not ``"_orig_mod.layer4"``).
    """
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner
    return model
