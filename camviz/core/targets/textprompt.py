"""Text prompts as targets for CLIP-like dual encoders: why an image matches a text.

:class:`TextPrompt` explains ``cos(f(x), t_k)``, the cosine similarity of the image
embedding ``f(x)`` (``get_image_features``) with the embedding ``t_k`` of each prompt
(``get_text_features``), for Hugging Face's ``CLIPModel`` and ``SiglipModel`` and any model
with both methods. ``k`` prompts give ``k`` maps per image, one rank each, in the order given
(map ``n * k + j`` is prompt ``j`` of image ``n``, as the ranks of ``"top3"``).

* The texts are embedded once per explanation, before the pass (:meth:`TextPrompt.prepare`,
  under :func:`camviz.core.modelstate.no_grad`): the text tower never enters the pass, and
  the map and its gradients are those of the image tower alone.
* The explained input is ``pixel_values``. A dual encoder's own ``forward`` needs text too,
  so when the explained model is the dual encoder itself, its calls answer
  ``get_image_features(x).pooler_output`` for the explanation
  (:class:`camviz.core.modelstate.ForwardAs`, a model change like the others: hooks and
  layer names stay the model's), the image embedding the ``hf:`` wrapper answers too, so
  both give the same default layer and output. A model that
  already answers the image embedding and holds the dual encoder (camviz's ``hf:`` models,
  :class:`camviz.io.sources.huggingface.ImageEmbedding`) is called as it is.
* The tokenizer is given, or carried by the explained model as its ``tokenizer`` attribute
  (``camviz.load_model("hf:DIR")`` loads the one saved in the folder). Prompts are padded to
  the text tower's length (``max_position_embeddings``): SigLIP pools its last token and was
  trained on padded texts, and CLIP, which pools its end token under a causal mask, gives
  the same embedding padded or not. Only what the tokenizer returns is passed (SigLIP's
  returns no attention mask, as SigLIP was trained).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from camviz.core.errors import CamvizError, first_line
from camviz.core.modelstate import ForwardAs, ModelChange, no_grad
from camviz.core.similarity import Similarity
from camviz.core.targets.protocol import Change, Context, Resolved, TargetObject

if TYPE_CHECKING:
    from camviz.core.inputs import Inputs

__all__ = ["EmbeddedPrompts", "TextPrompt", "dual_encoder", "text_encoder"]


class TextPrompt(TargetObject):
    """Target: the cosine similarity of each image's embedding with each text's, for a
    CLIP-like model (see the module docstring).

    Args:
        text: One prompt, or several (one map each, in this order).
        tokenizer: The model's tokenizer (or its processor); ``None``: the one the explained
            model carries (a model from ``camviz.load_model("hf:...")``).

    Example:
        >>> camviz.explain(clip, pixel_values, target=camviz.TextPrompt(["a cat", "a dog"], tok))
    """

    def __init__(self, text: str | Sequence[str], tokenizer: Any = None) -> None:
        texts = (text,) if isinstance(text, str) else tuple(text)
        if not texts or not all(isinstance(one, str) and one.strip() for one in texts):
            raise CamvizError(
                f"TextPrompt needs one or more non-empty texts, not {text!r}; e.g. "
                "TextPrompt('a photo of a cat')"
            )
        self.texts = texts
        self.tokenizer = tokenizer

    def __repr__(self) -> str:
        return f"TextPrompt({', '.join(map(repr, self.texts))})"

    def model_changes(self, model: nn.Module) -> tuple[ModelChange, ...]:
        """The dual encoder itself answers its image features; any other model as it is."""
        if not _is_dual_encoder(model):
            return ()
        return (ForwardAs("get_image_features", "pooler_output"),)

    def prepare(self, model: nn.Module, inputs: Inputs) -> EmbeddedPrompts:
        """The prompts embedded by the model's text tower, on the inputs' device."""
        encoder, tokenizer = text_encoder(model, self.tokenizer)
        return EmbeddedPrompts(self.texts, _embedded(encoder, tokenizer, self.texts, inputs))

    def resolve(self, output: Any, context: Context) -> Resolved:
        """Refused: the texts are embedded by the model first (:meth:`prepare`).

        Raises:
            CamvizError: Always.
        """
        raise CamvizError(
            f"{self!r} is not embedded yet; explain with it through camviz.explain, which "
            "embeds the texts with the model's text tower first"
        )

    def follow(self, change: Change) -> TargetObject:
        return self


@dataclass(frozen=True, eq=False)
class EmbeddedPrompts(TargetObject):
    """A :class:`TextPrompt` ready for the passes: its texts and their ``(K, D)`` embeddings.

    Resolves to one :class:`~camviz.core.similarity.Similarity` per prompt, in order.
    """

    texts: tuple[str, ...]
    embeddings: torch.Tensor

    def __repr__(self) -> str:
        return f"TextPrompt({', '.join(map(repr, self.texts))})"

    def resolve(self, output: Any, context: Context) -> Resolved:
        """One similarity score per prompt.

        Raises:
            CamvizError: The model's output is no embedding of the texts' size.
        """
        scores = tuple(
            Similarity(embedding.unsqueeze(0), name=text)
            for text, embedding in zip(self.texts, self.embeddings, strict=True)
        )
        image = scores[0].embedding(output)
        if image.shape[-1] != self.embeddings.shape[-1]:
            raise CamvizError(
                f"the model answers image embeddings of shape {tuple(image.shape)}, but its "
                f"text embeddings have {self.embeddings.shape[-1]} values; explain the CLIP-like "
                "model itself (its calls then answer get_image_features)"
            )
        return Resolved(scores)

    def follow(self, change: Change) -> TargetObject:
        return self


def _is_dual_encoder(module: nn.Module) -> bool:
    """Whether ``module`` has both towers' methods (CLIP, SigLIP)."""
    return callable(getattr(module, "get_text_features", None)) and callable(
        getattr(module, "get_image_features", None)
    )


