"""Read video frames and write overlay videos with OpenCV.

Frames are read with ``cv2.VideoCapture``. A :class:`FrameReader` keeps each video open
between calls and reads forward when the next frame asked for lies a little ahead (the
usual case: a DataLoader worker gets consecutive frames), because seeking makes the decoder
start again from the previous key frame.

The overlay video is written with ``cv2.VideoWriter`` (MPEG-4 Part 2, ``mp4v``, which every
OpenCV build with FFmpeg can encode; H.264 encoders are often missing) through
:func:`camviz.io.atomic.atomic_path`: to a hidden temporary file that replaces the target only
when complete, like every other camviz output.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from camviz.core.errors import CamvizError
from camviz.io.atomic import atomic_path

#: Codec for each video container camviz writes.
FOURCC = {".mp4": "mp4v", ".avi": "MJPG"}

# Reading this many frames forward is cheaper than a seek, which decodes from a key frame.
_READ_AHEAD = 64

# Videos a reader keeps open at once (each holds a decoder and a file handle).
_OPEN_VIDEOS = 4


# FFmpeg, inside OpenCV, prints its own log lines ("moov atom not found") on stderr; camviz
# reports an unreadable video in its own words, so they are silenced (-8 is FFmpeg's
# AV_LOG_QUIET). OpenCV reads this once, when it first uses FFmpeg in the process, so it is
# set on import; a value the user set is kept.
os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")


def _cv2() -> Any:
    import cv2

    return cv2


def _open(path: str | os.PathLike[str]) -> Any:
    cv2 = _cv2()
    capture = cv2.VideoCapture(os.fspath(path))
    if not capture.isOpened():
        capture.release()
        reason = "file not found" if not Path(path).exists() else "not a video OpenCV can read"
        raise CamvizError(f"cannot open video {path} ({reason}); check the file or convert it")
    return capture


def frame_count(path: str | os.PathLike[str]) -> int:
    """The number of frames in a video.

    The container's count is used when it gives one; otherwise (some streams, some AVI
    files) the frames are counted by reading through the file.

    Raises:
        CamvizError: OpenCV cannot open the file.
    """
    capture = _open(path)
    try:
        count = int(capture.get(_cv2().CAP_PROP_FRAME_COUNT))
        if count <= 0:
            count = 0
            while capture.grab():
                count += 1
        return count
    finally:
        capture.release()


def frame_rate(path: str | os.PathLike[str], default: float = 25.0) -> float:
    """Frames per second of a video; ``default`` when the file does not say."""
    capture = _open(path)
    try:
        fps = float(capture.get(_cv2().CAP_PROP_FPS))
    finally:
        capture.release()
    return fps if fps > 0 else default


class FrameReader:
    """Reads single frames of videos as RGB images, keeping a few videos open between calls.

    One reader per process: DataLoader workers each get their own copy of the dataset,
    and with it their own reader, before any video is opened.
    """

    def __init__(self) -> None:
        self._open: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # path -> (capture, next)

    def read(self, path: str, index: int) -> Image.Image:
        """Frame ``index`` (from 0) of the video at ``path``, as an RGB image.

        Raises:
            CamvizError: The video cannot be opened or has no frame ``index``.
        """
        capture, position = self._open.pop(path, (None, 0))
        if capture is None:
            capture, position = _open(path), 0
            while len(self._open) >= _OPEN_VIDEOS:
                self._open.popitem(last=False)[1][0].release()
        if not position <= index <= position + _READ_AHEAD:
            cv2 = _cv2()
            capture.set(cv2.CAP_PROP_POS_FRAMES, index)
            position = int(capture.get(cv2.CAP_PROP_POS_FRAMES))
            if position != index:
                # The container does not seek to exact frames: read from the start instead.
                capture.release()
                capture, position = _open(path), 0
        while position < index and capture.grab():
            position += 1
        ok, frame = capture.read() if position == index else (False, None)
        if not ok or frame is None:
            capture.release()
            raise CamvizError(f"cannot read frame {index} of {path}; the video may be truncated")
        self._open[path] = (capture, index + 1)
        return Image.fromarray(np.ascontiguousarray(frame[..., ::-1]))

    def close(self) -> None:
        """Release every open video."""
        while self._open:
            self._open.popitem()[1][0].release()

    def __getstate__(self) -> dict[str, Any]:
        # Open captures cannot cross a process boundary; a copy starts with none.
        return {"_open": OrderedDict()}


def _bgr(frame: str | os.PathLike[str] | Image.Image) -> np.ndarray:
    """An image (or image file) as the BGR pixels OpenCV writes."""
    if isinstance(frame, Image.Image):
        return np.asarray(frame.convert("RGB"))[..., ::-1]
    with Image.open(frame) as image:
        return np.asarray(image.convert("RGB"))[..., ::-1]


def _frame_name(frame: str | os.PathLike[str] | Image.Image, number: int) -> str:
    return f"number {number}" if isinstance(frame, Image.Image) else os.fspath(frame)


def write_video(
    frames: Iterable[str | os.PathLike[str] | Image.Image], path: str | os.PathLike[str], fps: float
) -> int:
    """Write image files (or images) as the frames of a video, atomically.

    Args:
        frames: Image files or PIL images, in order, all of one size; read one at a time,
            so a generator of pictures never holds more than one.
        path: The video to write; its extension picks the container (see :data:`FOURCC`).
        fps: Frames per second.

    Returns:
        The number of frames written (no frame: no file).

    Raises:
        CamvizError: An unknown extension, a frame of another size, or OpenCV cannot write.
    """
    cv2 = _cv2()
    path = Path(path)
    codec = FOURCC.get(path.suffix.lower())
    if codec is None:
        raise CamvizError(f"cannot write a {path.suffix!r} video; use one of {', '.join(FOURCC)}")
    pictures = ((_frame_name(frame, number), _bgr(frame)) for number, frame in enumerate(frames))
    first = next(pictures, None)
    if first is None:
        return 0
    height, width = first[1].shape[:2]
    count = 0
    # VideoWriter picks the container from the name, so the temporary file keeps the suffix.
    with atomic_path(path, keep_suffix=True) as temporary:
        writer = cv2.VideoWriter(
            str(temporary), cv2.VideoWriter.fourcc(*codec), fps, (width, height)
        )
        try:
            if not writer.isOpened():
                raise CamvizError(f"OpenCV cannot write {path}; check the folder and codecs")
            for name, pixels in itertools.chain([first], pictures):
                if pixels.shape[:2] != (height, width):
                    raise CamvizError(
                        f"frame {name} is {pixels.shape[1]}x{pixels.shape[0]}, not "
                        f"{width}x{height} like the first; a video's frames must share one size"
                    )
                writer.write(np.ascontiguousarray(pixels))
                count += 1
        finally:
            writer.release()
    return count
