"""Where models come from: one small module per source, behind one interface.

:func:`source_for` reads a model name and picks its source (:class:`base.ModelSource`):

* ``None``, ``"efficientnet_lite0"``, a torchvision name, ``"timm:NAME"``: :mod:`.named`;
* ``"hf:NAME_OR_DIR"``: :mod:`.huggingface` (``pip install 'camviz[hf]'``);
* ``"yolo:FILE.yaml"``, ``"yolo:FILE.pt"``: :mod:`.ultralytics` (``camviz[yolo]``);
* ``"package.module:factory"``, ``"path/to/file.py:factory"``: :mod:`.factory`.

A name that is a file (``yolov8n.pt``) or a hub name (``google/vit-base-patch16-224``)
without its prefix is refused with the name it was probably meant as.
"""

from __future__ import annotations

from camviz.core.errors import CamvizError
from camviz.io.architectures import OFFLINE_MODEL
from camviz.io.sources import factory, huggingface, named, ultralytics
from camviz.io.sources.base import ModelSource, SourceOptions

__all__ = ["source_for"]

# Files that are models of a library, not model names.
_MODEL_FILES = (".pt", ".pth", ".yaml", ".yml")


def source_for(name: str | None, options: SourceOptions) -> ModelSource:
    """The source of the model named ``name``, with ``options`` (see the module docstring).

    Raises:
        CamvizError: ``trust_pickle`` with a source that loads no pickle, or a name that no
            source reads (with the name it was probably meant as).
    """
    name = OFFLINE_MODEL if name is None else name.strip()
    if options.trust_pickle and not (
        name.startswith(ultralytics.PREFIX) and name.lower().endswith(".pt")
    ):
        raise CamvizError(
            f"--trust-pickle (trust_pickle=True) is only for a pickled Ultralytics model, "
            f"yolo:FILE.pt; {name} loads without running code from a file, so drop it"
        )
    if name.startswith(huggingface.PREFIX):
        return huggingface.HuggingFaceSource(name, options)
    if name.startswith(ultralytics.PREFIX):
        return ultralytics.UltralyticsSource(name, options)
    if factory.is_factory(name) and not name.startswith("timm:"):
        return factory.FactorySource(name, options)
    if name.lower().endswith(_MODEL_FILES):
        raise CamvizError(
            f"{name} is a file, not a model name; did you mean `yolo:{name}` (an Ultralytics "
            "model)? A state_dict goes to --weights, with --model naming its architecture"
        )
    if "/" in name and ":" not in name:
        raise CamvizError(
            f"unknown model {name!r}; did you mean `hf:{name}` (a Hugging Face model)?"
        )
    return named.NamedSource(name, options)
