"""train.decode: the DALI loader's decode paths (roi, full, cpu) on CPU DALI (device_id=None) give the
same records, the same random-resized-crop statistics, and images in the training's dtype and layout."""

import io

import numpy as np
import pytest
import torch
from nvidia.dali import types
from PIL import Image

from rectrain.loaders import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    LoaderSpec,
    build_loader,
    choose_loader,
    decode_path,
    image_dtype,
)
from rectrain.recordio import IRHeader, RecordWriter, pack_record

WIDTH, HEIGHT = 160, 120
RECORDS = 1024


@pytest.fixture(scope="module")
def ramp_rec(tmp_path_factory):
    """RECORDS copies of one JPEG whose red channel is the x coordinate and green the y coordinate
    (0..255 across the image), label = record id: a crop's red and green ranges are its window's width
    and height as shares of the image's."""
    red = np.broadcast_to(np.linspace(0, 255, WIDTH), (HEIGHT, WIDTH))
    green = np.broadcast_to(np.linspace(0, 255, HEIGHT)[:, None], (HEIGHT, WIDTH))
    buf = io.BytesIO()
    pixels = np.stack([red, green, np.full((HEIGHT, WIDTH), 128.0)], -1).astype(np.uint8)
    Image.fromarray(pixels).save(buf, "JPEG", quality=95)
    tmp = tmp_path_factory.mktemp("ramp")
    with RecordWriter(tmp / "ramp.rec", tmp / "ramp.idx") as writer:
        for i in range(RECORDS):
            writer.write(i, pack_record(IRHeader(0, float(i), i, 0), buf.getvalue()))
    return str(tmp / "ramp.rec"), str(tmp / "ramp.idx")


