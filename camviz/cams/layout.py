"""Where the channels and the image grid are in a layer's output, and its ``(N, C, h, w)`` view.

CAM maths works on ``(N, C, h, w)`` feature maps. Layers emit three layouts:

* ``nchw`` - convolutional networks: ``(N, C, h, w)``, used as it is;
* ``nhwc`` - channels last, as Swin transformers (timm and torchvision) emit between blocks:
  ``(N, h, w, C)``;
* ``tokens`` - vision transformers: ``(N, T, C)`` with ``T = P + h * w``, where the ``P``
  leading tokens are not image patches (the class token, DeiT's distillation token, register
  tokens) and the ``h * w`` patch tokens follow in row-major order.

The grid is inferred from the input size, never assumed (no fixed ``14 x 14``): for tokens,
``(h, w) = (H / s, W / s)`` for the patch stride ``s`` (the model's patch embedding when it
has one, else the largest stride-consistent grid that fits in ``T``), and ``P = T - h * w``.
A 4-D output is channels last when its dims 1-2, not 2-3, match the input's aspect ratio
(``(N, 8, 8, 32)`` for a ``64 x 64`` input); when both readings fit (``(N, 16, 16, 16)`` for
a square input) it is read as ``nchw``; pick a layer whose channel count differs from its
width then.

The same :class:`Layout` serves activations and their gradients (same shape, same layout),
and methods that edit a layer's output (Ablation-CAM) use :attr:`Layout.channel_dim`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from camviz.core.errors import CamvizError

Kind = Literal["nchw", "nhwc", "tokens"]


@dataclass(frozen=True)
class Layout:
    """The layout of one layer's output.

    Attributes:
        kind: ``"nchw"``, ``"nhwc"`` or ``"tokens"``.
        height: Rows ``h`` of the grid.
        width: Columns ``w`` of the grid.
        prefix: Leading tokens that are not patches (``tokens`` only): class, distillation
            and register tokens.
    """

    kind: Kind
    height: int
    width: int
    prefix: int = 0

    @property
    def channel_dim(self) -> int:
        """The channel dimension of the layer's own output."""
        return 1 if self.kind == "nchw" else -1

    def to_spatial(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ``(N, C, h, w)`` view of an output (or its gradient) in this layout."""
        if self.kind == "nchw":
            return tensor
        if self.kind == "nhwc":
            return tensor.permute(0, 3, 1, 2)
        patches = tensor[:, self.prefix :]
        return patches.unflatten(1, (self.height, self.width)).permute(0, 3, 1, 2)


def layout_of(
    shape: Sequence[int],
    layer: str,
    input_size: Sequence[int] | None = None,
    patch_size: int | None = None,
) -> Layout:
    """The layout of an output of ``shape`` produced for an input of ``input_size``.

    Args:
        shape: The layer output's shape, batch first.
        layer: The layer's name, for error messages.
        input_size: ``(H, W)`` of the input batch. Without it, 4-D outputs are read as
            ``nchw`` and token grids are assumed square.
        patch_size: The model's patch stride (see :func:`patch_size`), when known.

    Raises:
        CamvizError: The output is not a feature map or a token sequence with a grid.
    """
    shape = tuple(shape)
    if len(shape) == 4:
        if input_size is not None and _is_channels_last(shape, input_size):
            return Layout("nhwc", shape[1], shape[2])
        return Layout("nchw", shape[2], shape[3])
    if len(shape) == 3:
        height, width = _token_grid(shape[1], input_size, patch_size)
        if _holds(shape[1], (height, width)):
            return Layout("tokens", height, width, shape[1] - height * width)
        raise CamvizError(
            f"layer {layer!r} outputs {shape[1]} tokens, which do not form a patch grid for an "
            f"input of size {tuple(input_size) if input_size else '?'}; pick a transformer "
            "block (or its norm) that keeps the patch tokens"
        )
    raise CamvizError(
        f"layer {layer!r} outputs shape {shape}, not a feature map: it is not a (N, C, H, W) "
        "feature map, a channels-last (N, H, W, C) one or a token sequence (N, T, C); pick a "
        "convolutional layer or a transformer block"
    )


def as_spatial(
    tensor: torch.Tensor,
    layer: str,
    input_size: Sequence[int] | None = None,
    patch_size: int | None = None,
) -> torch.Tensor:
    """A layer's output (or its gradient) as an ``(N, C, h, w)`` map; see :func:`layout_of`."""
    return layout_of(tensor.shape, layer, input_size, patch_size).to_spatial(tensor)


def patch_size(model: nn.Module) -> int | None:
    """The stride of the model's patch embedding, or ``None`` if it has none.

    The patch embedding is the first ``Conv2d`` whose kernel equals its stride (timm's
    ``patch_embed.proj``, torchvision's ``conv_proj``), as in ViT, DeiT and Swin.
    """
    for module in model.modules():
        if (
            isinstance(module, nn.Conv2d)
            and module.kernel_size == module.stride
            and module.stride[0] == module.stride[1] > 1
        ):
            return module.stride[0]
    return None


def _matches_input(rows: int, cols: int, input_size: Sequence[int]) -> bool:
    """Whether a ``rows x cols`` grid has the input's aspect ratio, up to rounding.

    A grid of stride ``s`` has ``rows = H / s + e`` with ``|e|`` about one (padding,
    rounding), so ``rows / H - cols / W`` is at most about ``1 / H + 1 / W`` in size.
    """
    height, width = input_size
    return abs(rows * width - cols * height) <= 2 * (height + width)


def _is_channels_last(shape: tuple[int, ...], input_size: Sequence[int]) -> bool:
    return _matches_input(shape[1], shape[2], input_size) and not _matches_input(
        shape[2], shape[3], input_size
    )


def _token_grid(
    tokens: int, input_size: Sequence[int] | None, patch: int | None
) -> tuple[int, int]:
    """The patch grid ``(h, w)`` of ``tokens`` tokens for this input (``(0, 0)`` if none).

    The grid of the model's patch stride wins when the tokens hold it (with fewer extra
    tokens than patches); otherwise the largest stride-consistent grid that fits.
    """
    if input_size is None:
        side = math.isqrt(tokens)
        return side, side
    if patch and _holds(tokens, best := _largest_grid(tokens, input_size, [patch])):
        return best
    return _largest_grid(tokens, input_size, range(1, max(input_size) + 1))


def _largest_grid(
    tokens: int, input_size: Sequence[int], strides: Iterable[int]
) -> tuple[int, int]:
    height, width = input_size
    candidates = []
    for stride in strides:
        # Patch embeddings drop a partial last patch (floor) or pad it (ceil).
        candidates.append((height // stride, width // stride))
        candidates.append((-(-height // stride), -(-width // stride)))
    fitting = [(rows, cols) for rows, cols in candidates if 0 < rows * cols <= tokens]
    return max(fitting, key=lambda grid: grid[0] * grid[1], default=(0, 0))


def _holds(tokens: int, grid: tuple[int, int]) -> bool:
    """Whether ``tokens`` is a grid of patches plus fewer extra tokens than patches."""
    patches = grid[0] * grid[1]
    return 0 < patches <= tokens and tokens - patches < patches
