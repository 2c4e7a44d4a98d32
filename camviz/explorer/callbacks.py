"""What the page does when the user acts: one handler per event, on the tab's session.

Each handler reads the tab's :class:`~camviz.explorer.session.Session` and the widgets'
values, and returns the widgets it changes (a dict; the others stay as they are). Every
handler runs under :func:`_guarded`: a :class:`~camviz.core.errors.CamvizError` becomes the
one line of the page's status (``camviz: error: ...``) and nothing else changes, so the
page and the server go on; any other exception is a bug, printed with its traceback on the
server's stderr and named in the status line.

Files reach the server only as uploads, which Gradio stores under a name of its own; they
are read with :func:`camviz.load_image` (its size and pixel limits), and the line that
reports a bad one names the file by the name it was uploaded with. Images given when the
server started are offered by name, and the page sends back a name, never a path.
"""

from __future__ import annotations

import functools
import html
import itertools
import tempfile
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from PIL import Image

from camviz.cams.registry import get
from camviz.core.errors import CamvizError, first_line
from camviz.explorer.export import export, faithfulness
from camviz.explorer.session import Session, Settings, format_options, parse_options
from camviz.explorer.subject import Subject
from camviz.explorer.views import channel_view, photo, to_input, view_overlay
from camviz.io.images import load_image

__all__ = ["PANELS", "Handlers", "Widgets", "numbered", "status_line"]

Updates = dict[Any, Any]

#: The panels' label when it names no panel.
PANELS = "Panels side by side"
Handler = TypeVar("Handler", bound=Callable[..., Updates])


@dataclass
class Widgets:
    """The page's components that handlers read or change (Gradio blocks)."""

    state: Any
    status: Any
    images: Any
    picture: Any
    candidates: Any
    class_name: Any
    method: Any
    method_info: Any
    options: Any
    layer: Any
    alpha: Any
    colormap: Any
    overlay: Any
    caption: Any
    panels: Any
    channels: Any
    channel_map: Any
    channel_info: Any
    faithfulness: Any
    files: Any

    def all(self) -> list[Any]:
        """Every widget a handler may change (the outputs of every event)."""
        return [getattr(self, field.name) for field in fields(self)]


# Numbers each line of HTML the page gets, so that a line repeated is still seen as new.
_LINES = itertools.count(1)


def status_line(text: str, error: bool = False) -> str:
    """The status line's HTML: one line of text, escaped, numbered."""
    return numbered(html.escape(text), "camviz-error" if error else "camviz-ok")


def numbered(line: str, kind: str = "camviz-ok") -> str:
    """A line of HTML as a paragraph with its number."""
    return f'<p class="{kind}" data-line="{next(_LINES)}">{line}</p>'


def _guarded(handler: Handler) -> Handler:
    """``handler`` with errors shown in the status line (see the module docstring); the
    choices the user just made and that were not applied go back to what is shown."""

    @functools.wraps(handler)
    def guarded(self: Handlers, *args: Any, **kwargs: Any) -> Updates:
        try:
            return handler(self, *args, **kwargs)
        except CamvizError as error:
            line = status_line(f"camviz: error: {first_line(error)}", True)
        except Exception as error:  # a bug: say so, keep the traceback, keep serving
            traceback.print_exc()
            said = f"camviz: internal error: {type(error).__name__}: {first_line(error)}"
            line = status_line(f"{said} (the server's log has the traceback)", True)
        session = args[0] if args and isinstance(args[0], Session) else None
        return {self.w.status: line} | (self._chosen(session) if session is not None else {})

    return guarded  # type: ignore[return-value]


