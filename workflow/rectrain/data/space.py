"""What a pack will write, for the free-space check before it starts (rectrain.storage.preflight).

The sources' own bytes (an archive member counts as its whole archive, once), plus what re-encoding
the files not named as JPEG may add beyond their size: a PNG is re-encoded as JPEG even in a
pass-through pack, and a 32 KB PNG of 0.27 gigapixels came out as a 4.19 MB JPEG (issue #26). The
estimate is read from each such file's header at rectrain.storage.jpeg_bytes_per_pixel, high for photos;
a noise image can take more, which the pack's stop on a full disk covers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from PIL import Image, UnidentifiedImageError

from rectrain import storage
from rectrain.data.fit import Fit
from rectrain.data.images import MAX_PIXELS, open_supported
from rectrain.data.rawfiles import RawFiles


def source_bytes(raw_root: Path, sources: Iterable[str]) -> int:
    """Bytes the sources occupy; an archive member counts as its whole outer archive, once."""
    total = 0
    archives = set()
    root = f"{raw_root}/"  # a str, not a Path per source: 4x faster over 1.28 M files
    for src in sources:
        if "::" in src:
            archives.add(src.split("::", 1)[0])
            continue
        try:
            total += os.stat(root + src).st_size
        except OSError:
            pass  # reported per image as a skip when the worker cannot read it
    for archive in archives:
        try:
            total += os.stat(root + archive).st_size
        except OSError:
            pass
    return total


JPEG_NAMES = (".jpg", ".jpeg")
HEADER_BYTES = 64 << 10  # enough for the size fields of PNG, GIF, BMP, WebP and most TIFF headers


def reencoded_extra(files: RawFiles, sources: Iterable[str], fit: Fit, quality: int) -> int:
    """Bytes the re-encoded JPEGs of the files not named as JPEG may take beyond their own size, from
    their headers (opened as the pack opens them). Files that cannot be read add nothing: they are skips."""
    extra, per_pixel = 0, storage.jpeg_bytes_per_pixel(quality)
    for src in sources:
        if "::" in src or src.lower().endswith(JPEG_NAMES):
            continue
        try:
            fd = files.open(files.root / src)
            try:
                size, head = os.fstat(fd).st_size, os.pread(fd, HEADER_BYTES, 0)
            finally:
                os.close(fd)
            with open_supported(head) as im:
                width, height = im.size
        except (OSError, SyntaxError, ValueError, UnidentifiedImageError, Image.DecompressionBombError):
            continue
        if width * height <= MAX_PIXELS:  # a larger one is a skip (the decompression bomb guard)
            out_w, out_h = fit.size(width, height)
            extra += max(0, int(out_w * out_h * per_pixel) - size)
    return extra
