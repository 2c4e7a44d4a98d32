"""Gradio, imported on first use and set up to make no request beyond this machine.

Gradio is an optional dependency (``pip install "camviz[app]"``), imported only when a page
is built, so that ``import camviz`` and ``camviz --help`` stay fast and work without it.
Before the import, its usage analytics and the Hugging Face hub's telemetry are turned off
(both read the environment); the page is then launched without a share link, without
server-side rendering (a Node process), and with a theme whose fonts are the system's, so
the browser loads nothing but what this server sends.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from camviz.core.errors import CamvizError

__all__ = ["INSTALL", "gradio", "theme"]

#: What to install for the explorer.
INSTALL = 'pip install "camviz[app]"'

# The Gradio versions whose API the page is written for.
_MAJOR_VERSIONS = (6,)


def gradio() -> ModuleType:
    """The ``gradio`` module, with analytics and telemetry off.

    Raises:
        CamvizError: Gradio is not installed, or is a version the page is not written for.
    """
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    try:
        import gradio as gr
    except ImportError:
        raise CamvizError(f"the explorer needs Gradio; install it with {INSTALL}") from None
    major = int(gr.__version__.split(".")[0])
    if major not in _MAJOR_VERSIONS:
        raise CamvizError(
            f"the explorer is written for Gradio 6, not {gr.__version__}; install it with {INSTALL}"
        )
    return gr


def theme(gr: ModuleType) -> Any:
    """Gradio's default theme with system fonts: its own fonts are fetched from Google."""
    return gr.themes.Default(
        font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )
