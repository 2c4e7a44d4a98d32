"""What a batch is, which of its inputs carries the map, and how the model is called.

:func:`camviz.explain` takes one tensor, a tuple or list of inputs (passed positionally,
``model(*inputs)``) or a dict (passed as keywords, ``model(**inputs)``, e.g. Hugging Face's
``pixel_values=``). Every tensor in it is a batch of the same ``N`` samples (0-d tensors
and other values are passed along as they are). The *map input* is the one the heatmap is
laid on (the first, unless ``map_input=`` names another; for a dict whose first input is
no float batch with spatial axes, as a processor's ``input_ids`` before ``pixel_values``,
the one input that is): a float ``(N, C, *spatial)`` batch with one to three spatial
axes - signals ``(N, C, L)``, images ``(N, C, H, W)``, volumes or clips ``(N, C, D, H, W)``.

A tensor is always a batch, with one exception kept for convenience: a single ``(C, H, W)``
image for a model whose first convolution is 2-D (decided from the model, not the rank).

A list (or tuple) is several positional inputs, with one exception decided from the model:
given to a torchvision detector (a model that holds a ``GeneralizedRCNNTransform``), a list
of ``(C, H_n, W_n)`` tensors is a list of images, which may differ in size, as torchvision's
detectors take them. It is kept as one zero-padded ``(N, C, H_max, W_max)`` map input with
each image's size (:attr:`Inputs.image_sizes`), and the detector is called with the list of
the images cropped back out of it, so every re-run of the model (masked copies, rows of
other samples) hands the detector each image at its own size. A list in gives a list of
maps out, each at its own image's size, even when the images have one size.

**The model's own failures.** Every call of the user's model goes through
:func:`run_model`: an exception raised by the model's code (a shape its layers refuse, an
assertion of its own) becomes a :class:`~camviz.core.errors.ModelError` with the original as
its ``__cause__``, which says that the model failed on these inputs, so that a run over many
inputs can record it for them. A :class:`~camviz.core.errors.CamvizError` and an
out-of-memory error pass as they are, and so does anything raised by camviz's own hooks
inside the pass: a bug of camviz keeps its traceback.
"""

from __future__ import annotations

import itertools
import os
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from camviz.core.errors import CamvizError, ModelError, first_line
from camviz.core.layerkinds import spatial_rank_of_model
from camviz.core.memory import is_out_of_memory
from camviz.core.placement import takes_image_lists

Key = int | str


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first parameter or buffer; ``None`` if it has neither."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return None if tensor is None else tensor.device


