"""``camviz explain``: heatmap overlays, panels and a manifest for images, folders and videos."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from camviz.cli.options import (
    add_compile_option,
    add_layout_option,
    add_memory_budget_option,
    add_model_options,
    add_precision_options,
    worker_count,
)
from camviz.cli.text import echo

if TYPE_CHECKING:
    from camviz.core.targets import Unit
    from camviz.io.models import LoadedModel
    from camviz.pipeline.settings import JobSettings

# Skipped inputs listed on stderr; the manifest has them all.
_LISTED_FAILURES = 10


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain",
        help="explain images, folders or videos with a CAM method",
        description="Write, per image, a heatmap overlay at the photo's size and a panel "
        "(image | heatmap | overlay), one row per image in manifest.jsonl and a summary in "
        "manifest.json. The model's task decides what is explained: a classifier's classes; "
        "a segmentation model's predicted region of a class (--target NAME); a detector's "
        "objects, one overlay each with its box and label, and a panel of all of them; a "
        "video model's clips, as overlay videos. Unreadable inputs are skipped and listed. "
        "Running again with the same "
        "--out resumes; one run at a time may use an output folder, and the files camviz "
        "wrote are never taken as inputs. Under torchrun (torchrun --nproc_per_node=N -m "
        "camviz explain ...) the processes share the inputs.",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="image files, folders (searched recursively), glob patterns, .txt files listing "
        "paths, videos, or NIfTI volumes (.nii, .nii.gz)",
    )
    add_model_options(parser)
    _add_what_to_explain(parser)
    _add_outputs(parser)
    _add_batches(parser)
    add_precision_options(parser, job=True)
    add_memory_budget_option(parser)
    add_compile_option(parser)
    add_layout_option(parser)
    _add_task_options(parser)
    _add_volume_options(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def _add_volume_options(parser: argparse.ArgumentParser) -> None:
    """How NIfTI volumes are read and cut into sliding windows."""
    volumes = parser.add_argument_group(
        "NIfTI volumes (written as NAME_heatmap.nii.gz with the scan's affine, and "
        "NAME_montage.png)"
    )
    volumes.add_argument(
        "--window",
        type=_numbers(2, float),
        default=None,
        metavar="LOW,HIGH",
        help="map intensities LOW..HIGH to 0..1, clipped (CT: -1000,400)",
    )
    volumes.add_argument(
        "--percentile",
        type=_numbers(2, float),
        default=None,
        metavar="LOW,HIGH",
        help="window each scan at these percentiles of its intensities (MR: 0.5,99.5)",
    )
    volumes.add_argument(
        "--roi-size",
        type=_numbers(3, int),
        default=None,
        metavar="D,H,W",
        help="explain in sliding windows of this size, along the scan's voxel axes (default: "
        "the whole volume, when it fits --memory-budget)",
    )
    volumes.add_argument(
        "--overlap", type=float, default=0.25, help="share of a window the next overlaps"
    )
    volumes.add_argument(
        "--blend",
        choices=("constant", "gaussian"),
        default="constant",
        help="weights of overlapping windows' outputs (MONAI's modes)",
    )


def _numbers(count: int, kind: type) -> Any:
    """An argparse ``type=`` for ``count`` numbers of ``kind`` separated by commas."""

    def parse(text: str) -> tuple:
        parts = text.split(",")
        try:
            values = tuple(kind(part) for part in parts)
        except ValueError:
            values = ()
        if len(values) != count:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {count} {kind.__name__} numbers separated by commas"
            )
        return values

    return parse


def _add_what_to_explain(parser: argparse.ArgumentParser) -> None:
    """``--layer``, ``--target``, ``--similar-to`` and ``--method``."""
    parser.add_argument("--layer", default=None, help="target layer (see `camviz layers`)")
    parser.add_argument(
        "--target",
        default="top1",
        help="class id, top1 (default) or topK (one map for each of the K best classes); "
        "unit:LAYER@CHANNELS for channels of a layer (unit:layer3.1@42, unit:layer3.1@0-7: one "
        "map each) or unit:LAYER@C,I,J for one neuron, explained at the layer before it; "
        "for segmentation and detection a class name (person) or id: the region predicted "
        "as that class (default: each image's largest class but the background), the "
        "objects of that class (default: all)",
    )
    parser.add_argument(
        "--similar-to",
        default=None,
        metavar="IMAGE",
        help="explain why each input looks like IMAGE to an embedding model (the cosine "
        "similarity of their outputs) instead of a class; --target is then ignored",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="explain why each input matches TEXT to a CLIP-like model (--model hf:DIR of a "
        "CLIPModel or SiglipModel saved with its tokenizer): the cosine similarity of the "
        "image's and the text's embeddings; repeat for several texts, one map each "
        "(NAME_rank1_... for the first --prompt, and so on)",
    )
    parser.add_argument("--method", default="gradcam", help="CAM method (see `camviz methods`)")


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    """``--out`` and what is written there."""
    parser.add_argument("--out", default="camviz-out", metavar="DIR", help="output folder")
    parser.add_argument(
        "--alpha", type=float, default=0.5, help="heatmap weight in the overlay, 0..1"
    )
    parser.add_argument("--colormap", default="jet", help="matplotlib colour map name")
    parser.add_argument(
        "--overlay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the overlay (and, for videos, the overlay video)",
    )
    parser.add_argument(
        "--panel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the image | heatmap | overlay panel (still images only)",
    )
    parser.add_argument(
        "--heatmap",
        choices=("npz", "png16"),
        default=None,
        help="also write the raw heatmap, as compressed float32 .npz or 16-bit .png",
    )


def _add_batches(parser: argparse.ArgumentParser) -> None:
    """Batches, decoding workers, frames and the device."""
    parser.add_argument(
        "--batch-size", type=_positive, default=16, metavar="N", help="images per batch"
    )
    parser.add_argument(
        "--workers",
        type=worker_count,
        default=None,
        metavar="N",
        help="processes that decode images beside the model (default: 0 on a CPU, where the "
        "writer threads decode them between the model's passes; else up to 4)",
    )
    parser.add_argument(
        "--threads",
        type=_positive,
        default=None,
        metavar="N",
        help="torch threads of the model (default: torch's setting; with --workers on a "
        "CPU, with Linux's glibc, one fewer, leaving a core to the workers and writers)",
    )
    parser.add_argument(
        "--every",
        type=_positive,
        default=1,
        metavar="N",
        help="explain every N-th frame of a video (image models; video models take clips)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="where the model runs (cpu, cuda, cuda:1); by default this process's GPU if any",
    )


def _add_task_options(parser: argparse.ArgumentParser) -> None:
    """The options of detection and video models."""
    detection = parser.add_argument_group("detection models")
    detection.add_argument(
        "--min-score",
        type=_score,
        default=0.5,
        metavar="S",
        help="explain the objects detected with a score of at least S",
    )
    detection.add_argument(
        "--max-objects",
        type=_positive,
        default=10,
        metavar="N",
        help="at most N objects per image, best first",
    )
    video = parser.add_argument_group("video models")
    video.add_argument(
        "--clip-len",
        type=_positive,
        default=None,
        metavar="T",
        help="frames per clip (default: the model's, 16 for r3d_18)",
    )
    video.add_argument(
        "--stride",
        type=_positive,
        default=None,
        metavar="N",
        help="frames from one clip's start to the next (default: --clip-len)",
    )


def _positive(text: str) -> int:
    value = _not_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _score(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _not_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must not be negative")
    return value


def run(args: argparse.Namespace) -> int:
    from camviz.cli.options import load_model, model_device_option
    from camviz.io.pictures import check_render_options
    from camviz.io.volumes import is_volume
    from camviz.pipeline import distributed
    from camviz.pipeline.job import explain_files

    check_render_options(args.alpha, args.colormap)
    context = distributed.from_environment()
    device = model_device_option(args.device, context)
    if args.task is None and all(is_volume(name) for name in args.inputs):
        args.task = "volume"  # a 3-D model of NIfTI scans, not of video clips
    loaded = load_model(args)
    loaded.model.to(device)
    manifest = explain_files(args.inputs, args.out, loaded, _settings(args, loaded))
    if context.is_main:
        _report(manifest, args.out)
    return 0


def _settings(args: argparse.Namespace, loaded: LoadedModel) -> JobSettings:
    """The job's settings from the command line (``--similar-to`` needs the model)."""
    from camviz.cli.options import explain_settings
    from camviz.core.inputs import model_device
    from camviz.core.targets import parse_unit
    from camviz.pipeline.settings import JobSettings, Outputs, RenderOptions
    from camviz.pipeline.tasks import TaskOptions
    from camviz.pipeline.threads import default_workers
    from camviz.pipeline.volumes import VolumeOptions

    shared = explain_settings(args)
    target = int(args.target) if args.target.lstrip("-").isdigit() else args.target
    if args.target.startswith("unit:"):
        target = parse_unit(args.target)
        shared["layer"] = shared["layer"] or _layer_before(target, loaded)
    if args.similar_to is not None:
        target = _similarity(args.similar_to, loaded)
    if args.prompt is not None:
        target = _prompt(args, loaded)
    return JobSettings(
        **shared,
        method=args.method,
        target=target,
        render=RenderOptions(alpha=args.alpha, colormap=args.colormap),
        outputs=Outputs(overlay=args.overlay, panel=args.panel, heatmap=args.heatmap),
        batch_size=args.batch_size,
        workers=default_workers(model_device(loaded.model))
        if args.workers is None
        else args.workers,
        threads=args.threads,
        every=args.every,
        progress=False if args.quiet else None,
        task_options=TaskOptions(
            min_score=args.min_score,
            max_objects=args.max_objects,
            clip_len=args.clip_len,
            stride=args.stride,
        ),
        input_size=args.input_size,
        volumes=VolumeOptions(
            window=args.window,
            percentile=args.percentile,
            roi_size=args.roi_size,
            overlap=args.overlap,
            blend=args.blend,
        ),
    )


def _layer_before(unit: Unit, loaded: LoadedModel) -> str:
    """The layer a ``--target unit:...`` is explained at without ``--layer``: the last one
    before the unit's, found on a noise image of the model's input size (the folder job
    would otherwise take the model's default layer for classes, after the unit)."""
    import torch

    from camviz.core.layers import default_target_layer

    size = getattr(loaded.preprocess, "size", 224)
    channels = getattr(loaded.preprocess, "channels", 3)  # --input-channels
    device = next(loaded.model.parameters()).device
    probe = torch.rand(1, channels, size, size, generator=torch.Generator().manual_seed(0))
    return default_target_layer(loaded.model, probe.to(device), unit)


def _similarity(path: str, loaded: object) -> object:
    """The Similarity target for ``--similar-to``: the reference image, preprocessed."""
    from camviz.core.similarity import Similarity
    from camviz.io.images import load_image

    reference = loaded.preprocess(load_image(path))  # type: ignore[attr-defined]
    return Similarity(reference.unsqueeze(0), name=os.path.basename(path))


def _prompt(args: argparse.Namespace, loaded: LoadedModel) -> object:
    """The TextPrompt target of ``--prompt``, checked against the model and the options."""
    from camviz.core.errors import CamvizError
    from camviz.core.targets.textprompt import TextPrompt, dual_encoder

    if args.similar_to is not None or args.target != "top1":
        given = "--similar-to" if args.similar_to is not None else "--target"
        raise CamvizError(f"--prompt and {given} both say what to explain; give one of them")
    if dual_encoder(loaded.model) is None:
        raise CamvizError(
            f"--prompt needs a CLIP-like model with a text tower (a CLIPModel or SiglipModel "
            f"as --model hf:DIR); {loaded.name} has none"
        )
    if getattr(loaded.model, "tokenizer", None) is None:
        raise CamvizError(
            f"--prompt needs the model's tokenizer, and {loaded.name} has none saved beside it; "
            "save it into the model's folder (tokenizer.save_pretrained(DIR))"
        )
    return TextPrompt(args.prompt)


