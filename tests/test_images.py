"""camviz.io.images: every common image mode read back as the RGB pixels it should be."""

from __future__ import annotations

import gc
import re
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from camviz.core.errors import CamvizError
from camviz.io.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    Preprocess,
    load_batch,
    load_image,
    to_rgb,
)


def pixels(image: Image.Image) -> np.ndarray:
    assert image.mode == "RGB"
    return np.asarray(image).astype(int)


def composite_on_white(rgba: np.ndarray) -> np.ndarray:
    colour, alpha = rgba[..., :3].astype(float), rgba[..., 3:].astype(float) / 255
    return np.rint(colour * alpha + 255 * (1 - alpha)).astype(int)


RGB_PIXELS = np.array(
    [[[255, 0, 0], [0, 255, 0], [0, 0, 255]], [[10, 20, 30], [128, 128, 128], [250, 5, 77]]],
    dtype=np.uint8,
)


@pytest.mark.parametrize("suffix", [".png", ".tiff", ".bmp", ".webp"])
def test_lossless_rgb_formats_read_back_exactly(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"image{suffix}"
    options = {"lossless": True} if suffix == ".webp" else {}
    Image.fromarray(RGB_PIXELS).save(path, **options)
    np.testing.assert_array_equal(pixels(load_image(path)), RGB_PIXELS)


def test_greyscale_becomes_three_equal_channels(tmp_path: Path) -> None:
    grey = np.array([[0, 50], [200, 255]], dtype=np.uint8)
    Image.fromarray(grey).save(tmp_path / "grey.png")
    np.testing.assert_array_equal(
        pixels(load_image(tmp_path / "grey.png")), np.stack([grey] * 3, -1)
    )


def test_rgba_is_composited_on_white(tmp_path: Path) -> None:
    rgba = np.array(
        [[[200, 100, 50, 128], [0, 0, 0, 0]], [[10, 20, 30, 255], [255, 0, 0, 64]]], dtype=np.uint8
    )
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    result = pixels(load_image(tmp_path / "rgba.png"))
    np.testing.assert_allclose(result, composite_on_white(rgba), atol=1)
    assert result[0, 1].tolist() == [255, 255, 255]  # hidden black under alpha 0 is not shown
    assert result[1, 0].tolist() == [10, 20, 30]


def test_greyscale_with_alpha_is_composited_on_white(tmp_path: Path) -> None:
    Image.fromarray(np.array([[[100, 0], [100, 255]]], dtype=np.uint8), "LA").save(
        tmp_path / "la.png"
    )
    assert pixels(load_image(tmp_path / "la.png")).tolist() == [[[255] * 3, [100] * 3]]


PALETTE = [0, 0, 0, 255, 0, 0, 0, 128, 255, 30, 60, 90]


def palette_image(indices: list[list[int]]) -> Image.Image:
    image = Image.fromarray(np.array(indices, dtype=np.uint8), "P")
    image.putpalette(PALETTE)
    return image


def test_palette_image_expands_to_its_colours(tmp_path: Path) -> None:
    palette_image([[0, 1], [2, 3]]).save(tmp_path / "p.png")
    expected = [[[0, 0, 0], [255, 0, 0]], [[0, 128, 255], [30, 60, 90]]]
    assert pixels(load_image(tmp_path / "p.png")).tolist() == expected


def test_palette_transparent_index_becomes_white(tmp_path: Path) -> None:
    image = palette_image([[0, 1], [2, 3]])
    image.save(tmp_path / "p.png", transparency=2)
    assert pixels(load_image(tmp_path / "p.png")).tolist() == [
        [[0, 0, 0], [255, 0, 0]],
        [[255, 255, 255], [30, 60, 90]],
    ]


def test_palette_gif_with_transparency(tmp_path: Path) -> None:
    image = palette_image([[0, 1], [2, 3]])
    image.save(tmp_path / "p.gif", transparency=1)
    assert pixels(load_image(tmp_path / "p.gif"))[0].tolist() == [[0, 0, 0], [255, 255, 255]]


SIXTEEN_BIT = np.array([[0, 257, 1000, 32896, 65535]], dtype=np.uint16)


@pytest.mark.parametrize("suffix", [".png", ".tiff"])
def test_16_bit_greyscale_is_scaled_not_clipped(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"deep{suffix}"
    Image.fromarray(SIXTEEN_BIT).save(path)
    with Image.open(path) as original:
        assert original.mode.startswith("I")  # Pillow kept 16 bits
    expected = np.rint(SIXTEEN_BIT.astype(np.int64) * 255 / 65535).astype(int)
    assert pixels(load_image(path))[..., 0].tolist() == expected.tolist()
    assert expected.tolist() == [[0, 1, 4, 128, 255]]  # Pillow's convert would give 255 for 1000


def test_32_bit_integers_beyond_16_bits_are_stretched(tmp_path: Path) -> None:
    values = np.array([[-100, 0, 100_000, 199_900]], dtype=np.int32)
    Image.fromarray(values, "I").save(tmp_path / "wide.tiff")
    expected = np.rint((values + 100) * 255 / 200_000).astype(int)
    assert pixels(load_image(tmp_path / "wide.tiff"))[..., 1].tolist() == expected.tolist()


def test_float_image_in_unit_range_is_scaled_by_255(tmp_path: Path) -> None:
    values = np.array([[0.0, 0.25, 1.0]], dtype=np.float32)
    Image.fromarray(values, "F").save(tmp_path / "float.tiff")
    assert pixels(load_image(tmp_path / "float.tiff"))[..., 2].tolist() == [[0, 64, 255]]


def test_cmyk_jpeg_converts_like_pillow_and_torchvision(tmp_path: Path) -> None:
    cyan, magenta, yellow, black = 10, 200, 50, 30
    Image.new("CMYK", (16, 16), (cyan, magenta, yellow, black)).save(
        tmp_path / "cmyk.jpg", quality=100
    )
    expected = [round((255 - ink) * (255 - black) / 255) for ink in (cyan, magenta, yellow)]
    result = pixels(load_image(tmp_path / "cmyk.jpg"))
    np.testing.assert_allclose(result[8, 8], expected, atol=3)


def test_exif_orientation_6_is_rotated_upright(tmp_path: Path) -> None:
    stored = np.zeros((16, 32, 3), dtype=np.uint8)
    stored[:, :16] = (255, 0, 0)  # left half red, right half blue
    stored[:, 16:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    Image.fromarray(stored).save(tmp_path / "phone.jpg", exif=exif.tobytes(), quality=95)
    upright = load_image(tmp_path / "phone.jpg")
    assert upright.size == (16, 32)  # width and height swapped
    expected = np.rot90(stored, k=-1)  # clockwise: the left half becomes the top half
    result = pixels(upright)
    for row, col in [(0, 0), (4, 12), (27, 3), (31, 15)]:
        np.testing.assert_allclose(result[row, col], expected[row, col], atol=12)
    assert result[0, 0, 0] > 200 and result[31, 0, 2] > 200


def header_only_png(path: Path, width: int, height: int) -> Path:
    """A PNG that declares ``width x height`` but holds no pixel data (a few bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    return path


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail loudly if any pixel is decoded."""

    def refuse(self: ImageFile.ImageFile) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


@pytest.mark.usefixtures("no_decoding")
def test_image_above_the_limit_is_refused_from_its_header(tmp_path: Path) -> None:
    path = header_only_png(tmp_path / "huge.png", 10_000, 8_000)  # 80 MP, under Pillow's limit
    with pytest.raises(CamvizError, match=r"huge\.png is 10000x8000 \(80\.0 megapixels\)"):
        load_image(path)


@pytest.mark.usefixtures("no_decoding")
def test_max_pixels_is_configurable(tmp_path: Path) -> None:
    Image.fromarray(RGB_PIXELS).save(tmp_path / "small.png")
    with pytest.raises(CamvizError, match=r"small\.png is 3x2"):
        load_image(tmp_path / "small.png", max_pixels=5)


@pytest.mark.parametrize("side", [10_000, 20_000])  # Pillow's warning, then its error
def test_pillow_decompression_bomb_checks_become_camviz_errors(tmp_path: Path, side: int) -> None:
    path = header_only_png(tmp_path / "bomb.png", side, side)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning may escape
        with pytest.raises(CamvizError, match=r"bomb\.png is larger than Pillow allows"):
            load_image(path, max_pixels=None)


def write_truncated_png(path: Path) -> Path:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:2000])
    return path


def missing(folder: Path) -> Path:
    return folder / "missing.png"


def directory(folder: Path) -> Path:
    (folder / "album.png").mkdir()
    return folder / "album.png"


def empty(folder: Path) -> Path:
    (folder / "empty.png").write_bytes(b"")
    return folder / "empty.png"


def text_as_jpeg(folder: Path) -> Path:
    (folder / "notes.jpg").write_text("not a photo")
    return folder / "notes.jpg"


def truncated(folder: Path) -> Path:
    return write_truncated_png(folder / "cut.png")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (missing, "not found"),
        (directory, "is a folder"),
        (empty, "empty"),
        (text_as_jpeg, "not an image"),
        (truncated, "truncated or corrupt"),
    ],
)
def test_unreadable_files_give_one_line_naming_the_file(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path)
    with pytest.raises(CamvizError) as raised:
        load_image(path)
    text = str(raised.value)
    assert message in text and path.name in text and "\n" not in text


def test_files_are_closed_on_success_and_on_error(tmp_path: Path) -> None:
    Image.fromarray(RGB_PIXELS).save(tmp_path / "ok.png")
    truncated = write_truncated_png(tmp_path / "cut.png")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = load_image(tmp_path / "ok.png")
        with pytest.raises(CamvizError):
            load_image(truncated)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    np.testing.assert_array_equal(pixels(image), RGB_PIXELS)  # usable after the file closed


def test_to_rgb_keeps_rgb_pixels_and_returns_a_new_image() -> None:
    image = Image.fromarray(RGB_PIXELS)
    converted = to_rgb(image)
    assert converted is not image
    np.testing.assert_array_equal(pixels(converted), RGB_PIXELS)


# Preprocess


def manual_preprocess(image: Image.Image, width: int, height: int, resample: int) -> np.ndarray:
    resized = np.asarray(image.resize((width, height), resample), dtype=np.float64) / 255
    normalised = (resized - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    return normalised.transpose(2, 0, 1)


@pytest.fixture
def tiny_image() -> Image.Image:
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, (4, 6, 3), dtype=np.uint8))  # 6 wide, 4 high


@pytest.mark.parametrize(
    ("interpolation", "resample"),
    [("bilinear", Image.Resampling.BILINEAR), ("bicubic", Image.Resampling.BICUBIC)],
)
def test_preprocess_shorter_matches_a_manual_resize_and_normalise(
    tiny_image: Image.Image, interpolation: str, resample: int
) -> None:
    tensor = Preprocess(size=3, interpolation=interpolation)(tiny_image)
    # shorter side 4 -> 3, longer side 6 * 3 / 4 = 4.5 -> 5
    expected = manual_preprocess(tiny_image, width=5, height=3, resample=resample)
    assert tensor.dtype == torch.float32
    np.testing.assert_allclose(tensor.numpy(), expected, atol=1e-5)


