"""The explorer (``camviz.app``), driven in Debian's headless Chromium by Playwright.

Every host but 127.0.0.1 is blocked and recorded: a page that asked for any other host
fails its test. The maps the page shows and exports are compared with ``camviz.explain``'s
(the ``.npz`` within 1e-6, the overlay pixel for pixel with ``camviz.overlay`` of it), the
channel view with ``camviz.features`` and the method's channel weights, and the
faithfulness line with ``camviz.metrics``. The tests skip when Chromium, Playwright or
Gradio is missing, unless ``CAMVIZ_REQUIRE_BROWSER=1`` (CI sets it).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import threading
import time
import urllib.request
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
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        _missing("chromium is not installed; install it with `apt-get install -y chromium`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing('the explorer tests need Playwright: pip install -e ".[test]"')
    with sync_playwright() as playwright:
        executable = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


class Tab:
    """A page of the explorer, with every request to another host than 127.0.0.1 aborted
    and remembered in :attr:`elsewhere`."""

    def __init__(self, browser: Any, url: str) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.elsewhere: list[str] = []
        self.page.route("**/*", self._route)
        self.after(lambda: self.page.goto(url), "")

    def _route(self, route: Any) -> None:
        if urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            self.elsewhere.append(route.request.url)
            route.abort()

    def status(self) -> str:
        return self.page.inner_text("#camviz-status p").strip()

    def _line(self, widget: str) -> str:
        """The number of the line a widget shows (each answer of the server has a new one)."""
        return self.page.evaluate(
            "(id) => { const p = document.querySelector(`#${id} p`); "
            "return p ? p.dataset.line : ''; }",
            widget,
        )

    def after(self, action: Callable[[], object], text: str, widget: str = "camviz-status") -> str:
        """Do ``action``, wait for the server's answer in ``widget`` (holding ``text``, or
        an error), and return that line."""
        before = self._line(widget)
        action()
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

    def choose(self, widget: str, label: str) -> None:
        """Open a dropdown and pick its option whose label is ``label`` (or, for a layer,
        starts with the layer's name)."""
        self.page.click(f"#{widget} input")
        options = self.page.locator(f"#{widget} ul.option-list li")
        by_label = options.filter(has=self.page.locator("xpath=self::*[@aria-label]"))
        matching = [
            i
            for i, text in enumerate(by_label.evaluate_all("items => items.map(i => i.ariaLabel)"))
            if text.strip() == label or text.strip().startswith(f"{label}  ")
        ]
        by_label.nth(matching[0]).click()

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
        source = self.page.locator(f"#{widget} img").get_attribute("src")
        return np.asarray(Image.open(io.BytesIO(self.fetch(source))).convert("RGB"))

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
        assert self.elsewhere == [], f"the page asked for other hosts: {self.elsewhere}"


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
def classifier_server(gradio, classifier, cat_path) -> Iterator[camviz.explorer.AppServer]:
    server = camviz.app(classifier, [cat_path], port=0, block=False)
    yield server
    server.close()


@pytest.fixture(scope="module")
def second_tab(browser, classifier_server) -> Iterator[Tab]:
    """Another tab on the classifier's server, for the tests that need one."""
    tab = Tab(browser, classifier_server.url)
    yield tab
    tab.close()


@pytest.mark.browser
def test_class_method_channels_layer_and_export_are_camviz_explain(
    browser, classifier_server, second_tab, classifier, cat_path
):
    model = classifier.model
    image = load_image(cat_path)
    inputs = RAW(image).unsqueeze(0)
    second = int(model(inputs)[0].topk(2).indices[1])
    assert urlparse(classifier_server.url).hostname == "127.0.0.1"
    assert _listening_addresses(classifier_server.port) == {"127.0.0.1"}

    tab = Tab(browser, classifier_server.url)
    other = second_tab  # it keeps its own state
    line = tab.after(lambda: tab.upload(cat_path), "chelsea.png:")
    assert line.startswith("chelsea.png: explained ") and "by gradcam @ features" in line
    radios = tab.page.locator("#camviz-candidates input[type=radio]")
    assert CLASSES[second] in tab.after(lambda: radios.nth(1).check(), "explained")
    third = other.page.locator("#camviz-candidates input[type=radio]").nth(2)
    elsewhere = other.after(third.check, "explained")

    line = tab.after(lambda: tab.choose("camviz-method", "scorecam"), "explained")
    assert line.startswith(f"explained {CLASSES[second]} (") and "by scorecam @ features in" in line
    weights = camviz.explain(model, inputs, "scorecam", TARGET_LAYER, second).weights
    strongest = int(weights[TARGET_LAYER][0].argmax())
    tab.page.click("#camviz-channel-view button.label-wrap")
    shown_channels = "#camviz-show-channels"
    line = tab.after(lambda: tab.page.click(shown_channels), "weight", "camviz-channel-info")
    assert "by scorecam weight" in line and f"channel {strongest} of features," in line
    activations = camviz.features(model, inputs, [TARGET_LAYER])[TARGET_LAYER]
    _, scaled = camviz.render.select_channels(activations, [strongest])
    shown = np.asarray(camviz.overlay(image, scaled[0]))
    assert np.array_equal(tab.picture("camviz-channel-map"), shown)

    line = tab.after(
        lambda: tab.choose("camviz-layer", "features.6"), "of features.6", "camviz-channel-info"
    )
    assert "scorecam @ features.6 in" in tab.status()
    expected = camviz.explain(model, inputs, "scorecam", "features.6", second)
    measure = lambda: tab.page.click("#camviz-measure")  # noqa: E731
    line = tab.after(measure, "deletion AUC", "camviz-faithfulness")
    deletion = camviz.metrics.deletion(model, inputs, expected.heatmaps, second, steps=20)
    assert line.startswith(f"deletion AUC {float(deletion.auc[0]):.3f} (lower is better)")

    exported = tab.exported()
    maps = _maps(exported)
    assert float(np.abs(maps["heatmaps"] - expected.heatmaps.numpy()).max()) <= 1e-6
    assert maps["targets"].tolist() == [second] and str(maps["method"]) == "scorecam"
    overlaid = np.asarray(camviz.overlay(image, torch.from_numpy(maps["heatmaps"][0])))
    assert np.array_equal(tab.picture("camviz-overlay"), overlaid)
    report = exported["report.html"].decode()
    assert "scorecam @ features.6" in report and "http://" not in report

    assert other.status() == elsewhere  # the other tab is where it was
    tab.close()


@pytest.mark.browser
def test_a_bad_upload_is_one_line_in_the_page_and_the_next_request_works(second_tab, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    tab = second_tab
    line = tab.after(lambda: tab.upload(broken), "error")
    assert re.fullmatch(r"camviz: error: broken\.png is not an image Pillow can read; .*", line)
    assert "\n" not in line and str(tmp_path) not in line
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
    gradio, monkeypatch, cat_path, tiny_checkpoint
):
    from camviz.cli import main
    from camviz.explorer.server import AppServer

    served: list[AppServer] = []
    monkeypatch.setattr(AppServer, "wait", lambda server: served.append(server))
    args = ["app", str(cat_path), "--model", "resnet18", "--weights", tiny_checkpoint]
    assert main([*args, "--port", "0"]) == 0
    (server,) = served
    try:
        assert _listening_addresses(server.port) == {"127.0.0.1"}
        with urllib.request.urlopen(f"{server.url}config", timeout=30) as response:
            assert json.load(response)["title"] == "camviz explorer - resnet18"
    finally:
        server.close()


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


def test_a_port_in_use_is_one_line(gradio, classifier):
    from camviz.core.errors import CamvizError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CamvizError, match=rf"^cannot listen on 127\.0\.0\.1:{port} \("):
            camviz.app(classifier, port=port, block=False)
