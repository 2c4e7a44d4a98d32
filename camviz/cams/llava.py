"""LLaVA-style models: the parts a per-token map reads, and where their image lies on the photo.

A LLaVA model (Hugging Face's ``LlavaForConditionalGeneration`` and
``LlavaNextForConditionalGeneration``) runs a vision tower on the processed image, maps its
patch tokens into the language model's space with the *multi-modal projector*, and writes
them over the image placeholder tokens of the prompt, where the language model reads them as
a contiguous span of its sequence. The projector's output is therefore the one place where
every image token the language model sees is a function of one patch: its gradient is the
gradient at that span (LLaVA-NeXT adds its newline embeddings after the projector).

LLaVA-NeXT's projector sees several views of the photo: first the *base image* (the whole
photo resized to the vision tower's square), then tiles of a larger copy. The maps use the
base image's patches, whose grid covers the whole photo; tiles and newline tokens are
skipped: at the projector (:func:`base_tokens`) and in the language model's sequence, whose
attention to the base image's positions (:func:`base_positions`) the attention methods read.

Where the processed image lies on the photo is read from the image processor's settings
(:func:`base_window`) and checked against the processed image's size, so a processor that
works otherwise is refused in one line instead of laying a map in the wrong place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from camviz.core.errors import CamvizError
from camviz.core.placement import Window

#: The model classes whose image tokens are laid out as this module reads them.
LLAVA_CLASSES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")

#: The projector's name in both classes.
PROJECTOR = "model.multi_modal_projector"

#: The language model's name in both classes.
LANGUAGE_MODEL = "model.language_model"


@dataclass(frozen=True)
class Llava:
    """What a per-token map needs to know of one LLaVA-style model.

    Attributes:
        image_token_id: The placeholder token the projected patches replace.
        patch_size: The vision tower's patch size in pixels.
        tiled: Whether the processed image holds tiles after the base image (LLaVA-NeXT).
    """

    image_token_id: int
    patch_size: int
    tiled: bool


def llava_of(model: nn.Module) -> Llava:
    """What :class:`Llava` records of ``model``.

    Raises:
        CamvizError: ``model`` is not one of :data:`LLAVA_CLASSES`.
    """
    kind = next((c.__name__ for c in type(model).__mro__ if c.__name__ in LLAVA_CLASSES), None)
    config: Any = getattr(model, "config", None)
    if kind is None or config is None:
        raise CamvizError(
            f"explain_generation needs a LLaVA-style model ({' or '.join(LLAVA_CLASSES)} "
            f"from transformers), not a {type(model).__name__}"
        )
    return Llava(
        image_token_id=int(config.image_token_id),
        patch_size=int(config.vision_config.patch_size),
        tiled=kind == "LlavaNextForConditionalGeneration",
    )


def base_tokens(llava: Llava, projected: torch.Tensor, pixels: tuple[int, int]) -> torch.Tensor:
    """The base image's projected patch tokens as a ``(1, C, h, w)`` grid.

    Args:
        llava: The model's parts.
        projected: The projector's output, ``(views, tokens, C)``; view 0 is the base image.
        pixels: The processed image's ``(H, W)``.

    Raises:
        CamvizError: The token count is not the patch grid's (plus a class token).
    """
    rows, columns = (side // llava.patch_size for side in pixels)
    tokens = projected[0][_patches(llava, len(projected[0]), pixels)]
    return tokens.T.reshape(1, -1, rows, columns)


def base_positions(
    llava: Llava, input_ids: torch.Tensor, view_tokens: int, pixels: tuple[int, int]
) -> torch.Tensor:
    """Where the language model reads the base image's patch tokens: their positions in the
    prompt ``input_ids`` ``(1, L)``, ``(h * w,)`` in the order of :func:`base_tokens`' grid.

    The projected tokens replace the image tokens in order, the base image's
    ``view_tokens`` (the projector's tokens per view) first; LLaVA-NeXT's tiles and newline
    tokens come after them.

    Raises:
        CamvizError: Fewer image tokens than the base image's, or a token count that is not
            the patch grid's (plus a class token).
    """
    positions = (input_ids[0] == llava.image_token_id).nonzero()[:, 0]
    if len(positions) < view_tokens:
        raise CamvizError(
            f"the prompt holds {len(positions)} image tokens for the base image's "
            f"{view_tokens}; explain_generation needs the processor's expanded prompt"
        )
    return positions[:view_tokens][_patches(llava, view_tokens, pixels)]


def _patches(llava: Llava, count: int, pixels: tuple[int, int]) -> slice:
    """Which of a view's ``count`` projected tokens are its patches, one per patch: all, or
    all but a leading class token (``vision_feature_select_strategy="full"`` keeps it)."""
    rows, columns = (side // llava.patch_size for side in pixels)
    if count == rows * columns + 1:
        return slice(1, count)
    if count != rows * columns:
        raise CamvizError(
            f"the projector gives {count} tokens for a {rows} x {columns} patch grid "
            f"({pixels[0]} x {pixels[1]} px, patch {llava.patch_size}); explain_generation "
            "reads one token per patch, with at most one class token"
        )
    return slice(0, count)


@dataclass(frozen=True)
class _Frame:
    """A pixel array and the window of the photo it covers (photo pixels)."""

    pixels: tuple[int, int]
    top: float
    left: float
    height: float
    width: float

    def resized(self, pixels: tuple[int, int]) -> _Frame:
        return _Frame(pixels, self.top, self.left, self.height, self.width)

    def cut(self, top: int, left: int, pixels: tuple[int, int]) -> _Frame:
        """The ``pixels`` array at offset ``(top, left)``: a crop, or with negative offsets
        and a larger size, a padding."""
        down, across = self.height / self.pixels[0], self.width / self.pixels[1]
        return _Frame(
            pixels,
            self.top + top * down,
            self.left + left * across,
            pixels[0] * down,
            pixels[1] * across,
        )

    def centre_cut(self, pixels: tuple[int, int]) -> _Frame:
        """A centred crop (or centred padding where ``pixels`` is larger), as the image
        processors' ``center_crop`` and ``pad_to_square`` place it."""
        offsets = [
            (old - new) // 2 if new <= old else -((new - old) // 2)
            for old, new in zip(self.pixels, pixels, strict=True)
        ]
        return self.cut(offsets[0], offsets[1], pixels)


def _field(size: Any, key: str) -> int | None:
    """One entry of an image processor's size (a ``SizeDict`` or a plain dict)."""
    value = size.get(key) if isinstance(size, Mapping) else getattr(size, key, None)
    return None if value is None else int(value)


def _resized(size: Any, pixels: tuple[int, int]) -> tuple[int, int]:
    """The size an image processor resizes a ``pixels`` image to (transformers' rule)."""
    height, width, short = (_field(size, key) for key in ("height", "width", "shortest_edge"))
    if height and width:
        return height, width
    if short and not _field(size, "longest_edge"):
        low, high = sorted(pixels)
        long = int(short * high / low)
        return (long, short) if pixels[1] <= pixels[0] else (short, long)
    raise CamvizError(
        f"explain_generation cannot tell where an image processor with size {size} puts the "
        "photo; it reads sizes given as height and width, or as shortest_edge alone"
    )


def base_window(
    processor: Any, llava: Llava, photo: tuple[int, int], pixels: tuple[int, int]
) -> Window:
    """Where the processed base image lies on a photo of ``photo = (H, W)`` pixels.

    LLaVA's processor pads the photo to a square (``do_pad``), resizes it and crops its
    centre; LLaVA-NeXT's base image is the photo stretched to a square, then resized and
    cropped the same way.

    Raises:
        CamvizError: The settings give another size than the processed image's ``pixels``.
    """
    settings = processor.image_processor
    frame = _Frame(photo, 0.0, 0.0, float(photo[0]), float(photo[1]))
    if llava.tiled:
        height, width = _field(settings.size, "height"), _field(settings.size, "width")
        short = _field(settings.size, "shortest_edge") or 0
        frame = frame.resized((height, width) if height and width else (short, short))
    elif getattr(settings, "do_pad", False):
        frame = frame.centre_cut((max(photo), max(photo)))
    if getattr(settings, "do_resize", True):
        frame = frame.resized(_resized(settings.size, frame.pixels))
    if getattr(settings, "do_center_crop", False):
        crop = settings.crop_size
        frame = frame.centre_cut((_field(crop, "height") or 0, _field(crop, "width") or 0))
    if frame.pixels != pixels:
        raise CamvizError(
            f"explain_generation expected the processor to give a {frame.pixels[0]} x "
            f"{frame.pixels[1]} image from its settings, but it gave {pixels[0]} x {pixels[1]}; "
            f"it cannot tell where this {type(settings).__name__}'s image lies on the photo"
        )
    return Window(frame.top, frame.left, frame.height, frame.width, photo)
