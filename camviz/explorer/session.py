"""What one browser tab is looking at: its image, what it explains, how, and the maps.

Each tab of the page has its own :class:`Session` (the page keeps it in per-tab state), so
tabs never mix their images, classes or maps; they share only the :class:`Subject`, whose
model is used by one request at a time. A session holds:

* the image (always one the server read itself: a file given when the server started, or
  an upload read with :func:`camviz.load_image`'s checks) and the model's output for it;
* the :class:`~camviz.explorer.subject.Candidate` explained and the :class:`Settings`
  (method, layer, method options), with the last :class:`~camviz.Explanation`;
* the settings pinned for side-by-side panels, and the channel view once it is open.

Every map comes from :func:`camviz.explain` called with exactly the settings shown, so what
the page shows is what ``camviz.explain`` gives.
"""

from __future__ import annotations

import inspect
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from camviz.cams.engine import Explanation, explain
from camviz.cams.registry import get, names
from camviz.core.errors import CamvizError, first_line
from camviz.explorer.progress import Report, copies, watched
from camviz.explorer.subject import MIN_SCORE, Candidate, LayerEntry, Subject

if TYPE_CHECKING:
    from camviz.explorer.views import ChannelView

__all__ = [
    "DEFAULT_METHOD",
    "MAX_PANELS",
    "Panel",
    "Session",
    "Settings",
    "format_options",
    "parse_options",
]

#: The method a tab starts with.
DEFAULT_METHOD = "gradcam"

#: Panels side by side: the current view and up to three pinned ones.
MAX_PANELS = 4

# Option values the page can show and read back as text.
_SIMPLE = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class Settings:
    """How a map is computed: a registered method, its options and the target layer."""

    method: str
    layer: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """``"scorecam @ features"``, with the options that differ from the defaults."""
        extra = ", ".join(f"{name}={value!r}" for name, value in self.options)
        return f"{self.method} @ {self.layer}" + (f" ({extra})" if extra else "")


@dataclass(frozen=True)
class Panel:
    """One map shown: its settings, the explanation, how long it took and the warnings
    :func:`camviz.explain` gave (an all-zero map, a memory budget too small)."""

    settings: Settings
    explained: Explanation
    seconds: float
    warnings: tuple[str, ...] = ()


