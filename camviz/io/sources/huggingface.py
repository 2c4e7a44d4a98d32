"""Hugging Face transformers models: ``hf:NAME_OR_DIR``.

The model is read with ``from_pretrained`` of the class its config names (``architectures``;
an ``AutoModel`` when it names none), from the hub (which needs internet) or from a local
folder made by ``save_pretrained`` (which works offline). The image processor saved beside it
(``preprocessor_config.json``) gives the size, mean, std and interpolation: a processor that
crops, or resizes to a fixed height and width, becomes a square input of that size (the
whole photo is explained, squashed rather than cropped), one that resizes the shortest edge
keeps the aspect ratio. The config's ``id2label`` names the classes.

The task is told from the model's class: ``...ForImageClassification`` classifies,
``...ForSemanticSegmentation`` segments (its logits at a quarter of the input for Segformer),
and so do ``...ForInstanceSegmentation`` and ``...ForUniversalSegmentation`` (MaskFormer,
Mask2Former: their queries' classes and masks made per-class maps,
:class:`~camviz.io.sources.hfheads.SemanticLogits`); ``...ForObjectDetection`` (DETR,
Conditional and Deformable DETR, RT-DETR, YOLOS) detects, its sets of boxes read as
torchvision's detections on the photo (:class:`~camviz.io.sources.hfheads.SetPredictionDetector`,
which takes the photo at its own size and resizes it as the processor does). Dual encoders
(CLIP, SigLIP: models with ``get_image_features``) and bare encoders (``ViTModel``,
``Dinov2Model``) answer an image embedding (:class:`ImageEmbedding`), explained against
another embedding with :class:`camviz.Similarity`; a dual encoder carries the tokenizer
saved beside it, so that :class:`camviz.TextPrompt` explains it against texts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from camviz.core.errors import CamvizError, first_line
from camviz.core.placement import AspectResize
from camviz.io.checkpoints import load_weights
from camviz.io.sources.base import ModelSource, SourceOptions, import_extra

if TYPE_CHECKING:
    from camviz.io.architectures import Task
    from camviz.io.images import Preprocess

__all__ = ["PREFIX", "HuggingFaceSource", "ImageEmbedding"]

#: Names starting with this are Hugging Face models (``"hf:google/vit-base-patch16-224"``).
PREFIX = "hf:"

# The task of a model class, by the end of its name.
_TASKS: tuple[tuple[str, Task], ...] = (
    ("ForImageClassification", "classification"),
    ("ForImageClassificationWithTeacher", "classification"),
    ("ForSemanticSegmentation", "segmentation"),
    ("ForInstanceSegmentation", "segmentation"),
    ("ForUniversalSegmentation", "segmentation"),
    ("ForObjectDetection", "detection"),
)

# Classes whose queries' class scores and masks become per-class maps.
_MASK_CLASSIFIERS = ("ForInstanceSegmentation", "ForUniversalSegmentation")


class HuggingFaceSource(ModelSource):
    """``hf:NAME_OR_DIR`` (see the module docstring)."""

    def __init__(self, name: str, options: SourceOptions) -> None:
        self.name = name
        self.options = options
        self.reference = name.removeprefix(PREFIX)
        if not self.reference:
            raise CamvizError("hf: needs a model: hf:NAME (a hub name) or hf:DIR (a local folder)")
        self.config: Any = None
        self.model_task: Task = "embedding"

    def build(self) -> nn.Module:
        transformers = import_extra("transformers", "hf", "hf: models")
        with _quiet(transformers), self._reading("the model"):
            self.config = transformers.AutoConfig.from_pretrained(self.reference)
            model_class = _model_class(transformers, self.config)
            model = model_class.from_pretrained(self.reference)
        class_name = model_class.__name__
        self.model_task = next(
            (task for ending, task in _TASKS if class_name.endswith(ending)), "embedding"
        )
        if self.options.weights is not None:
            load_weights(model, self.options.weights, self.name)
        # Not at import: the set-prediction adapter imports torchvision.
        from camviz.io.sources.hfheads import SemanticLogits, SetPredictionDetector

        if self.model_task == "detection":
            labels = int(getattr(self.config, "num_labels", 0) or 0)
            return SetPredictionDetector(model, self._resize(), labels)
        if class_name.endswith(_MASK_CLASSIFIERS):
            return SemanticLogits(model)
        if self.model_task != "embedding":
            return model
        texts = hasattr(model, "get_text_features")
        return ImageEmbedding(model, _tokenizer(transformers, self.reference) if texts else None)

    def preprocess(self) -> Preprocess:
        from camviz.io.images import Preprocess

        processor = self._processor()
        if processor is None:
            # The options give the size; a model of one input size (a ViT's position
            # embeddings) takes the image squashed to it; a detector resizes inside.
            fixed = isinstance(getattr(self.config, "image_size", None), int)
            squashed = fixed and self.model_task != "detection"
            return Preprocess(mean=(0.0,), std=(1.0,), resize="square" if squashed else "none")
        preprocess = _processor_preprocess(processor)
        if self.model_task == "detection":  # the photo at its size: the model resizes it
            return dataclasses.replace(preprocess, resize="none")
        return preprocess

    def _processor(self) -> Any:
        """The image processor saved beside the model; ``None`` when there is none and
        ``--input-size`` is given.

        Raises:
            CamvizError: There is no processor, and no ``--input-size``.
        """
        transformers = import_extra("transformers", "hf", "hf: models")
        try:
            with _quiet(transformers):
                return transformers.AutoImageProcessor.from_pretrained(self.reference)
        except (OSError, ValueError):
            if self.options.input_size is None:
                raise CamvizError(
                    f"{self.reference} has no image processor (preprocessor_config.json); save "
                    "it beside the model (processor.save_pretrained(DIR)), or give "
                    "--input-size, --mean and --std"
                ) from None
            return None

    def _resize(self) -> AspectResize:
        """A detector's resize, as its processor resizes (``--input-size`` as the shorter
        side without one)."""
        processor = self._processor()
        if processor is None:
            return AspectResize(shortest=self.options.input_size)
        size = getattr(processor, "size", None)
        (fixed, shortest), longest = _size_of(size), _read(size, "longest_edge")
        if shortest is not None:
            return AspectResize(shortest=shortest, longest=longest)
        if fixed is not None:
            return AspectResize(fixed=(_read(size, "height"), _read(size, "width")))
        raise CamvizError(
            f"camviz cannot read the image size of {type(processor).__name__} ({size!r}); "
            "give --input-size"
        )

    def class_names(self, model: nn.Module) -> list[str] | None:
        if self.model_task == "embedding":
            return None
        labels = getattr(self.config, "id2label", None) or {}
        return [str(labels[key]) for key in sorted(labels)] or None

    def task(self, model: nn.Module) -> Task | None:
        return self.model_task

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        """A failed read as one line: a folder that is no model, or a failed download."""
        try:
            yield
        except (OSError, ValueError) as error:
            folder = Path(self.reference)
            if folder.is_dir():
                missing = "" if (folder / "config.json").is_file() else "no config.json; "
                raise CamvizError(
                    f"{folder} is not a Hugging Face model folder ({missing}{first_line(error)}); "
                    "make one with model.save_pretrained(DIR) (config.json and the weights)"
                ) from None
            raise CamvizError(
                f"could not read {what} {self.reference!r} from the Hugging Face hub "
                f"({first_line(error)}); where there is internet, save it with "
                "save_pretrained(DIR) and pass the local folder: --model hf:DIR"
            ) from None


class ImageEmbedding(nn.Module):
    """A Hugging Face model as a map from images to one embedding per image.

    ``get_image_features`` of a dual encoder (CLIP, SigLIP), else the encoder's pooled
    output (``pooler_output``; the mean of ``last_hidden_state`` over the tokens when the
    model has no pooler).

    Attributes:
        model: The Hugging Face model.
        tokenizer: A dual encoder's tokenizer, saved beside it, which a
            :class:`~camviz.core.targets.textprompt.TextPrompt` finds here; ``None`` for
            other models, or when the folder holds none.
    """

    def __init__(self, model: nn.Module, tokenizer: Any = None) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        model: Any = self.model
        if hasattr(model, "get_image_features"):
            output = model.get_image_features(pixel_values=pixel_values)
        else:
            output = model(pixel_values=pixel_values)
        if isinstance(output, torch.Tensor):
            return output
        pooled = getattr(output, "pooler_output", None)
        if isinstance(pooled, torch.Tensor):
            return pooled.flatten(1)
        return output.last_hidden_state.mean(dim=1)


def _tokenizer(transformers: ModuleType, reference: str) -> Any:
    """The tokenizer saved with a dual encoder, or ``None`` when there is none: the model
    still explains images against image embeddings, and a text prompt says what is missing.

    Without tokenizer files, transformers builds the config's tokenizer class with no
    vocabulary but its special tokens, which would encode every prompt alike; that is none.
    """
    try:
        with _quiet(transformers):
            tokenizer = transformers.AutoTokenizer.from_pretrained(reference)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tokenizer if len(tokenizer) > len(set(tokenizer.all_special_tokens)) else None


def _model_class(transformers: ModuleType, config: Any) -> Any:
    """The class the config names (its first ``architectures`` entry), else ``AutoModel``."""
    for name in getattr(config, "architectures", None) or ():
        found = getattr(transformers, name, None)
        if found is not None:
            return found
    return transformers.AutoModel


def _processor_preprocess(processor: Any) -> Preprocess:
    """The whole-image :class:`~camviz.images.Preprocess` of a Hugging Face image processor."""
    from camviz.io.images import Preprocess

    size = _size_of(getattr(processor, "size", None))
    crop = _size_of(getattr(processor, "crop_size", None))
    resize: Literal["square", "shorter"]
    if getattr(processor, "do_center_crop", False) and crop[0] is not None:
        side, resize = crop[0], "square"
    elif size[0] is not None:
        side, resize = size[0], "square"
    elif size[1] is not None:
        side, resize = size[1], "shorter"
    else:
        raise CamvizError(
            f"camviz cannot read the image size of {type(processor).__name__} ({size!r}); "
            "give --input-size"
        )
    normalize = getattr(processor, "do_normalize", True)
    mean = tuple(processor.image_mean) if normalize else (0.0,)
    std = tuple(processor.image_std) if normalize else (1.0,)
    resample = int(getattr(processor, "resample", 2) or 2)  # PIL's numbers: 3 is bicubic
    return Preprocess(
        size=side,
        mean=mean,
        std=std,
        resize=resize,
        interpolation="bicubic" if resample == 3 else "bilinear",
    )


def _size_of(size: Any) -> tuple[int | None, int | None]:
    """``(fixed side, shortest edge)`` of a processor's ``size`` or ``crop_size`` (a dict or
    a ``SizeDict``; a fixed height and width that differ give the smaller)."""
    if size is None:
        return None, None
    if isinstance(size, int):
        return size, None
    height, width = _read(size, "height"), _read(size, "width")
    fixed = min(height, width) if height and width else None
    return fixed, _read(size, "shortest_edge")


def _read(size: Any, key: str) -> Any:
    """``key`` of a processor's ``size`` (a dict or a ``SizeDict``; ``None`` if absent)."""
    if isinstance(size, int) or size is None:
        return None
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


@contextlib.contextmanager
def _quiet(transformers: ModuleType) -> Iterator[None]:
    """transformers' progress bars and warnings about the config off for the block."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
