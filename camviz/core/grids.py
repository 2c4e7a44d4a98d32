"""Where the channels and the grid are in a layer's output, and its ``(N, C, *grid)`` view.

CAM maths works on channels-first feature maps ``(N, C, *grid)`` with a grid of one, two
or three axes (signals, images, volumes and clips). Layers emit three layouts
(:data:`camviz.core.layerkinds.Kind`):

* ``"channels_first"`` - convolutional networks: ``(N, C, L)``, ``(N, C, H, W)``,
  ``(N, C, D, H, W)``, used as they are;
* ``"channels_last"`` - ``(N, H, W, C)`` (Swin transformers between blocks) and the like;
* ``"tokens"`` - transformers: ``(N, T, C)``, of which ``prod(grid)`` tokens from ``prefix``
  on are the patches, in row-major order; tokens before them are class, distillation or
  register tokens, tokens after them detection tokens (YOLOS).

Which one a layer emits is decided from what produced it (:mod:`camviz.core.layerkinds`):
its module kind, or that of the module that produced the same tensor; the shape is used
only where the kind is unknown and the shape leaves one reading (an ``(N, A, B, C)`` map
whose axes 2-3, but not 1-2, have the input's proportions). Anything else raises and names
``layout=``, the argument of :func:`camviz.explain` that settles it.

Where the patches of a token sequence are is told by the pass that produced it: the patch
embedding's feature map that camviz followed into the tokens
(:class:`~camviz.core.lineage.TokenGrid`), which gives the grid and which tokens are patches.
Tokens that come from no feature map (a DETR decoder's object queries) have no grid, and are
refused in one line, never laid on a grid that their count happens to fit. Where nothing
tells, ``layout=camviz.Tokens(patches=slice(1, 197), grid=(14, 14))`` says where they are;
``layout="tokens"`` asks camviz to infer the grid from the token count and the input size
(``grid = size / s`` for the patch stride ``s`` of the model's patch embedding, else the
largest stride-consistent grid that fits in ``T``, the leading tokens the rest).

The same :class:`Layout` serves activations and their gradients (same shape, same layout),
and methods that edit a layer's output (Ablation-CAM) use :attr:`Layout.channel_dim`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.layerkinds import Kind
from camviz.core.layouts import Tokens
from camviz.core.lineage import TokenGrid

LAYOUT_HINT = (
    "pass layout='channels_first' (N, C, *grid), 'channels_last' (N, *grid, C) or "
    "'tokens' (N, T, C) to say which it is"
)


class NoPatchGridError(CamvizError):
    """A layer's tokens come from no patch embedding that camviz saw, so they have no grid.

    Attributes:
        layer: The layer.
        count: How many tokens it outputs.
    """

    def __init__(self, layer: str, count: int, patch_layers: Sequence[str] = ()) -> None:
        self.layer = layer
        self.count = count
        named = (
            f"e.g. {', '.join(map(repr, patch_layers))}"
            if patch_layers
            else "`camviz layers` lists the layers"
        )
        super().__init__(
            f"layer {layer!r} outputs {count} tokens that come from no patch embedding (object "
            f"queries?), so they have no grid; pick a layer whose tokens are patches ({named}), "
            "or say where they are with layout=camviz.Tokens(patches=slice(START, STOP))"
        )


@dataclass(frozen=True)
class Layout:
    """The layout of one layer's output.

    Attributes:
        kind: ``"channels_first"``, ``"channels_last"`` or ``"tokens"``.
        grid: The grid's size, one to three axes.
        prefix: Leading tokens that are not patches (``tokens`` only); the ``prod(grid)``
            patch tokens follow, and any tokens after them are not patches either.
    """

    kind: Kind
    grid: tuple[int, ...]
    prefix: int = 0

    @property
    def channel_dim(self) -> int:
        """The channel dimension of the layer's own output."""
        return 1 if self.kind == "channels_first" else -1

    def to_spatial(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ``(N, C, *grid)`` view of an output (or its gradient) in this layout."""
        if self.kind == "channels_first":
            return tensor
        if self.kind == "channels_last":
            return tensor.movedim(-1, 1)
        patches = tensor[:, self.prefix : self.prefix + math.prod(self.grid)]
        return patches.unflatten(1, self.grid).movedim(-1, 1)


def layout_of(
    shape: Sequence[int],
    layer: str,
    input_size: Sequence[int] | None = None,
    patch_size: int | Sequence[int] | None = None,
    kind: Kind | None = None,
    tokens: TokenGrid | Tokens | None = None,
) -> Layout:
    """The layout of an output of ``shape`` produced for an input of ``input_size``.

    Args:
        shape: The layer output's shape, batch first.
        layer: The layer's name, for error messages.
        input_size: The input's spatial size (``(L,)``, ``(H, W)`` or ``(D, H, W)``).
            Without it, outputs are read as channels first and token grids as square.
        patch_size: The model's patch stride (see :func:`patch_size`), when known.
        kind: What the producing module says (or ``layout=``: ``"tokens"`` there asks for the
            grid inferred from the token count); ``None``: only the shape.
        tokens: Where the patch tokens are: told by the pass, or by ``layout=Tokens(...)``.

    Raises:
        CamvizError: The output is not a feature map or a token grid, its layout cannot be
            told without ``layout=``, or (:class:`NoPatchGridError`) its tokens have no grid.
    """
    shape = tuple(shape)
    size = None if input_size is None else tuple(input_size)
    if len(shape) < 3:
        raise CamvizError(
            f"layer {layer!r} outputs shape {shape}, not a feature map: it has no spatial "
            "axes; pick a convolutional layer or a transformer block"
        )
    if isinstance(tokens, Tokens):
        return _given_tokens(shape, layer, size, tokens)
    if kind is None and tokens is None:
        kind = _kind_from_shape(shape, layer, size)
    if kind == "channels_first":
        return Layout("channels_first", shape[2:])
    if kind == "channels_last" and len(shape) > 3:
        return Layout("channels_last", shape[1:-1])
    if tokens is not None:
        return Layout("tokens", tokens.grid, tokens.start)
    if kind != "tokens":
        raise NoPatchGridError(layer, shape[1])
    grid = _token_grid(shape[1], size, patch_size)
    if _holds(shape[1], grid):
        return Layout("tokens", grid, shape[1] - math.prod(grid))
    raise CamvizError(
        f"layer {layer!r} outputs {shape[1]} tokens, which do not form a patch grid for an "
        f"input of size {size if size else '?'}; pick a transformer block (or its norm) that "
        "keeps the patch tokens"
    )


def _given_tokens(
    shape: tuple[int, ...], layer: str, size: tuple[int, ...] | None, given: Tokens
) -> Layout:
    """The layout that ``layout=Tokens(patches=..., grid=...)`` gives an ``(N, T, C)`` output."""
    if len(shape) != 3:
        raise CamvizError(
            f"layout=Tokens(...) is for token outputs (N, T, C), but layer {layer!r} outputs "
            f"shape {shape}"
        )
    start, stop, step = given.patches.indices(shape[1])
    count = len(range(start, stop, step))
    if step != 1 or count < 1:
        raise CamvizError(
            f"Tokens(patches={given.patches}) selects no run of tokens of the {shape[1]} that "
            f"layer {layer!r} outputs; give slice(START, STOP) within them"
        )
    grid = given.grid
    if grid is None and size is None:
        grid = (math.isqrt(count),) * 2
    elif grid is None:
        assert size is not None
        strides = [(stride,) * len(size) for stride in range(1, max(size) + 1)]
        grid = _largest_grid(count, size, strides)
    if math.prod(grid) != count:
        raise CamvizError(
            f"Tokens(patches={given.patches}) holds {count} tokens of layer {layer!r}, which "
            f"are not a grid {tuple(grid)} for an input of size {size}; pass Tokens(grid=...)"
        )
    return Layout("tokens", tuple(grid), start)


def _kind_from_shape(shape: tuple[int, ...], layer: str, size: tuple[int, ...] | None) -> Kind:
    """The layout when nothing but the shape speaks: only where one reading is possible
    (token sequences never: where their patches are is told by the pass)."""
    if size is None and len(shape) > 3:
        return "channels_first"
    if size is not None and len(shape) == len(size) + 2 and len(size) > 1:
        first = _matches_input(shape[2:], size)
        last = _matches_input(shape[1:-1], size)
        if not (first and last):
            return "channels_last" if last else "channels_first"
    raise CamvizError(
        f"cannot tell how layer {layer!r} lays out its output of shape {shape} for an input "
        f"of size {size} (nothing that produced it says); {LAYOUT_HINT}"
    )


def as_spatial(
    tensor: torch.Tensor,
    layer: str,
    input_size: Sequence[int] | None = None,
    patch_size: int | Sequence[int] | None = None,
    kind: Kind | None = None,
    tokens: TokenGrid | Tokens | None = None,
) -> torch.Tensor:
    """A layer's output (or its gradient) as an ``(N, C, *grid)`` map; see :func:`layout_of`."""
    return layout_of(tensor.shape, layer, input_size, patch_size, kind, tokens).to_spatial(tensor)


def patch_size(model: nn.Module) -> tuple[int, ...] | None:
    """The stride of the model's patch embedding per axis, or ``None`` if it has none.

    The patch embedding is the first convolution whose kernel equals its stride (timm's
    ``patch_embed.proj``, torchvision's ``conv_proj``, a video transformer's tubelets), as
    in ViT, DeiT and Swin.
    """
    for module in model.modules():
        if (
            isinstance(module, nn.modules.conv._ConvNd)
            and module.kernel_size == module.stride
            and max(module.stride) > 1
        ):
            return tuple(module.stride)
    return None


def _matches_input(grid: Sequence[int], size: Sequence[int]) -> bool:
    """Whether a grid has the input's proportions on every pair of axes, up to rounding.

    A grid of stride ``s`` has ``g_i = S_i / s + e`` with ``|e|`` about one (padding,
    rounding), so ``g_i S_j - g_j S_i`` is at most about ``S_i + S_j`` in size.
    """
    return all(
        abs(grid[i] * size[j] - grid[j] * size[i]) <= 2 * (size[i] + size[j])
        for i in range(len(size))
        for j in range(i + 1, len(size))
    )


# The most tokens besides the patches that a grid told without the model's stride may leave.
MAX_EXTRA_TOKENS = 16


def _token_grid(
    tokens: int, size: tuple[int, ...] | None, patch: int | Sequence[int] | None
) -> tuple[int, ...]:
    """The patch grid of ``tokens`` tokens for this input (all zeros if none).

    The grid of the model's patch stride wins when the tokens hold it (with fewer extra
    tokens than patches); otherwise the largest stride-consistent grid that fits.
    """
    if size is None:
        side = math.isqrt(tokens)
        return side, side
    if patch is not None:
        strides = (patch,) * len(size) if isinstance(patch, int) else tuple(patch)
        if len(strides) == len(size) and _holds(
            tokens, best := _largest_grid(tokens, size, [strides])
        ):
            return best
    uniform = [(stride,) * len(size) for stride in range(1, max(size) + 1)]
    grid = _largest_grid(tokens, size, uniform)
    # Without the model's own stride, only a grid that leaves a few extra tokens (class,
    # distillation, register tokens) is believed: MViT's pooled 8 x 7 x 7 tokens of a
    # 16 x 224 x 224 clip would otherwise be read as a 1 x 18 x 18 grid and 69 extras.
    return grid if tokens - math.prod(grid) <= MAX_EXTRA_TOKENS else (0,) * len(size)


def _largest_grid(
    tokens: int, size: tuple[int, ...], strides: Iterable[tuple[int, ...]]
) -> tuple[int, ...]:
    candidates = []
    for stride in strides:
        # Patch embeddings drop a partial last patch (floor) or pad it (ceil).
        candidates.append(tuple(extent // step for extent, step in zip(size, stride, strict=True)))
        candidates.append(
            tuple(-(-extent // step) for extent, step in zip(size, stride, strict=True))
        )
    fitting = [grid for grid in candidates if 0 < math.prod(grid) <= tokens]
    return max(fitting, key=math.prod, default=(0,) * len(size))


def _holds(tokens: int, grid: tuple[int, ...]) -> bool:
    """Whether ``tokens`` is a grid of patches plus fewer extra tokens than patches."""
    patches = math.prod(grid)
    return 0 < patches <= tokens and tokens - patches < patches
