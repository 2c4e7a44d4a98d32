"""Every registered CAM method against pytorch-grad-cam and torchcam: time, memory, agreement.

Run by hand (never in the tests)::

    python benchmarks/bench_methods.py              # the table of the README (minutes)
    python benchmarks/bench_methods.py --quick      # small models and inputs: a smoke run
    python benchmarks/bench_methods.py --threads 1  # on a machine that others share too

Three set-ups, each with the same model, target layer, batch and classes for every library:

* ``gradient``: every method but the perturbation ones, on a random-weight ResNet-50
  (``layer4``, 8 images), against plain inference under ``torch.inference_mode``;
* ``perturbation``: Score-CAM, SS-CAM and Ablation-CAM on a random-weight ResNet-18
  (``layer4``, one image), each library with its default batching (see ``OPTIONS``);
* ``offline``: Ablation-CAM on the shipped EfficientNet-Lite0 (``bn2``) and the cat photo.

Each (method, library) runs in a fresh process: one run measures the peak extra memory (the
peak resident set size, Linux ``VmHWM`` reset after set-up, minus the resident size after
set-up, so the model and the batch are not counted) and the time is the median of
``--repeat`` further runs (runs longer than 3 s are timed once). The maps are then compared
in the parent: the largest absolute difference between min-max normalised maps, at the
input's resolution for pytorch-grad-cam and at the layer's for torchcam (which returns those).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from bench_gradcam import _status_kib

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ("camviz", "pytorch-grad-cam", "torchcam")
PERTURBATION = ("scorecam", "sscam", "ablationcam")

# camviz method -> the class name in pytorch-grad-cam and in torchcam.methods (None: none).
PEERS = {
    "gradcam": ("GradCAM", "GradCAM"),
    "gradcam++": ("GradCAMPlusPlus", "GradCAMpp"),
    "smooth_gradcam++": (None, "SmoothGradCAMpp"),
    "xgradcam": ("XGradCAM", "XGradCAM"),
    "layercam": ("LayerCAM", "LayerCAM"),
    "hirescam": ("HiResCAM", None),
    "gradcam_elementwise": ("GradCAMElementWise", None),
    "eigencam": ("EigenCAM", None),
    "eigen_gradcam": ("EigenGradCAM", None),
    "fullgrad": ("FullGrad", None),
    "scorecam": ("ScoreCAM", "ScoreCAM"),
    "sscam": (None, "SSCAM"),
    "ablationcam": ("AblationCAM", None),
}


@dataclass
class Setup:
    """One model, layer, batch and set of classes that every library explains."""

    name: str
    model: str
    layer: str
    batch: int
    size: int
    methods: list[str]
    options: dict[str, dict] = field(default_factory=dict)


# camviz options, given to the peers too (torchcam's names below). SS-CAM's 35 draws would
# cost 35 Score-CAMs; 2 draws show the cost per draw. Smooth Grad-CAM++ averages 4 noisy
# passes. Every library keeps its default chunking of perturbed passes, which changes the
# speed but not the maps: Score-CAM and SS-CAM batches of 6 images at 224 px in camviz on a
# CPU, 16 in pytorch-grad-cam, 32 in torchcam; Ablation-CAM chunks of 128 MiB of ablated
# copies in camviz, 32 copies in pytorch-grad-cam.
OPTIONS = {
    "sscam": {"num_samples": 2, "std": 0.5},
    "smooth_gradcam++": {"samples": 4},
}
TORCHCAM_NAMES = {"num_samples": "num_samples", "std": "std", "samples": "num_samples"}


def setups(quick: bool, methods: list[str]) -> list[Setup]:
    gradient = [name for name in methods if name not in PERTURBATION]
    perturbation = [name for name in methods if name in PERTURBATION]
    offline = [name for name in methods if name == "ablationcam"]
    if quick:
        return [
            Setup("gradient", "resnet18", "layer4", 2, 64, gradient, OPTIONS),
            Setup("perturbation", "resnet18", "layer4", 1, 64, perturbation, OPTIONS),
            Setup("offline", "efficientnet_lite0", "bn2", 1, 96, offline, OPTIONS),
        ]
    return [
        Setup("gradient", "resnet50", "layer4", 8, 224, gradient, OPTIONS),
        Setup("perturbation", "resnet18", "layer4", 1, 224, perturbation, OPTIONS),
        Setup("offline", "efficientnet_lite0", "bn2", 1, 224, offline, OPTIONS),
    ]


def build(setup: Setup) -> tuple[torch.nn.Module, torch.Tensor, list[int]]:
    """The model, the input batch and the explained class of each sample."""
    torch.manual_seed(0)
    if setup.model == "efficientnet_lite0":
        from PIL import Image

        from camviz.io.models import load

        loaded = load(setup.model)
        inputs = loaded.preprocess(Image.open(ROOT / "assets" / "chelsea.png").convert("RGB"))
        height, width = inputs.shape[-2:]
        size = (setup.size, round(width * setup.size / height))
        inputs = torch.nn.functional.interpolate(inputs[None], size=size, mode="bilinear")
        model = loaded.model.eval()
        with torch.inference_mode():
            classes = model(inputs).argmax(1).tolist()
        return model, inputs, classes
    import torchvision

    model = torchvision.models.get_model(setup.model, weights=None).eval()
    inputs = torch.randn(setup.batch, 3, setup.size, setup.size)
    return model, inputs, [7 * index % 1000 for index in range(setup.batch)]


def runner(setup: Setup, method: str, library: str) -> Callable[[], dict[str, torch.Tensor]]:
    """A function that explains the batch once with ``library``'s ``method``."""
    model, inputs, classes = build(setup)
    options = setup.options.get(method, {})
    module = dict(model.named_modules())[setup.layer]
    if method == "inference":

        def run() -> dict[str, torch.Tensor]:
            with torch.inference_mode():
                model(inputs)
            return {}

    elif library == "camviz":
        import camviz

        def run() -> dict[str, torch.Tensor]:
            result = camviz.explain(model, inputs, method, setup.layer, classes, **options)
            return {"input": result.heatmaps, "layer": result.layer_maps}

    elif library == "pytorch-grad-cam":
        import pytorch_grad_cam
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        cls = getattr(pytorch_grad_cam, PEERS[method][0])
        cam = cls(model=model, target_layers=[module])
        targets = [ClassifierOutputTarget(c) for c in classes]

        def run() -> dict[str, torch.Tensor]:
            return {"input": torch.from_numpy(cam(inputs, targets=targets))}

    else:
        import torchcam.methods

        cls = getattr(torchcam.methods, PEERS[method][1])
        extra = {TORCHCAM_NAMES[key]: value for key, value in options.items()}
        shape = tuple(inputs.shape[1:])

        def run() -> dict[str, torch.Tensor]:
            with cls(model, setup.layer, input_shape=shape, **extra) as extractor:
                scores = model(inputs)
                (maps,) = extractor(classes, scores)
            return {"layer": maps.detach()}

    return run


