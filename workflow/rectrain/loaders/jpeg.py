"""Image decoding for the torch loader: bytes from a .rec -> uint8 CHW RGB tensors.

The pack stores only JPEG (rectrain.data.images re-encodes every other format); a pair of your own
(recordio) keeps, as they are, records in the other formats the pack opens (PNG, BMP, TIFF, WebP, GIF:
rectrain.data.formats) once its check has decoded every one.  A .rec from elsewhere is untrusted: a
decoder that opens any format lets a record choose its decoder (Pillow's PostScript plugin starts
Ghostscript).  So every path here refuses bytes that do not begin with the signature of one of those
formats before any decoder sees them, and each decoder used reads only those formats.

- decode (the worker path), JPEG: simplejpeg (libjpeg-turbo, JPEG-only), lenient like Pillow (libjpeg's
  recoverable warnings do not fail a training read); Pillow restricted to JPEG for what simplejpeg
  refuses and where simplejpeg is not installed. Both give the same RGB pixels for what the pack
  writes (baseline/progressive YCbCr or grayscale), so the augmentation sees what it saw with Pillow.
- decode, the other formats: Pillow restricted to them, with the pack's size guard and its conversion
  to RGB (rectrain.data.images.to_rgb: alpha on mid-gray, 16-bit samples scaled), so a kept PNG trains
  on the pixels the pack would have re-encoded.
- decode_batch (train.gpu_decode): TorchCodec's decode_jpeg, one batched nvJPEG call on a GPU for the
  batch's JPEGs (the maintained successor of the deprecated torchvision.io decoders), any other record
  decoded here and moved; on the CPU without TorchCodec, decode per image.
Speeds: bench/torch_decode_bench.py, numbers in bench/RESULTS.md.
"""

from __future__ import annotations

import functools
import io

import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from rectrain.data import images
from rectrain.data.formats import HEAD_BYTES, SUPPORTED_FORMATS, sniff
from rectrain.loaders.spec import TORCHCODEC_FIX

try:  # libjpeg-turbo through a thin wrapper, as the pack uses it (rectrain.data.images)
    import simplejpeg
except ImportError:  # Pillow restricted to JPEG serves every image
    simplejpeg = None


class Undecodable(ValueError):
    """Bytes the torch loader will not decode; str() says what they are and the fix; `position`: the
    item's place in the batch (decode_batch)."""

    position: int | None = None


def image_format(data) -> str:
    """The format `data` (bytes or a uint8 tensor) begins like, one of SUPPORTED_FORMATS; Undecodable
    for anything else."""
    head = bytes(data[:HEAD_BYTES].tolist()) if isinstance(data, torch.Tensor) else bytes(data[:HEAD_BYTES])
    fmt = sniff(head)
    if fmt is None:
        raise Undecodable(
            f"not an image the loader decodes (starts with {head[:8]!r}): records hold JPEG, or from a pair of "
            f"your own {', '.join(f for f in SUPPORTED_FORMATS if f != 'JPEG')}; rebuild the pair with the "
            "pack, or re-encode its records as JPEG"
        )
    return fmt


def decode_pil(data: bytes) -> torch.Tensor:
    """Pillow, JPEG plugin only (any colour space, CMYK included, converted to RGB)."""
    with Image.open(io.BytesIO(data), formats=("JPEG",)) as im:
        return F.pil_to_tensor(im.convert("RGB"))


def decode_simplejpeg(data: bytes) -> torch.Tensor:
    """simplejpeg to RGB; ValueError for what libjpeg-turbo cannot read or convert to RGB."""
    return torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB", strict=False)).permute(2, 0, 1)


def decode_other(data: bytes) -> torch.Tensor:
    """A PNG, BMP, TIFF, WebP or GIF (first frame) in RGB as the pack converts it; ValueError for a header
    whose size no photo needs."""
    try:
        with images.open_supported(data) as im:
            images.check_pixels(*im.size, f"the {im.format} header")
            deep = images.deep_samples(im)
            im.load()
            return F.pil_to_tensor(images.to_rgb(im, im.format, deep, []))
    except images.Skip as err:
        raise ValueError(str(err)) from None
    except Image.DecompressionBombError as err:  # Pillow's own guard, in open() past twice the limit
        raise ValueError(f"decompression bomb guard: {err}") from None


def decode(data: bytes) -> torch.Tensor:
    """A record's pixels as a uint8 CHW RGB tensor; Undecodable for bytes in none of the formats,
    OSError/ValueError when the image itself cannot be read."""
    if image_format(data) != "JPEG":
        return decode_other(data)
    if simplejpeg is None:
        return decode_pil(data)
    try:
        return decode_simplejpeg(data)
    except ValueError:  # what Pillow may still read (its lenient path); else Pillow's own error names it
        return decode_pil(data)


@functools.cache
def torchcodec_error() -> str | None:
    """Why TorchCodec's image decoders cannot be used here; None when they can."""
    try:
        from torchcodec.decoders import decode_jpeg  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install (ABI, missing library) is as unusable as none
        return f"{type(exc).__name__}: {exc}"
    return None


def decode_batch(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Decode a batch of image byte tensors (CPU) to uint8 CHW RGB tensors on `device`: the JPEGs with
    TorchCodec when installed (one nvJPEG call on a GPU), every other record and every image without
    TorchCodec by `decode`.

    Raises Undecodable, its `position` set, for the first item in none of the formats."""
    formats = []
    for pos, item in enumerate(data):
        try:
            formats.append(image_format(item))
        except Undecodable as err:
            err.position = pos
            raise
    if torchcodec_error() is None:
        from torchcodec.decoders import decode_jpeg

        jpegs = [pos for pos, fmt in enumerate(formats) if fmt == "JPEG"]
        decoded = decode_jpeg([data[p] for p in jpegs], mode="RGB", device=device) if jpegs else []
        out = dict(zip(jpegs, decoded, strict=True))
        for pos, fmt in enumerate(formats):
            if fmt != "JPEG":
                out[pos] = decode_other(data[pos].numpy().tobytes()).to(device)
        return [out[pos] for pos in range(len(data))]
    if device.type != "cpu":
        raise RuntimeError(f"GPU JPEG decode needs TorchCodec ({torchcodec_error()}): {TORCHCODEC_FIX}")
    return [decode(item.numpy().tobytes()) for item in data]
