"""Deep Feature Factorization: a layer's activations as a few non-negative concepts.

Paper: Collins, Achanta and Susstrunk, "Deep Feature Factorization for Concept Discovery",
ECCV 2018.

The ``(N, C, h, w)`` activations of a layer, over every location of every image of the
batch, form the rows of a matrix ``V`` of shape ``(N h w, C)``. Non-negative matrix
factorisation finds ``V ~ W H`` with ``W >= 0`` of shape ``(N h w, k)`` and ``H >= 0`` of
shape ``(k, C)``: row ``j`` of ``H`` is a concept (a direction in channel space), column
``j`` of ``W`` is where it is present, in every image at once, so the same concept is found
in all images of the batch. No class and no gradient is involved.

NMF needs ``V >= 0``: after a ReLU it is; a channel with negative values (a norm layer, a
transformer's tokens) is shifted by its minimum first, and the shift is added back to the
concepts' embeddings. pytorch-grad-cam shifts every channel by its minimum, also a positive
one; that subtracts a rank-one term from ``V`` which ``k`` concepts then have to absorb, so
camviz leaves non-negative channels as they are (the paper's setting).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.grids import layout_of, patch_size
from camviz.core.hooks import capture
from camviz.core.inputs import as_batch
from camviz.core.layerkinds import module_kind
from camviz.core.layers import default_target_layer, resolve_layers
from camviz.core.lineage import Lineage
from camviz.core.maps import normalize
from camviz.core.modelstate import eval_mode, no_grad
from camviz.core.placement import recording
from camviz.core.targets import as_logits


@dataclass
class Concepts:
    """The result of :func:`factorize`: ``k`` concepts found in a batch of ``N`` images.

    Attributes:
        maps: ``(N, k, h, w)`` loadings ``W`` of each concept at each location of the
            layer's grid, non-negative, scaled so that each concept's largest loading in the
            batch is 1.
        heatmaps: ``(N, k, H, W)`` the maps laid on the input (:mod:`camviz.core.placement`)
            and min-max normalised per image and concept (for drawing).
        embeddings: ``(k, C)`` each concept as activations of the layer: the activation
            vector of a location where the concept has loading 1 and no other is present.
        class_scores: ``(k, classes)`` the model's logits for a feature map filled with each
            concept's embedding, when the model's head is a linear layer after global
            average pooling of this layer (checked on the batch); else ``None``.
        error: ``||V - W H|| / ||V||`` (Frobenius norms), the share of the activations the
            concepts do not explain.
        layer: The layer's name.
    """

    maps: torch.Tensor
    heatmaps: torch.Tensor
    embeddings: torch.Tensor
    class_scores: torch.Tensor | None
    error: float
    layer: str

    def top_classes(self, n: int = 3) -> torch.Tensor:
        """``(k, n)`` the ``n`` classes each concept scores highest, best first.

        Raises:
            CamvizError: The model's head is not a linear layer after global average pooling.
        """
        if self.class_scores is None:
            raise CamvizError(
                f"no class scores for the concepts of layer {self.layer!r}: the model's head "
                "is not a linear layer after global average pooling of this layer"
            )
        return self.class_scores.topk(n, dim=-1).indices


def nmf(
    matrix: torch.Tensor, k: int, iterations: int = 500, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative ``W (M, k)`` and ``H (k, C)`` with ``W H ~ matrix`` in Frobenius norm.

    Lee and Seung's multiplicative updates (NIPS 2000) from a seeded random start::

        H <- H * (W^T V) / (W^T W H)        W <- W * (V H^T) / (W H H^T)

    Each update does not increase ``||V - W H||``; ``iterations`` updates of both are run.
    """
    generator = torch.Generator(device=matrix.device).manual_seed(seed)
    rows, columns = matrix.shape
    scale = (matrix.mean() / k).sqrt()
    shape_w, shape_h = (rows, k), (k, columns)
    w = scale * torch.rand(shape_w, generator=generator, device=matrix.device, dtype=matrix.dtype)
    h = scale * torch.rand(shape_h, generator=generator, device=matrix.device, dtype=matrix.dtype)
    tiny = torch.finfo(matrix.dtype).tiny
    for _ in range(iterations):
        h = h * (w.T @ matrix) / (w.T @ w @ h).clamp_min(tiny)
        w = w * (matrix @ h.T) / (w @ (h @ h.T)).clamp_min(tiny)
    return w, h


