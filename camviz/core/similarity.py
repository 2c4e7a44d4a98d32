"""Explain why two inputs look alike to an embedding model (CLIP-like retrieval, faces,
re-identification): the cosine similarity of the model's output embedding with a reference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.inputs import Inputs, as_inputs
from camviz.core.targets.outputs import as_logits
from camviz.core.targets.protocol import Change, Context, Resolved, TargetObject


class Similarity(TargetObject):
    """Target: ``cos(e(x_n), r_n)``, the cosine similarity between the model's output
    embedding of each sample and its reference.

    Args:
        reference: Either embeddings - a ``(D,)`` vector for every sample, or ``(N, D)``
            (or ``(1, D)``) - or an input batch for the same model (a tensor with spatial
            axes, a tuple or a dict, as :func:`camviz.explain` takes them), which is run
            through the model first; one reference input serves every sample.
        output_key: Where the embedding is in a tuple or dict output; by default a dict's
            ``image_embeds``, its one ``*_embeds`` or ``pooler_output`` (Hugging Face's
            outputs), else what :func:`camviz.core.targets.as_logits` finds.
        name: What the reference is, for its ``repr`` (manifests record it); by default a
            digest of its values.

    Called as ``similarity(output, rows)`` (``rows[r]``: the sample output row ``r`` was
    made from, for perturbation methods), it gives the ``(R,)`` similarities.

    Example:
        >>> camviz.explain(model, query, target=camviz.Similarity(reference_image))
    """

    def __init__(
        self, reference: Any, output_key: str | int | None = None, name: str | None = None
    ) -> None:
        self.reference = reference
        self.output_key = output_key
        self.name = name

    def __repr__(self) -> str:
        if self.name is None and isinstance(self.reference, torch.Tensor):
            values = self.reference.detach().cpu().contiguous().numpy().tobytes()
            self.name = hashlib.sha1(values).hexdigest()[:12]
        return f"Similarity({self.name or type(self.reference).__name__})"

    def is_embedding(self) -> bool:
        """Whether the reference is embeddings (a 1-D or 2-D tensor) rather than inputs."""
        return isinstance(self.reference, torch.Tensor) and self.reference.dim() <= 2

    def prepare(self, model: nn.Module, inputs: Inputs) -> Similarity:
        """This target with its reference as ``(1 or N, D)`` embeddings, checked against
        the model's output for ``inputs`` (the model must be in eval mode)."""
        reference = self.reference
        if not self.is_embedding():
            reference_inputs = as_inputs(reference, model)
            with torch.no_grad():
                reference = self.embedding(reference_inputs(model))
        if not isinstance(reference, torch.Tensor) or not reference.is_floating_point():
            raise CamvizError(
                f"Similarity needs a float reference embedding or an input batch, not "
                f"{type(reference).__name__}"
            )
        device = inputs.main.device
        reference = reference.detach().to(device)
        if reference.dim() == 1:
            reference = reference.unsqueeze(0)
        first = torch.zeros(1, dtype=torch.long, device=device)
        with torch.no_grad():
            sample = self.embedding(inputs.replaced({}, first)(model))
        if reference.shape[-1] != sample.shape[-1] or reference.shape[0] not in (1, inputs.size):
            raise CamvizError(
                f"the Similarity reference has shape {tuple(reference.shape)}, but the model "
                f"embeds each of the {inputs.size} inputs in {sample.shape[-1]} values; give "
                f"({sample.shape[-1]},), (1, {sample.shape[-1]}) or ({inputs.size}, "
                f"{sample.shape[-1]}) embeddings, or 1 or {inputs.size} reference inputs"
            )
        return Similarity(reference, self.output_key, self.name)

    def resolve(self, output: Any, context: Context) -> Resolved:
        """This similarity as the one score function (no class).

        Raises:
            CamvizError: The reference is inputs, not yet embedded by :meth:`prepare`.
        """
        if not self.is_embedding():
            raise CamvizError(
                "this Similarity holds reference inputs, which must be embedded by the model "
                "first (camviz.explain does it); pass reference embeddings here"
            )
        return Resolved((self,))

    def follow(self, change: Change) -> TargetObject:
        return self

    def embedding(self, output: Any) -> torch.Tensor:
        """The ``(R, D)`` embeddings in a model output: ``output[output_key]``, else in a dict
        (Hugging Face's outputs) ``image_embeds``, its one ``*_embeds`` or ``pooler_output``,
        else the output's scores (:func:`~camviz.core.targets.as_logits`)."""
        what = "the embedding that the score compares with the reference"
        if self.output_key is None and isinstance(output, Mapping):
            embeds = [key for key in output if isinstance(key, str) and key.endswith("_embeds")]
            named = (
                "image_embeds"
                if "image_embeds" in output
                else embeds[0]
                if len(embeds) == 1
                else "pooler_output"
                if "pooler_output" in output
                else None
            )
            if named is not None:
                return as_logits(output[named], what=what).flatten(1)
        return as_logits(output, self.output_key, what=what).flatten(1)

    def __call__(self, output: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
        embedding = self.embedding(output)
        reference = self.reference
        if reference.dim() == 1:
            reference = reference.unsqueeze(0)
        if rows is not None and reference.shape[0] > 1:
            reference = reference[rows]
        elif reference.shape[0] not in (1, embedding.shape[0]):
            raise CamvizError(
                f"Similarity has {reference.shape[0]} references for {embedding.shape[0]} "
                "output rows; call it with the rows' sample indices"
            )
        return F.cosine_similarity(embedding, reference.to(embedding.dtype), dim=-1)
