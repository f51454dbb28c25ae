"""Open a raw file for the pack under the rules the index admitted it by, checked again at the time of reading.

Snakemake does not notice changes under `raw`, so whatever the index checked may have changed by the
time the pack runs: an image replaced by a link to a file outside the dataset, by a FIFO (a read
that never returns), by a 2 GB file, or deleted. Each source is therefore opened read-only and
non-blocking (a FIFO or device opens at once instead of waiting for a writer), and the open
descriptor - not the name, which could be swapped again - must be a regular file whose real path lies
inside the folders the index admits links into (rectrain.data.index.link_rules) and, for an image,
no larger than pack.max_image_bytes. The bytes read must match the size fstat gave. Anything else is
a Refused error whose text starts with the kind of skip it becomes ("not a regular file: ...").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from rectrain import safefs
from rectrain.data import index


class Refused(OSError):
    """A source the pack will not read; str() is the skip reason, its kind first."""


_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CHUNK = 8 << 20


def _real_path(fd: int, path: str) -> str:
    """The real path of what `fd` is open on (Linux names it under /proc; elsewhere the name's)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)


class RawFiles:
    """Opens files under one raw root for SourceReader (its `opener`) and reads images from them."""

    def __init__(self, raw_root: Path, max_image_bytes: int):
        self.root = Path(raw_root)
        self.rules = index.link_rules(self.root)
        self.max_image_bytes = int(max_image_bytes)

    def open(self, path) -> int:
        """A read-only descriptor of the regular file `path`, checked as the module says."""
        path = os.fspath(path)
        try:
            fd = os.open(path, _FLAGS)
        except FileNotFoundError:
            raise Refused(
                f"missing since the index: {self._rel(path)} is no longer under the raw root (deleted or moved "
                "after the index was built); rebuild the index if that was meant"
            ) from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise Refused(f"not a regular file: {self._rel(path)} is now {safefs.special_file(mode)}")
            real = _real_path(fd, path)
            if not self.rules.inside(real):
                raise Refused(f"outside the raw root: {self._rel(path)} now resolves to {real}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self, path) -> bytes:
        """The bytes of one image file, at most max_image_bytes, exactly as many as fstat says."""
        fd = self.open(path)
        try:
            size = os.fstat(fd).st_size
            self.check_size(size, path)
            parts, got = [], 0
            while got <= size and (chunk := os.read(fd, min(_CHUNK, size + 1 - got))):
                parts.append(chunk)
                got += len(chunk)
        finally:
            os.close(fd)
        if got != size:
            parts.clear()  # the error's traceback keeps this frame, and so the bytes, alive
            raise Refused(
                f"changed while read: {self._rel(path)} had {size} bytes when opened and "
                f"{'more' if got > size else got} when read; something is writing the raw dataset"
            )
        return b"".join(parts)

    def check_size(self, size: int, path) -> None:
        if size > self.max_image_bytes:
            raise Refused(
                f"too large: {self._rel(path)} has {size} bytes, above pack.max_image_bytes = "
                f"{self.max_image_bytes} (no photo is that large; raise the limit if yours are)"
            )

    def _rel(self, path) -> str:
        path = os.fspath(path)
        root = os.fspath(self.root)
        return path[len(root) + 1 :] if path.startswith(root + os.sep) else path
