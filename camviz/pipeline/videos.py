"""The overlay video of each input video, made from the overlays of its frames or clips.

An image model explains a video frame by frame (every ``every``-th): the video's overlay
``V_overlay.mp4`` is made of the frames' overlays, at the video's frame rate divided by
``every``. A video model explains clips: the overlay is made of the clips' overlay videos,
each clip up to where the next one starts, so that every frame shows once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from camviz.io.video import FrameReader, frame_count, frame_rate, write_video
from camviz.pipeline import manifest
from camviz.pipeline.inputs import Item
from camviz.pipeline.naming import video_file


def write_videos(
    out: Path, items: list[Item], overlays: dict[str, str], every: int, stride: int | None
) -> list[dict[str, Any]]:
    """One overlay video per input video, in order: from its explained frames' overlays
    (``overlays``: the first overlay file of each explained frame or clip, by input key) or,
    for a video model (``stride`` given), from its clips' overlay videos, each clip up to
    where the next one starts, so that every frame shows once."""
    # video name -> (path, [(overlay file, frame or clip start)])
    frames: dict[str, tuple[str, list[tuple[str, int]]]] = {}
    for item in items:
        overlay_file = overlays.get(item.key)
        if item.video is not None and item.frame is not None and overlay_file is not None:
            frames.setdefault(item.video, (item.path, []))[1].append((overlay_file, item.frame))
    videos = []
    for name, (path, shown) in frames.items():
        video = video_file(name)
        if stride is None:
            pictures: Iterable[Path | Image.Image] = (out / file for file, _ in shown)
            fps = frame_rate(path) / every
        else:
            pictures, fps = _clip_frames(out, shown), frame_rate(path)
        count = write_video(pictures, out / video, fps)
        entry = {**manifest.input_fields(path), "frames": count, "every": every, "file": video}
        videos.append(entry if stride is None else {**entry, "every": 1, "stride": stride})
    return videos


def _clip_frames(out: Path, clips: list[tuple[str, int]]) -> Iterator[Image.Image]:
    """The frames of consecutive clips' overlay videos (file, first frame), each clip's up to
    where the next one starts (all of the last one's)."""
    reader = FrameReader()
    try:
        for number, (name, start) in enumerate(clips):
            count = frame_count(out / name)
            following = clips[number + 1][1] if number + 1 < len(clips) else start + count
            for index in range(min(count, following - start)):
                yield reader.read(str(out / name), index)
    finally:
        reader.close()
