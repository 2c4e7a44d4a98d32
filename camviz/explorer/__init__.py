"""The explorer: a page in the browser to explain one model on images, interactively.

:func:`camviz.app` (``camviz app`` on the command line) serves it. It sits beside the
command line and uses only camviz's public functions: :func:`camviz.explain` for every map,
:func:`camviz.overlay` for every picture, the method registry for the methods and their
options, ``camviz layers``' shapes for the layer tree, :func:`camviz.channel_grid` for the
channel view, the report's metrics and writer for the numbers and the export.

Modules: :mod:`~camviz.explorer.subject` (the model and what can be explained on an image),
:mod:`~camviz.explorer.session` (one browser tab's state), :mod:`~camviz.explorer.progress`
(progress and cancel of the slow methods), :mod:`~camviz.explorer.views` (the pictures),
:mod:`~camviz.explorer.export` (numbers and files), :mod:`~camviz.explorer.callbacks` and
:mod:`~camviz.explorer.page` (the Gradio page), :mod:`~camviz.explorer.framework` (Gradio,
imported on first use, with nothing sent beyond this machine) and
:mod:`~camviz.explorer.server` (:func:`app`). The package is not named ``app``, so that
``camviz.app`` stays the function.
"""

from camviz.explorer.server import AppServer, app

__all__ = ["AppServer", "app"]