def run_model(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)``; what the model's own code raises becomes a ModelError.

    Raises:
        ModelError: The model raised (the original is the ``__cause__``).
        CamvizError: As raised inside the pass (a hook's check, a NaN).
        Exception: Out-of-memory errors, and errors raised by camviz's hooks, as they are.
    """
    try:
        return model(*args, **kwargs)
    except CamvizError:
        raise
    except Exception as error:
        if is_out_of_memory(error) or _raised_by_camviz(error):
            raise
        raise ModelError(
            f"the model failed on this input ({type(error).__name__}: {first_line(error)})"
        ) from error


# camviz's own source files, and the camviz functions that run the model's code rather than
# their own: a module's forward (the shipped synthetic models) and the torch modes that see
# each call (core.calls, core.memory).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MODEL_CODE = frozenset({"forward", "__torch_function__", "__torch_dispatch__"})


def _raised_by_camviz(error: BaseException) -> bool:
    """Whether ``error`` comes from camviz's code inside the model's pass (a hook): a camviz
    frame called from outside camviz, other than one that runs the model's own code."""
    caller_in_camviz = True  # the first frame is run_model's
    for frame, _ in traceback.walk_tb(error.__traceback__):
        code = frame.f_code
        inside = code.co_filename.startswith(_PACKAGE)
        if inside and not caller_in_camviz and code.co_name not in _MODEL_CODE:
            return True
        caller_in_camviz = inside
    return False


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)``, ``model(*inputs)`` or ``model(**inputs)``, on the model's device,
    through :func:`run_model`.

    Args:
        model: The network to run.
        inputs: A tensor, a tuple or list of positional arguments, or a dict of keyword
            arguments. Tensors among them are moved to the device of the model's first
            parameter (or buffer); a model with neither takes them as they are.
    """
    device = model_device(model)

    def move(value: Any) -> Any:
        return value.to(device) if isinstance(value, torch.Tensor) and device else value

    if isinstance(inputs, Mapping):
        return run_model(model, **{key: move(value) for key, value in inputs.items()})
    if isinstance(inputs, Sequence) and not isinstance(inputs, str):
        return run_model(model, *(move(value) for value in inputs))
    return run_model(model, move(inputs))


@dataclass(frozen=True)
class Inputs:
    """A model's inputs for one batch, and where the map input is.

    Attributes:
        args: Positional inputs.
        kwargs: Keyword inputs.
        key: The map input's position in ``args`` (int) or name in ``kwargs`` (str).
        size: The batch size ``N``.
        image_sizes: For a list of images (see the module docstring), the spatial size of
            each sample in the zero-padded map input, which the model gets cropped to it;
            ``None``: every sample fills the map input.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: Key
    size: int
    image_sizes: tuple[tuple[int, ...], ...] | None = None

    @property
    def main(self) -> torch.Tensor:
        """The map input, ``(N, C, *spatial)``."""
        return self[self.key]

    def __getitem__(self, key: Key) -> Any:
        return self.kwargs[key] if isinstance(key, str) else self.args[key]

    def __call__(self, model: nn.Module) -> Any:
        """The model's output for these inputs (a list of images: the list of crops)."""
        if self.image_sizes is None:
            return run_model(model, *self.args, **self.kwargs)
        sizes = self.image_sizes
        images = [corner(image, size) for image, size in zip(self.main, sizes, strict=True)]
        return self.replaced({self.key: images}, keep_sizes=False)(model)

    def spatial_sizes(self) -> tuple[tuple[int, ...], ...]:
        """The spatial size of each sample: its image's for a list, else the map input's."""
        if self.image_sizes is not None:
            return self.image_sizes
        return (tuple(self.main.shape[2:]),) * self.size

    def items(self) -> Iterator[tuple[Key, Any]]:
        """``(position or name, value)`` of every input."""
        yield from enumerate(self.args)
        yield from self.kwargs.items()

    def replaced(
        self,
        values: Mapping[Key, Any],
        rows: torch.Tensor | None = None,
        *,
        keep_sizes: bool = True,
    ) -> Inputs:
        """These inputs with ``values`` put in, and every other batched tensor taken at
        ``rows`` (``(R,)`` sample indices; ``None`` keeps them as they are). The image sizes
        of a list follow ``rows`` (a new map input keeps them: row ``r`` is an image of
        sample ``rows[r]``'s size), unless ``keep_sizes`` is false."""

        def pick(key: Key, value: Any) -> Any:
            if key in values:
                return values[key]
            if rows is not None and _is_batched(value):
                return value[rows]
            return value

        args = tuple(pick(position, value) for position, value in enumerate(self.args))
        kwargs = {name: pick(name, value) for name, value in self.kwargs.items()}
        size = len(rows) if rows is not None else self.size
        sizes = self.image_sizes if keep_sizes else None
        if sizes is not None and rows is not None:
            sizes = tuple(sizes[row] for row in rows.tolist())
        return replace(self, args=args, kwargs=kwargs, size=size, image_sizes=sizes)

    def with_main(self, tensor: torch.Tensor, rows: torch.Tensor | None = None) -> Inputs:
        """These inputs with the map input replaced by ``tensor`` (see :meth:`replaced`)."""
        return self.replaced({self.key: tensor}, rows)

    def run(self, model: nn.Module, tensor: torch.Tensor, rows: torch.Tensor | None = None) -> Any:
        """The model's output with the map input replaced by ``tensor``, whose row ``r`` was
        made from sample ``rows[r]`` (the other inputs follow ``rows``)."""
        return self.with_main(tensor, rows)(model)

    def spatial_keys(self) -> list[Key]:
        """The inputs that are float batches with spatial axes (input-gradient maps)."""
        return [
            key
            for key, value in self.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 3
        ]


def _is_batched(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def as_inputs(inputs: Any, model: nn.Module, map_input: Key | None = None) -> Inputs:
    """Check ``inputs`` (a tensor, tuple/list or dict) and move them to the model's device.

    Raises:
        CamvizError: Not tensors, inputs of different batch sizes, ``map_input`` out of
            range, or a map input without spatial axes.
    """
    if isinstance(inputs, torch.Tensor):
        if map_input not in (None, 0):
            raise CamvizError(
                f"map_input={map_input!r} names a second input, but one tensor was given"
            )
        if inputs.dim() == 3 and spatial_rank_of_model(model) == 2:
            inputs = inputs.unsqueeze(0)  # one (C, H, W) image for an image model
        args: tuple[Any, ...] = (inputs,)
        kwargs: dict[str, Any] = {}
    elif isinstance(inputs, (tuple, list)) and _is_image_list(inputs, model):
        return _image_list(inputs, model, map_input)
    elif isinstance(inputs, (tuple, list)) and inputs:
        args, kwargs = tuple(inputs), {}
    elif isinstance(inputs, Mapping) and inputs:
        args, kwargs = (), dict(inputs)
    else:
        raise CamvizError(
            f"inputs must be a tensor, a tuple of inputs or a dict of keyword inputs, not "
            f"{type(inputs).__name__}; preprocess images first (camviz.images.load_batch)"
        )
    key = _map_key(args, kwargs, map_input)
    device = model_device(model)
    moved = Inputs(
        tuple(_to(value, device) for value in args),
        {name: _to(value, device) for name, value in kwargs.items()},
        key,
        0,
    )
    main = moved.main
    if (
        not isinstance(main, torch.Tensor)
        or not main.is_floating_point()
        or not 3 <= main.dim() <= 5
    ):
        described = (
            f"{main.dtype} of shape {tuple(main.shape)}"
            if isinstance(main, torch.Tensor)
            else type(main).__name__
        )
        which = "inputs" if len(args) + len(kwargs) == 1 else f"the map input {key!r}"
        raise CamvizError(
            f"{which} must be a float (N, C, L), (N, C, H, W) or (N, C, D, H, W) batch "
            f"or one (C, H, W) image, got {described}"
        )
    sizes = {key: value.shape[0] for key, value in moved.items() if _is_batched(value)}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"input {key!r}: {size}" for key, size in sizes.items())
        raise CamvizError(f"the inputs have different batch sizes ({listed}); give N rows each")
    return replace(moved, size=main.shape[0])