def test_preprocess_square_squashes_to_size(tiny_image: Image.Image) -> None:
    tensor = Preprocess(size=4, resize="square")(tiny_image)
    expected = manual_preprocess(tiny_image, 4, 4, Image.Resampling.BILINEAR)
    np.testing.assert_allclose(tensor.numpy(), expected, atol=1e-5)


def test_preprocess_converts_other_modes_like_load_image(tiny_image: Image.Image) -> None:
    grey = tiny_image.convert("L")
    np.testing.assert_array_equal(Preprocess(size=3)(grey), Preprocess(size=3)(to_rgb(grey)))


@pytest.mark.parametrize(
    ("preprocess", "width", "height", "expected"),
    [
        (Preprocess(size=224), 640, 480, (224, 299)),
        (Preprocess(size=224), 451, 300, (224, 337)),
        (Preprocess(size=224), 300, 451, (337, 224)),
        (Preprocess(size=224, multiple_of=32), 640, 480, (224, 288)),
        (Preprocess(size=5, max_size=20), 100, 10, (2, 20)),
        (Preprocess(size=224, resize="square"), 640, 480, (224, 224)),
        (Preprocess(size=100, resize="square", multiple_of=32), 640, 480, (96, 96)),
    ],
)
def test_output_size(preprocess: Preprocess, width: int, height: int, expected) -> None:
    assert preprocess.output_size(width, height) == expected


