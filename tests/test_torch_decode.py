"""The torch loader decodes JPEG and the other formats a pair of your own keeps (PNG, BMP, TIFF, WebP,
GIF) and nothing else (a .rec from elsewhere is untrusted: #26), with maintained decoders and no
deprecation warning (#24); it gives the pixels Pillow gives, converted to RGB as the pack converts."""

import io
import os
import stat
import subprocess
import warnings
import zlib

import numpy as np
import pytest
import torch
from helpers.packdata import animated_gif, gray16_png, photo, png_bytes, postscript, transparent_png
from PIL import Image
from torchvision.transforms.v2 import functional as F

from rectrain.data import images
from rectrain.loaders import LoaderSpec, jpeg
from rectrain.loaders.pytorch import RecordDecodeError, TorchLoader
from rectrain.recordio import IRHeader, RecordWriter, pack_record


def _jpeg(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _rec(path, payloads: dict[int, bytes]):
    """A .rec/.idx with one record per (id, image bytes), label 0."""
    rec, idx = path / "data.rec", path / "data.idx"
    with RecordWriter(rec, idx) as w:
        for key, data in payloads.items():
            w.write(key, pack_record(IRHeader(0, 0.0, key, 0), data))
    return str(rec), str(idx)


def _fake_gs(tmp_path, monkeypatch):
    """A Ghostscript stand-in first on PATH: if anything runs it, the returned marker appears."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "gs-was-run"
    bin_dir.mkdir()
    fake = bin_dir / "gs"
    fake.write_text(f'#!/bin/sh\necho "$@" > {marker}\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return marker


def _read_all(rec, idx, workers: int, decode_on_device: bool):
    spec = LoaderSpec(rec, idx, batch_size=4, image_size=16, train=False, workers=workers)
    return [y for _, ys in TorchLoader(spec, decode_on_device=decode_on_device).epoch(0) for y in ys.tolist()]


@pytest.mark.parametrize("workers,decode_on_device", [(1, False), (0, False), (0, True)])
def test_postscript_record_through_the_torch_loader_starts_no_program_and_names_the_record(
    tmp_path, monkeypatch, workers, decode_on_device
):
    marker = _fake_gs(tmp_path, monkeypatch)
    good = {k: _jpeg(photo(40, 30, k)) for k in range(3)}
    rec, idx = _rec(tmp_path, {**good, 7: postscript()})
    if workers == 0:  # in this process, nothing may start a program at all (a worker's would not show here)
        monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"a record started a program: {a}"))
    with pytest.raises(RecordDecodeError) as caught:
        _read_all(rec, idx, workers, decode_on_device)
    assert not marker.exists(), f"a record started Ghostscript: {marker.read_text()}"
    message = str(caught.value)
    assert rec in message and "id 7" in message
    assert "not an image the loader decodes (starts with b'%!PS-Ado')" in message
    assert "rebuild the pair with the pack" in message


def _saved(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,kw", [("PNG", {}), ("BMP", {}), ("TIFF", {}), ("WEBP", {"lossless": True})])
def test_a_lossless_record_of_a_pair_of_your_own_decodes_to_its_exact_pixels(fmt, kw):
    """An im2rec pass-through .rec keeps ImageNet's PNG named .JPEG as a PNG record: the torch loader
    decodes it (it refused it mid-epoch before) to the pixels that were saved."""
    im = photo(48, 36, 3)
    decoded = jpeg.decode(_saved(im, fmt, **kw))
    assert decoded.dtype == torch.uint8 and decoded.shape == (3, 36, 48)
    assert torch.equal(decoded, F.pil_to_tensor(im))


def test_a_kept_record_trains_on_the_pixels_the_pack_would_have_re_encoded():
    """Transparency on mid-gray, 16-bit samples scaled, a GIF's first frame, a palette: what the pack stores for
    these (rectrain.data.images.prepare, a JPEG) is what the loader decodes from the kept record, within
    the JPEG's own error."""
    for data in (
        transparent_png(),
        gray16_png(),
        animated_gif(),
        png_bytes(Image.new("RGB", (64, 48), (200, 40, 90)).quantize(4)),
    ):
        kept = jpeg.decode(data).int()
        packed = jpeg.decode(images.prepare(data, 0, 95, True)[0]).int()
        assert kept.shape == packed.shape
        assert (kept - packed).abs().float().mean() < 2.0, (kept - packed).abs().float().mean()
    right_half = jpeg.decode(transparent_png())[:, :, 32:]
    assert (right_half == torch.tensor(images.NEUTRAL, dtype=torch.uint8).view(3, 1, 1)).all(), "not the hidden green"


@pytest.mark.parametrize("decode_on_device", [False, True])
def test_an_epoch_over_jpeg_png_and_gif_records_reads_every_record(tmp_path, decode_on_device):
    """Both decode paths (per worker, and per batch as train.gpu_decode does) read the whole epoch."""
    payloads = {
        0: _jpeg(photo(40, 30, 0)),
        5: png_bytes(photo(40, 30, 1)),
        6: animated_gif(),
        9: _jpeg(photo(30, 40, 2)),
    }
    rec, idx = _rec(tmp_path, payloads)
    spec = LoaderSpec(rec, idx, batch_size=4, image_size=16, train=False, workers=0)
    ids = []
    for images_, _ in TorchLoader(spec, decode_on_device=decode_on_device).epoch(0):
        assert images_.shape[1:] == (3, 16, 16) and torch.isfinite(images_).all()
        ids.append(len(images_))
    assert sum(ids) == len(payloads)


def test_a_bomb_header_in_a_kept_record_is_refused_before_its_decode():
    """The pack's size guard holds in the loader too: a PNG claiming 20000 x 20000 is never decoded."""
    small = png_bytes(photo(8, 8, 0))
    ihdr = small.index(b"IHDR") + 4
    header = b"IHDR" + (20000).to_bytes(4, "big") * 2 + small[ihdr + 8 : ihdr + 13]
    bomb = small[: ihdr - 4] + header + zlib.crc32(header).to_bytes(4, "big") + small[ihdr + 17 :]
    with pytest.raises(ValueError, match="decompression bomb guard"):
        jpeg.decode(bomb)


def test_damaged_jpeg_record_names_the_record_and_the_decoder_error(tmp_path):
    data = _jpeg(photo(40, 30, 0))
    rec, idx = _rec(tmp_path, {3: data[:2] + b"\xff\xd8" + data[20:300]})  # JPEG signature, no picture
    with pytest.raises(RecordDecodeError, match=r"record 0 \(id 3\)"):
        _read_all(rec, idx, 0, False)


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
@pytest.mark.parametrize("with_simplejpeg", [True, False])
def test_worker_decode_gives_the_pixels_pillow_gives(monkeypatch, mode, with_simplejpeg):
    """The loader's augmentation sees what it saw when Pillow decoded every record: the same RGB pixels
    for the colour spaces the pack writes; a CMYK JPEG (a .rec from elsewhere) within one level (libjpeg-
    turbo's and Pillow's CMYK -> RGB formulas round differently)."""
    if not with_simplejpeg:
        monkeypatch.setattr(jpeg, "simplejpeg", None)
    data = _jpeg(photo(48, 36, 2).convert(mode))
    expected = F.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
    decoded = jpeg.decode(data)
    assert decoded.dtype == torch.uint8 and decoded.shape == (3, 36, 48)
    assert (decoded.int() - expected.int()).abs().max() <= (1 if mode == "CMYK" else 0)


def test_batch_decode_with_torchcodec_matches_the_worker_decode():
    pytest.importorskip("torchcodec.decoders")
    data = [_jpeg(photo(48, 36, k)) for k in range(3)] + [_jpeg(photo(30, 20, 9).convert("L"))]
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    decoded = jpeg.decode_batch(tensors, torch.device("cpu"))
    assert all(torch.equal(a, jpeg.decode(d)) for a, d in zip(decoded, data, strict=True))


@pytest.mark.parametrize("decode_on_device", [False, True])
def test_torch_loader_decodes_without_a_deprecation_warning(tmp_path, decode_on_device):
    """torchvision.io's decoders warn (deprecated since torchvision 0.29): neither path may use them."""
    rec, idx = _rec(tmp_path, {k: _jpeg(photo(40, 30, k)) for k in range(6)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        spec = LoaderSpec(rec, idx, batch_size=4, image_size=16, train=True, workers=0, seed=1)
        batches = list(TorchLoader(spec, decode_on_device=decode_on_device).epoch(0))
    assert sum(len(y) for _, y in batches) == 8 and np.isfinite(torch.cat([x for x, _ in batches]).numpy()).all()