def _report(manifest: dict, out: str) -> None:
    """Skipped inputs on stderr (the first few), one summary line on stdout."""
    failed = manifest["failures"]
    for row in failed[:_LISTED_FAILURES]:
        frame = "" if row["frame"] is None else f" frame {row['frame']}"
        _warn(f"skipped {row['input']}{frame}: {row['reason']}")
    rows = os.path.join(out, "manifest.jsonl")
    if len(failed) > _LISTED_FAILURES:
        _warn(f"... and {len(failed) - _LISTED_FAILURES} more skipped; see {rows}")
    skipped = manifest.get("skipped_rows", 0)
    if skipped:
        _warn(
            f"{skipped} line(s) of {rows} are not camviz rows (cut short by a crash, or edited) "
            "and were left out"
        )
    others = manifest["other_files"]
    if others:
        _warn(
            f"{len(others)} file(s) in {out} belong to no input of this run (an earlier run's); "
            "manifest.json lists them under other_files"
        )
    counts = manifest["counts"]
    total, done = counts["ok"] + counts["error"], counts["already_done"]
    where = os.path.join(out, "manifest.json") + "".join(
        f", {video['file']}" for video in manifest["videos"]
    )
    if done == total:
        summary = f"all {total} inputs were already done -> {where}"
    elif done:
        summary = (
            f"explained {counts['ok'] - done} of the {total - done} inputs left "
            f"({done} were already done) -> {where}"
        )
    else:
        summary = f"explained {counts['ok']} of {total} inputs -> {where}"
    empty = counts.get("empty_maps", 0)
    if empty:
        _warn(
            f"{empty} map(s) are all zero: no positive evidence at the layer (their rows say "
            '"empty": true); try another --layer'
        )
    echo(summary)


def _warn(line: str) -> None:
    echo(f"camviz: {line}", stream=sys.stderr)
