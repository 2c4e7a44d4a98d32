"""Leave the model as it came: every temporary change camviz makes to a model, made and undone
in one place.

camviz changes a user's model only for the length of a block, and only through
:func:`changed`: it takes :class:`ModelChange` objects, makes them in order and undoes them
in reverse when the block ends, errors included (a change whose own ``apply`` fails halfway is
undone too, since what it will restore is saved before it starts). The changes camviz makes:

* :class:`EvalMode` - every module in eval mode (:func:`eval_mode`);
* :class:`ForwardPrecision` - autocast and channels-last inputs around each call of the model,
  through a forward pre-hook and a forward hook (:func:`camviz.core.precision.forward_precision`);
* :class:`FusedAttention` - attention modules (timm, MONAI, Hugging Face) switched to the
  fused call, which :mod:`camviz.core.attention` records;
* :class:`DetectorInputSize` - the sizes a torchvision detector resizes its images to
  (:func:`camviz.models.with_input_size`);
* :class:`Attributes` - given attributes of given modules set to given values (a detector's
  score threshold in a folder job);
* :class:`ForwardAs` - the model called through another of its methods (a CLIP model's
  ``get_image_features``, for a :class:`~camviz.core.targets.textprompt.TextPrompt`).

The passes camviz runs of a model without a gradient (dry runs, layer shapes, perturbed
copies, metrics, sanity checks) go through :func:`no_grad`, never ``torch.inference_mode``:
a model that caches a tensor on its first call for an input shape (Ultralytics' ``Detect``
head keeps its anchors and strides) would keep an inference tensor, and every later backward
pass through it, the user's own included, would fail.

Hooks come on and off through :class:`HookSet`, whose handles are removed together, on
errors too. :func:`exclusive` serialises the calls that hook a model: two threads that
explain with one shared model (a web service) take turns, because the hooks of one call
would see the other's forward pass and the flags one call restores would change the other's.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
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
        self._marks: list[tuple[nn.Module, bool | None]] = []

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        """Keep ``handle`` so that :meth:`remove` takes its hook off."""
        self._handles.append(handle)
        return handle

    def add_full_backward_hook(
        self, module: nn.Module, hook: Callable[..., Any]
    ) -> RemovableHandle:
        """``module.register_full_backward_hook(hook)``, kept like :meth:`add`.

        PyTorch marks a module that was given a full backward hook for good, and refuses it
        plain backward hooks from then on, even once the hook is removed; the mark is put
        back as it was too.
        """
        self._marks.append((module, module._is_full_backward_hook))
        return self.add(module.register_full_backward_hook(hook))

    def remove(self) -> None:
        """Take off every hook added so far (safe to call twice)."""
        while self._handles:
            self._handles.pop().remove()
        while self._marks:
            module, mark = self._marks.pop()
            module._is_full_backward_hook = mark

    def __len__(self) -> int:
        return len(self._handles)

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


class ModelChange:
    """One kind of temporary change to a model; :func:`changed` makes and undoes it.

    A change is a description (the same object may be applied to many models, and to one
    model more than once): what it needs to undo itself is returned by :meth:`save` and
    handed back to :meth:`apply` and :meth:`restore`.
    """

    def save(self, model: nn.Module) -> Any:
        """What :meth:`restore` needs, read before anything is changed."""
        raise NotImplementedError

    def apply(self, model: nn.Module, saved: Any) -> None:
        """Make the change."""
        raise NotImplementedError

    def restore(self, model: nn.Module, saved: Any) -> None:
        """Undo the change (also after an :meth:`apply` that failed halfway)."""
        raise NotImplementedError


@contextlib.contextmanager
def changed(model: nn.Module, *changes: ModelChange) -> Iterator[nn.Module]:
    """``model`` with ``changes`` made in order for the block, undone in reverse at its end.

    Every path restores: a change that fails to apply is undone with those made before it,
    an exception in the block undoes them all, and a restore that raises does not keep the
    others from running.
    """
    with contextlib.ExitStack() as undo:
        for change in changes:
            saved = change.save(model)
            undo.callback(change.restore, model, saved)
            change.apply(model, saved)
        yield model


@dataclass(frozen=True)
class EvalMode(ModelChange):
    """Every submodule in eval mode; each one's own flag comes back.

    ``model.train(previous)`` would not do: a model may mix modes (frozen BatchNorm layers
    in eval inside a model in train mode), and those must come back unchanged.
    """

    def save(self, model: nn.Module) -> list[tuple[nn.Module, bool]]:
        return [(module, module.training) for module in model.modules()]

    def apply(self, model: nn.Module, saved: Any) -> None:
        model.eval()

    def restore(self, model: nn.Module, saved: list[tuple[nn.Module, bool]]) -> None:
        for module, training in saved:
            module.training = training


#: One attribute to set: its owner, its name and the value it takes during the block.
Setting = tuple[object, str, Any]


class _SetAttributes(ModelChange):
    """Attributes of the model's modules set for the block; each one's value comes back."""

    def settings(self, model: nn.Module) -> Sequence[Setting]:
        """The attributes to set and their values during the block."""
        raise NotImplementedError

    def save(self, model: nn.Module) -> list[tuple[object, str, Any, Any]]:
        return [
            (owner, name, getattr(owner, name), value)
            for owner, name, value in self.settings(model)
        ]

    def apply(self, model: nn.Module, saved: list[tuple[object, str, Any, Any]]) -> None:
        for owner, name, _, value in saved:
            setattr(owner, name, value)

    def restore(self, model: nn.Module, saved: list[tuple[object, str, Any, Any]]) -> None:
        for owner, name, previous, _ in reversed(saved):
            setattr(owner, name, previous)


@dataclass(frozen=True, eq=False)
class Attributes(_SetAttributes):
    """The given attributes set to the given values, ``(owner, name, value)`` each."""

    values: tuple[Setting, ...]

    def settings(self, model: nn.Module) -> Sequence[Setting]:
        return self.values


@dataclass(frozen=True)
class FusedAttention(_SetAttributes):
    """Every attention module that computes its softmax itself switched to the fused call,
    ``F.scaled_dot_product_attention``, which :mod:`camviz.core.attention` computes
    explicitly and records (an explicit softmax would escape it):

    * timm's attention modules built without fused attention (``TIMM_FUSED_ATTN=0``):
      ``fused_attn``;
    * MONAI's ``SABlock`` without relative position embeddings: ``use_flash_attention``;
    * Hugging Face models: ``_attn_implementation`` ``"sdpa"`` on every config a module
      holds and on each of its sub-configs (a CLIP model's vision and text configs), set on
      each config itself, so that each one's own value comes back.
    """

    def settings(self, model: nn.Module) -> Sequence[Setting]:
        settings: list[Setting] = []
        for module in model.modules():
            if getattr(module, "fused_attn", None) is False:
                settings.append((module, "fused_attn", True))
            if (
                getattr(module, "use_flash_attention", None) is False
                and getattr(module, "rel_positional_embedding", None) is None
            ):
                settings.append((module, "use_flash_attention", True))
        configs = [getattr(module, "config", None) for module in model.modules()]
        for config in _with_sub_configs(configs):
            if config._attn_implementation_internal != "sdpa":
                settings.append((config, "_attn_implementation_internal", "sdpa"))
        return settings


def _with_sub_configs(configs: Sequence[Any]) -> list[Any]:
    """The Hugging Face configs among ``configs`` and their sub-configs, each once."""
    found: dict[int, Any] = {}
    pending = list(configs)
    while pending:
        config = pending.pop()
        if not hasattr(config, "_attn_implementation_internal") or id(config) in found:
            continue
        found[id(config)] = config
        pending += [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    return list(found.values())


@dataclass(frozen=True)
class DetectorInputSize(_SetAttributes):
    """A torchvision detector's images resized to ``size`` pixels on their shorter side.

    Each ``GeneralizedRCNNTransform`` in the model gets ``min_size = (size,)`` and a
    longer side of at most ``size`` times its own ratio of ``max_size`` to ``min_size``; a
    fixed-size one (SSD) resizes to ``size x size``. A letterboxing detector (Ultralytics',
    :class:`~camviz.core.placement.CentredLetterbox`) fits its images in ``size x size``; a
    Hugging Face detector's :class:`~camviz.core.placement.AspectResize` takes ``size`` as
    its shorter side, the longer one limited as ``min_size`` above (a fixed one:
    ``size x size``).
    """

    size: int

    def settings(self, model: nn.Module) -> Sequence[Setting]:
        from camviz.core.placement import aspect_resizes, detector_transforms, letterboxes

        settings: list[Setting] = [
            (letterbox, "size", self.size) for letterbox in letterboxes(model)
        ]
        for resize in aspect_resizes(model):
            if resize.fixed is not None:
                settings.append((resize, "fixed", (self.size, self.size)))
                continue
            assert resize.shortest is not None
            settings.append((resize, "shortest", self.size))
            if resize.longest is not None:
                longest = max(self.size, round(self.size * resize.longest / resize.shortest))
                settings.append((resize, "longest", longest))
        transform: Any  # torchvision's GeneralizedRCNNTransform
        for transform in detector_transforms(model):
            ratio = transform.max_size / transform.min_size[0]
            settings += [
                (transform, "min_size", (self.size,)),
                (transform, "max_size", max(self.size, round(self.size * ratio))),
            ]
            if transform.fixed_size is not None:
                settings.append((transform, "fixed_size", (self.size, self.size)))
        return settings


#: What :class:`InstanceForward` saves when the model had no ``forward`` of its own instance.
_NO_OWN_FORWARD = object()


class InstanceForward(ModelChange):
    """The model's calls run :meth:`replacement` instead of its ``forward``: set as an
    attribute of the instance, so ``model(x)`` still runs its hooks (camviz's and the
    user's) and its layer names stay; the class's ``forward`` is untouched, and the instance
    comes back with no ``forward`` of its own (or with the one it had)."""

    def replacement(self, model: nn.Module) -> Callable[..., Any]:
        """The callable that answers the model's calls for the block."""
        raise NotImplementedError

    def save(self, model: nn.Module) -> Any:
        return model.__dict__.get("forward", _NO_OWN_FORWARD)

    def apply(self, model: nn.Module, saved: Any) -> None:
        model.__dict__["forward"] = self.replacement(model)

    def restore(self, model: nn.Module, saved: Any) -> None:
        if saved is _NO_OWN_FORWARD:
            model.__dict__.pop("forward", None)
        else:
            model.__dict__["forward"] = saved


@dataclass(frozen=True)
class ForwardAs(InstanceForward):
    """The model's calls run its method ``method`` instead of ``forward``, and answer that
    output's ``key`` when it is no tensor: a CLIP model, whose ``forward`` needs text as well
    as pixels, answers ``get_image_features(x).pooler_output``, its image embedding."""

    method: str
    key: str | None = None

    def replacement(self, model: nn.Module) -> Callable[..., Any]:
        method, key = getattr(model, self.method), self.key

        # Named ``forward``: what raises inside is the model's (core.inputs.run_model).
        def forward(*args: Any, **kwargs: Any) -> Any:
            output = method(*args, **kwargs)
            return output if key is None or isinstance(output, torch.Tensor) else output[key]

        return forward


# Channels-last memory formats by tensor rank: images (N, C, H, W) and volumes (N, C, D, H, W).
CHANNELS_LAST_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


@dataclass
class _OpenPasses:
    """The hooks of one :class:`ForwardPrecision` and the autocasts of calls in progress."""

    hooks: HookSet = field(default_factory=HookSet)
    autocasts: list[torch.autocast] = field(default_factory=list)


@dataclass(frozen=True)
class ForwardPrecision(ModelChange):
    """Every call of the model under autocast to ``dtype`` (``None``: none), with a
    channels-last copy of each image or volume input if ``channels_last``.

    A forward pre-hook opens the autocast and a forward hook closes it, so only the model's
    own calls run in reduced precision; nothing of the model is converted. An autocast that
    a failed call left open is closed when the change is undone.
    """

    dtype: torch.dtype | None
    channels_last: bool
    device: torch.device

    def save(self, model: nn.Module) -> _OpenPasses:
        return _OpenPasses()

    def apply(self, model: nn.Module, saved: _OpenPasses) -> None:
        saved.hooks.add(model.register_forward_pre_hook(self._entering(saved)))
        saved.hooks.add(model.register_forward_hook(self._leaving(saved)))

    def restore(self, model: nn.Module, saved: _OpenPasses) -> None:
        self._close(saved)  # a forward pass that raised never reached its forward hook
        saved.hooks.remove()

    def _entering(self, saved: _OpenPasses) -> Callable[[nn.Module, tuple[Any, ...]], Any]:
        def enter(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            if self.dtype is not None:
                context = torch.autocast(self.device.type, dtype=self.dtype)
                context.__enter__()
                saved.autocasts.append(context)
            if self.channels_last:
                args = tuple(
                    arg.contiguous(memory_format=CHANNELS_LAST_FORMATS[arg.dim()])
                    if isinstance(arg, torch.Tensor) and arg.dim() in CHANNELS_LAST_FORMATS
                    else arg
                    for arg in args
                )
            return args

        return enter

    def _leaving(self, saved: _OpenPasses) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if saved.autocasts:
                saved.autocasts.pop().__exit__(None, None, None)

        return leave

    @staticmethod
    def _close(saved: _OpenPasses) -> None:
        while saved.autocasts:
            saved.autocasts.pop().__exit__(None, None, None)


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """``torch.no_grad()`` for a pass of the user's model, with ordinary tensors even inside
    a caller's ``torch.inference_mode()`` block (see the module docstring)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def eval_mode(model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """Every submodule in eval mode for the block, then each one's own flag back
    (:class:`EvalMode`)."""
    return changed(model, EvalMode())


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
