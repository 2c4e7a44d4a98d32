"""Ready-made edits for :func:`camviz.core.hooks.edit`: what to do to a layer's output.

Each function returns a callable ``output -> new output`` to use as a value of the mapping
that ``camviz.edit`` takes::

    with camviz.edit(model, {"layer4": zero_channels([17])}):
        logits = model(x)  # as if channel 17 of layer4 were switched off

The edits never change the layer's output in place (the model may still need it, as
ResNet's shortcut does) and stay differentiable, so they work inside :func:`camviz.explain`
and :func:`camviz.inspect` too. Channels are dimension 1, as in ``(N, C, H, W)`` maps; pass
``dim=-1`` for ``(N, tokens, C)`` transformer outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name

from camviz.core.errors import CamvizError
from camviz.core.hooks import EditFn

__all__ = [
    "add_noise",
    "clamp",
    "keep_channels",
    "spatial_mask",
    "zero_channels",
]


def zero_channels(channels: int | Sequence[int], *, dim: int = 1) -> EditFn:
    """Set the given channels to zero and leave the others as they are.

    Args:
        channels: A channel index or several (negative ones count from the end).
        dim: The channel dimension.
    """
    channels = _as_tuple(channels)

    def zeroed(output: torch.Tensor) -> torch.Tensor:
        return output.index_fill(dim, _channel_index(output, channels, dim), 0)

    return zeroed


def keep_channels(channels: int | Sequence[int], *, dim: int = 1) -> EditFn:
    """Keep only the given channels; every other channel becomes zero.

    Args:
        channels: A channel index or several (negative ones count from the end).
        dim: The channel dimension.
    """
    channels = _as_tuple(channels)

    def kept(output: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(output.shape[dim], dtype=torch.bool, device=output.device)
        keep[_channel_index(output, channels, dim)] = True
        shape = [1] * output.dim()
        shape[dim] = -1
        # where, not a multiplication by a 0/1 mask: Inf * 0 would be NaN.
        return torch.where(keep.view(shape), output, 0)

    return kept


def spatial_mask(mask: torch.Tensor) -> EditFn:
    """Multiply every channel by a spatial mask, resized to the layer's resolution.

    A mask drawn at the input's size (``1`` where the object is, ``0`` elsewhere) can thus
    be applied at any layer. A mask is shrunk by averaging (``area``), so each cell of a
    coarse map gets the fraction of it that the mask covers; a smaller mask is enlarged
    bilinearly.

    Args:
        mask: ``(H, W)`` for every sample, or ``(N, H, W)`` / ``(N, 1, H, W)`` per sample.
    """
    if not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(mask)
    shaped = mask[None] if mask.dim() == 2 else mask
    shaped = shaped[:, None] if shaped.dim() == 3 else shaped
    if shaped.dim() != 4 or shaped.shape[1] != 1:
        raise CamvizError(
            f"a spatial mask must be (H, W), (N, H, W) or (N, 1, H, W), got shape "
            f"{tuple(mask.shape)}"
        )

    def masked(output: torch.Tensor) -> torch.Tensor:
        if output.dim() != 4 or shaped.shape[0] not in (1, output.shape[0]):
            raise CamvizError(
                f"a spatial mask of shape {tuple(mask.shape)} does not fit a layer output of "
                f"shape {tuple(output.shape)}; mask (N, C, H, W) outputs, one mask or N masks"
            )
        weights = shaped.to(output.device, torch.float32)
        size = output.shape[-2:]
        if weights.shape[-2:] != size:
            shrinking = weights.shape[-2] >= size[0] and weights.shape[-1] >= size[1]
            if shrinking:
                weights = F.interpolate(weights, size, mode="area")
            else:
                weights = F.interpolate(weights, size, mode="bilinear", align_corners=False)
        return output * weights.to(output.dtype)

    return masked


def add_noise(std: float, *, seed: int | None = None) -> EditFn:
    """Add Gaussian noise of a fixed standard deviation to the output.

    With a ``seed`` the noise is reproducible: a fresh ``add_noise(std, seed=s)`` draws the
    same sequence of noise tensors, call after call, on the same device, and the global
    random state is left alone. Without one it draws from torch's global generator.

    Args:
        std: Standard deviation of the noise, in the units of the layer's output.
        seed: Seed of a generator of the edit's own.
    """
    if not std >= 0:
        raise CamvizError(f"the noise std must be zero or positive, not {std}")
    generators: dict[torch.device, torch.Generator] = {}

    def noisy(output: torch.Tensor) -> torch.Tensor:
        generator = None
        if seed is not None:
            if output.device not in generators:
                generators[output.device] = torch.Generator(output.device).manual_seed(seed)
            generator = generators[output.device]
        noise = torch.randn(
            output.shape, generator=generator, device=output.device, dtype=output.dtype
        )
        return output + std * noise

    return noisy


def clamp(min: float | None = None, max: float | None = None) -> EditFn:
    """Limit the output to ``[min, max]``; either bound may be left open.

    Args:
        min: The lowest value let through, or ``None``.
        max: The highest value let through, or ``None``.
    """
    if min is None and max is None:
        raise CamvizError("clamp needs min=, max= or both")
    if min is not None and max is not None and min > max:
        raise CamvizError(f"clamp needs min <= max, got min={min}, max={max}")

    def clamped(output: torch.Tensor) -> torch.Tensor:
        return output.clamp(min, max)

    return clamped


def _as_tuple(channels: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(channels, int):
        return (channels,)
    return tuple(int(channel) for channel in channels)


def _channel_index(output: torch.Tensor, channels: Sequence[int], dim: int) -> torch.Tensor:
    """``channels`` as a long tensor on the output's device, checked against its size."""
    if not isinstance(output, torch.Tensor):
        raise CamvizError(
            f"channel edits need a tensor layer output, not {type(output).__name__}; "
            "pick a layer that outputs a feature map"
        )
    count = output.shape[dim]
    outside = [channel for channel in channels if not -count <= channel < count]
    if outside or not channels:
        raise CamvizError(
            f"channel indices must lie in 0..{count - 1} (the output has {count} channels "
            f"in dimension {dim}), got {outside or 'none'}"
        )
    return torch.tensor([channel % count for channel in channels], device=output.device)
