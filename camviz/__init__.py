"""camviz: see what a PyTorch vision model looks at.

The public API, importable as ``camviz.NAME``. Submodules load on first use, so that
``import camviz`` (and ``camviz --help``) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> "module:attribute". One table, read by __getattr__ and __dir__.
_EXPORTS = {
    "CamvizError": "camviz.errors:CamvizError",
    "Contrast": "camviz.targets:Contrast",
    "Explanation": "camviz.cams.engine:Explanation",
    "GradientMonitor": "camviz.monitor:GradientMonitor",
    "ImageResult": "camviz.dataset:ImageResult",
    "LayerTable": "camviz.layerstats:LayerTable",
    "Preprocess": "camviz.images:Preprocess",
    "Region": "camviz.targets:Region",
    "TopK": "camviz.targets:TopK",
    "capture": "camviz.hooks:capture",
    "channel_grid": "camviz.render:channel_grid",
    "edit": "camviz.hooks:edit",
    "explain": "camviz.cams.engine:explain",
    "explain_dataset": "camviz.dataset:explain_dataset",
    "explain_files": "camviz.files:explain_files",
    "features": "camviz.extraction:features",
    "find_first_nonfinite": "camviz.layerstats:find_first_nonfinite",
    "inspect": "camviz.layerstats:inspect",
    "load_image": "camviz.images:load_image",
    "load_model": "camviz.models:load",
    "overlay": "camviz.render:overlay",
    "panel": "camviz.render:panel",
    "save": "camviz.render:save",
    "show": "camviz.render:show",
}

__all__ = [*sorted(_EXPORTS), "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name].split(":")
        return getattr(importlib.import_module(module), attribute)
    try:
        return importlib.import_module(f"camviz.{name}")
    except ModuleNotFoundError:
        raise AttributeError(f"module 'camviz' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return __all__
