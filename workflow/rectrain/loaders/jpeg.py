"""JPEG decoding for the torch loader: bytes from a .rec -> uint8 CHW RGB tensors, JPEG and nothing else.

The pack stores only JPEG (rectrain.data.images re-encodes every other format), and a .rec from
elsewhere is untrusted: a decoder that also opens other formats lets a record choose its decoder
(Pillow's PostScript plugin starts Ghostscript). So every path here refuses bytes that do not begin
with a JPEG signature before any decoder sees them, and each decoder used reads JPEG alone.

- decode (the worker path): simplejpeg (libjpeg-turbo, JPEG-only), lenient like Pillow (libjpeg's
  recoverable warnings do not fail a training read); Pillow restricted to JPEG for what simplejpeg
  refuses and where simplejpeg is not installed. Both give the same RGB pixels for what the pack
  writes (baseline/progressive YCbCr or grayscale), so the augmentation sees what it saw with Pillow.
- decode_batch (train.gpu_decode): TorchCodec's decode_jpeg, one batched nvJPEG call on a GPU (the
  maintained successor of the deprecated torchvision.io decoders); on the CPU without TorchCodec,
  decode per image.
Speeds: bench/torch_decode_bench.py, numbers in bench/RESULTS.md.
"""

from __future__ import annotations

import functools
import io

import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from rectrain.loaders import TORCHCODEC_FIX

try:  # libjpeg-turbo through a thin wrapper, as the pack uses it (rectrain.data.images)
    import simplejpeg
except ImportError:  # Pillow restricted to JPEG serves every image
    simplejpeg = None

SIGNATURE = b"\xff\xd8\xff"  # SOI followed by a marker: how every JPEG begins


class NotJpeg(ValueError):
    """Bytes the torch loader will not decode; str() says what they are and the fix; `position`: the
    item's place in the batch (decode_batch)."""

    position: int | None = None


def check_jpeg(data) -> None:
    """NotJpeg unless `data` (bytes or a uint8 tensor) begins like a JPEG."""
    head = bytes(data[:3].tolist()) if isinstance(data, torch.Tensor) else bytes(data[:3])
    if head != SIGNATURE:
        start = bytes(data[:8].tolist()) if isinstance(data, torch.Tensor) else bytes(data[:8])
        raise NotJpeg(
            f"not a JPEG (starts with {start!r}); the pack stores only JPEG and the torch loader decodes "
            "nothing else: rebuild the pair with the pack, or re-encode its records as JPEG"
        )


def decode_pil(data: bytes) -> torch.Tensor:
    """Pillow, JPEG plugin only (any colour space, CMYK included, converted to RGB)."""
    check_jpeg(data)
    with Image.open(io.BytesIO(data), formats=("JPEG",)) as im:
        return F.pil_to_tensor(im.convert("RGB"))


def decode_simplejpeg(data: bytes) -> torch.Tensor:
    """simplejpeg to RGB; ValueError for what libjpeg-turbo cannot read or convert to RGB."""
    check_jpeg(data)
    return torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB", strict=False)).permute(2, 0, 1)


def decode(data: bytes) -> torch.Tensor:
    """A JPEG's pixels as a uint8 CHW RGB tensor; NotJpeg for anything else, OSError/ValueError when
    the JPEG itself cannot be read."""
    if simplejpeg is None:
        return decode_pil(data)
    try:
        return decode_simplejpeg(data)
    except NotJpeg:
        raise
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
    """Decode a batch of JPEG byte tensors (CPU) to uint8 CHW RGB tensors on `device`: TorchCodec when
    installed (one nvJPEG call for the batch on a GPU), else one CPU decode per image.

    Raises NotJpeg, its `position` set, for the first item that is not a JPEG."""
    for pos, item in enumerate(data):
        try:
            check_jpeg(item)
        except NotJpeg as err:
            err.position = pos
            raise
    if torchcodec_error() is None:
        from torchcodec.decoders import decode_jpeg

        return decode_jpeg(data, mode="RGB", device=device)
    if device.type != "cpu":
        raise RuntimeError(f"GPU JPEG decode needs TorchCodec ({torchcodec_error()}): {TORCHCODEC_FIX}")
    return [decode(item.numpy().tobytes()) for item in data]
