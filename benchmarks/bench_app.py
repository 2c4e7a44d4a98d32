"""How fast the explorer shows a new map, against ``camviz.explain`` alone.

Run by hand (never in the tests); it needs ``camviz[app]``, Playwright and Chromium::

    python benchmarks/bench_app.py                        # Lite0 on the cat photo
    python benchmarks/bench_app.py --methods gradcam,scorecam --layer blocks.6
    python benchmarks/bench_app.py --screenshot assets/app_screenshot.png

For each method, the page switches the explained class between the top two ``--repeat``
times (5 by default): the time from the click to the new status line in the browser (the
map and its overlay drawn, sent and shown), against the median of ``camviz.explain`` for the
same settings in this process. The issue's target: the page within 0.5 s of ``explain``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from PIL import Image

import camviz

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

# Clicks a radio of the candidates and resolves, in milliseconds, once the status line is
# a new one (each line the server sends carries a new number).
_CLICK_AND_TIME = """async (index) => {
    const line = () => document.querySelector('#camviz-status p').dataset.line;
    const before = line();
    const started = performance.now();
    document.querySelectorAll('#camviz-candidates input[type=radio]')[index].click();
    while (line() === before) await new Promise((done) => setTimeout(done, 5));
    return performance.now() - started;
}"""


def page_seconds(page: Any, repeat: int) -> list[float]:
    """Seconds from a click on a class to the new map, alternating the top two classes."""
    return [page.evaluate(_CLICK_AND_TIME, (n + 1) % 2) / 1000 for n in range(repeat)]


def explain_seconds(loaded: Any, method: str, layer: str | None, repeat: int) -> list[float]:
    model = loaded.model
    image = camviz.load_image(ROOT / "assets/chelsea.png")
    inputs = loaded.preprocess(image).unsqueeze(0)
    classes = model(inputs)[0].topk(2).indices.tolist()
    times = []
    for n in range(repeat + 1):  # the first is a warm-up
        started = time.perf_counter()
        camviz.explain(model, inputs, method, layer, classes[(n + 1) % 2])
        times.append(time.perf_counter() - started)
    return times[1:]


def choose(page: Any, widget: str, label: str) -> None:
    """Pick the option of a dropdown whose label is (or, for a layer, starts with) ``label``."""
    page.click(f"#{widget} input")
    options = page.locator(f"#{widget} ul.option-list li")
    labels = options.evaluate_all("items => items.map(i => (i.ariaLabel || '').trim())")
    index = next(i for i, text in enumerate(labels) if text == label or text.startswith(label))
    before = page.evaluate("document.querySelector('#camviz-status p').dataset.line")
    options.nth(index).click()
    page.wait_for_function(
        "(before) => document.querySelector('#camviz-status p').dataset.line !== before",
        arg=before,
        timeout=600_000,
    )


def screenshot(page: Any, path: Path) -> None:
    """The page's top as a small PNG (a 256-colour palette)."""
    page.set_viewport_size({"width": 1280, "height": 760})
    shot = Image.open(io.BytesIO(page.screenshot()))
    shot = shot.convert("RGB").quantize(256)
    shot.save(path, optimize=True)
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a camviz.load_model name (Lite0)")
    parser.add_argument("--methods", default="gradcam,layercam")
    parser.add_argument("--layer", default=None, help="the layer (default: the model's)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--screenshot", type=Path, default=None, help="also write the page")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    loaded = camviz.load_model(args.model)
    server = camviz.app(loaded, [ROOT / "assets/chelsea.png"], port=0, block=False)
    rows = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS
            )
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(server.url)
            page.wait_for_selector("#camviz-status p", timeout=600_000)
            if args.layer is not None:
                choose(page, "camviz-layer", args.layer)
            for method in args.methods.split(","):
                if page.input_value("#camviz-method input") != method:
                    choose(page, "camviz-method", method)
                shown = statistics.median(page_seconds(page, args.repeat))
                layer = args.layer or loaded.default_layer
                alone = statistics.median(explain_seconds(loaded, method, layer, args.repeat))
                rows.append((method, alone, shown))
            if args.screenshot is not None:
                screenshot(page, args.screenshot)
            browser.close()
    finally:
        server.close()
    print(f"{'method':<16}{'explain s':>11}{'page s':>9}{'page - explain':>16}")
    for method, alone, shown in rows:
        print(f"{method:<16}{alone:>11.3f}{shown:>9.3f}{shown - alone:>16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