def dual_encoder(model: nn.Module) -> nn.Module | None:
    """The dual encoder in ``model``: the model itself or its first submodule with both
    towers' methods; ``None`` when there is none."""
    return next((module for module in model.modules() if _is_dual_encoder(module)), None)


def text_encoder(model: nn.Module, tokenizer: Any = None) -> tuple[nn.Module, Any]:
    """The dual encoder in ``model`` (the model itself or a submodule) and the tokenizer to
    use: ``tokenizer`` (a processor's own tokenizer), else the model's ``tokenizer``.

    Raises:
        CamvizError: ``model`` holds no dual encoder, or no tokenizer is given or carried.
    """
    encoder = dual_encoder(model)
    if encoder is None:
        raise CamvizError(
            f"a TextPrompt needs a CLIP-like model with a text tower (get_text_features, as "
            f"Hugging Face's CLIPModel and SiglipModel), not {type(model).__name__}; compare "
            "an image embedding model's outputs with camviz.Similarity"
        )
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise CamvizError(
            "a TextPrompt needs the model's tokenizer: pass TextPrompt(text, "
            "tokenizer=AutoTokenizer.from_pretrained(NAME)), or load the model with "
            "camviz.load_model('hf:DIR') from a folder that holds its tokenizer"
        )
    return encoder, getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its own


def _embedded(
    encoder: nn.Module, tokenizer: Any, texts: Sequence[str], inputs: Inputs
) -> torch.Tensor:
    """``(K, D)``: the texts embedded by ``get_text_features``, without a graph."""
    config = getattr(getattr(encoder, "config", None), "text_config", None)
    length = getattr(config, "max_position_embeddings", None)
    try:
        tokens = tokenizer(
            list(texts),
            padding="max_length" if length else True,
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
    except (ValueError, TypeError, KeyError) as error:
        raise CamvizError(
            f"the tokenizer could not encode the prompts ({first_line(error)}); pass the "
            "model's own tokenizer (AutoTokenizer.from_pretrained of the model's folder)"
        ) from None
    device = inputs.main.device
    encode: Any = encoder.get_text_features
    with no_grad():
        output = encode(**{key: value.to(device) for key, value in tokens.items()})
    embeddings = output if isinstance(output, torch.Tensor) else output.pooler_output
    return embeddings.detach()