class Handlers:
    """The page's event handlers, for one model and the images given at start.

    Args:
        gr: The ``gradio`` module.
        subject: The model.
        images: The images offered by name: ``{name: path on this machine}``.
        widgets: The page's components.
        export_root: Where exports are written, one new folder each.
    """

    def __init__(
        self,
        gr: ModuleType,
        subject: Subject,
        images: Mapping[str, str],
        widgets: Widgets,
        export_root: Path,
    ) -> None:
        self.gr = gr
        self.subject = subject
        self.images = dict(images)
        self.w = widgets
        self.export_root = export_root

    # --- images ---------------------------------------------------------------------------

    @_guarded
    def start(self) -> Updates:
        """A new tab: its own session, showing the first image given, if any."""
        session = Session(self.subject)
        updates: Updates = {self.w.state: session}
        if self.images:
            name = next(iter(self.images))
            updates |= self._open(session, load_image(self.images[name]), name)
        else:
            updates[self.w.status] = status_line("upload an image to start")
        return updates

    @_guarded
    def pick_image(self, session: Session | None, name: str) -> Updates:
        if name not in self.images:
            raise CamvizError(f"no image named {name!r}; pick one from the list")
        return self._open(_live(session), load_image(self.images[name]), name)

    @_guarded
    def upload(self, session: Session | None, stored: str | None) -> Updates:
        if not stored:
            raise CamvizError("the upload did not arrive; upload the image again")
        # Gradio hands over only files of its upload folder; checked again here, so that no
        # path a page sends is ever opened, whatever Gradio's version does.
        uploads = Path(self.gr.utils.get_upload_folder()).resolve()
        if not Path(stored).resolve().is_relative_to(uploads):
            raise CamvizError("that file was not uploaded through the page; upload it again")
        name = Path(stored).name
        try:
            image = load_image(stored)
        except CamvizError as error:
            raise CamvizError(str(error).replace(stored, name)) from None
        return self._open(_live(session), image, name)

    def _open(self, session: Session, image: Image.Image, name: str) -> Updates:
        session.open(image, name)
        updates: Updates = {
            self.w.picture: photo(session),
            self.w.candidates: self.gr.update(
                choices=[(candidate.label, i) for i, candidate in enumerate(session.candidates)],
                value=0 if session.candidates else None,
            ),
            self.w.class_name: self.gr.update(value=None),
            self.w.layer: self.gr.update(
                choices=[(entry.label, entry.name) for entry in session.layers],
                value=session.settings.layer if session.settings else None,
            ),
        }
        cleared: Updates = {self.w.overlay: None, self.w.caption: "", self.w.panels: None}
        if session.chosen is None:
            line = status_line(f"{name}: {_nothing(session)}")
            return updates | cleared | {self.w.status: line}
        try:
            shown = _merged(updates, self._show(session, _current(session), None))
        except CamvizError as error:  # the image is shown; its map could not be made
            line = status_line(f"camviz: error: {first_line(error)}", True)
            return updates | cleared | {self.w.status: line}
        return shown | {self.w.status: status_line(f"{name}: explained {session.described()}")}

    # --- what is explained ----------------------------------------------------------------

    @_guarded
    def pick_candidate(self, session: Session | None, index: int | None, progress: Any) -> Updates:
        session = _live(session)
        if index is None or not 0 <= int(index) < len(session.candidates):
            raise CamvizError("pick one of the listed classes, objects or regions")
        return self._show(session, _current(session), progress, session.candidates[int(index)])

    @_guarded
    def pick_class(self, session: Session | None, name: str | None, progress: Any) -> Updates:
        session = _live(session)
        if not name:
            raise CamvizError("type a class name and pick it from the list")
        chosen = self.subject.named(name, session.output, session.candidates)
        return self._show(session, _current(session), progress, chosen)

    @_guarded
    def click_picture(self, session: Session | None, x: float, y: float, progress: Any) -> Updates:
        session = _live(session)
        if session.inputs is None:
            raise CamvizError("no image yet; upload one or pick one from the list")
        input_x, input_y = to_input(session, x, y)
        size = (int(session.inputs.shape[-2]), int(session.inputs.shape[-1]))
        chosen = self.subject.at_point(input_x, input_y, size, session.output, session.candidates)
        return self._show(session, _current(session), progress, chosen)

    # --- how ------------------------------------------------------------------------------

    @_guarded
    def pick_method(self, session: Session | None, method: str, progress: Any) -> Updates:
        session = _live(session)
        settings = session.with_settings(method=get(method).name)
        return self._show(session, settings, progress) | {
            self.w.options: format_options(settings.method),
            self.w.method_info: method_info(settings.method),
        }

    @_guarded
    def apply_options(self, session: Session | None, text: str, progress: Any) -> Updates:
        session = _live(session)
        method = _current(session).method
        return self._show(
            session, session.with_settings(options=parse_options(method, text)), progress
        )

    @_guarded
    def pick_layer(self, session: Session | None, layer: str, progress: Any) -> Updates:
        session = _live(session)
        return self._show(session, session.with_settings(layer=layer), progress)

    @_guarded
    def restyle(self, session: Session | None, alpha: float, colormap: str) -> Updates:
        session = _live(session)
        session.alpha, session.colormap = float(alpha), colormap
        if session.explained is None:
            return {}
        return {self.w.overlay: view_overlay(session), self.w.panels: self._panels(session, None)}

    @_guarded
    def cancel(self, session: Session | None) -> Updates:
        _live(session).cancel.set()
        return {}

    def _chosen(self, session: Session) -> Updates:
        """The widgets that say what the current view is, set to it."""
        index = next(
            (i for i, found in enumerate(session.candidates) if found is session.chosen), None
        )
        settings = session.shown.settings if session.shown is not None else session.settings
        if settings is None:
            return {self.w.candidates: self.gr.update(value=index)}
        return {
            self.w.candidates: self.gr.update(value=index),
            self.w.method: self.gr.update(value=settings.method),
            self.w.layer: self.gr.update(value=settings.layer),
        }

    def _show(
        self, session: Session, settings: Settings, progress: Any, candidate: Any = None
    ) -> Updates:
        """Explain with ``settings`` (and ``candidate``) and show it; the views that depend
        on the map follow."""
        session.show(settings, _reporter(progress), candidate)
        updates: Updates = self._chosen(session) | {
            self.w.overlay: view_overlay(session),
            self.w.caption: status_line(session.described()),
            self.w.status: status_line(f"explained {session.described()}"),
            self.w.panels: self._panels(session, progress),
            self.w.faithfulness: "",
        }
        if session.channels is not None:
            updates |= self._channels(session)
        return updates

    # --- panels, channels, numbers, files -------------------------------------------------

    @_guarded
    def pin(self, session: Session | None, progress: Any) -> Updates:
        session = _live(session)
        session.pin()
        return {
            self.w.panels: self._panels(session, progress),
            self.w.status: status_line(
                f"pinned {_current(session).label}; change the method or layer to compare"
            ),
        }

    @_guarded
    def clear(self, session: Session | None) -> Updates:
        _live(session).pinned.clear()
        panels = self.gr.update(value=[], label=PANELS)
        return {self.w.panels: panels, self.w.status: status_line("panels cleared")}

    def _panels(self, session: Session, progress: Any) -> Any:
        """The panels: the current view and the pinned ones, named left to right in the
        gallery's label (its thumbnails show no caption)."""
        if not session.pinned:
            return self.gr.update(value=[], label=PANELS)
        views = [session.current(), *session.compared(_reporter(progress))]
        captions = ["; warning: ".join([view.settings.label, *view.warnings]) for view in views]
        pictures = [view_overlay(session, view.explained, view.settings) for view in views]
        return self.gr.update(
            value=list(zip(pictures, captions, strict=True)),
            label=f"{PANELS}, left to right: {' | '.join(captions)}",
        )

    @_guarded
    def show_channels(self, session: Session | None) -> Updates:
        session = _live(session)
        return self._channels(session, opening=True)

    def _channels(self, session: Session, opening: bool = False) -> Updates:
        if opening or session.channels is not None:
            session.channels = channel_view(session)
        view = session.channels
        assert view is not None
        first = view.order[0]
        return {
            self.w.channels: view.grid,
            self.w.channel_map: view.channel_map(session, first),
            self.w.channel_info: status_line(
                f"{min(len(view.order), 64)} of {len(view.order)} channels of {view.layer}, "
                f"by {view.by} weight, strongest first; click one to see it. Shown: "
                + view.caption(first)
            ),
        }

    @_guarded
    def click_channel(self, session: Session | None, x: float, y: float) -> Updates:
        session = _live(session)
        if session.channels is None:
            raise CamvizError("open the channel view first")
        channel = session.channels.channel_at(x, y)
        return {
            self.w.channel_map: session.channels.channel_map(session, channel),
            self.w.channel_info: status_line(f"shown: {session.channels.caption(channel)}"),
        }

    @_guarded
    def measure(self, session: Session | None) -> Updates:
        return {self.w.faithfulness: numbered(faithfulness(_live(session)))}

    @_guarded
    def export(self, session: Session | None, progress: Any) -> Updates:
        session = _live(session)
        panels = session.compared(_reporter(progress))
        folder = Path(tempfile.mkdtemp(prefix="export-", dir=self.export_root))
        written = export(session, folder, panels)
        return {
            self.w.files: [str(written["report"]), str(written["maps"])],
            self.w.status: status_line(f"exported {session.described()}"),
        }


def _merged(first: Updates, then: Updates) -> Updates:
    """``first`` with ``then`` over it; two updates of one widget are merged key by key (an
    image's new choices and the value chosen among them)."""
    merged = dict(first)
    for widget, value in then.items():
        before = merged.get(widget)
        both = isinstance(before, dict) and isinstance(value, dict)
        merged[widget] = {**before, **value} if both else value  # type: ignore[dict-item]
    return merged


def method_info(method: str) -> str:
    """One line on a method: its paper and what it needs (the registry's words)."""
    cls = get(method)
    return status_line(f"{cls.name}: {cls.paper}; needs {cls.needs}")


def _reporter(progress: Any) -> Callable[[float, str], None] | None:
    if progress is None:
        return None
    return lambda fraction, text: progress(fraction, desc=text)


def _live(session: Session | None) -> Session:
    if session is None:
        raise CamvizError("the page is still starting; try again in a moment")
    return session


def _current(session: Session) -> Settings:
    if session.settings is None:
        raise CamvizError("no image yet; upload one or pick one from the list")
    return session.settings


def _nothing(session: Session) -> str:
    task = session.subject.task
    if task == "detection":
        return "no object found in this image; try another image"
    return "nothing to explain in this image; try another image"