def corner(tensor: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """The view of ``tensor``'s last ``len(size)`` axes cut to ``size`` from their start (an
    image of a list in its zero-padded batch)."""
    first = tensor.dim() - len(size)
    for offset, extent in enumerate(size):
        tensor = tensor.narrow(first + offset, 0, extent)
    return tensor


def _is_image_list(inputs: Sequence[Any], model: nn.Module) -> bool:
    """Whether ``inputs`` is a list of images for a detector (see the module docstring)."""
    return (
        bool(inputs)
        and all(isinstance(value, torch.Tensor) and value.dim() == 3 for value in inputs)
        and takes_image_lists(model)
    )


def _image_list(images: Sequence[torch.Tensor], model: nn.Module, map_input: Key | None) -> Inputs:
    """A list of ``(C, H_n, W_n)`` images as one zero-padded map input with their sizes."""
    if map_input not in (None, 0):
        raise CamvizError(
            f"map_input={map_input!r} names a second input, but a list of images was given"
        )
    channels = {image.shape[0] for image in images}
    if not all(image.is_floating_point() for image in images) or len(channels) > 1:
        described = ", ".join(f"{image.dtype} {tuple(image.shape)}" for image in images)
        raise CamvizError(
            f"a list of images must hold float (C, H, W) images with one C, got {described}"
        )
    sizes = tuple(tuple(image.shape[1:]) for image in images)
    first = images[0]
    canvas = first.new_zeros(len(images), first.shape[0], *map(max, zip(*sizes, strict=True)))
    for row, image in enumerate(images):
        corner(canvas[row], image.shape[1:]).copy_(image)
    main = _to(canvas, model_device(model))
    return Inputs((main,), {}, 0, len(images), image_sizes=sizes)


def _map_key(args: Sequence[Any], kwargs: Mapping[str, Any], map_input: Key | None) -> Key:
    if kwargs:
        names = list(kwargs)
        if map_input is None:
            return _first_map(kwargs)
        if map_input not in kwargs:
            raise CamvizError(f"map_input={map_input!r} is not one of the inputs {names}")
        return map_input
    if map_input is None:
        return 0
    if (
        isinstance(map_input, bool)
        or not isinstance(map_input, int)
        or not 0 <= map_input < len(args)
    ):
        raise CamvizError(
            f"map_input={map_input!r} is out of range: there are {len(args)} inputs "
            f"(0..{len(args) - 1})"
        )
    return map_input


def _is_map(value: Any) -> bool:
    """Whether ``value`` can carry a map: a float batch with one to three spatial axes."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and 3 <= value.dim() <= 5


def _first_map(kwargs: Mapping[str, Any]) -> str:
    """The map input of keyword inputs: the first, unless it cannot carry a map (a
    processor's ``input_ids`` come before ``pixel_values``) and one other input can."""
    names = list(kwargs)
    if _is_map(kwargs[names[0]]):
        return names[0]
    maps = [name for name in names if _is_map(kwargs[name])]
    if len(maps) > 1:
        raise CamvizError(
            f"the first input {names[0]!r} is no float (N, C, *spatial) batch, and "
            f"{', '.join(map(repr, maps))} all are; pass map_input= the one to lay maps on"
        )
    return maps[0] if maps else names[0]


def _to(value: Any, device: torch.device | None) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) and device is not None else value


def as_batch(inputs: object, model: nn.Module) -> torch.Tensor:
    """One float image batch ``(N, C, H, W)`` on the model's device, for the functions that
    change an image's pixels (the metrics, the sanity check, the comparison report) or read
    its grid (:func:`camviz.factorize`).

    The same checks, device and single-image rule as :func:`as_inputs`, for one tensor of
    images.

    Raises:
        CamvizError: As :func:`as_inputs`; also several inputs, signals or volumes.
    """
    if not isinstance(inputs, torch.Tensor):
        raise CamvizError(
            f"inputs must be one tensor of images (N, C, H, W), not {type(inputs).__name__}"
        )
    batch = as_inputs(inputs, model).main
    if batch.dim() != 4:
        raise CamvizError(
            f"this takes image batches (N, C, H, W), got shape {tuple(batch.shape)}; "
            "explain signals and volumes with camviz.explain"
        )
    return batch.detach()
