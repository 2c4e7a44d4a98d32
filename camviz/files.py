"""Explain image files and write the results to a folder: the job behind ``camviz explain``.

For every image: an overlay at the photo's own size, a panel (image | heatmap | overlay with
the class name and score), and one entry in ``manifest.json`` listing the files written, the
top-5 predictions and the explained class(es).

Everything that can be checked is checked before anything is written: every image is read,
the model is loaded, the layer and target are resolved on the first image, and the output
folder is created and tested. Each file is then written atomically, the manifest last, so a
failed run leaves no half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from camviz.cams.engine import Explanation, explain
from camviz.errors import CamvizError
from camviz.images import load_image
from camviz.models import LoadedModel
from camviz.render import atomic_write, overlay, panel, save
from camviz.targets import Target, as_logits

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class RenderOptions:
    """How heatmaps are drawn: blend weight of the heatmap and matplotlib colour map."""

    alpha: float = 0.5
    colormap: str = "jet"


def explain_files(
    paths: Sequence[str | Path],
    out_dir: str | Path,
    loaded: LoadedModel,
    *,
    method: str = "gradcam",
    layer: str | Sequence[str] | None = None,
    target: Target = None,
    render: RenderOptions = RenderOptions(),
) -> dict[str, Any]:
    """Explain each image file with ``loaded.model`` and write overlays, panels and a manifest.

    Args:
        paths: Image files.
        out_dir: Folder for the results; created if missing.
        loaded: A model from :func:`camviz.models.load` (model, preprocessing, class names).
        method: A CAM method name (``camviz methods`` lists them).
        layer: Target layer name(s); ``None`` uses the model's known default or finds one.
        target: What to explain (class id, ``"top1"``, ``"top3"``, ...).
        render: Colour map and blend weight of the overlays.

    Returns:
        The manifest, as written to ``out_dir/manifest.json``.
    """
    if not paths:
        raise CamvizError("no image given; pass one or more image files")
    images = [load_image(path) for path in paths]
    out = Path(out_dir)
    _check_out_dir(out)
    layer = layer if layer is not None else loaded.default_layer
    results = [
        explain(loaded.model, loaded.preprocess(image), method, layer, target) for image in images
    ]
    _make_out_dir(out)
    entries = [
        _write_image_results(out, Path(path), image, result, loaded, render, stem)
        for path, image, result, stem in zip(
            paths, images, results, _unique_stems(paths), strict=True
        )
    ]
    manifest = {
        "model": loaded.name,
        "method": results[0].method,
        "layers": results[0].layers,
        "target": target if isinstance(target, (int, str, type(None))) else repr(target),
        "images": entries,
    }
    with atomic_write(out / MANIFEST, "w") as file:
        file.write(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _write_image_results(
    out: Path,
    path: Path,
    image: Any,
    result: Explanation,
    loaded: LoadedModel,
    render: RenderOptions,
    stem: str,
) -> dict[str, Any]:
    probabilities = as_logits(result.output).softmax(-1)[0]
    top = probabilities.topk(min(5, probabilities.numel()))
    explained = []
    for rank, (class_id, score) in enumerate(zip(result.targets, result.scores, strict=True)):
        suffix = "" if len(result.targets) == 1 else f"_rank{rank + 1}"
        name = _class_name(loaded, int(class_id))
        heatmap = result.heatmaps[rank]
        probability = float(probabilities[class_id]) if class_id >= 0 else None
        shown = f"p={probability:.2f}" if probability is not None else f"score {float(score):.2f}"
        title = f"{name}: {shown} ({result.method}, layer {', '.join(result.layers)})"
        files = {
            "overlay": f"{stem}{suffix}_overlay.png",
            "panel": f"{stem}{suffix}_panel.png",
        }
        save(
            overlay(image, heatmap, alpha=render.alpha, colormap=render.colormap),
            out / files["overlay"],
        )
        save(
            panel(image, heatmap, title=title, alpha=render.alpha, colormap=render.colormap),
            out / files["panel"],
        )
        explained.append(
            {
                "id": int(class_id),
                "name": name,
                "score": float(score),
                "probability": probability,
                "files": files,
            }
        )
    return {
        "input": str(path),
        "size": list(image.size),
        "top5": [
            {"id": int(i), "name": _class_name(loaded, int(i)), "probability": float(p)}
            for p, i in zip(top.values, top.indices, strict=True)
        ],
        "explained": explained,
        "files": [name for entry in explained for name in entry["files"].values()],
    }


def _class_name(loaded: LoadedModel, class_id: int) -> str:
    if 0 <= class_id < len(loaded.categories):
        return loaded.categories[class_id]
    return "custom target" if class_id < 0 else f"class {class_id}"


def _unique_stems(paths: Sequence[str | Path]) -> list[str]:
    """File stems, with ``-2``, ``-3`` added where two inputs share one."""
    seen: dict[str, int] = {}
    stems = []
    for path in paths:
        stem = Path(path).stem
        seen[stem] = seen.get(stem, 0) + 1
        stems.append(stem if seen[stem] == 1 else f"{stem}-{seen[stem]}")
    return stems


def _check_out_dir(out: Path) -> None:
    """Fail early, before any work, if ``out`` cannot become a folder we write into."""
    existing = next(folder for folder in (out, *out.parents) if folder.exists())
    if not existing.is_dir():
        raise CamvizError(
            f"cannot use {str(out)!r} as the output folder: {str(existing)!r} is a file; "
            "pass --out a folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CamvizError(f"output folder {str(out)!r} is not writable; pass --out another folder")


def _make_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise CamvizError(
            f"cannot write to output folder {str(out)!r} ({reason}); pass --out a writable folder"
        ) from None
