"""Watch or change every torch call of a forward pass, whatever module or function makes it.

Methods that must reach functional calls inside a model (guided ReLUs, FullGrad's bias taps,
LeGrad's attention maps, the sanity check's order of first use) cannot rely on module hooks:
``F.relu`` or ``F.scaled_dot_product_attention`` inside a ``forward`` has no module. A
:class:`CallMode` sees each call instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.overrides import TorchFunctionMode


class CallMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` whose subclasses implement :meth:`call`.

    Example:
        >>> class Count(CallMode):
        ...     def call(self, func, args, kwargs):
        ...         self.calls = getattr(self, "calls", 0) + 1
        ...         return func(*args, **kwargs)
        >>> with Count() as counting:
        ...     model(x)
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.call(func, args, kwargs or {})

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The result of ``func(*args, **kwargs)``, as this mode computes it."""
        raise NotImplementedError