def child(setup: Setup, method: str, library: str, repeat: int, maps_path: str) -> None:
    """In a fresh process: print time and peak extra memory, save the maps to ``maps_path``."""
    run = runner(setup, method, library)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = _status_kib("VmRSS")
    start = time.perf_counter()
    maps = run()
    first = time.perf_counter() - start
    extra_mib = (_status_kib("VmHWM") - baseline) / 1024
    samples = [first]
    if first < 3:
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
    torch.save(maps, maps_path)
    print(json.dumps({"seconds": statistics.median(samples), "extra_mib": extra_mib}))


def measure(setup: Setup, method: str, library: str, repeat: int, folder: Path) -> dict:
    maps_path = folder / f"{setup.name}-{method}-{library}.pt"
    request = {"setup": setup.__dict__, "method": method, "library": library}
    command = [sys.executable, __file__, "--child", json.dumps(request), "--repeat", str(repeat)]
    command += ["--maps", str(maps_path), "--threads", str(torch.get_num_threads())]
    finished = subprocess.run(command, capture_output=True, text=True)
    if finished.returncode != 0:
        return {"error": finished.stderr.strip().splitlines()[-1][:80]}
    result = json.loads(finished.stdout.strip().splitlines()[-1])
    result["maps"] = torch.load(maps_path)
    return result


def min_max(maps: torch.Tensor) -> torch.Tensor:
    maps = maps.float()
    low = maps.flatten(1).amin(1).view(-1, 1, 1)
    span = maps.flatten(1).amax(1).view(-1, 1, 1) - low
    return torch.where(span > 0, (maps - low) / span.clamp_min(1e-12), 0)


def difference(ours: dict, theirs: dict) -> str:
    """Largest absolute difference of normalised maps, at the resolution the peer gives."""
    key = "input" if "input" in theirs["maps"] else "layer"
    mine, peer = ours["maps"][key], theirs["maps"][key]
    if mine.shape != peer.shape:
        return f"shape {tuple(peer.shape)}"
    return f"{(min_max(mine) - min_max(peer)).abs().max():.1e}"


def cell(result: dict | None) -> str:
    if result is None:
        return "—"
    if "error" in result:
        return f"error: {result['error']}"
    return f"{format_seconds(result['seconds'])}, {result['extra_mib']:.0f} MiB"


def format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def table(setup: Setup, repeat: int, folder: Path) -> list[str]:
    inference = measure(setup, "inference", "camviz", repeat, folder)
    lines = [
        f"\n**{setup.name}**: {setup.model}, layer `{setup.layer}`, batch {setup.batch}, "
        f"{setup.size} px high. Plain inference: {cell(inference)}.\n",
        "| method | camviz (time, peak extra memory) | vs inference | pytorch-grad-cam "
        "| torchcam | speed-up over the fastest peer | max diff vs pytorch-grad-cam "
        "| max diff vs torchcam |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method in setup.methods:
        ours = measure(setup, method, "camviz", repeat, folder)
        peers = {}
        for library, peer_class in zip(LIBRARIES[1:], PEERS.get(method, (None, None)), strict=True):
            if peer_class is not None:
                peers[library] = measure(setup, method, library, repeat, folder)
        timed = [peer["seconds"] for peer in peers.values() if "seconds" in peer]
        speed = "—"
        if timed and "seconds" in ours:
            speed = f"{min(timed) / ours['seconds']:.2f}x"
        ratio = "—"
        if "seconds" in ours:
            ratio = f"{ours['seconds'] / inference['seconds']:.2f}x"
        diffs = []
        for library in LIBRARIES[1:]:
            peer = peers.get(library)
            ok = peer is not None and "maps" in peer and "maps" in ours
            diffs.append(difference(ours, peer) if ok else "—")
        lines.append(
            f"| `{method}` | {cell(ours)} | {ratio} "
            f"| {cell(peers.get('pytorch-grad-cam'))} "
            f"| {cell(peers.get('torchcam'))} | {speed} | {diffs[0]} | {diffs[1]} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's); 1 on a busy machine"
    )
    parser.add_argument("--quick", action="store_true", help="small models and inputs")
    parser.add_argument("--methods", nargs="*", help="only these registry names")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--maps", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        request = json.loads(args.child)
        setup = Setup(**request["setup"])
        child(setup, request["method"], request["library"], args.repeat, args.maps)
        return
    import camviz.cams

    methods = args.methods or camviz.cams.names()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        for setup in setups(args.quick, methods):
            if setup.methods:
                lines += table(setup, args.repeat, Path(folder))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
