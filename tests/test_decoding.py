"""JPEG decoding on the device in the folder job's input path: which decoder each file
gets, and the device path (run here with the CPU as the device) giving Pillow's pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import conv_net
from PIL import Image

import camviz.pipeline.dataset as dataset_module
from camviz.io.images import Preprocess, load_image
from camviz.pipeline import decoding
from camviz.pipeline.dataset import explain_dataset


@pytest.fixture
def files(tmp_path: Path, cat_path: Path) -> dict[str, Path]:
    """One file of each case the selection tells apart."""
    photo = Image.open(cat_path).convert("RGB").resize((64, 48))
    paths = {name: tmp_path / name for name in ("rgb.jpg", "grey.jpg", "cmyk.jpg", "turned.jpg")}
    photo.save(paths["rgb.jpg"], quality=90)
    photo.convert("L").save(paths["grey.jpg"])
    photo.convert("CMYK").save(paths["cmyk.jpg"])
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: nvjpeg would not turn it upright
    photo.save(paths["turned.jpg"], exif=exif)
    paths["photo.png"] = tmp_path / "photo.png"
    photo.save(paths["photo.png"])
    data = paths["rgb.jpg"].read_bytes()
    paths["truncated.jpg"] = tmp_path / "truncated.jpg"
    paths["truncated.jpg"].write_bytes(data[: len(data) // 2])  # header fine, data cut
    paths["text.jpg"] = tmp_path / "text.jpg"
    paths["text.jpg"].write_text("not an image")
    return paths


def test_decoder_choice(files):
    chosen = {name: decoding.decoder(path, on_device=True) for name, path in files.items()}
    assert chosen == {
        "rgb.jpg": "device",
        "grey.jpg": "device",
        "cmyk.jpg": "pillow",  # Pillow's CMYK conversion is what the model should see
        "turned.jpg": "pillow",  # EXIF orientation: only the CPU decoders apply it
        "photo.png": "pillow",
        "truncated.jpg": "device",  # the header is fine; decode() gives None, Pillow words it
        "text.jpg": "pillow",
    }
    assert {decoding.decoder(path, on_device=False) for path in files.values()} == {"pillow"}


def test_only_cuda_with_nvjpeg_and_a_tensor_preprocess_decodes_on_the_device(monkeypatch):
    if not torch.cuda.is_available():
        assert not decoding.nvjpeg_decodes(torch.device("cuda", 0))
    monkeypatch.setattr(decoding, "nvjpeg_decodes", lambda device: device.type == "cuda")
    assert decoding.device_decodes(torch.device("cuda", 0), Preprocess())
    assert not decoding.device_decodes(torch.device("cpu"), Preprocess())
    assert not decoding.device_decodes(None, Preprocess())
    assert not decoding.device_decodes(torch.device("cuda"), lambda image: torch.zeros(3))
    monkeypatch.setattr(decoding, "nvjpeg_decodes", lambda device: False)  # no nvjpeg built in
    assert not decoding.device_decodes(torch.device("cuda", 0), Preprocess())


def test_decode_gives_pillows_pixels_and_none_for_a_file_it_refuses(files):
    names = ["rgb.jpg", "truncated.jpg", "grey.jpg"]
    encoded = [decoding.encoded_jpeg(files[name], max_pixels=None) for name in names]
    rgb, truncated, grey = decoding.decode(encoded, torch.device("cpu"))
    assert truncated is None
    for name, pixels in (("rgb.jpg", rgb), ("grey.jpg", grey)):
        assert pixels is not None and pixels.dtype == torch.uint8
        expected = np.asarray(load_image(files[name]))
        np.testing.assert_array_equal(pixels.permute(1, 2, 0).numpy(), expected)


def test_tensor_preprocessing_is_within_a_level_of_pillows(cat_path):
    photo = load_image(cat_path)
    preprocess = Preprocess(size=40)
    from_pillow = preprocess(photo)
    from_tensor = preprocess(torch.from_numpy(np.array(photo)).permute(2, 0, 1))
    assert from_tensor.shape == from_pillow.shape
    levels = (from_tensor - from_pillow) * torch.tensor(preprocess.std).view(3, 1, 1) * 255
    assert levels.abs().max() <= 1.01 and levels.abs().mean() < 0.2


def test_the_folder_job_with_device_decoding_gives_the_pillow_results(files, monkeypatch):
    paths = [str(path) for path in files.values()]
    model = conv_net(6, classes=4, padding=1)

    def run() -> dict[str, dataset_module.ImageResult]:
        results = explain_dataset(
            model, paths, preprocess=Preprocess(size=24), layer="1", batch_size=8
        )
        return {Path(str(result.path)).name: result for result in results}

    on_cpu = run()
    batches: list[int] = []
    real_decode = decoding.decode

    def counted(encoded: list[torch.Tensor], device: torch.device) -> list:
        batches.append(len(encoded))
        return real_decode(encoded, device)

    # The device path, with the CPU standing in for the GPU.
    monkeypatch.setattr(dataset_module, "device_decodes", lambda device, preprocess: True)
    monkeypatch.setattr(dataset_module, "decode", counted)
    on_device = run()
    assert batches == [3]  # rgb, grey and truncated, decoded together
    assert set(on_device) == set(on_cpu)
    for name, want in on_cpu.items():
        got = on_device[name]
        assert (got.status, got.reason, got.size) == (want.status, want.reason, want.size), name
        if want.ok:
            np.testing.assert_array_equal(np.asarray(got.image), np.asarray(want.image))
            torch.testing.assert_close(got.heatmaps, want.heatmaps, atol=0.05, rtol=0)
    assert [name for name, result in on_cpu.items() if not result.ok] == [
        "truncated.jpg",
        "text.jpg",
    ]
