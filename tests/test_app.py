"""The explorer (``camviz.app``), driven in Debian's headless Chromium by Playwright.

Every host but 127.0.0.1 is blocked, and the browser's request log is kept: a page that
asked for any other host fails its test; so does a connection of this process (the server)
to any other address. The maps the page shows and exports are compared with
``camviz.explain``'s (the ``.npz`` within 1e-6, the overlay pixel for pixel with
``camviz.overlay`` of it), the layer tree with the layers' outputs, the channel view with
``camviz.channel_grid(order="weight")`` of ``camviz.features`` and the method's channel
weights, and the faithfulness line with ``camviz.metrics``. One server and one browser serve
the classifier's tests. The tests skip when Chromium, Playwright or Gradio is missing,
unless ``CAMVIZ_REQUIRE_BROWSER=1`` (CI sets it).
"""

from __future__ import annotations

import io
import ipaddress
import itertools
import json
import os
import re
import shutil
import socket
import struct
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the conventional name
from PIL import Image
from torch import nn
from torchvision.utils import save_image

import camviz
from camviz.cams.registry import names
from camviz.evaluation.synthetic import (
    CLASSES,
    SEGMENTATION_CLASSES,
    TARGET_LAYER,
    load_detector,
    load_model,
    make_scenes,
)
from camviz.io.images import Preprocess, load_image
from camviz.io.models import LoadedModel

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Inputs in [0, 1]: the synthetic networks normalise them themselves.
RAW = Preprocess(size=64, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
WAIT_MS = 60_000  # a bound on waiting for the page, not a timing: the machine may be busy


def _missing(what: str) -> None:
    if os.environ.get("CAMVIZ_REQUIRE_BROWSER") == "1":
        pytest.fail(what)
    pytest.skip(what)


@pytest.fixture(scope="module")
def gradio() -> None:
    try:
        import gradio  # noqa: F401 - the explorer's framework
    except ImportError:
        _missing('the explorer tests need Gradio: pip install -e ".[test]"')


@pytest.fixture(scope="module")
def browser(gradio) -> Iterator[Any]:
    """One window (context) of Debian's Chromium, driven by Playwright: its tabs share a cache."""
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        _missing("chromium is not installed; install it with `apt-get install -y chromium`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing('the explorer tests need Playwright: pip install -e ".[test]"')
    with sync_playwright() as playwright:
        executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        # One window for every tab: they share its cache, as a user's tabs do.
        window = launched.new_context(
            viewport={"width": 1400, "height": 1000}, service_workers="block"
        )
        yield window
        window.close()
        launched.close()


@pytest.fixture(scope="module")
def outbound() -> Iterator[list[object]]:
    """Every address other than this machine's that this process connects to meanwhile (the
    servers of this module run in it)."""
    elsewhere: list[object] = []
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def note(sock: socket.socket, address: Any) -> None:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return
        host = address[0]
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            elsewhere.append(address)

    def noted(real: Callable[..., Any]) -> Callable[..., Any]:
        return lambda sock, address: (note(sock, address), real(sock, address))[1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", noted(connect))
        patch.setattr(socket.socket, "connect_ex", noted(connect_ex))
        yield elsewhere


class Tab:
    """A page of the explorer, with every request to another host than 127.0.0.1 aborted,
    and the hosts of all its requests in :attr:`hosts` (the browser's request log)."""

    def __init__(self, browser: Any, url: str) -> None:
        self.page = browser.new_page()
        self.hosts: set[str | None] = set()
        self.page.on("request", lambda request: self._log(request.url))
        self.page.on("websocket", lambda socket: self._log(socket.url))
        self.page.route("**/*", self._route)
        self.after(lambda: self.page.goto(url), "")

    def _log(self, url: str) -> None:
        if not url.startswith(("data:", "blob:")):
            self.hosts.add(urlparse(url).hostname)

    def _route(self, route: Any) -> None:
        if urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            route.abort()

    def status(self) -> str:
        return self.page.inner_text("#camviz-status p").strip()

    def line(self, widget: str = "camviz-status") -> str:
        """The number of the line a widget shows (each answer of the server has a new one)."""
        return self.page.evaluate(
            "(id) => { const p = document.querySelector(`#${id} p`); "
            "return p ? p.dataset.line : ''; }",
            widget,
        )

    def answer(self, before: str, text: str, widget: str = "camviz-status") -> str:
        """Wait for a line after ``before`` in ``widget`` holding ``text`` (or an error)."""
        self.page.wait_for_function(
            """([id, before, text]) => {
                const p = document.querySelector(`#${id} p`);
                return p && p.dataset.line !== before
                    && (p.innerText.includes(text) || p.innerText.includes('error'));
            }""",
            arg=[widget, before, text],
            timeout=WAIT_MS,
        )
        return self.page.inner_text(f"#{widget} p").strip()

    def after(self, action: Callable[[], object], text: str, widget: str = "camviz-status") -> str:
        """Do ``action``, wait for the server's answer in ``widget`` (holding ``text``, or
        an error), and return that line."""
        before = self.line(widget)
        action()
        return self.answer(before, text, widget)

    def redrawn(self, action: Callable[[], object], widget: str) -> None:
        """Do ``action`` and wait until the picture of ``widget`` is another one."""
        before = self.page.locator(f"#{widget} img").get_attribute("src")
        action()
        self.page.wait_for_function(
            """([id, before]) => {
                const image = document.querySelector(`#${id} img`);
                return image && image.getAttribute('src') !== before;
            }""",
            arg=[widget, before],
            timeout=WAIT_MS,
        )

    def offered(self, widget: str, typed: str | None = None) -> list[str]:
        """The labels a dropdown offers once opened (and, with ``typed``, once typed in)."""
        self.page.click(f"#{widget} input")
        options = self.page.locator(f"#{widget} ul.option-list li[aria-label]")
        options.first.wait_for(timeout=WAIT_MS)
        if typed is not None:  # then wait for the list to show only what matches
            self.page.keyboard.type(typed)
            self.page.wait_for_function(
                """([id, typed]) => [...document.querySelectorAll(`#${id} li[aria-label]`)]
                    .every(item => item.ariaLabel.toLowerCase().includes(typed))""",
                arg=[widget, typed.lower()],
                timeout=WAIT_MS,
            )
        return [label.strip() for label in options.evaluate_all("o => o.map(i => i.ariaLabel)")]

    def choose(self, widget: str, label: str) -> None:
        """Open a dropdown and pick its option whose label is ``label`` (or, for a layer,
        starts with the layer's name)."""
        self.pick(widget, self.offered(widget), label)

    def pick(self, widget: str, labels: list[str], label: str) -> None:
        """Pick an option of the open dropdown, which offers ``labels``."""
        matching = [
            i for i, text in enumerate(labels) if text == label or text.startswith(f"{label}  ")
        ]
        self.page.locator(f"#{widget} ul.option-list li[aria-label]").nth(matching[0]).click()

    def upload(self, path: Path) -> None:
        """Upload a file with the page's upload button (its file input sits beside it)."""
        self.page.set_input_files("input[data-testid='Upload an image-upload-button']", path)

    def click_pixel(self, widget: str, x: float, y: float) -> None:
        """Click the pixel ``(x, y)`` of a picture, as Gradio maps clicks to pixels (the
        picture is shown contained in its box, never enlarged)."""
        image = self.page.locator(f"#{widget} img")
        loaded = "(image) => image.complete && image.naturalWidth > 0"
        self.page.wait_for_function(loaded, arg=image.element_handle(), timeout=WAIT_MS)
        box = image.bounding_box()
        width, height = image.evaluate("i => [i.naturalWidth, i.naturalHeight]")
        scale = min(box["width"] / width, box["height"] / height, 1)
        left = (box["width"] - width * scale) / 2
        top = (box["height"] - height * scale) / 2
        image.click(position={"x": left + (x + 0.5) * scale, "y": top + (y + 0.5) * scale})

    def picture(self, widget: str) -> np.ndarray:
        """The pixels the page shows in a picture widget, fetched from its source."""
        return self.pictures(widget)[0]

    def pictures(self, widget: str) -> list[np.ndarray]:
        """The pixels of every picture a widget shows, left to right."""
        images = self.page.locator(f"#{widget} img")
        sources = [images.nth(i).get_attribute("src") for i in range(images.count())]
        return [
            np.asarray(Image.open(io.BytesIO(self.fetch(source))).convert("RGB"))
            for source in sources
        ]

    def fetch(self, url: str) -> bytes:
        response = self.page.request.get(url)
        assert response.ok, url
        return response.body()

    def exported(self) -> dict[str, bytes]:
        """Click export; the exported files by name."""
        self.page.click("#camviz-export")
        links = self.page.locator("#camviz-files a")
        links.nth(1).wait_for(timeout=WAIT_MS)
        hrefs = [links.nth(i).get_attribute("href") for i in range(links.count())]
        return {Path(urlparse(href).path).name: self.fetch(href) for href in hrefs}

    def close(self) -> None:
        self.page.close()
        assert self.hosts <= {"127.0.0.1"}, f"the page asked for other hosts: {self.hosts}"


def _maps(exported: dict[str, bytes]) -> dict[str, np.ndarray]:
    return dict(np.load(io.BytesIO(exported["maps.npz"])))


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (from /proc/net/tcp*)."""
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                if len(raw) == 4:
                    addresses.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    addresses.add(socket.inet_ntop(socket.AF_INET6, words))
    return addresses


def _shown_by(line: str) -> tuple[str, str]:
    """The method and layer a status line says the map was made with."""
    found = re.search(r" by (\S+) @ (\S+) in ", line)
    assert found is not None, line
    return found[1], found[2]


# --- the classifier -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier() -> LoadedModel:
    return LoadedModel(
        model=load_model(),
        preprocess=RAW,
        categories=list(CLASSES),
        name="synthetic_cnn",
        default_layer=TARGET_LAYER,
    )


@pytest.fixture(scope="module")
def shown_inline() -> list[Any]:
    """What ``camviz.app(block=False)`` displayed, launched as in a notebook."""
    return []


@pytest.fixture(scope="module")
def classifier_server(
    gradio, outbound, shown_inline, classifier, cat_path
) -> Iterator[camviz.explorer.AppServer]:
    import gradio
    import IPython.display

    with pytest.MonkeyPatch.context() as patch:  # a notebook's kernel, as Gradio tells it
        patch.setattr(gradio.utils, "ipython_check", lambda: True)
        patch.setattr(IPython.display, "display", shown_inline.append)
        server = camviz.app(classifier, [cat_path], port=0, block=False)
    yield server
    server.close()


@pytest.fixture(scope="module")
def second_tab(browser, classifier_server) -> Iterator[Tab]:
    """Another tab on the classifier's server, for the tests that need one."""
    tab = Tab(browser, classifier_server.url)
    yield tab
    tab.close()


def _layer_tree(model: nn.Module, inputs: torch.Tensor) -> list[str]:
    """What the layer tree lists: every layer with a map output, with its shape as a
    forward hook sees it, the default marked."""
    rows: list[str] = []

    def record(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            if output.dim() == 4 and not any(row.startswith(f"{name}  ") for row in rows):
                mark = "  \u2190 default" if name == TARGET_LAYER else ""
                rows.append(f"{name}  {type(module).__name__} {tuple(output.shape)}{mark}")

        return hook

    hooks = [module.register_forward_hook(record(n)) for n, module in model.named_modules() if n]
    with torch.no_grad():
        model(inputs)
    for hook in hooks:
        hook.remove()
    return rows


def _check_channels(tab: Tab, image: Image.Image, inputs: torch.Tensor, class_id: int) -> None:
    """The channel view: the grid of ``camviz.channel_grid(order="weight")`` with
    Score-CAM's weights, the strongest channel shown, a click on a tile shows its own."""
    model = load_model()
    weights = camviz.explain(model, inputs, "scorecam", TARGET_LAYER, class_id).weights
    assert weights is not None
    weight = weights[TARGET_LAYER][0]
    order = torch.argsort(weight, descending=True, stable=True).tolist()
    tab.page.click("#camviz-channel-view button.label-wrap")
    shown = lambda: tab.page.click("#camviz-show-channels")  # noqa: E731
    line = tab.after(shown, "weight", "camviz-channel-info")
    assert "by scorecam weight" in line and f"channel {order[0]} of features," in line
    activations = camviz.features(model, inputs, [TARGET_LAYER])[TARGET_LAYER]
    tiles = activations.repeat_interleave(3, dim=-2).repeat_interleave(3, dim=-1)  # 48 px
    grid = camviz.channel_grid(
        tiles, channels=64, order="weight", weights=weight, ncols=8, colormap="viridis"
    )
    expected_grid = grid.mul(255).round().byte().permute(1, 2, 0).numpy()
    assert np.array_equal(tab.picture("camviz-channels"), expected_grid)

    def channel_map_is(channel: int) -> None:
        _, scaled = camviz.render.select_channels(activations, [channel])
        expected = np.asarray(camviz.overlay(image, scaled[0]))
        assert np.array_equal(tab.picture("camviz-channel-map"), expected)

    channel_map_is(order[0])
    tenth = 1 + 49 + 24  # the centre of the tenth tile: second row, second column
    click = lambda: tab.click_pixel("camviz-channels", tenth, tenth)  # noqa: E731
    line = tab.after(click, "shown:", "camviz-channel-info")
    assert line.startswith(f"shown: channel {order[9]} of features, scorecam weight ")
    channel_map_is(order[9])


def _check_panels(tab: Tab, image: Image.Image, inputs: torch.Tensor, class_id: int) -> None:
    """Two panels side by side: the current Score-CAM map at features.6, and the pinned
    Grad-CAM one at the default layer."""
    model = load_model()
    label = tab.page.inner_text("#camviz-panels")
    assert "left to right: scorecam @ features.6 | gradcam @ features" in label
    views = [("scorecam", "features.6"), ("gradcam", TARGET_LAYER)]
    expected = [
        np.asarray(
            camviz.overlay(image, camviz.explain(model, inputs, m, at, class_id).heatmaps[0])
        )
        for m, at in views
    ]
    shown = tab.pictures("camviz-panels")
    assert len(shown) == 2 and all(map(np.array_equal, shown, expected))


def _check_restyle(tab: Tab, image: Image.Image, heatmap: torch.Tensor) -> None:
    """Another colour map and opacity redraw the overlay as ``camviz.overlay`` does."""
    tab.redrawn(lambda: tab.choose("camviz-colormap", "viridis"), "camviz-overlay")
    alpha = "#camviz-alpha input[type=number]"
    tab.redrawn(
        lambda: (tab.page.fill(alpha, "0.3"), tab.page.press(alpha, "Tab")), "camviz-overlay"
    )
    expected = np.asarray(camviz.overlay(image, heatmap, 0.3, "viridis"))
    assert np.array_equal(tab.picture("camviz-overlay"), expected)


@pytest.mark.browser
def test_the_page_shows_and_exports_what_camviz_explain_gives(
    browser, classifier_server, second_tab, outbound, cat_path
):
    model = load_model()
    image = load_image(cat_path)
    inputs = RAW(image).unsqueeze(0)
    second = int(model(inputs)[0].topk(2).indices[1])
    assert urlparse(classifier_server.url).hostname == "127.0.0.1"
    assert _listening_addresses(classifier_server.port) == {"127.0.0.1"}

    other = second_tab  # a class typed with completion; it keeps its own state
    completed = other.offered("camviz-class", "tri")
    assert completed == ["triangle"]
    typed = other.after(lambda: other.pick("camviz-class", completed, "triangle"), "explained")
    assert typed.startswith("explained triangle (")
    method, layer = _shown_by(typed)
    heatmap = camviz.explain(model, inputs, method, layer, CLASSES.index("triangle")).heatmaps
    typed_overlay = np.asarray(camviz.overlay(image, heatmap[0]))
    assert np.array_equal(other.picture("camviz-overlay"), typed_overlay)

    tab = Tab(browser, classifier_server.url)
    line = tab.after(lambda: tab.upload(cat_path), "chelsea.png:")
    assert line.startswith("chelsea.png: explained ") and "by gradcam @ features" in line
    radios = tab.page.locator("#camviz-candidates input[type=radio]")
    assert CLASSES[second] in tab.after(lambda: radios.nth(1).check(), "explained")
    assert tab.after(lambda: tab.page.click("#camviz-pin"), "pinned").startswith("pinned ")

    methods = tab.offered("camviz-method")
    assert methods == names(model)  # every method registered for this model
    line = tab.after(lambda: tab.pick("camviz-method", methods, "scorecam"), "explained")
    assert line.startswith(f"explained {CLASSES[second]} (") and "by scorecam @ features in" in line
    options = tab.page.input_value("#camviz-options textarea")
    assert options == camviz.explorer.session.format_options("scorecam")
    _check_channels(tab, image, inputs, second)

    layers = tab.offered("camviz-layer")
    assert layers == _layer_tree(model, inputs)
    pick = lambda: tab.pick("camviz-layer", layers, "features.6")  # noqa: E731
    line = tab.after(pick, "of features.6", "camviz-channel-info")
    assert "scorecam @ features.6 in" in tab.status()
    _check_panels(tab, image, inputs, second)
    expected = camviz.explain(model, inputs, "scorecam", "features.6", second)
    measure = lambda: tab.page.click("#camviz-measure")  # noqa: E731
    line = tab.after(measure, "deletion AUC", "camviz-faithfulness")
    deletion = camviz.metrics.deletion(model, inputs, expected.heatmaps, second, steps=20)
    insertion = camviz.metrics.insertion(model, inputs, expected.heatmaps, second, steps=20)
    assert line.startswith(f"deletion AUC {float(deletion.auc[0]):.3f} (lower is better), ")
    assert f"insertion AUC {float(insertion.auc[0]):.3f} (higher is better)" in line

    exported = tab.exported()
    maps = _maps(exported)
    assert float(np.abs(maps["heatmaps"] - expected.heatmaps.numpy()).max()) <= 1e-6
    assert maps["targets"].tolist() == [second] and str(maps["method"]) == "scorecam"
    overlaid = np.asarray(camviz.overlay(image, torch.from_numpy(maps["heatmaps"][0])))
    assert np.array_equal(tab.picture("camviz-overlay"), overlaid)
    report = exported["report.html"].decode()
    assert "scorecam @ features.6" in report and "gradcam @ features" in report
    assert "http://" not in report and "https://" not in report
    _check_restyle(tab, image, torch.from_numpy(maps["heatmaps"][0]))

    assert other.status() == typed  # the other tab is where it was
    assert np.array_equal(other.picture("camviz-overlay"), typed_overlay)
    tab.close()
    assert outbound == []  # nor did the server connect anywhere


def test_block_false_shows_the_page_inline_in_a_notebook(classifier_server, shown_inline):
    (shown,) = shown_inline
    assert f'<iframe src="{classifier_server.url}"' in shown.data


@pytest.mark.browser
def test_a_slow_method_shows_its_progress_and_is_cancelled_from_the_page(second_tab, classifier):
    tab = second_tab
    if tab.page.input_value("#camviz-method input") != "scorecam":
        tab.after(lambda: tab.choose("camviz-method", "scorecam"), "explained")
    layer = _shown_by(tab.status())[1]
    before = tab.picture("camviz-overlay")
    released, passes = threading.Event(), itertools.count()

    def held(module: nn.Module, args: object, output: object) -> None:
        if next(passes) >= 2:  # from the third pass on, until the page has cancelled
            released.wait(WAIT_MS / 1000)

    holding = classifier.model.register_forward_hook(held)
    try:
        tab.page.fill("#camviz-options textarea", "batch_size = 1")
        started = tab.line()
        tab.page.click("#camviz-apply")
        progress = f"scorecam at {layer}: "
        tab.page.wait_for_function(
            "(text) => document.querySelector('#camviz-overlay').innerText.includes(text)",
            arg=progress,
            timeout=WAIT_MS,
        )
        text = tab.page.inner_text("#camviz-overlay")
        assert re.search(rf"{re.escape(progress)}\d+/\d+ copies", text), text
        with tab.page.expect_response(lambda response: response.request.method == "POST"):
            tab.page.click("#camviz-cancel")
        released.set()
        line = tab.answer(started, "cancelled")
    finally:
        released.set()
        holding.remove()
    assert (
        line == f"camviz: error: cancelled scorecam at {layer}; the map shown is the previous one"
    )
    assert np.array_equal(tab.picture("camviz-overlay"), before)


def _too_many_pixels(path: Path) -> Path:
    """A PNG whose header says 9000 x 9000 pixels (81 megapixels), with no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", 9000, 9000, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")
    )
    return path


@pytest.mark.browser
def test_a_bad_upload_is_one_line_in_the_page_and_the_next_request_works(second_tab, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    tab = second_tab
    line = tab.after(lambda: tab.upload(broken), "error")
    assert re.fullmatch(r"camviz: error: broken\.png is not an image Pillow can read; .*", line)
    assert "\n" not in line and str(tmp_path) not in line
    huge = _too_many_pixels(tmp_path / "huge.png")
    line = tab.after(lambda: tab.upload(huge), "error")
    assert re.fullmatch(r"camviz: error: huge\.png is 9000x9000 \(81\.0 megapixels\), .*", line)
    fourth = tab.page.locator("#camviz-candidates input[type=radio]").nth(3)
    assert tab.after(fourth.check, "explained").startswith("explained ")


@pytest.mark.browser
def test_no_path_the_client_sends_is_opened(classifier_server, classifier, monkeypatch):
    import camviz.explorer.callbacks as callbacks
    from camviz.explorer.framework import gradio
    from camviz.explorer.session import Session
    from camviz.explorer.subject import Subject

    opened: list[str] = []
    reading = callbacks.load_image
    monkeypatch.setattr(callbacks, "load_image", lambda path: opened.append(path) or reading(path))
    forged = {"path": "/etc/hostname", "meta": {"_type": "gradio.FileData"}}
    call = urllib.request.Request(
        f"{classifier_server.url}gradio_api/call/upload",
        data=json.dumps({"data": [None, forged]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(call, timeout=30) as response:
        event = json.load(response)["event_id"]
    answer = f"{classifier_server.url}gradio_api/call/upload/{event}"
    with urllib.request.urlopen(answer, timeout=30) as response:
        assert response.read().decode().startswith("event: error")  # refused by Gradio
    # ...and by the handler itself, whatever Gradio lets through.
    widgets = callbacks.Widgets(*(object() for _ in fields(callbacks.Widgets)))
    handlers = callbacks.Handlers(gradio(), Subject(classifier), {}, widgets, Path("."))
    line = handlers.upload(Session(handlers.subject), "/etc/hostname")[widgets.status]
    assert "camviz: error: that file was not uploaded through the page" in line
    assert opened == []


# --- a detector and a segmenter -------------------------------------------------------------


class SceneSegmenter(nn.Module):
    """The shipped synthetic detector's cells read as a class map: each 8-pixel cell's class
    logits beside a background logit of 0 (so a class wins where its probability passes
    one half), repeated over the cell's pixels: ``(N, 1 + classes, H, W)``."""

    def __init__(self) -> None:
        super().__init__()
        self.detector = load_detector()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.detector.cells(images)[:, 4:]
        background = torch.zeros_like(logits[:, :1])
        return F.interpolate(torch.cat([background, logits], dim=1), scale_factor=8.0)


@pytest.fixture(scope="module")
def scene(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scene") / "scene.png"
    save_image(make_scenes(1, seed=1).images[0], path)
    return path


@pytest.mark.browser
def test_clicking_a_box_of_the_detector_and_a_region_of_a_segmenter(browser, scene):
    image = load_image(scene)
    inputs = RAW(image).unsqueeze(0)
    detector = LoadedModel(load_detector().eval(), RAW, list(CLASSES), "detector", TARGET_LAYER)
    adapter = camviz.DenseDetections()
    found = adapter(detector.model(inputs))[0]
    box, label = found["boxes"][1].tolist(), CLASSES[int(found["labels"][1])]
    with camviz.app(detector, [scene], port=0, block=False) as server:
        tab = Tab(browser, server.url)
        centre = ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)
        line = tab.after(lambda: tab.click_pixel("camviz-picture", *centre), "explained")
        assert line.startswith(f"explained {label} (")
        target = camviz.Detection(1, adapter=adapter)
        expected = camviz.explain(detector.model, inputs, "gradcam", TARGET_LAYER, target)
        drawn = camviz.overlay(image, expected.heatmaps[0])  # the scene is shown as it is
        camviz.render.draw_box(drawn, box, f"{label} ({float(found['scores'][1]):.2f})")
        assert np.array_equal(tab.picture("camviz-overlay"), np.asarray(drawn))
        tab.close()

    segmenter = LoadedModel(
        SceneSegmenter().eval(),
        RAW,
        list(SEGMENTATION_CLASSES),
        "segmenter",
        "detector.features",
        task="segmentation",
    )
    predicted = segmenter.model(inputs).argmax(dim=1)[0]
    row, col = (predicted == predicted.max()).nonzero()[0].tolist()
    region = camviz.Region(int(predicted[row, col]), predicted == predicted[row, col])
    with camviz.app(segmenter, [scene], port=0, block=False) as server:
        tab = Tab(browser, server.url)
        # The largest region comes first: the background, whose logit is a constant here.
        assert tab.status().startswith("scene: explained background (")
        assert "; warning: gradcam: 1 of 1 maps are all zero" in tab.status()
        name = SEGMENTATION_CLASSES[region.class_id]
        line = tab.after(lambda: tab.click_pixel("camviz-picture", col, row), "explained")
        assert line.startswith(f"explained {name} (")
        expected = camviz.explain(segmenter.model, inputs, "gradcam", "detector.features", region)
        assert float(expected.heatmaps.max()) == 1.0 and "warning" not in line
        drawn = camviz.overlay(image, expected.heatmaps[0])
        assert np.array_equal(tab.picture("camviz-overlay"), np.asarray(drawn))
        tab.close()


# --- the command line -----------------------------------------------------------------------


@pytest.mark.browser
def test_camviz_app_serves_its_model_on_127_0_0_1_only(
    browser, outbound, monkeypatch, cat_path, tiny_checkpoint, tmp_path
):
    from camviz.cli import main
    from camviz.explorer.server import AppServer

    photos = tmp_path / "photos"  # a folder of images, offered by name
    photos.mkdir()
    shutil.copy(cat_path, photos / "chelsea.png")
    served: list[AppServer] = []
    monkeypatch.setattr(AppServer, "wait", lambda server: served.append(server))
    args = ["app", str(photos), "--model", "resnet18", "--weights", tiny_checkpoint]
    args += ["--input-size", "64"]  # small maps: fast
    assert main([*args, "--port", "0"]) == 0
    (server,) = served
    try:
        assert _listening_addresses(server.port) == {"127.0.0.1"}
        tab = Tab(browser, server.url)
        assert tab.status().startswith("chelsea: explained ")
        radios = tab.page.locator("#camviz-candidates input[type=radio]")
        line = tab.after(lambda: radios.nth(1).check(), "explained")
        class_id = int(re.fullmatch(r"explained class (\d+) \(.*", line)[1])
        tab.after(lambda: tab.choose("camviz-method", "layercam"), "explained")
        line = tab.after(lambda: tab.choose("camviz-layer", "layer3"), "explained")
        assert " by layercam @ layer3 in " in line
        shown = tab.picture("camviz-overlay")
        tab.close()
    finally:
        server.close()
    loaded = camviz.load_model("resnet18", weights=tiny_checkpoint, input_size=64)
    image = load_image(cat_path)
    inputs = loaded.preprocess(image).unsqueeze(0)
    expected = camviz.explain(loaded.model, inputs, "layercam", "layer3", class_id)
    assert np.array_equal(shown, np.asarray(camviz.overlay(image, expected.heatmaps[0])))
    assert outbound == []


def test_a_cancel_stops_a_perturbation_method_between_passes(classifier, untouched, cat_path):
    from camviz.explorer.progress import CancelledError
    from camviz.explorer.session import Session
    from camviz.explorer.subject import Subject

    session = Session(Subject(classifier))
    session.open(load_image(cat_path), "chelsea")
    shown = session.show(session.with_settings()).explained  # Grad-CAM, the first view
    reports: list[float] = []

    def report(fraction: float, text: str) -> None:
        reports.append(fraction)
        if len(reports) == 3:
            session.cancel.set()

    settings = session.with_settings(method="scorecam", options=(("batch_size", 2),))
    with untouched(classifier.model), pytest.raises(CancelledError, match=r"^cancelled scorecam"):
        session.show(settings, report)
    assert len(reports) == 3 and session.explained is shown  # the view stays as it was

    passes = []
    counting = classifier.model.register_forward_hook(lambda *_: passes.append(1))
    try:
        full: list[float] = []
        session.show(settings, lambda fraction, text: full.append(fraction))
    finally:
        counting.remove()
    # One report per pass, rising to 1 when the 32 channels' copies (2 a pass) are done.
    assert len(full) == len(passes) > 16 and full == sorted(full) and full[-1] == 1.0
    assert full[-2] < 1.0 and session.explained is not shown


def test_two_tabs_take_turns_with_one_model(classifier, cat_path):
    from camviz.explorer.session import Session
    from camviz.explorer.subject import Subject

    subject = Subject(classifier)
    tabs = [Session(subject), Session(subject)]
    for tab in tabs:
        tab.open(load_image(cat_path), "chelsea")
    settings = tabs[0].with_settings(method="scorecam", options=(("batch_size", 4),))
    alone: list[float] = []
    tabs[0].show(settings, lambda fraction, text: alone.append(fraction))
    running, most, guard = 0, 0, threading.Lock()

    def entering(module: nn.Module, args: object) -> None:
        nonlocal running, most
        with guard:
            running += 1
            most = max(most, running)
        time.sleep(0.002)  # a chance for the other tab's pass to start meanwhile

    def leaving(module: nn.Module, args: object, output: object) -> None:
        nonlocal running
        with guard:
            running -= 1

    reports: list[list[float]] = [[], []]
    threads = [
        threading.Thread(target=tab.show, args=(settings, lambda f, t, n=n: reports[n].append(f)))
        for n, tab in enumerate(tabs)
    ]
    model = classifier.model
    with model.register_forward_pre_hook(entering), model.register_forward_hook(leaving):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert most == 1  # one pass at a time
    assert reports == [alone, alone]  # each tab's progress counts its own passes only
    assert all(tab.explained is not None for tab in tabs)


def test_without_gradio_the_command_says_what_to_install(monkeypatch, capsys):
    from camviz.cli import main

    monkeypatch.setitem(__import__("sys").modules, "gradio", None)
    assert main(["app"]) == 1
    assert capsys.readouterr().err == (
        'camviz: error: the explorer needs Gradio; install it with pip install "camviz[app]"\n'
    )


def test_options_are_read_as_the_method_takes_them():
    from camviz.core.errors import CamvizError
    from camviz.explorer.session import format_options, parse_options

    assert format_options("scorecam") == (
        "batch_size = None\nweighting = softmax\nmemory_budget = None\neigen_smooth = False\n"
        "compile_rest = False"
    )
    text = "batch_size = 8\nweighting = softmax\nmemory_budget = 512MiB, eigen_smooth = true"
    assert parse_options("scorecam", text) == (
        ("batch_size", 8),
        ("memory_budget", "512MiB"),
        ("eigen_smooth", True),
    )
    with pytest.raises(CamvizError, match="scorecam has no option 'size'; it takes batch_size"):
        parse_options("scorecam", "size = 3")


def test_another_host_than_this_machine_is_warned_about(gradio, classifier, monkeypatch, capsys):
    import camviz.explorer.page as page

    class StopError(Exception):
        """Raised where the page would be built: nothing listens in this test."""

    def stop(*args: object) -> None:
        raise StopError

    monkeypatch.setattr(page, "build", stop)
    with pytest.raises(StopError):
        camviz.app(classifier, host="0.0.0.0", port=0, block=False)
    assert capsys.readouterr().err == (
        "camviz: warning: the explorer listens on 0.0.0.0: anyone who can reach this address "
        "can run the model and upload images\n"
    )
    with pytest.raises(StopError):
        camviz.app(classifier, port=0, block=False)
    assert capsys.readouterr().err == ""


def test_a_port_in_use_is_one_line(gradio, classifier, monkeypatch):
    import gradio as gr

    import camviz.explorer.page as page
    from camviz.core.errors import CamvizError

    def empty(*args: object) -> Any:  # what is served is no matter here
        with gr.Blocks() as blocks:
            gr.Markdown("")
        return blocks

    monkeypatch.setattr(page, "build", empty)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CamvizError, match=rf"^cannot listen on 127\.0\.0\.1:{port} \("):
            camviz.app(classifier, port=port, block=False)