def test_shorter_keeps_the_aspect_ratio_of_a_real_photo(cat_path: Path) -> None:
    photo = load_image(cat_path)
    tensor = Preprocess(size=64)(photo)
    height, width = tensor.shape[-2:]
    assert min(height, width) == 64
    assert abs(width / height - photo.width / photo.height) < 1 / 64


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"size": 0}, "size must be a positive number of pixels, not 0"),
        (
            {"mean": (0.5, 0.5)},
            "mean must have one value for all channels or one per channel (3), got 2",
        ),
        (
            {"channels": 1, "mean": (0.5,), "std": (0.2, 0.2, 0.2)},
            "std must have one value for all channels or one per channel (1), got 3",
        ),
        ({"channels": 4}, "channels must be 3 (RGB) or 1 (grey), not 4"),
        ({"std": (0.2, 0.0, 0.2)}, "std values must be positive, got (0.2, 0.0, 0.2)"),
        ({"resize": "crop"}, "resize must be 'shorter', 'square' or 'none', not 'crop'"),
        (
            {"interpolation": "lanczos"},
            "interpolation must be one of bilinear, bicubic, not 'lanczos'",
        ),
        ({"max_size": 100}, "max_size (100) must be at least size (224), or None"),
        ({"multiple_of": 0}, "multiple_of must be a positive integer, not 0"),
    ],
)
def test_preprocess_rejects_bad_settings(options: dict, message: str) -> None:
    with pytest.raises(CamvizError, match=re.escape(message)) as error:
        Preprocess(**options)
    assert "\n" not in str(error.value)


def test_preprocess_is_hashable_with_list_statistics() -> None:
    preprocess = Preprocess(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5])
    assert preprocess.mean == (0.5, 0.5, 0.5)
    assert hash(preprocess) == hash(Preprocess(mean=(0.5,) * 3, std=(0.5,) * 3))


# load_batch


def test_load_batch_stacks_square_images_and_keeps_the_originals(
    cat_path: Path, coffee_path: Path
) -> None:
    preprocess = Preprocess(size=32, resize="square")
    batch, originals = load_batch([cat_path, coffee_path], preprocess)
    assert batch.shape == (2, 3, 32, 32)
    for path, tensor, original in zip([cat_path, coffee_path], batch, originals, strict=True):
        assert original.size == load_image(path).size
        torch.testing.assert_close(tensor, preprocess(load_image(path)))


def test_load_batch_accepts_one_path(cat_path: Path) -> None:
    preprocess = Preprocess(size=32)
    batch, originals = load_batch(str(cat_path), preprocess)
    assert batch.shape[0] == 1 and len(originals) == 1
    torch.testing.assert_close(batch[0], preprocess(load_image(cat_path)))


def test_load_batch_refuses_images_of_different_shapes(tmp_path: Path) -> None:
    Image.new("RGB", (40, 20)).save(tmp_path / "wide.png")
    Image.new("RGB", (20, 40)).save(tmp_path / "tall.png")
    with pytest.raises(CamvizError, match=r"wide\.png -> 16x32, tall\.png -> 32x16.*square"):
        load_batch([tmp_path / "wide.png", tmp_path / "tall.png"], Preprocess(size=16))


def test_load_batch_needs_a_path() -> None:
    with pytest.raises(CamvizError, match="no image paths"):
        load_batch([])


def test_reading_on_several_threads_leaves_the_warning_state_as_it_was(tmp_path: Path) -> None:
    # catch_warnings is process-wide; two threads inside it at once left one thread's
    # recorder in place, and every later warning of the process went into it.
    import threading

    paths = []
    for number in range(8):
        path = tmp_path / f"{number}.png"
        Image.fromarray(np.full((64, 48, 3), number * 30, np.uint8)).save(path)
        paths.append(path)

    def read_all() -> None:
        for _ in range(10):
            for path in paths:
                load_image(path)

    with pytest.warns(UserWarning, match="after the reads") as caught:
        filters, show = list(warnings.filters), warnings.showwarning
        threads = [threading.Thread(target=read_all) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert warnings.filters == filters and warnings.showwarning is show
        warnings.warn("after the reads", UserWarning, stacklevel=1)
    assert len(caught) == 1
