"""Decide, by content, what the packer stores for one source file.

- a clean JPEG (baseline/extended/progressive Huffman, 8-bit, grayscale or YCbCr, complete, no EXIF
  rotation, entropy-coded data that libjpeg-turbo decodes without a warning) is stored byte for byte
  when no resize is needed (pack.resize, pack.max_side: rectrain.data.fit): no quality loss;
- CMYK/YCCK, other formats behind a .JPEG name (PNG, GIF, BMP, TIFF, WebP), EXIF-rotated or otherwise
  odd JPEGs are decoded, fixed and re-encoded as RGB JPEG, and reported as repaired with the reason;
  16-bit samples are scaled to 8 bits, transparency is composited on mid-gray, an animation keeps its
  first frame, each said in the reason;
- empty, truncated, corrupt, oversized (decompression bomb) and non-image files, and every format
  outside SUPPORTED_FORMATS (PostScript would make Pillow start Ghostscript), are skipped with the reason.

Every JPEG's scan data is checked by a decode at 1/8 scale in grayscale (libjpeg-turbo still reads
every Huffman code but skips most of the inverse DCT and all colour conversion): ~0.7 ms per 500x375
q90 image on the CI box, against ~0.9 ms for a full decode. A resize's own strict decode is the
check there. A header check alone passes corrupt scan data that then kills the training decoder.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from rectrain.data.fit import Fit
from rectrain.data.formats import SUPPORTED_FORMATS, extension, named_format

try:  # libjpeg-turbo through a thinner wrapper: decodes 500x375 JPEGs in ~0.75 ms, Pillow ~0.92 ms
    import simplejpeg
except ImportError:  # Pillow's path serves every image, ~10 % slower when resizing
    simplejpeg = None
try:  # SIMD resampling (see shrink); in the env, but absent from e.g. a bare GPU box's system Python
    import cv2
except ImportError:
    cv2 = None

# Very large photos are legitimate input here (the user's own data); JPEG draft decoding keeps their
# memory down. The limit stops a decompression bomb before its decode: a 32 KB PNG claiming 0.27
# gigapixels took 1.37 GB (~5 bytes per pixel through decode, alpha and conversion), so 2**27 (134
# megapixels) keeps one image under ~0.7 GB per pack thread, while 100-megapixel camera photos and
# ImageNet's largest (~7,000 x 5,000) still pack. prepare() checks every header against it before
# decoding, so Pillow's own warning (between one and two times its limit) would only repeat that.
MAX_PIXELS = 1 << 27
Image.MAX_IMAGE_PIXELS = MAX_PIXELS
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

# Refused by their signature, so the reason names what they are instead of "not an image".
_REFUSED_SIGNATURES = {b"%!PS": "PostScript", b"\xc5\xd0\xd3\xc6": "EPS", b"%PDF": "PDF"}
# Transparent areas are composited on mid-gray: close to the dataset mean, so after normalisation
# they carry almost no signal, unlike the hidden colours stored under alpha 0 or a white/black fill.
NEUTRAL = (128, 128, 128)
# libjpeg warnings that mean picture data was lost or guessed; others (an unknown JFIF version,
# SOS parameters a sequential decoder does not expect) leave the pixels intact.
_DATA_LOSS = ("Corrupt JPEG data", "Premature end of JPEG file", "Inconsistent progression")

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

    @property
    def kind(self) -> str:
        """The reason without its details (the text before the first colon): groups skips by cause."""
        return str(self).split(":", 1)[0]


def open_supported(data: bytes) -> Image.Image:
    """Pillow's image for bytes in one of SUPPORTED_FORMATS (header read only, nothing decoded)."""
    return Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)


def check_pixels(width: int, height: int, where: str) -> None:
    """Skip a header whose size would take more memory to decode than any photo needs."""
    if width * height > MAX_PIXELS:
        raise Skip(
            f"decompression bomb guard: {where} says {width}x{height} ({width * height / 1e6:.0f} megapixels), "
            f"above the limit of {MAX_PIXELS / 1e6:.0f} megapixels"
        )


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