@dataclass
class Session:
    """One tab's state; see the module docstring."""

    subject: Subject
    image: Image.Image | None = None
    image_name: str = ""
    inputs: torch.Tensor | None = None
    output: Any = None
    candidates: list[Candidate] = field(default_factory=list)
    chosen: Candidate | None = None
    settings: Settings | None = None
    shown: Panel | None = None
    alpha: float = 0.5
    colormap: str = "jet"
    pinned: list[Settings] = field(default_factory=list)
    channels: ChannelView | None = None  # the channel view, once opened
    cancel: threading.Event = field(default_factory=threading.Event)
    _compared: list[Panel] = field(default_factory=list, repr=False)
    _compared_key: tuple[Any, ...] = field(default=(), repr=False)
    _generation: int = 0  # counts the images and candidates chosen

    def open(self, image: Image.Image, name: str) -> None:
        """Show ``image``: its output and candidates, the best one chosen, the default layer
        (or the current layer, when the new image's model input has it too)."""
        inputs = self.subject.prepare(image)
        output = self.subject.forward(inputs)
        candidates = self.subject.candidates(output)
        layers = [entry.name for entry in self.subject.layers(inputs)]
        layer = self.subject.default_layer(inputs)
        if self.settings is not None and self.settings.layer in layers:
            layer = self.settings.layer
        method = self.settings.method if self.settings is not None else DEFAULT_METHOD
        options = self.settings.options if self.settings is not None else ()
        self.image, self.image_name, self.inputs, self.output = image, name, inputs, output
        self.candidates = candidates
        self.chosen = candidates[0] if candidates else None
        self.settings = Settings(method, layer, options)
        self.shown = None
        self._generation += 1

    def choose(self, candidate: Candidate) -> None:
        """Explain ``candidate`` from now on (the maps shown are then out of date)."""
        self.chosen = candidate
        self._generation += 1

    @property
    def layers(self) -> list[LayerEntry]:
        return self.subject.layers(self._inputs())

    def entry(self, layer: str) -> LayerEntry:
        found = [entry for entry in self.layers if entry.name == layer]
        if not found:
            raise CamvizError(f"no layer named {layer!r}; pick one from the layer tree")
        return found[0]

    def _inputs(self) -> torch.Tensor:
        if self.inputs is None:
            raise CamvizError("no image yet; upload one or pick one from the list")
        return self.inputs

    def with_settings(
        self,
        *,
        method: str | None = None,
        layer: str | None = None,
        options: tuple[tuple[str, Any], ...] | None = None,
    ) -> Settings:
        """The current settings with some changed (a new method starts from its defaults)."""
        if self.settings is None:
            raise CamvizError("no image yet; upload one or pick one from the list")
        changed = self.settings
        if method is not None and method != changed.method:
            if method not in names(self.subject.model):
                raise CamvizError(f"{method!r} cannot explain this model; pick another method")
            changed = replace(changed, method=method, options=())
        if layer is not None:
            changed = replace(changed, layer=self.entry(layer).name)
        if options is not None:
            changed = replace(changed, options=options)
        return changed

    def explain(self, settings: Settings, report: Report | None = None) -> Panel:
        """:func:`camviz.explain` of the chosen candidate with ``settings``, followed by a
        progress report and stopped when :attr:`cancel` is set."""
        if self.chosen is None:
            raise CamvizError(_NOTHING[self.subject.task or "classification"])
        inputs = self._inputs()
        options = dict(settings.options)
        expected = copies(settings.method, options, self.entry(settings.layer).channels)
        what = f"{settings.method} at {settings.layer}"
        started = time.perf_counter()
        model = self.subject.model
        # The lock first: the hook must see this call's passes only, not another tab's.
        # Under the lock, only this call warns through camviz: its warnings are this map's.
        with (
            self.subject.using(),
            watched(model, self.cancel, expected, report, what),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            explained = explain(
                model,
                inputs,
                settings.method,
                settings.layer,
                self.chosen.target,
                precision=self.subject.precision,
                channels_last=self.subject.channels_last,
                **options,
            )
        said = tuple(dict.fromkeys(_first_line(warning.message) for warning in caught))
        return Panel(settings, explained, time.perf_counter() - started, said)

    def show(
        self,
        settings: Settings,
        report: Report | None = None,
        candidate: Candidate | None = None,
    ) -> Panel:
        """Explain ``candidate`` (``None``: the chosen one) with ``settings`` and make it the
        current view; when that fails (or is cancelled) the view stays as it was."""
        self.cancel.clear()
        previous = self.chosen, self._generation
        if candidate is not None:
            self.choose(candidate)
        try:
            panel = self.explain(settings, report)
        except BaseException:
            self.chosen, self._generation = previous
            raise
        self.settings, self.shown = settings, panel
        return panel

    @property
    def explained(self) -> Explanation | None:
        """The current view's explanation, if there is one."""
        return self.shown.explained if self.shown is not None else None

    def current(self) -> Panel:
        """The current view."""
        if self.shown is None:
            raise CamvizError("nothing explained yet; pick a class, an object or a region")
        return self.shown

    def compared(self, report: Report | None = None) -> list[Panel]:
        """The pinned settings explained for the current candidate (kept until the image or
        the candidate changes)."""
        key = (self._generation, tuple(self.pinned))
        if self._compared_key != key:
            self.cancel.clear()
            self._compared = [self.explain(settings, report) for settings in self.pinned]
            self._compared_key = key
        return self._compared

    def heatmap(self, explained: Explanation | None = None) -> torch.Tensor:
        """The ``(H, W)`` map of the current view (or of ``explained``)."""
        explained = explained if explained is not None else self.explained
        if explained is None:
            raise CamvizError("nothing explained yet; pick a class, an object or a region")
        return explained.heatmaps[0]

    def pin(self) -> None:
        """Keep the current settings as a panel beside the current view."""
        if self.settings is None or self.explained is None:
            raise CamvizError("nothing explained yet; pick a class, an object or a region")
        if self.settings in self.pinned:
            raise CamvizError(
                f"{self.settings.label} is already a panel; change the method or layer"
            )
        if len(self.pinned) + 1 >= MAX_PANELS:
            raise CamvizError(f"at most {MAX_PANELS} panels side by side; clear them first")
        self.pinned.append(self.settings)

    def described(self) -> str:
        """What the current view explains, in words, with camviz's warnings about it."""
        if self.chosen is None or self.shown is None:
            return ""
        shown = self.shown
        said = "".join(f"; warning: {warning}" for warning in shown.warnings)
        return f"{self.chosen.label} by {shown.settings.label} in {shown.seconds:.2f} s{said}"


_NOTHING = {
    "classification": "nothing to explain; pick a class",
    "detection": f"no object scored {MIN_SCORE:g} or more in this image; try another image",
    "segmentation": "nothing to explain; click a region",
}


def _first_line(message: Warning | str) -> str:
    return first_line(message) if isinstance(message, Warning) else message.splitlines()[0]


def format_options(method: str, options: tuple[tuple[str, Any], ...] = ()) -> str:
    """The method's options as ``name = value`` lines: its defaults, with ``options`` over
    them (what the page's options box shows)."""
    given = dict(options)
    lines = []
    for name, parameter in inspect.signature(get(method)).parameters.items():
        default = parameter.default
        if parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            continue
        if default is inspect.Parameter.empty or not isinstance(default, _SIMPLE):
            continue
        lines.append(f"{name} = {given.get(name, default)!s}")
    return "\n".join(lines)


def parse_options(method: str, text: str) -> tuple[tuple[str, Any], ...]:
    """The options box read back: ``name = value`` lines (or ``name=value, ...``); values
    are ``True``/``False``, ``None``, numbers or text. Only the options that differ from the
    method's defaults are kept, so the call is the one a user writes by hand."""
    parameters = inspect.signature(get(method)).parameters
    chosen = []
    for line in text.replace(",", "\n").splitlines():
        if not line.strip():
            continue
        name, equals, value = (part.strip() for part in line.partition("="))
        if not equals or not name:
            raise CamvizError(f"options are name = value lines; cannot read {line.strip()!r}")
        if name not in parameters:
            takes = ", ".join(p for p in parameters if p not in ("options",)) or "none"
            raise CamvizError(f"{method} has no option {name!r}; it takes {takes}")
        parsed = _value(value)
        if parsed != parameters[name].default or type(parsed) is not type(parameters[name].default):
            chosen.append((name, parsed))
    return tuple(chosen)


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip("'\"")
