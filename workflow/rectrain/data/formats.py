"""The image formats the pack may open, their file-name extensions and their signatures.

One list for both sides: the index takes a file whose extension (any case) names one of these formats
without reading it, and reads the first bytes of any other file to recognise one of them by content;
the pack opens only these formats (rectrain.data.images) and re-encodes every one but JPEG.

The index trusts extensions rather than reading every file because the pack reads each image in
full anyway and checks its content (a PNG named .JPEG is repaired, not lost), while a read of the
first bytes of each file turns the index's directory listing into one random read per image:
measured in bench/RESULTS.md ("Index: content sniffing").
"""

from __future__ import annotations

import functools

# The only formats Pillow may open: JPEG and the formats photos are saved in that re-encode
# cleanly. Never EPS/PS (Pillow runs Ghostscript on them) or any other plugin that starts a program:
# data from the internet must not run anything.
SUPPORTED_FORMATS = ("JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP")

# How each format's files begin (the formats' specifications: JFIF/JPEG SOI + marker, the PNG
# signature, GIF87a/89a, the BMP file header, TIFF's two byte orders; WebP: a RIFF container whose type, after the chunk size, is WEBP).
_SIGNATURES = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)
HEAD_BYTES = 12  # enough for every signature above and WebP's


@functools.cache
def extensions() -> dict[str, str]:
    """Lower-case extension (".jpg") -> format, for every extension Pillow registers for a supported
    format (.jpg .jpeg .jpe .jfif, .png .apng, .gif, .bmp, .tif .tiff, .webp)."""
    from PIL import Image

    Image.init()
    return {ext: fmt for ext, fmt in Image.registered_extensions().items() if fmt in SUPPORTED_FORMATS}


def extension(name: str) -> str:
    """The lower-case extension of a file name ("" for none or a dot file); string operations only:
    this runs once per file of a 1.28 M-file tree."""
    base = name.rpartition("/")[2]
    stem, dot, ext = base.rpartition(".")
    return dot + ext.lower() if stem else ""


def named_format(name: str) -> str | None:
    """The supported format the name's extension says, whatever its case; None when it names none."""
    return extensions().get(extension(name))


def sniff(head: bytes) -> str | None:
    """The supported format these first bytes of a file begin, or None."""
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "WEBP"
    return next((fmt for magic, fmt in _SIGNATURES if head.startswith(magic)), None)
