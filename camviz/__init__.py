"""camviz: see what a PyTorch model looks at.

The public API, importable as ``camviz.NAME``. Submodules load on first use, so that
``import camviz`` (and ``camviz --help``) does not pay for importing torch.

The package is laid out by part (see ``docs/architecture.md``): ``core`` (hooks, layers,
targets, maps), ``cams`` (the engine and the methods), ``io`` (images, video, models,
rendering), ``debug`` (features, layer statistics, gradient monitor, edits), ``pipeline``
(many images) and ``evaluation`` (metrics, localisation, sanity checks, reports). The
user-facing modules also answer to short names: ``camviz.metrics`` is
``camviz.evaluation.metrics``, ``camviz.render`` is ``camviz.io.render``, and so on
(``PUBLIC_MODULES``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import TYPE_CHECKING, Any

from camviz._deprecation import warn_moved

__version__ = "0.2.0"

# Public name -> "module:attribute". One table, read by __getattr__, __dir__ and (through a
# test that keeps them equal) the TYPE_CHECKING imports below.
_EXPORTS = {
    "CamvizError": "camviz.core.errors:CamvizError",
    "Concepts": "camviz.cams.factorization:Concepts",
    "Contrast": "camviz.core.targets:Contrast",
    "DenseDetections": "camviz.core.detection:DenseDetections",
    "Detection": "camviz.core.detection:Detection",
    "Explanation": "camviz.cams.engine:Explanation",
    "Generation": "camviz.cams.generation:Generation",
    "GradientMonitor": "camviz.debug.monitor:GradientMonitor",
    "ImageResult": "camviz.pipeline.dataset:ImageResult",
    "LayerTable": "camviz.debug.layerstats:LayerTable",
    "ModelError": "camviz.core.errors:ModelError",
    "Nearest": "camviz.core.targets:Nearest",
    "NonFiniteError": "camviz.core.errors:NonFiniteError",
    "Preprocess": "camviz.io.images:Preprocess",
    "Region": "camviz.core.targets:Region",
    "RowTarget": "camviz.core.targets:RowTarget",
    "SetPredictions": "camviz.core.setpredictions:SetPredictions",
    "Similarity": "camviz.core.similarity:Similarity",
    "TextPrompt": "camviz.core.targets.textprompt:TextPrompt",
    "Tokens": "camviz.core.layouts:Tokens",
    "TopK": "camviz.core.targets:TopK",
    "Tracker": "camviz.training.tracker:Tracker",
    "Unit": "camviz.core.targets:Unit",
    "ZeroMapWarning": "camviz.core.errors:ZeroMapWarning",
    "app": "camviz.explorer.server:app",
    "capture": "camviz.core.hooks:capture",
    "channel_grid": "camviz.io.render:channel_grid",
    "compare": "camviz.evaluation.report:compare",
    "edit": "camviz.core.hooks:edit",
    "explain": "camviz.cams.engine:explain",
    "explain_dataset": "camviz.pipeline.dataset:explain_dataset",
    "explain_files": "camviz.pipeline.job:explain_files",
    "explain_generation": "camviz.cams.generation:explain_generation",
    "factorize": "camviz.cams.factorization:factorize",
    "features": "camviz.debug.extraction:features",
    "find_first_nonfinite": "camviz.debug.layerstats:find_first_nonfinite",
    "inspect": "camviz.debug.layerstats:inspect",
    "load_image": "camviz.io.images:load_image",
    "load_model": "camviz.io.models:load",
    "overlay": "camviz.io.render:overlay",
    "panel": "camviz.io.render:panel",
    "save": "camviz.io.render:save",
    "show": "camviz.io.render:show",
    "top_examples": "camviz.units.scan:top_examples",
    "visualize_unit": "camviz.units.visualize:visualize_unit",
    "write_report": "camviz.evaluation.report:write_report",
}

# Short module paths that are part of the public API: `import camviz.metrics` gives the very
# module object of `camviz.evaluation.metrics`, without a warning.
PUBLIC_MODULES = {
    "camviz.edits": "camviz.debug.edits",
    "camviz.images": "camviz.io.images",
    "camviz.localization": "camviz.evaluation.localization",
    "camviz.metrics": "camviz.evaluation.metrics",
    "camviz.models": "camviz.io.models",
    "camviz.render": "camviz.io.render",
    "camviz.sanity": "camviz.evaluation.sanity",
    "camviz.synthetic": "camviz.evaluation.synthetic",
}

# Module paths of release 0.1 that moved in 0.2. They keep working until 0.3, with a
# DeprecationWarning that names the new path (see CHANGELOG.md); names that moved out of a
# public module warn the same way (camviz._deprecation).
MOVED_MODULES = {
    "camviz.cams.layout": "camviz.core.grids",
    "camviz.dataset": "camviz.pipeline.dataset",
    "camviz.distributed": "camviz.pipeline.distributed",
    "camviz.errors": "camviz.core.errors",
    "camviz.extraction": "camviz.debug.extraction",
    "camviz.files": "camviz.pipeline.job",
    "camviz.hooks": "camviz.core.hooks",
    "camviz.inputs": "camviz.pipeline.inputs",
    "camviz.layers": "camviz.core.layers",
    "camviz.layerstats": "camviz.debug.layerstats",
    "camviz.manifest": "camviz.pipeline.manifest",
    "camviz.maps": "camviz.core.maps",
    "camviz.modelstate": "camviz.core.modelstate",
    "camviz.monitor": "camviz.debug.monitor",
    "camviz.targets": "camviz.core.targets",
    "camviz.video": "camviz.io.video",
    "camviz.writer": "camviz.pipeline.writer",
}

__all__ = [*sorted(_EXPORTS), "__version__"]

if TYPE_CHECKING:
    from camviz import cams as cams
    from camviz.cams.engine import Explanation as Explanation
    from camviz.cams.engine import explain as explain
    from camviz.cams.factorization import Concepts as Concepts
    from camviz.cams.factorization import factorize as factorize
    from camviz.cams.generation import Generation as Generation
    from camviz.cams.generation import explain_generation as explain_generation
    from camviz.core.detection import DenseDetections as DenseDetections
    from camviz.core.detection import Detection as Detection
    from camviz.core.errors import CamvizError as CamvizError
    from camviz.core.errors import ModelError as ModelError
    from camviz.core.errors import NonFiniteError as NonFiniteError
    from camviz.core.errors import ZeroMapWarning as ZeroMapWarning
    from camviz.core.hooks import capture as capture
    from camviz.core.hooks import edit as edit
    from camviz.core.layouts import Tokens as Tokens
    from camviz.core.setpredictions import SetPredictions as SetPredictions
    from camviz.core.similarity import Similarity as Similarity
    from camviz.core.targets import Contrast as Contrast
    from camviz.core.targets import Nearest as Nearest
    from camviz.core.targets import Region as Region
    from camviz.core.targets import RowTarget as RowTarget
    from camviz.core.targets import TopK as TopK
    from camviz.core.targets import Unit as Unit
    from camviz.core.targets.textprompt import TextPrompt as TextPrompt
    from camviz.debug import edits as edits
    from camviz.debug.extraction import features as features
    from camviz.debug.layerstats import LayerTable as LayerTable
    from camviz.debug.layerstats import find_first_nonfinite as find_first_nonfinite
    from camviz.debug.layerstats import inspect as inspect
    from camviz.debug.monitor import GradientMonitor as GradientMonitor
    from camviz.evaluation import localization as localization
    from camviz.evaluation import metrics as metrics
    from camviz.evaluation import sanity as sanity
    from camviz.evaluation import synthetic as synthetic
    from camviz.evaluation.report import compare as compare
    from camviz.evaluation.report import write_report as write_report
    from camviz.explorer.server import app as app
    from camviz.io import images as images
    from camviz.io import models as models
    from camviz.io import render as render
    from camviz.io.images import Preprocess as Preprocess
    from camviz.io.images import load_image as load_image
    from camviz.io.models import load as load_model
    from camviz.io.render import channel_grid as channel_grid
    from camviz.io.render import overlay as overlay
    from camviz.io.render import panel as panel
    from camviz.io.render import save as save
    from camviz.io.render import show as show
    from camviz.pipeline.dataset import ImageResult as ImageResult
    from camviz.pipeline.dataset import explain_dataset as explain_dataset
    from camviz.pipeline.job import explain_files as explain_files
    from camviz.training.tracker import Tracker as Tracker
    from camviz.units.scan import top_examples as top_examples
    from camviz.units.visualize import visualize_unit as visualize_unit

    # Type checkers do not evaluate the __all__ above; `X as X` re-exports a name, and an
    # export imported under another name is re-exported by listing it here.
    __all__ += ["load_model"]


class _AliasLoader(importlib.abc.Loader):
    """Answers an import of an alias path with the module it stands for."""

    def __init__(self, target: str, deprecated: bool) -> None:
        self.target = target
        self.deprecated = deprecated
        self.target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.deprecated:
            warn_moved(spec.name, self.target, stacklevel=2)
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The target was executed when it was imported; the import system has just set its
        # __spec__ to the alias's, so give it back its own.
        module.__spec__ = self.target_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in PUBLIC_MODULES:
            return importlib.machinery.ModuleSpec(
                fullname, _AliasLoader(PUBLIC_MODULES[fullname], deprecated=False)
            )
        if fullname in MOVED_MODULES:
            return importlib.machinery.ModuleSpec(
                fullname, _AliasLoader(MOVED_MODULES[fullname], deprecated=True)
            )
        return None


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.append(_AliasFinder())


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
