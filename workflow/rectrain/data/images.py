"""Decide, by content, what the packer stores for one source file.

- a clean JPEG (baseline/extended/progressive Huffman, 8-bit, grayscale or YCbCr, complete, no EXIF
  rotation) is stored byte for byte when no resize is needed: no decode, no quality loss;
- CMYK/YCCK, other formats behind a .JPEG name (PNG, GIF, BMP...), EXIF-rotated or otherwise odd
  JPEGs are decoded, fixed and re-encoded as RGB JPEG, and reported as repaired with the reason;
- empty, truncated and non-image files are skipped with the reason.

The pass-through check reads only the JPEG marker segments: a full decode of every image would cost
as much as resizing it. Truncation, the failure real data has, shows as a missing end-of-image
marker after the scan data; the pack's verification step still decodes a sample of the output.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

try:  # libjpeg-turbo through a thinner wrapper: decodes 500x375 JPEGs in ~0.75 ms, Pillow ~0.92 ms
    import simplejpeg
except ImportError:  # Pillow's path serves every image, ~10 % slower when resizing
    simplejpeg = None
try:  # SIMD resampling (see shrink); in the env, but absent from e.g. a bare GPU box's system Python
    import cv2
except ImportError:
    cv2 = None

# Very large photos are legitimate input here (the user's own data); JPEG draft decoding keeps their
# memory down. The limit still stops a decompression bomb (1 gigapixel ~ 3 GB as RGB).
Image.MAX_IMAGE_PIXELS = 1 << 30

# The pack parallelises over images with its own threads (cv2 releases the GIL); OpenCV's pool on
# top of them would only oversubscribe the rule's cores.
if cv2 is not None:
    cv2.setNumThreads(1)

# Huffman-coded sequential (C0, C1) and progressive (C2) frames: what every JPEG decoder reads,
# DALI/nvJPEG included. Lossless, hierarchical and arithmetic-coded frames get re-encoded.
_PLAIN_SOF = {0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive"}
_ALL_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = {0x01, 0xD8} | set(range(0xD0, 0xD8))


class Skip(Exception):
    """The file cannot be packed; str() is the reason recorded in the manifest."""


@dataclass
class JpegInfo:
    sof: int | None = None
    bits: int = 8
    width: int = 0
    height: int = 0
    components: int = 0
    adobe_transform: int | None = None
    exif: bytes | None = None
    complete: bool = False  # an end-of-image marker follows the first scan


def read_jpeg_header(data: bytes) -> JpegInfo | None:
    """Marker segments up to the first scan; None when the bytes are not a JPEG at all."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    info = JpegInfo()
    pos, n = 2, len(data)
    while True:
        if pos + 4 > n:
            raise Skip(f"truncated JPEG: file ends at byte {n} inside the header")
        if data[pos] != 0xFF:
            raise Skip(f"corrupt JPEG: expected a marker at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker == 0xD9:
            raise Skip("corrupt JPEG: end-of-image marker before any image data")
        seglen = int.from_bytes(data[pos + 2 : pos + 4], "big")
        seg = data[pos + 4 : pos + 2 + seglen]
        if marker in _ALL_SOF and info.sof is None and len(seg) >= 6:
            info.sof, info.bits, info.components = marker, seg[0], seg[5]
            info.height, info.width = int.from_bytes(seg[1:3], "big"), int.from_bytes(seg[3:5], "big")
        elif marker == 0xE1 and seg.startswith(b"Exif\0\0") and info.exif is None:
            info.exif = seg
        elif marker == 0xEE and seg.startswith(b"Adobe") and len(seg) >= 12:
            info.adobe_transform = seg[11]
        elif marker == 0xDA:
            scan_start = pos + 2 + seglen
            info.complete = data.rfind(b"\xff\xd9", scan_start) != -1
            return info
        pos += 2 + seglen


def exif_orientation(exif_segment: bytes | None) -> int:
    if not exif_segment:
        return 1
    exif = Image.Exif()
    try:
        exif.load(exif_segment)
    except Exception:
        return 1  # unreadable EXIF: decoders ignore it as well
    return int(exif.get(0x0112, 1) or 1)


def _jpeg_problems(info: JpegInfo, orientation: int) -> list[str]:
    """Why this JPEG cannot be stored as is (empty when it is clean)."""
    problems = []
    if info.sof not in _PLAIN_SOF:
        kind = f"SOF marker 0x{info.sof:02X}" if info.sof is not None else "no frame header"
        problems.append(f"JPEG with an unusual coding ({kind}) re-encoded as baseline")
    if info.components == 4:
        problems.append("CMYK JPEG converted to RGB")
    elif info.components not in (1, 3):
        problems.append(f"JPEG with {info.components} colour components converted to RGB")
    elif info.components == 3 and info.adobe_transform == 0:
        problems.append("JPEG stored as raw RGB (Adobe transform 0) re-encoded as YCbCr")
    if orientation not in (0, 1):
        problems.append(f"EXIF orientation {orientation} applied to the pixels")
    return problems


def _target_size(width: int, height: int, resize: int) -> tuple[int, int]:
    """Shorter side = resize, aspect kept; never larger than the source."""
    short = min(width, height)
    if resize <= 0 or short <= resize:
        return width, height
    scale = resize / short
    if width <= height:
        return resize, max(1, round(height * scale))
    return max(1, round(width * scale)), resize


def _prefilter_sigma(scale: float) -> float:
    """Gaussian blur that takes a pixel's own blur (sigma 0.5) to that of the larger output pixel
    (0.5 * scale): sqrt((0.5 s)^2 - 0.5^2), the scale-space rule image pyramids use."""
    return 0.5 * math.sqrt(scale * scale - 1) if scale > 1 else 0.0


def shrink(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Downscale an HxWxC uint8 array to ``size`` (w, h), antialiased: Gaussian prefilter + bilinear.

    bench/resize_quality.py, 500x375 q90 photo-like JPEGs to shorter sides 200-320: PSNR against an
    area average of the uncompressed image within 0.25 dB of OpenCV's INTER_AREA (ahead of it from
    ratio 1.4 up) and 1.5-2 dB above Pillow's BOX, in a third of their time: both OpenCV steps are SIMD
    at any ratio, while INTER_AREA and Pillow run scalar code for the fractional ratios left after
    the DCT-domain reduction. Plain bilinear (im2rec's INTER_LINEAR) is as fast but aliases: up to
    -2 dB from ratio 1.4 up. Without OpenCV, Pillow's antialiased BILINEAR: the same PSNR, 4x slower.
    """
    if cv2 is None:
        return np.asarray(Image.fromarray(pixels).resize(size, Image.Resampling.BILINEAR))
    height, width = pixels.shape[:2]
    sigma_x, sigma_y = _prefilter_sigma(width / size[0]), _prefilter_sigma(height / size[1])
    if max(sigma_x, sigma_y) > 0.1:  # below that the 8-bit kernel is the identity
        # After the DCT-domain reduction the ratio is under 2 (sigma < 0.87): 3 taps give the same
        # PSNR as OpenCV's 5 (within 0.02 dB) and cost 30 % less. Other sources get OpenCV's size.
        taps = (3, 3) if max(sigma_x, sigma_y) < 1 else (0, 0)
        # a sigma of 0 would make OpenCV derive one from the kernel size and blur an unscaled axis
        pixels = cv2.GaussianBlur(pixels, taps, sigmaX=max(sigma_x, 1e-3), sigmaY=max(sigma_y, 1e-3))
    return cv2.resize(pixels, size, interpolation=cv2.INTER_LINEAR)


def _decoded_short_side(short: int, resize: int) -> int:
    """The shorter side to decode a JPEG at: the strongest 1/8, 1/4 or 1/2 reduction still >= resize.

    libjpeg-turbo also scales by m/8 (6/8 makes a 375-px side 282 px), but measured on 500x375 q90
    JPEGs to 256 px that is no faster: its m/8 inverse DCTs have no SIMD code (decoding at 6/8 takes
    1.10 ms against 0.75 ms at full size), and the nearly 1:1 Pillow BOX step then used after it lost
    ~1 dB PSNR against a reference downscale of the uncompressed image. The power-of-two reductions
    are the ones Pillow's draft() uses, so both paths agree.
    """
    for denominator in (8, 4, 2):
        if -(-short // denominator) >= resize:
            return -(-short // denominator)
    return short


def _resize_clean_jpeg(data: bytes, info: JpegInfo, resize: int, quality: int) -> bytes | None:
    """Decode (simplejpeg, RGB), shrink and encode (simplejpeg) a clean JPEG; None when
    libjpeg-turbo objects.

    Strict decoding refuses even recoverable damage, which then takes Pillow's path as before.
    """
    if info.width * info.height > Image.MAX_IMAGE_PIXELS:
        return None  # Pillow's path reports the decompression bomb
    size = _target_size(info.width, info.height, resize)
    # simplejpeg decodes at the strongest reduction that keeps this side: exactly the one asked for
    if info.width <= info.height:
        fit = {"min_width": _decoded_short_side(info.width, resize)}
    else:
        fit = {"min_height": _decoded_short_side(info.height, resize)}
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", **fit)
    except ValueError:
        return None
    if pixels.shape[1::-1] != size:
        pixels = shrink(pixels, size)
    # the same libjpeg-turbo encoder and 4:2:0 subsampling as Pillow's default, ~0.1 ms faster
    return simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling="420")


def _encode(data: bytes, resize: int, quality: int, jpeg: JpegInfo | None, orientation: int | None) -> bytes:
    """Decode, orient, convert, shrink and encode as JPEG. ``orientation`` None = not known yet."""
    try:
        im = Image.open(io.BytesIO(data))
        source_size = im.size  # the output's aspect comes from it, not from a reduced decode
        if jpeg is not None:
            target = _target_size(im.width, im.height, resize)
            # A YCbCr JPEG stays YCbCr through the resize into the encoder (no colour conversions),
            # and draft() downscales in the DCT domain (1/2, 1/4, 1/8) while decoding.
            im.draft("YCbCr" if im.mode == "RGB" and jpeg.adobe_transform != 0 else None, target)
        im.load()
        if orientation not in (0, 1):
            upright = ImageOps.exif_transpose(im)
            if upright.size != im.size:
                source_size = source_size[::-1]
            im = upright
        if im.mode in ("P", "PA", "LA"):
            im = im.convert("RGBA")  # palette/alpha images convert to RGB correctly only via RGBA
        if im.mode not in ("RGB", "YCbCr"):
            im = im.convert("RGB")
        size = _target_size(*source_size, resize)
        if size != im.size:  # YCbCr pixels shrink like RGB ones: the filter is per channel
            im = Image.frombytes(im.mode, size, shrink(np.asarray(im), size).tobytes())
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
        return buf.getvalue()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise Skip(f"cannot decode: {err}") from None


def prepare(data: bytes, resize: int, quality: int) -> tuple[bytes, str | None]:
    """The JPEG bytes to store for one source and the repair reason (None when nothing was wrong).

    Raises Skip when the file cannot become a usable image.
    """
    if not data:
        raise Skip("empty file (0 bytes)")
    info = read_jpeg_header(data)
    if info is not None:
        if not info.complete:
            raise Skip("truncated JPEG: no end-of-image marker after the scan data")
        if info.bits != 8:
            raise Skip(f"{info.bits}-bit JPEG: 8-bit decoders (DALI, PIL) cannot read it")
        orientation = exif_orientation(info.exif)
        problems = _jpeg_problems(info, orientation)
        if not problems and _target_size(info.width, info.height, resize) == (info.width, info.height):
            return data, None
        if not problems and simplejpeg is not None:
            resized = _resize_clean_jpeg(data, info, resize, quality)
            if resized is not None:
                return resized, None
        return _encode(data, resize, quality, info, orientation), "; ".join(problems) or None
    try:
        with Image.open(io.BytesIO(data)) as probe:
            fmt = probe.format
    except UnidentifiedImageError:
        head = data[:16]
        raise Skip(f"not an image: unrecognised content (starts with {head!r})") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise Skip(f"cannot decode: {err}") from None
    return _encode(data, resize, quality, None, None), f"{fmt} content named as JPEG re-encoded as JPEG"