def one_epoch(ramp_rec, **spec):
    rec, idx = ramp_rec
    loader = build_loader("dali", LoaderSpec(rec, idx, batch_size=64, image_size=32, workers=1, **spec))
    batches = list(loader.epoch(0))
    return loader, torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def crop_windows(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(area share, log aspect ratio w/h in source pixels) of each crop, read from its ramp values."""
    px = images.float() * torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    width = (px[:, 0].amax((1, 2)) - px[:, 0].amin((1, 2))) / 255
    height = (px[:, 1].amax((1, 2)) - px[:, 1].amin((1, 2))) / 255
    return width * height, torch.log(width * WIDTH / (height * HEIGHT))


@pytest.fixture(scope="module")
def roi_epoch(ramp_rec):
    return one_epoch(ramp_rec, decode="roi")


@pytest.mark.parametrize("decode", ["full", "cpu"])
def test_each_decode_path_reads_the_roi_paths_records_with_its_crop_statistics(ramp_rec, roi_epoch, decode):
    """Same records in the same order (the reader is the same), and windows drawn from the same
    distribution: over 1024 crops, measured area share 0.420 +- 0.204 (roi) and 0.419 +- 0.209 (full),
    log aspect ratio 0.034 +- 0.164 and 0.030 +- 0.166; the tolerances are 3-4 standard errors of
    the difference (a scale of (0.25, 1) instead of (0.08, 1) moves the mean area by ~0.1)."""
    _, roi_images, roi_labels = roi_epoch
    loader, images, labels = one_epoch(ramp_rec, decode=decode)
    assert loader.choice.decode_path == decode and f"train.decode: {decode}" in loader.choice.decode
    assert labels.tolist() == roi_labels.tolist()
    assert sorted(labels.tolist()) == list(range(RECORDS))  # 16 full batches of 64: no padding
    assert images.shape == roi_images.shape == (RECORDS, 3, 32, 32)
    (area, ratio), (roi_area, roi_ratio) = crop_windows(images), crop_windows(roi_images)
    assert abs(area.mean() - roi_area.mean()) < 0.03, (area.mean(), roi_area.mean())
    assert abs(area.std() - roi_area.std()) < 0.03, (area.std(), roi_area.std())
    assert abs(ratio.mean() - roi_ratio.mean()) < 0.03, (ratio.mean(), roi_ratio.mean())
    assert abs(ratio.std() - roi_ratio.std()) < 0.03, (ratio.std(), roi_ratio.std())


def test_the_roi_paths_crops_span_the_random_resized_crop_range(roi_epoch):
    """The measurement above sees the windows: areas from near the 0.08 floor to the whole image."""
    area, _ = crop_windows(roi_epoch[1])
    assert area.min() < 0.12 and area.max() > 0.9


@pytest.mark.parametrize("decode", ["roi", "full"])
@pytest.mark.parametrize("dtype,channels_last", [("float16", True), ("float32", False), ("float32", True)])
def test_dali_images_come_in_the_training_dtype_and_layout(ramp_rec, decode, dtype, channels_last):
    """crop_mirror_normalize writes the dtype and, with channels_last, NHWC (an NCHW view: the step's
    .contiguous(channels_last) copies nothing); without it plain NCHW."""
    loader, images, _ = one_epoch(ramp_rec, decode=decode, dtype=dtype, channels_last=channels_last)
    assert images.dtype == loader.image_dtype == getattr(torch, dtype)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert images.is_contiguous(memory_format=layout)
    assert not images.is_contiguous(memory_format=torch.contiguous_format if channels_last else torch.channels_last)


def test_float16_images_equal_the_float32_ones_rounded(ramp_rec):
    _, half, _ = one_epoch(ramp_rec, decode="roi", dtype="float16")
    _, full, _ = one_epoch(ramp_rec, decode="roi", dtype="float32")
    assert torch.allclose(half.float(), full, atol=2e-3, rtol=1e-3)


def test_bf16_training_gets_bfloat16_where_dali_has_it_else_float32(ramp_rec):
    """DALI 1.34 (envs/requirements.txt) has no bfloat16: its images stay float32 and autocast casts them
    in the first layer; the torch loader writes bfloat16."""
    assert image_dtype("bf16") == "bfloat16" and image_dtype("fp16") == "float16" and image_dtype("fp32") == "float32"
    loader, images, _ = one_epoch(ramp_rec, decode="roi", dtype="bfloat16")
    expected = torch.bfloat16 if hasattr(types, "BFLOAT16") else torch.float32
    assert images.dtype == loader.image_dtype == expected
    rec, idx = ramp_rec
    spec = LoaderSpec(rec, idx, batch_size=8, image_size=32, workers=0, dtype="bfloat16", seed=1)
    x, _ = next(iter(build_loader("torch", spec).epoch(0)))
    assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)


def test_auto_is_roi_and_an_unknown_path_is_refused_naming_the_key():
    assert decode_path("auto") == "roi"
    with pytest.raises(ValueError, match="train.decode"):
        decode_path("gpu")


@pytest.mark.parametrize(
    "decode,starts,names",
    [
        ("auto", "gpu: DALI mixed decoder, ROI decode", "roi"),
        ("roi", "gpu: DALI mixed decoder, ROI decode", "roi"),
        ("full", "gpu: DALI mixed decoder, full-image decode", "full"),
        ("cpu", "cpu: DALI (libjpeg-turbo)", "cpu"),
    ],
)
def test_on_a_gpu_the_decode_path_decides_where_dali_decodes(decode, starts, names):
    choice = choose_loader("dali", has_cuda=True, has_dali=True, decode=decode)
    assert choice.decode.startswith(starts) and choice.decode_path == names and choice.note is None


def test_decode_cpu_keeps_the_torch_loaders_decode_off_the_gpu_too():
    assert choose_loader("torch", True, True, decode="cpu").decode.startswith("cpu: simplejpeg")
    assert choose_loader("torch", True, True, decode="full").decode.startswith("gpu: TorchCodec")
    assert LoaderSpec("r", "i", 8, 32, device="cuda:0", decode="cpu").gpu_decodes is False
    assert LoaderSpec("r", "i", 8, 32, device="cuda:0", decode="auto").gpu_decodes is True
