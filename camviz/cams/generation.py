"""A map per generated token for LLaVA-style vision-language models.

:func:`explain_generation` decodes greedily with the model's own ``generate``, then explains
every generated token's logit over the image patches from one *teacher-forced* pass over the
whole generated sequence: it gives the logit of every generated token at the position that
predicted it (position ``L - T - 1 + t`` predicts token ``t`` of ``T``, ``L`` the sequence's
length; ``logits_to_keep`` keeps only those rows of the vocabulary projection). The pass runs
under ``torch.no_grad()``: only what a method opens keeps a graph.

Grad-CAM (``method="gradcam"``, the default) reads the multi-modal projector's output ``P``:

1. The engine's tap on the projector (:class:`camviz.cams.recording.Tap`) hands the language
   model ``P + delta``, so only the layers after the projector keep a graph.
2. One backward pass per token, ``torch.autograd.grad(logit_t, delta)``, is exactly
   ``d logit_t / dP``.
3. Grad-CAM turns the base image's projected patch tokens and their gradient into a map on
   the patch grid (:func:`camviz.cams.llava.base_tokens`).

The attention methods (``attention_rollout``, ``gradient_rollout``,
``transformer_attribution``, with their options) read the language model's self-attention,
recorded in the same pass by :func:`camviz.core.attention.capturing` (fused attention, HF's
``sdpa``, computed explicitly; ``eager`` switched to it for the pass): their relevance matrix
over every block of the language model (``layer=`` is not offered: all of them), the row of
the position that predicted token ``t``, at the columns of the base image's patch tokens
(:func:`camviz.cams.llava.base_positions`). Rollout needs no gradient: one row each of one
matrix. The gradient-weighted ones take one backward pass per token, ``d logit_t / dA`` at
every block's attention ``A``. The language model is causal; its attention rows are zero
after the diagonal, and the formulas are the methods' own (:mod:`camviz.cams.attentionmethod`).

Either way the maps are ReLU'd, min-max normalised, and laid on the photo where the
processor put the image (:func:`camviz.cams.llava.base_window`; what the processor cropped
away is zero).

The model comes back as it came: eval mode through :class:`~camviz.core.modelstate.EvalMode`,
the tap through :func:`camviz.core.hooks.edit`, the attention implementation through
:class:`~camviz.core.modelstate.FusedAttention`, no parameter gradient computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch import nn

from camviz.cams import registry
from camviz.cams.attentionmethod import AttentionMethod
from camviz.cams.base import CamMethod, LayerData
from camviz.cams.llava import (
    LANGUAGE_MODEL,
    PROJECTOR,
    Llava,
    base_positions,
    base_tokens,
    base_window,
    llava_of,
)
from camviz.cams.recording import Tap
from camviz.core.attention import as_maps, capturing
from camviz.core.errors import CamvizError, NonFiniteError, first_line
from camviz.core.finite import is_finite
from camviz.core.hooks import edit
from camviz.core.inputs import model_device, run_model
from camviz.core.maps import normalize
from camviz.core.modelstate import EvalMode, changed, exclusive, no_grad, uncompiled
from camviz.core.precision import at_least_fp32

__all__ = ["Generation", "explain_generation"]

#: The methods a per-token map can use: Grad-CAM reads the projector's tokens and gradients
#: only, the attention methods the language model's attention (and its gradients).
GENERATION_METHODS = (
    "gradcam",
    "attention_rollout",
    "gradient_rollout",
    "transformer_attribution",
)


@dataclass
class Generation:
    """The result of :func:`explain_generation`, ``T`` generated tokens.

    Attributes:
        tokens: Each generated token's text (``tokenizer.decode`` of its id alone).
        token_ids: ``(T,)`` the generated token ids.
        heatmaps: ``(T, H, W)`` maps at the photo's size, in ``[0, 1]`` (ReLU, then min-max
            normalised per token); zero where the processor cropped the photo away.
        layer_maps: ``(T, h, w)`` raw maps on the base image's patch grid, before ReLU
            (the attention methods: the relevance of each patch's token).
        scores: ``(T,)`` each token's logit in the teacher-forced pass.
        text: The generated text (``tokenizer.decode`` of all of them).
        method: The method's registry name.
    """

    tokens: list[str]
    token_ids: torch.Tensor
    heatmaps: torch.Tensor
    layer_maps: torch.Tensor
    scores: torch.Tensor
    text: str
    method: str


def explain_generation(
    model: nn.Module,
    processor: Any,
    image: Image.Image,
    prompt: str,
    *,
    max_new_tokens: int = 20,
    method: str = "gradcam",
    **options: Any,
) -> Generation:
    """Generate an answer greedily and explain each generated token over the image.

    Args:
        model: A LLaVA-style model (transformers' ``LlavaForConditionalGeneration`` or
            ``LlavaNextForConditionalGeneration``); handed back as it came.
        processor: Its processor (``AutoProcessor``): it expands the prompt's image token
            and prepares the image.
        image: The photo, a PIL image; the maps are at its size.
        prompt: The prompt, with the processor's image token (``"<image>"``) where the
            image goes, in the model's chat format.
        max_new_tokens: At most this many tokens are generated (fewer when the model ends).
        method: ``"gradcam"``: Grad-CAM at the multi-modal projector's output;
            ``"attention_rollout"``, ``"gradient_rollout"`` or ``"transformer_attribution"``:
            the method on the language model's attention to the base image's tokens, over
            all its blocks (see the module docstring).
        **options: The method's constructor options (``head_fusion``, ``discard_ratio``).

    Returns:
        A :class:`Generation`: the tokens, their ids and one map each.

    Raises:
        CamvizError: Not a LLaVA-style model, not a PIL image, no image token in the
            prompt, an unknown method or option, a processor whose geometry camviz cannot
            read, or a language model whose attention camviz cannot record.
        NonFiniteError: NaN or Inf in the logits or the gradients.
    """
    network = uncompiled(model)
    llava = llava_of(network)
    explainer = _method(method, options)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise CamvizError(f"max_new_tokens must be a positive int, not {max_new_tokens!r}")
    inputs = _processed(processor, image, prompt, llava, network)
    window = base_window(processor, llava, (image.height, image.width), _pixels(inputs))
    prompt_length = inputs["input_ids"].shape[1]
    with exclusive(network), changed(network, EvalMode()):
        with no_grad():
            sequence = _greedy(network, inputs, max_new_tokens)
        generated = sequence[0, prompt_length:]
        if isinstance(explainer, AttentionMethod):
            scores, layer_maps = _attention_maps(network, inputs, sequence, explainer, llava)
        else:
            scores, layer_maps = _gradcam_maps(network, inputs, sequence, explainer, llava)
    heatmaps = window.lay(normalize(layer_maps.clamp_min(0)))
    tokenizer = processor.tokenizer
    ids = generated.tolist()
    return Generation(
        tokens=[tokenizer.decode([token]) for token in ids],
        token_ids=generated.cpu(),
        heatmaps=heatmaps.cpu(),
        layer_maps=layer_maps.cpu(),
        scores=scores.cpu(),
        text=tokenizer.decode(ids),
        method=explainer.name,
    )


def _method(name: str, options: dict[str, Any]) -> CamMethod:
    """The registry's method ``name`` built with ``options``, if a per-token map can use it."""
    cls = registry.get(name)
    if cls.name not in GENERATION_METHODS:
        raise CamvizError(
            f"explain_generation takes method={' or '.join(map(repr, GENERATION_METHODS))}, "
            f"not {name!r}"
        )
    return registry.create(cls.name, **options)


def _pixels(inputs: dict[str, torch.Tensor]) -> tuple[int, int]:
    """The processed image's ``(H, W)``."""
    height, width = inputs["pixel_values"].shape[-2:]
    return int(height), int(width)


def _processed(
    processor: Any, image: Image.Image, prompt: str, llava: Llava, model: nn.Module
) -> dict[str, torch.Tensor]:
    """The processor's tensors for ``image`` and ``prompt``, on the model's device, with the
    image in the model's floating dtype."""
    if not isinstance(image, Image.Image):
        raise CamvizError(
            f"explain_generation needs the photo as a PIL image (PIL.Image.open), not a "
            f"{type(image).__name__}"
        )
    token = getattr(processor, "image_token", "<image>")
    try:
        inputs = dict(processor(images=image.convert("RGB"), text=prompt, return_tensors="pt"))
    except (ValueError, TypeError) as error:  # what processors raise for a wrong prompt
        raise CamvizError(
            f"the processor refused the image and prompt ({first_line(error)}); the prompt "
            f"needs one {token!r} where the image goes"
        ) from error
    if not bool((inputs["input_ids"] == llava.image_token_id).any()):
        raise CamvizError(
            f"the processed prompt has no image token (id {llava.image_token_id}); put "
            f"{token!r} in the prompt where the image goes"
        )
    device = model_device(model)
    dtype = next(model.parameters()).dtype
    return {
        key: value.to(device, dtype) if value.is_floating_point() else value.to(device)
        for key, value in inputs.items()
        if isinstance(value, torch.Tensor)
    }


def _greedy(model: nn.Module, inputs: dict[str, torch.Tensor], limit: int) -> torch.Tensor:
    """The prompt followed by at most ``limit`` greedily decoded tokens, ``(1, L)``.

    A fresh generation config (greedy, the model's own end and padding tokens) keeps the
    model's sampling or penalty settings out of it: each token is its logit's argmax.
    """
    from transformers import GenerationConfig

    own = getattr(model, "generation_config", None)
    config = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=limit,
        eos_token_id=getattr(own, "eos_token_id", None),
        pad_token_id=getattr(own, "pad_token_id", None),
    )
    return run_model(model.generate, **inputs, generation_config=config)  # type: ignore[arg-type]