def factorize(
    model: nn.Module,
    inputs: torch.Tensor,
    layer: str | None = None,
    k: int = 4,
    *,
    iterations: int = 500,
    seed: int = 0,
    output_key: str | int | None = None,
) -> Concepts:
    """Deep Feature Factorization of a layer's activations over a batch into ``k`` concepts.

    Args:
        model: Any ``nn.Module``; used in eval mode and handed back as it came.
        inputs: ``(N, C, H, W)`` batch, or one ``(C, H, W)`` image, preprocessed.
        layer: The layer to factorise; ``None``: the default target layer of
            :func:`camviz.explain`.
        k: The number of concepts.
        iterations: NMF updates (see :func:`nmf`).
        seed: Seed of the NMF's random start: the same seed gives the same concepts.
        output_key: Where the logits are in a tuple or dict output (for ``class_scores``).

    Raises:
        CamvizError: Inputs that are not one float image batch (checked by
            :func:`camviz.core.inputs.as_batch`), a bad layer or ``k``, or activations that
            are all zero.
    """
    inputs = as_batch(inputs, model)
    with eval_mode(model):
        if layer is None:
            layer = default_target_layer(model, inputs)
        resolved = list(resolve_layers(model, layer))
        if len(resolved) != 1:
            raise CamvizError(f"factorize takes one layer; {layer!r} matches {len(resolved)}")
        layer = resolved[0]
        lineage = Lineage(inputs)  # where the patch tokens of a transformer layer are
        with capture(model, layer) as seen, recording(model) as placed, no_grad(), lineage:
            output = model(inputs)
    raw = seen.activations[layer]
    if not isinstance(raw, torch.Tensor):  # an FPN's levels: the default of a detector
        raise CamvizError(
            f"factorize takes one feature map, but layer {layer!r} gives a "
            f"{type(raw).__name__} of them; pass layer=NAME, e.g. a stage of its backbone"
        )
    patch = patch_size(model) if raw.dim() == 3 else None
    # Where the channels are: as the module says, or as in the input when it passes it on.
    kind = module_kind(model.get_submodule(layer), tuple(raw.shape))
    if kind is None and raw.shape == inputs.shape:
        kind = "channels_first"
    tokens = lineage.token_grid(raw)
    layout = layout_of(raw.shape, layer, inputs.shape[-2:], patch, kind, tokens)
    activations = layout.to_spatial(raw).float()
    batch, channels, height, width = activations.shape
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= channels:
        raise CamvizError(f"factorize needs 1 <= k <= {channels} (the channels), got {k!r}")
    matrix = activations.permute(0, 2, 3, 1).reshape(-1, channels)
    offset = matrix.amin(dim=0).clamp_max(0)
    shifted = matrix - offset
    if not bool(shifted.any()):
        raise CamvizError(f"layer {layer!r} outputs only zeros for this batch; pick another layer")
    w, h = nmf(shifted, k, iterations, seed)
    peak = w.amax(dim=0).clamp_min(torch.finfo(w.dtype).tiny)
    w, h = w / peak, h * peak.unsqueeze(1)
    error = float(torch.linalg.norm(shifted - w @ h) / torch.linalg.norm(shifted))
    maps = w.view(batch, height, width, k).permute(0, 3, 1, 2)
    embeddings = h + offset
    placement = placed.placement(inputs.shape[2:], None, batch)
    samples = torch.arange(batch).repeat_interleave(k)
    heatmaps = normalize(placement.lay(maps.flatten(0, 1), samples)).view(
        batch, k, *inputs.shape[-2:]
    )
    head = _pooled_linear_head(model, activations, output, output_key)
    with torch.no_grad():
        class_scores = head(embeddings) if head is not None else None
    return Concepts(maps, heatmaps, embeddings, class_scores, error, layer)


def _pooled_linear_head(
    model: nn.Module, activations: torch.Tensor, output: object, output_key: str | int | None
) -> nn.Linear | None:
    """The model's ``nn.Linear`` head if its logits are ``head(mean over h, w of A)``.

    Checked numerically on the batch, never assumed: the last linear layer taking ``C``
    features must reproduce the model's logits from the pooled activations.
    """
    try:
        logits = as_logits(output, output_key)
    except CamvizError:
        return None
    pooled = activations.mean(dim=(2, 3))
    candidates = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for linear in reversed(candidates):
        if linear.in_features != pooled.shape[1] or logits.shape != (
            len(pooled),
            linear.out_features,
        ):
            continue
        with torch.no_grad():
            predicted = linear(pooled.to(linear.weight.dtype))
        if torch.allclose(
            predicted, logits.float(), rtol=1e-3, atol=1e-4 * float(logits.abs().max())
        ):
            return linear
    return None
