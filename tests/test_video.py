"""Videos: frames read in any order, one row per explained frame, and an overlay video."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import camviz
from camviz.cli import main
from camviz.io.video import FrameReader

FRAMES = 7
SIZE = (64, 48)  # width, height
FPS = 10.0


@pytest.fixture(scope="module")
def clip(tmp_path_factory, cat_path):
    """A 7-frame MPEG-4 video written with OpenCV: crops of the cat that move frame by frame."""
    import cv2

    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    with Image.open(cat_path) as photo:
        pixels = np.asarray(photo.convert("RGB"))
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"mp4v"), FPS, SIZE)
    for frame in range(FRAMES):
        crop = pixels[6 * frame : 6 * frame + 240, 20 * frame : 20 * frame + 320]
        writer.write(np.ascontiguousarray(cv2.resize(crop, SIZE)[..., ::-1]))
    writer.release()
    return path


def decoded_frames(path) -> list[np.ndarray]:
    """Every frame, RGB, read straight through with OpenCV."""
    import cv2

    capture = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(frame[..., ::-1])
    capture.release()
    return frames


def test_frames_read_in_any_order_equal_a_straight_read(clip):
    frames = decoded_frames(clip)
    assert len(frames) == FRAMES
    reader = FrameReader()
    for index in (5, 1, 6, 0, 3, 3, 4, 2):
        assert np.array_equal(np.asarray(reader.read(str(clip), index)), frames[index])
    reader.close()
    with pytest.raises(camviz.CamvizError, match="frame 7"):
        reader.read(str(clip), FRAMES)


@pytest.mark.parametrize("every", [1, 3])
def test_video_gives_a_row_per_frame_and_an_overlay_video(
    clip, tmp_path, tiny_mobilenet, every, manifest_rows
):
    out = tmp_path / "out"
    model = ["--model", "mobilenet_v3_small", "--weights", tiny_mobilenet]
    args = [str(clip), *model, "--every", str(every), "--batch-size", "3", "--quiet"]
    assert main(["explain", *args, "--out", str(out)]) == 0
    summary = json.loads((out / "manifest.json").read_text())
    rows = manifest_rows(out)
    explained_frames = list(range(0, FRAMES, every))
    assert [(row["input"], row["frame"], row["status"]) for row in rows] == [
        (str(clip), frame, "ok") for frame in explained_frames
    ]

    loaded = camviz.io.models.load("mobilenet_v3_small", weights=tiny_mobilenet)
    frames = decoded_frames(clip)
    for row in rows:
        image = Image.fromarray(np.ascontiguousarray(frames[row["frame"]]))
        with torch.no_grad():
            probabilities = loaded.model(loaded.preprocess(image)[None]).softmax(-1)[0]
        assert row["prediction"]["id"] == int(probabilities.argmax())
        assert row["prediction"]["probability"] == pytest.approx(
            float(probabilities.max()), abs=1e-5
        )
        assert row["files"] == [f"clip_frames/{row['frame']:06d}_overlay.png"]  # no panels
        assert row["size"] == list(SIZE)

    (video,) = summary["videos"]
    assert video["file"] == "clip_overlay.mp4" and video["frames"] == len(explained_frames)
    written = decoded_frames(out / "clip_overlay.mp4")
    assert len(written) == len(explained_frames)
    assert written[0].shape == (SIZE[1], SIZE[0], 3)
    # The video holds the overlays in frame order (lossy codec: compare loosely).
    for frame_pixels, row in zip(written, rows, strict=True):
        with Image.open(out / row["files"][0]) as overlay:
            difference = np.abs(frame_pixels.astype(float) - np.asarray(overlay, dtype=float))
        assert difference.mean() < 12
    import cv2

    capture = cv2.VideoCapture(str(out / "clip_overlay.mp4"))
    assert capture.get(cv2.CAP_PROP_FPS) == pytest.approx(FPS / every, rel=0.01)
    capture.release()


def test_a_failed_video_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    from camviz.io.video import frame_count, write_video

    target = tmp_path / "clip.mp4"
    frames = (Image.new("RGB", SIZE, (40 * n, 0, 0)) for n in range(3))
    assert write_video(frames, target, FPS) == 3
    before = target.read_bytes()
    mixed = [Image.new("RGB", SIZE), Image.new("RGB", (32, 32))]
    with pytest.raises(camviz.CamvizError, match=r"frame number 1 is 32x32, not 64x48"):
        write_video(mixed, target, FPS)
    assert target.read_bytes() == before and frame_count(target) == 3
    assert write_video([], tmp_path / "empty.mp4", FPS) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["clip.mp4"]
