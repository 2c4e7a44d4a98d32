"""``camviz.app``: serve the explorer's page for one model, on this machine.

The server listens on ``127.0.0.1`` unless another host is asked for, and then warns on
stderr that anyone who reaches that address can use the model. Port 0 picks a free port
(found by binding to port 0 first: Gradio reports the port it was given). Several browser
tabs can use one server: each has its own session, and the model is used by one request
at a time. The page's exports are written under a temporary folder that :meth:`AppServer.close`
removes.
"""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from camviz.core.detection import Adapter
from camviz.core.errors import CamvizError, first_line
from camviz.core.precision import Precision
from camviz.explorer.framework import gradio, theme
from camviz.explorer.subject import Subject, as_loaded

__all__ = ["LOOPBACK", "MAX_UPLOAD", "AppServer", "app"]

#: Hosts that only this machine reaches.
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})

#: The largest upload the server accepts (its pixels are checked too, by ``load_image``).
MAX_UPLOAD = "100mb"


class AppServer:
    """A running explorer: its address, and how to stop it.

    Attributes:
        url: The page's address (``http://127.0.0.1:7860/``).
        host, port: Where it listens.
    """

    def __init__(self, page: Any, url: str, host: str, port: int, export_root: Path) -> None:
        self._page = page
        self.url = url
        self.host = host
        self.port = port
        self._export_root = export_root

    def close(self) -> None:
        """Stop the server and remove its exports (safe to call twice)."""
        self._page.close()
        shutil.rmtree(self._export_root, ignore_errors=True)

    def wait(self) -> None:
        """Serve until Ctrl-C, then close."""
        try:
            while True:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.close()

    def __enter__(self) -> AppServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AppServer(url={self.url!r})"


def app(
    model: Any = None,
    images: str | Path | Iterable[str | Path] = (),
    *,
    port: int = 7860,
    host: str = "127.0.0.1",
    block: bool = True,
    adapter: Adapter | None = None,
    precision: Precision = "fp32",
    channels_last: bool = False,
) -> AppServer:
    """Serve a page to explore ``model`` in a browser: classes, objects or regions, methods
    and their options, layers, panels side by side, channels, faithfulness, export.

    Args:
        model: A :class:`~camviz.models.LoadedModel` (from :func:`camviz.load_model`, with its
            preprocessing and class names), a model name for :func:`camviz.load_model`
            (``None``: the offline default), or an ``nn.Module`` (then ImageNet
            preprocessing at 224 pixels and classes named by number).
        images: Image files, folders or glob patterns offered in the page; more can be
            uploaded there.
        port: The port; ``0`` picks a free one.
        host: The address to listen on; any but this machine's own (``127.0.0.1``,
            ``localhost``, ``::1``) is warned about on stderr.
        block: Serve until Ctrl-C (then close); ``False`` returns at once, and in a notebook
            shows the page inline.
        adapter: For a detector whose output is not torchvision's list of dicts, what reads
            it (see :class:`camviz.Detection`); ``None`` reads a raw ``(N, anchors, 4 +
            classes)`` output with :class:`camviz.DenseDetections` defaults.
        precision, channels_last: How the model's passes run, as in :func:`camviz.explain`
            (the faithfulness numbers always in float32).

    Returns:
        The :class:`AppServer`, with its ``url``; ``close()`` stops it.

    Raises:
        CamvizError: Gradio is missing (``pip install "camviz[app]"``), the port is taken,
            the model or an image cannot be loaded, or the precision is not computed
            natively.
    """
    gr = gradio()
    subject = Subject(as_loaded(model), adapter, precision, channels_last)
    offered = _offered(images)
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise CamvizError(f"port must be a number from 0 to 65535, not {port!r}")
    if host not in LOOPBACK:
        print(
            f"camviz: warning: the explorer listens on {host}: anyone who can reach this "
            "address can run the model and upload images",
            file=sys.stderr,
        )
    port = port or _free_port(host)
    export_root = Path(tempfile.mkdtemp(prefix="camviz-app-"))
    try:
        page, url = _launched(gr, subject, offered, export_root, host, port, inline=not block)
    except BaseException:
        shutil.rmtree(export_root, ignore_errors=True)
        raise
    server = AppServer(page, url, host, port, export_root)
    if block:
        print(f"camviz explorer: {url} (Ctrl-C stops it)", file=sys.stderr)
        server.wait()
    return server


def _launched(
    gr: ModuleType,
    subject: Subject,
    offered: dict[str, str],
    export_root: Path,
    host: str,
    port: int,
    inline: bool,
) -> tuple[Any, str]:
    """The page, built and listening on ``host:port``, and its address."""
    from camviz.explorer.page import CSS, build

    page = build(gr, subject, offered, export_root)
    page.queue(default_concurrency_limit=4)
    try:
        _, url, _ = page.launch(
            server_name=host,
            server_port=port,
            prevent_thread_lock=True,
            inline=None if inline else False,  # None: inline in a notebook
            share=False,
            ssr_mode=False,
            quiet=True,
            show_error=False,
            max_file_size=MAX_UPLOAD,
            allowed_paths=[str(export_root)],
            footer_links=["settings"],
            run_history=False,
            theme=theme(gr),
            css=CSS,
        )
    except OSError as error:
        raise CamvizError(
            f"cannot listen on {host}:{port} ({first_line(error)}); pass another port, or 0 "
            "for a free one"
        ) from None
    return page, url


def _offered(images: str | Path | Iterable[str | Path]) -> dict[str, str]:
    """``{name shown: path}`` for the image files that files, folders and globs name."""
    from camviz.pipeline.inputs import expand

    offered = {}
    for item in expand(images):
        if item.reason is not None:
            raise CamvizError(f"cannot offer {item.path}: {item.reason}")
        if item.frame is not None or item.clip_len is not None:
            raise CamvizError(
                f"{item.path} is a video; the explorer shows still images (explain videos with "
                "`camviz explain`)"
            )
        offered[item.name] = item.path
    return offered


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