def _decoded_side(side: int, target: int) -> int:
    """The limited side (shorter for resize, longer for max_side) to decode a JPEG at: the strongest
    1/8, 1/4 or 1/2 reduction still >= target.

    libjpeg-turbo also scales by m/8 (6/8 makes a 375-px side 282 px), but measured on 500x375 q90
    JPEGs to 256 px that is no faster: its m/8 inverse DCTs have no SIMD code (decoding at 6/8 takes
    1.10 ms against 0.75 ms at full size), and the nearly 1:1 Pillow BOX step then used after it lost
    ~1 dB PSNR against a reference downscale of the uncompressed image. The power-of-two reductions
    are the ones Pillow's draft() uses, so both paths agree.
    """
    for denominator in (8, 4, 2):
        if -(-side // denominator) >= target:
            return -(-side // denominator)
    return side


def _resize_clean_jpeg(data: bytes, info: JpegInfo, fit: Fit, quality: int) -> bytes:
    """Decode (simplejpeg, RGB), shrink and encode (simplejpeg) a clean JPEG.

    The decode is strict: libjpeg-turbo's warnings raise ValueError (see libjpeg_refusal), so it is
    also this image's scan-data check.
    """
    size = fit.size(info.width, info.height)
    # simplejpeg decodes at the strongest reduction that keeps this side: exactly the one asked for
    if fit.limited_axis(info.width, info.height) == 0:
        reduced = {"min_width": _decoded_side(info.width, size[0])}
    else:
        reduced = {"min_height": _decoded_side(info.height, size[1])}
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", **reduced)
    if pixels.shape[1::-1] != size:
        pixels = shrink(pixels, size)
    # the same libjpeg-turbo encoder and 4:2:0 subsampling as Pillow's default, ~0.1 ms faster
    return simplejpeg.encode_jpeg(pixels, quality=quality, colorspace="RGB", colorsubsampling="420")


def libjpeg_refusal(message: str) -> str:
    """A strict libjpeg-turbo decode failed with ``message``: Skip when picture data is damaged, else
    the repair reason (only a lenient decoder, Pillow's, reads the file; it is re-encoded)."""
    if message.startswith(_DATA_LOSS):
        raise Skip(f"corrupt JPEG scan data: libjpeg-turbo reports {message!r}")
    return f"JPEG that libjpeg-turbo reads only leniently ({message}) re-encoded"


def check_scan(data: bytes, info: JpegInfo) -> str | None:
    """Decode the entropy-coded data at 1/8 scale: Skip when it is damaged, a repair reason when only
    a lenient decoder reads it, None when it is clean.

    Without simplejpeg, Pillow decodes it: that catches errors but not libjpeg's warnings (Pillow
    ignores them), so corrupt data that libjpeg can resynchronise past is not caught there.
    """
    if simplejpeg is not None and info.components in (1, 3, 4):
        try:  # grayscale output: the chroma components are entropy-decoded but never transformed
            simplejpeg.decode_jpeg(data, colorspace="CMYK" if info.components == 4 else "GRAY", min_factor=8)
        except ValueError as err:
            return libjpeg_refusal(str(err))
        return None
    try:
        with Image.open(io.BytesIO(data), formats=("JPEG",)) as im:
            im.draft(None, (max(1, im.width // 8), max(1, im.height // 8)))
            im.load()
    except (OSError, SyntaxError, ValueError) as err:
        raise Skip(f"corrupt JPEG scan data: {err}") from None
    return None


def _high_depth_to_8bit(im: Image.Image, notes: list[str]) -> Image.Image:
    """Scale 16-bit and float grayscale samples into 0..255 (Pillow's convert() would clip them:
    a 16-bit PNG would come out white)."""
    pixels = np.asarray(im)
    if im.mode == "F":
        if pixels.size and (pixels.min() < 0 or pixels.max() > 1):
            raise Skip(f"cannot decode: floating-point samples in {pixels.min():g}..{pixels.max():g}, not 0..1")
        notes.append("32-bit floating-point grayscale scaled from 0..1 to 8 bits")
        return Image.fromarray(np.rint(pixels * 255).astype(np.uint8))
    clipped = np.clip(pixels.astype(np.int64), 0, 65535)
    notes.append("16-bit grayscale scaled to 8 bits (value x 255 / 65535)")
    return Image.fromarray(((clipped * 255 + 32767) // 65535).astype(np.uint8))


def _flatten_alpha(im: Image.Image, notes: list[str]) -> Image.Image:
    """RGB from an image with an alpha channel or a transparent colour: transparent pixels are
    composited on NEUTRAL, not left in whatever colour they hide."""
    rgba = im.convert("RGBA")
    alpha = rgba.getchannel("A")
    clear = int(np.count_nonzero(np.asarray(alpha) < 255))
    if not clear:
        return rgba.convert("RGB")
    flat = Image.new("RGB", rgba.size, NEUTRAL)
    flat.paste(rgba.convert("RGB"), mask=alpha)
    notes.append(
        f"transparency ({100 * clear / (rgba.width * rgba.height):.1f} % of pixels not opaque) "
        f"composited on mid-gray {NEUTRAL}"
    )
    return flat


def deep_samples(im: Image.Image) -> bool:
    """True for a non-JPEG whose samples are 16-bit: read from its tiles, so before im.load()."""
    return im.format != "JPEG" and any(";16" in str(tile.args) for tile in im.tile)


def to_rgb(im: Image.Image, source_format: str, deep: bool, notes: list[str]) -> Image.Image:
    """An RGB (or YCbCr, from a JPEG draft) image of the loaded ``im`` (``deep``: deep_samples before
    the load); each change that alters pixels beyond a colour-space conversion is added to ``notes``.
    The pack re-encodes what comes out; the torch loader trains on it (a kept record of a pair of your own)."""
    if im.mode in ("I", "F") or im.mode.startswith("I;16"):
        im = _high_depth_to_8bit(im, notes)
    elif deep:  # Pillow decodes 16-bit RGB(A)/LA PNG and TIFF samples to their high byte
        notes.append("16-bit samples reduced to 8 bits (high byte kept)")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        return _flatten_alpha(im, notes)
    if im.mode == "CMYK" and source_format != "JPEG":  # a CMYK JPEG's reason says it already
        notes.append("CMYK converted to RGB")
    return im if im.mode in ("RGB", "YCbCr") else im.convert("RGB")


def _encode(
    data: bytes, fit: Fit, quality: int, jpeg: JpegInfo | None, orientation: int | None
) -> tuple[bytes, list[str]]:
    """Decode, orient, convert, shrink and encode as JPEG; returns the bytes and what was done to the
    pixels on the way. ``orientation`` None = not known yet."""
    notes = []
    try:
        im = open_supported(data)
        source_format = im.format
        check_pixels(*im.size, f"the {source_format} header")
        source_size = im.size  # the output's aspect comes from it, not from a reduced decode
        frames = getattr(im, "n_frames", 1)
        if frames > 1:  # Pillow opens at the first frame and decodes only that one
            notes.append(f"animated {source_format}: first of {frames} frames kept")
        deep = deep_samples(im)
        if jpeg is not None:
            target = fit.size(im.width, im.height)
            # A YCbCr JPEG stays YCbCr through the resize into the encoder (no colour conversions),
            # and draft() downscales in the DCT domain (1/2, 1/4, 1/8) while decoding.
            im.draft("YCbCr" if im.mode == "RGB" and jpeg.adobe_transform != 0 else None, target)
        im.load()
        if orientation not in (0, 1):
            upright = ImageOps.exif_transpose(im)
            if upright.size != im.size:
                source_size = source_size[::-1]
            im = upright
        im = to_rgb(im, source_format, deep, notes)
        size = fit.size(*source_size)
        if size != im.size:  # YCbCr pixels shrink like RGB ones: the filter is per channel
            im = Image.frombytes(im.mode, size, shrink(np.asarray(im), size).tobytes())
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
        return buf.getvalue(), notes
    except Image.DecompressionBombError as err:
        raise Skip(f"decompression bomb guard: {err}") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise Skip(f"cannot decode: {err}") from None


def _prepare_jpeg(data: bytes, info: JpegInfo, fit: Fit, quality: int, scan: bool) -> tuple[bytes, str | None]:
    if not info.complete:
        raise Skip("truncated JPEG: no end-of-image marker after the scan data")
    if info.sof is None:
        raise Skip("corrupt JPEG: no frame header (SOF marker) before the scan data")
    if info.bits != 8:
        raise Skip(f"{info.bits}-bit JPEG: 8-bit decoders (DALI, PIL) cannot read it")
    if info.width * info.height == 0:
        raise Skip(f"corrupt JPEG: the frame header gives a size of {info.width}x{info.height}")
    check_pixels(info.width, info.height, "the JPEG frame header")
    orientation = exif_orientation(info.exif)
    problems = _jpeg_problems(info, orientation)
    keeps_size = fit.size(info.width, info.height) == (info.width, info.height)
    if not problems and not keeps_size and simplejpeg is not None:
        try:
            return _resize_clean_jpeg(data, info, fit, quality), None
        except ValueError as err:
            problems.append(libjpeg_refusal(str(err)))
    else:
        lenient = check_scan(data, info) if scan else None
        if lenient is not None:
            problems.append(lenient)
        elif not problems and keeps_size:
            return data, None
    image, notes = _encode(data, fit, quality, info, orientation)
    return image, "; ".join(problems + notes) or None


def _format_reason(fmt: str, name: str | None) -> str:
    """What the repair did, saying a mismatch of content and name only where there is one: a .png that
    is a PNG is "PNG re-encoded as JPEG"; no name is the pack's historic case, a JPEG-named source."""
    named = "JPEG" if name is None else named_format(name)
    if named == fmt:
        return f"{fmt} re-encoded as JPEG"
    what = "as JPEG" if named == "JPEG" else extension(name) or "without an extension"
    return f"{fmt} content named {what} re-encoded as JPEG"


def _prepare_other(data: bytes, fit: Fit, quality: int, name: str | None) -> tuple[bytes, str]:
    for magic, refused in _REFUSED_SIGNATURES.items():
        if data.startswith(magic):
            raise Skip(
                f"unsupported format: {refused} content is never opened (Pillow would run an external "
                f"interpreter, Ghostscript, on it); supported: {', '.join(SUPPORTED_FORMATS)}"
            )
    try:
        with open_supported(data) as probe:
            fmt = probe.format
    except UnidentifiedImageError:
        raise Skip(
            f"not an image: the content is none of {', '.join(SUPPORTED_FORMATS)} (starts with {data[:16]!r})"
        ) from None
    except Image.DecompressionBombError as err:
        raise Skip(f"decompression bomb guard: {err}") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise Skip(f"cannot decode: {err}") from None
    image, notes = _encode(data, fit, quality, None, None)
    return image, "; ".join([_format_reason(fmt, name), *notes])


def prepare(
    data: bytes, resize: int, quality: int, check_scan_data: bool = True, name: str | None = None, *, max_side: int = 0
) -> tuple[bytes, str | None]:
    """The JPEG bytes to store for one source and the repair reason (None when nothing was wrong).
    ``resize`` (pack.resize, shorter side) or ``max_side`` (pack.max_side, longest side) shrinks a
    larger image; 0 = no limit (they are exclusive: rectrain.data.fit).

    Raises Skip when the file cannot become a usable image. ``check_scan_data`` False (the pack's
    pack.check_scan_data) stores a clean-headed JPEG without decoding it at all. ``name``: the
    source's file name, so that a re-encoded PNG's reason says whether it was named as one.
    """
    if not data:
        raise Skip("empty file (0 bytes)")
    fit = Fit(resize, max_side)
    info = read_jpeg_header(data)
    if info is None:
        return _prepare_other(data, fit, quality, name)
    return _prepare_jpeg(data, info, fit, quality, check_scan_data)
