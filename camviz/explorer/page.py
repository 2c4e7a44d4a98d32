"""The page: its layout, and which handler each event calls.

Left, the image: uploads and the images given at start, the photo (a detector's boxes drawn
on it; click a box, or a segmentation model's region), the classes, objects or regions to
pick, and a class typed by name. Middle, how: the method and its options, the layer tree
(``camviz layers``' rows, the default marked), opacity and colour map. Right, the map, with
a cancel button for the slow methods. Below: panels side by side, the channel view, the
faithfulness numbers and the export.

Events that explain take Gradio's progress bar; the cancel button bypasses the queue, so
that it reaches the server while an explanation runs. Widgets carry ``camviz-*`` element
ids, which the browser tests use.

This module keeps its annotations evaluated (no ``from __future__ import annotations``):
Gradio finds the click coordinates and the progress bar a handler wants from its signature.
"""

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from camviz.cams.registry import names
from camviz.explorer.callbacks import PANELS, Handlers, Widgets, method_info
from camviz.explorer.session import DEFAULT_METHOD, MAX_PANELS, format_options
from camviz.explorer.subject import Subject
from camviz.io.colormaps import SHIPPED_NAMES

__all__ = ["CSS", "build"]

#: The page's own style: pixel-sharp channel tiles, a red error line.
CSS = """
#camviz-channels img { image-rendering: pixelated; }
.camviz-error { color: #b91c1c; font-weight: 600; margin: 0; }
.camviz-ok { margin: 0; }
"""


# The pictures' buttons: no "share" (it posts to Hugging Face).
_BUTTONS = ["download", "fullscreen"]


@dataclass
class _Controls:
    """The widgets that only start events."""

    upload: Any
    apply: Any
    cancel: Any
    pin: Any
    clear: Any
    show_channels: Any
    measure: Any
    export: Any


def build(gr: ModuleType, subject: Subject, images: dict[str, str], export_root: Path) -> Any:
    """The page (a ``gradio.Blocks``) for ``subject`` and the images given by name."""
    title = f"camviz explorer - {subject.name}"
    with gr.Blocks(title=title, analytics_enabled=False, delete_cache=(600, 3600)) as page:
        gr.Markdown(
            f"## {title}\nPick a class, an object or a region; a method, its options and a "
            "layer. Everything is computed on this machine."
        )
        widgets, controls = _layout(gr, subject, images)
        handlers = Handlers(gr, subject, images, widgets, export_root)
        _wire(gr, page, widgets, controls, handlers)
    return page


def _layout(gr: ModuleType, subject: Subject, images: dict[str, str]) -> tuple[Widgets, _Controls]:
    made: dict[str, Any] = {
        "state": gr.State(),
        "status": gr.HTML("starting...", elem_id="camviz-status"),
    }
    with gr.Row():
        with gr.Column(scale=2):
            made |= _image_column(gr, subject, images)
        with gr.Column(scale=2):
            made |= _settings_column(gr, subject)
        with gr.Column(scale=3):
            made["overlay"] = _picture(gr, "Map", "camviz-overlay")
            made["caption"] = gr.HTML("", elem_id="camviz-caption")
            made["cancel"] = gr.Button("Cancel", variant="stop", size="sm", elem_id="camviz-cancel")
    made |= _below(gr)
    controls = {field: made.pop(field) for field in _Controls.__dataclass_fields__}
    return Widgets(**made), _Controls(**controls)


def _picture(gr: ModuleType, label: str, elem_id: str) -> Any:
    """A picture the server draws (PNG, lossless: the page shows camviz's pixels)."""
    return gr.Image(
        label=label,
        type="pil",
        format="png",
        interactive=False,
        buttons=_BUTTONS,
        elem_id=elem_id,
    )


def _image_column(gr: ModuleType, subject: Subject, images: dict[str, str]) -> dict[str, Any]:
    return {
        "upload": gr.UploadButton("Upload an image", type="filepath", elem_id="camviz-upload"),
        "images": gr.Dropdown(
            list(images),
            value=next(iter(images), None),
            label="Images given",
            visible=bool(images),
            elem_id="camviz-images",
        ),
        "picture": _picture(gr, "Image (click a box or a region)", "camviz-picture"),
        "candidates": gr.Radio([], label="Explain", elem_id="camviz-candidates"),
        "class_name": gr.Dropdown(
            list(subject.loaded.categories),
            value=None,
            label="Or type a class name",
            filterable=True,
            visible=bool(subject.loaded.categories),
            elem_id="camviz-class",
        ),
    }


def _settings_column(gr: ModuleType, subject: Subject) -> dict[str, Any]:
    return {
        "method": gr.Dropdown(
            names(subject.model), value=DEFAULT_METHOD, label="Method", elem_id="camviz-method"
        ),
        "method_info": gr.HTML(method_info(DEFAULT_METHOD), elem_id="camviz-method-info"),
        "options": gr.Textbox(
            format_options(DEFAULT_METHOD),
            lines=3,
            label="Options (name = value)",
            elem_id="camviz-options",
        ),
        "apply": gr.Button("Apply the options", size="sm", elem_id="camviz-apply"),
        "layer": gr.Dropdown(
            [], label="Layer (output shape; the default marked)", elem_id="camviz-layer"
        ),
        "alpha": gr.Slider(0.0, 1.0, value=0.5, step=0.05, label="Opacity", elem_id="camviz-alpha"),
        "colormap": gr.Dropdown(
            list(SHIPPED_NAMES), value="jet", label="Colour map", elem_id="camviz-colormap"
        ),
    }


