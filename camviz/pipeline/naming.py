"""Which files one result becomes: the names of an input's outputs, from its name alone.

An input named ``NAME`` (unique in the run, see :mod:`camviz.pipeline.inputs`) gets, per
explained map, ``NAME_overlay.png``, ``NAME_panel.jpg`` and ``NAME_heatmap.npz`` (or
``.png``), as :class:`~camviz.pipeline.settings.Outputs` asks (a NIfTI volume:
``NAME_heatmap.nii.gz`` and ``NAME_montage.png``); several maps (a ``topK``
target, several detected objects) are ``NAME_rankR_...``; a clip's overlay is
``NAME_overlay.mp4``; a detector's image also gets one ``NAME_panel.jpg`` of all its
objects; a video ``V`` gets ``V_overlay.mp4``. The names depend on nothing but the input's
name and what is written, so a resumed run finds the same files, and
:func:`output_owners` can tell, from a file's name, whose output it would be.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the settings know the tasks, whose items are named here
    from camviz.pipeline.settings import Outputs

#: The suffix of overlay videos.
VIDEO_SUFFIX = ".mp4"

# How outputs are named: NAME_overlay.png, NAME_rank2_panel.jpg, NAME_heatmap.npz, and a
# volume's NAME_heatmap.nii.gz and NAME_montage.png.
_OUTPUT_FILE = re.compile(
    r"(.+?)(_rank\d+)?_(?:(?:overlay|panel|heatmap)\.(?:png|jpg|npz|mp4)|heatmap\.nii\.gz"
    r"|montage\.png)"
)

# A name that a rank suffix could have made from another: NAME_rank3.
_RANKED = re.compile(r"(.+)_rank\d+")


@dataclass(frozen=True)
class ResultFiles:
    """The files of one result.

    Attributes:
        ranks: Per explained map, in rank order, its files by kind (``"overlay"``,
            ``"panel"``, ``"heatmap"``).
        whole: Files of the whole input: a detector's panel of all its objects.
    """

    ranks: list[dict[str, str]]
    whole: list[str] = field(default_factory=list)


def result_files(
    name: str, ranks: int, outputs: Outputs, *, still: bool, clip: bool, boxes: bool
) -> ResultFiles:
    """The files that one input's result becomes.

    Args:
        name: The input's name.
        ranks: How many maps were explained for it.
        outputs: Which files are written.
        still: A still image (panels are drawn for those only), not a video frame or clip.
        clip: A video model's clip, whose overlay is a video.
        boxes: Detected objects: each object's overlay shows its box, and the image gets
            one panel of all of them instead of one per map.
    """
    files = []
    for rank in range(ranks):
        stem = name if ranks == 1 else f"{name}_rank{rank + 1}"
        chosen = {}
        if outputs.overlay:
            chosen["overlay"] = f"{stem}_overlay{VIDEO_SUFFIX if clip else '.png'}"
        if outputs.panel and still and not boxes:
            chosen["panel"] = f"{stem}_panel.jpg"
        if outputs.heatmap is not None:
            chosen["heatmap"] = f"{stem}_heatmap{'.npz' if outputs.heatmap == 'npz' else '.png'}"
        files.append(chosen)
    whole = [f"{name}_panel.jpg"] if outputs.panel and boxes and ranks else []
    return ResultFiles(files, whole)


def volume_files(name: str, outputs: Outputs) -> dict[str, str]:
    """The files of a volume named ``name``: its map as NIfTI, always, and the montage of
    its slices with the map when overlays are drawn."""
    files = {"heatmap": f"{name}_heatmap.nii.gz"}
    if outputs.overlay:
        files["montage"] = f"{name}_montage.png"
    return files


def video_file(video: str) -> str:
    """The overlay video of the input video named ``video``."""
    return f"{video}_overlay{VIDEO_SUFFIX}"


def output_owners(relative: str) -> set[str]:
    """The input names whose outputs could be named ``relative`` (a ``/``-separated path
    inside the output folder); empty when it is named like no output.

    ``b_rank1_overlay.png`` could be the first map of ``b`` or the only map of ``b_rank1``.
    """
    match = _OUTPUT_FILE.fullmatch(relative)
    if match is None:
        return set()
    return {match.group(1), match.group(1) + (match.group(2) or "")}


def rank_clash(name: str, names: set[str]) -> bool:
    """Whether ``name`` is another name of ``names`` with a rank suffix (``b_rank1`` beside
    ``b``): the one map of ``b_rank1`` and the first of two maps of ``b`` would be one file.

    ``names`` holds case-folded names, as file systems that ignore case see them.
    """
    match = _RANKED.fullmatch(name)
    return match is not None and match.group(1).casefold() in names