def _teacher_forced(
    model: nn.Module, inputs: dict[str, torch.Tensor], sequence: torch.Tensor, tap: Tap
) -> torch.Tensor:
    """Each generated token's logit, ``(T,)``, from one pass over the whole ``sequence``
    with ``tap`` on the projector, under ``no_grad`` (only what the tap or an attention
    capture opens keeps a graph).

    The pass keeps the logits of the ``T + 1`` last positions; position ``L - T - 1 + t``
    predicts token ``t``.
    """
    count = sequence.shape[1] - inputs["input_ids"].shape[1]
    forced = {**inputs, "input_ids": sequence, "attention_mask": torch.ones_like(sequence)}
    with edit(model, {PROJECTOR: tap}), no_grad():
        output = run_model(model, **forced, logits_to_keep=count + 1)
    if not tap.ran:
        raise CamvizError(f"the model did not run {PROJECTOR!r}; is the image in the prompt?")
    logits = output.logits[0, :-1]
    return logits[torch.arange(count, device=logits.device), sequence[0, -count:]]


def _gradcam_maps(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    sequence: torch.Tensor,
    explainer: CamMethod,
    llava: Llava,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each generated token's logit and its ``(T, h, w)`` map from the projector's output
    ``P`` and ``d logit_t / dP``, of the base image's view."""
    tap = Tap(PROJECTOR, open_gradient_path=True, rank=1, lineage=None)
    scores = _teacher_forced(model, inputs, sequence, tap)
    delta = tap.deltas[PROJECTOR]
    # Only the base image's view (the first) is kept of each gradient: LLaVA-NeXT's tiles
    # would hold several times its memory per token.
    gradients = [
        at_least_fp32(torch.autograd.grad(score, delta, retain_graph=t < len(scores) - 1)[0][:1])
        for t, score in enumerate(scores)
    ]
    projected = at_least_fp32(tap.activations[PROJECTOR][:1])
    if not all(is_finite(tensor) for tensor in (scores, projected, *gradients)):
        raise NonFiniteError(
            "the generated tokens' logits, the projector's output or its gradients hold NaN "
            "or Inf, so their maps would be meaningless; run the model in float32 or bfloat16"
        )
    pixels = _pixels(inputs)
    activations = base_tokens(llava, projected, pixels)
    layer_maps = [
        explainer.layer_map(_layer_data(model, inputs, activations, gradient, llava, pixels))
        for gradient in gradients
    ]
    return at_least_fp32(scores.detach()), torch.cat(layer_maps)


def _attention_maps(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    sequence: torch.Tensor,
    explainer: AttentionMethod,
    llava: Llava,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each generated token's logit and its ``(T, h, w)`` map: the row of the position that
    predicted it in the relevance matrix of the language model's attention, at the base
    image's patch tokens (see the module docstring)."""
    weighted = explainer.attention == "gradients"
    tap = Tap(PROJECTOR, open_gradient_path=False, rank=1, lineage=None)
    with capturing(model.get_submodule(LANGUAGE_MODEL), gradients=weighted) as capture:
        scores = _teacher_forced(model, inputs, sequence, tap)
    length, count = sequence.shape[1], len(scores)
    predicting = torch.arange(length - count - 1, length - 1, device=sequence.device)
    queries = torch.nn.functional.one_hot(predicting, length).float()[None]  # (1, T, L)
    if weighted:
        deltas = [call.delta for call in capture.calls]
        rows = torch.cat(
            [
                explainer.relevance(
                    as_maps(capture, [_gradients(score, deltas, t < count - 1)], 1)[0],
                    queries[:, t : t + 1],
                )[0]
                for t, score in enumerate(scores)
            ]
        )
    else:
        rows = explainer.relevance(as_maps(capture, [], 1)[0], queries)[0]
    pixels = _pixels(inputs)
    view_tokens = tap.activations[PROJECTOR].shape[1]
    columns = base_positions(llava, inputs["input_ids"], view_tokens, pixels)
    grid = tuple(side // llava.patch_size for side in pixels)
    layer_maps = rows[:, columns].unflatten(1, grid)
    if not (is_finite(scores) and is_finite(layer_maps)):
        raise NonFiniteError(
            "the generated tokens' logits or the language model's attention (or its "
            "gradients) hold NaN or Inf, so their maps would be meaningless; run the model "
            "in float32 or bfloat16"
        )
    return at_least_fp32(scores.detach()), layer_maps


def _gradients(
    score: torch.Tensor, deltas: list[torch.Tensor | None], retain: bool
) -> list[torch.Tensor | None]:
    """``d score / dA`` at each recorded attention call (``None`` where it does not reach)."""
    inputs = [delta for delta in deltas if delta is not None]
    found = iter(torch.autograd.grad(score, inputs, retain_graph=retain, allow_unused=True))
    return [None if delta is None else next(found) for delta in deltas]


def _layer_data(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    activations: torch.Tensor,
    gradient: torch.Tensor,
    llava: Llava,
    pixels: tuple[int, int],
) -> LayerData:
    """What Grad-CAM reads for one token: the base image's tokens and their gradient."""
    return LayerData(
        layer=PROJECTOR,
        activations=activations,
        gradients=base_tokens(llava, gradient, pixels),
        model=model,
        inputs=inputs["pixel_values"],
        score_fn=_no_rescoring,
        class_ids=None,
    )


def _no_rescoring(*args: object) -> torch.Tensor:
    """The score function of a per-token map's layer data: its methods do not re-run the
    model (:data:`GENERATION_METHODS`)."""
    raise CamvizError("the methods of explain_generation do not re-run the model")