def _below(gr: ModuleType) -> dict[str, Any]:
    made: dict[str, Any] = {}
    with gr.Row():
        made["pin"] = gr.Button(
            f"Add the map to the panels (up to {MAX_PANELS})", elem_id="camviz-pin"
        )
        made["clear"] = gr.Button("Clear the panels", elem_id="camviz-clear")
    made["panels"] = gr.Gallery(
        label=PANELS,
        columns=MAX_PANELS,
        object_fit="contain",  # whole maps, not cropped squares
        height="auto",
        format="png",
        buttons=_BUTTONS,
        elem_id="camviz-panels",
    )
    with gr.Accordion("Channel view", open=False, elem_id="camviz-channel-view"):
        made["show_channels"] = gr.Button(
            "Show the layer's channels", elem_id="camviz-show-channels"
        )
        made["channel_info"] = gr.HTML("", elem_id="camviz-channel-info")
        with gr.Row():
            made["channels"] = _picture(gr, "Channels by weight (click one)", "camviz-channels")
            made["channel_map"] = _picture(gr, "The channel over the image", "camviz-channel-map")
    with gr.Row():
        made["measure"] = gr.Button("Measure deletion and insertion", elem_id="camviz-measure")
        made["export"] = gr.Button("Export the report and the maps", elem_id="camviz-export")
    made["faithfulness"] = gr.HTML("", elem_id="camviz-faithfulness")
    made["files"] = gr.File(
        label="Exported", file_count="multiple", interactive=False, elem_id="camviz-files"
    )
    return made


def _wire(gr: ModuleType, page: Any, w: Widgets, c: _Controls, h: Handlers) -> None:
    outputs = w.all()
    bar = gr.Progress()  # Gradio gives each call its own progress bar, found by this default

    def picked(session: Any, index: Any, progress: Any = bar) -> Any:
        return h.pick_candidate(session, index, progress)

    def typed(session: Any, name: Any, progress: Any = bar) -> Any:
        return h.pick_class(session, name, progress)

    # gr is a module value here, which mypy cannot read types from; Gradio reads the
    # annotation at run time to hand the handler the click.
    def clicked(session: Any, event: gr.SelectData, progress: Any = bar) -> Any:  # type: ignore[name-defined]
        return h.click_picture(session, event.index[0], event.index[1], progress)

    def method(session: Any, name: Any, progress: Any = bar) -> Any:
        return h.pick_method(session, name, progress)

    def options(session: Any, text: Any, progress: Any = bar) -> Any:
        return h.apply_options(session, text, progress)

    def layer(session: Any, name: Any, progress: Any = bar) -> Any:
        return h.pick_layer(session, name, progress)

    def pin(session: Any, progress: Any = bar) -> Any:
        return h.pin(session, progress)

    def channel(session: Any, event: gr.SelectData) -> Any:  # type: ignore[name-defined]
        return h.click_channel(session, event.index[0], event.index[1])

    def export(session: Any, progress: Any = bar) -> Any:
        return h.export(session, progress)

    # Dropdowns answer a pick (select), not input: Gradio 6 fires input on every blur too,
    # which would explain again (or reopen the image) whenever the user clicks elsewhere.
    # The progress bar and timer on the map only (on every output, they cost the page time).
    explaining = {"outputs": outputs, "show_progress_on": [w.overlay]}
    quiet = {"outputs": outputs, "show_progress": "hidden"}
    page.load(h.start, None, **explaining)
    w.images.select(h.pick_image, [w.state, w.images], **explaining)
    c.upload.upload(h.upload, [w.state, c.upload], **explaining)
    w.candidates.input(picked, [w.state, w.candidates], **explaining)
    w.class_name.select(typed, [w.state, w.class_name], **explaining)
    w.picture.select(clicked, [w.state], **explaining)
    w.method.select(method, [w.state, w.method], **explaining)
    c.apply.click(options, [w.state, w.options], **explaining)
    w.layer.select(layer, [w.state, w.layer], **explaining)
    w.alpha.release(h.restyle, [w.state, w.alpha, w.colormap], **quiet)
    w.colormap.select(h.restyle, [w.state, w.alpha, w.colormap], **quiet)
    c.cancel.click(h.cancel, [w.state], queue=False, **quiet)
    c.pin.click(pin, [w.state], outputs, show_progress_on=[w.panels])
    c.clear.click(h.clear, [w.state], **quiet)
    c.show_channels.click(h.show_channels, [w.state], outputs, show_progress_on=[w.channels])
    w.channels.select(channel, [w.state], **quiet)
    c.measure.click(h.measure, [w.state], outputs, show_progress_on=[w.faithfulness])
    c.export.click(export, [w.state], outputs, show_progress_on=[w.files])
