"""Read raw images in place: plain files under the raw root, tar members and members of nested tars.

A source is a path relative to the raw root, `archive.tar::member`, or `outer.tar::inner.tar::member`
(the official ILSVRC2012_img_train.tar holds one tar per class).  Members are read through a window
on the archive's file descriptor - never extracted to disk.  Tar member names are never used as
filesystem paths; a member that is absolute, climbs with `..`, is a link or a device is refused with
an error naming the archive and the member.  The index lists sources; the pack reads them here.

A listing must end at a valid end-of-archive (a zero block, with nothing but zeros after it) and every
member must lie inside its archive: otherwise CorruptArchive names the archive and the byte offset.
Python's tarfile ends a listing silently at a corrupt header or a truncation, which would drop every
member after it (whole classes of ILSVRC2012_img_train.tar) without a word.

The official file names live here, the one home the indexer and the demo generator both import.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from pathlib import Path, PurePosixPath

SEP = "::"
TRAIN_TAR, VAL_TAR = "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar"
DEVKIT_TGZ, DEVKIT_DIR = "ILSVRC2012_devkit_t12.tar.gz", "ILSVRC2012_devkit_t12/data"
GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
# The devkit's ILSVRC2012_ID -> wnid map: meta.mat (MATLAB) in the download, meta.csv in the demo.
META_MAT, META_CSV = "meta.mat", "meta.csv"
KAGGLE_CSV, SYNSET_MAPPING = "LOC_val_solution.csv", "LOC_synset_mapping.txt"
# Tiny-ImageNet (tiny-imagenet-200.zip): val/images/ labelled by val/val_annotations.txt, the class
# list in wnids.txt, 'wnid<TAB>words' for every WordNet id in words.txt.
TINY_ROOT, TINY_VAL_LABELS = "tiny-imagenet-200", "val_annotations.txt"
TINY_WNIDS, TINY_WORDS = "wnids.txt", "words.txt"
# What the official ILSVRC2012 archives hold (the counts every ImageNet paper trains and validates on).
OFFICIAL_COUNTS = {"classes": 1000, "train": 1_281_167, "val": 50_000}
BLOCK = 512  # tar header and padding unit
# Characters that would break a TSV row or the `::` source syntax.
UNNAMEABLE = ("\t", "\n", "\r", SEP)
# What reading one source can raise when that source, not the pack, is at fault: the image becomes a skip.
READ_ERRORS = (OSError, KeyError, ValueError, tarfile.TarError)


class UnsafeArchiveMember(ValueError):
    """A tar member that could escape a directory or is not a plain file."""


class CorruptArchive(ValueError):
    """A tar whose listing does not reach a valid end, or whose member runs past the end of the file."""


# Extended (POSIX.1-2001 pax) and GNU long-name headers: tarfile reads each whole into memory, and
# Python before 3.11.10 / 3.12.6 parses a pax header in time quadratic in its runs of digits
# (CVE-2024-6232; measured on 3.11.7: 1.31 s at 40k digits, 5.45 s at 80k). Real ones hold a path, a
# size and times - a few hundred bytes - so both are bounded before tarfile parses them, on every Python.
HEADER_MAX_BYTES = 64 * 1024
PAX_MAX_DIGITS = 64  # a run of digits that long is no size, time or id: parsing stays linear below it


class HeaderTooLarge(Exception):
    """An extended tar header beyond the bounds above (raised from inside tarfile's parsing)."""

    def __init__(self, what: str, offset: int):
        super().__init__(what)
        self.offset = offset


class BoundedTarInfo(tarfile.TarInfo):
    """tarfile's member header, refusing pax and GNU long-name headers beyond the bounds above before
    tarfile reads or parses them (pass tarinfo=BoundedTarInfo to tarfile.open)."""

    def _proc_gnulong(self, tarfile):
        self._bound(tarfile, "GNU long name header")
        return super()._proc_gnulong(tarfile)

    def _proc_pax(self, tarfile):
        buf = self._bound(tarfile, "pax extended header")
        if re.search(rb"\d{%d}" % (PAX_MAX_DIGITS + 1), buf):
            raise HeaderTooLarge(f"a pax extended header with a run of over {PAX_MAX_DIGITS} digits", self.offset)
        return super()._proc_pax(tarfile)

    def _bound(self, tarfile, what: str) -> bytes:
        """The header's bytes, read and put back (tarfile reads them again), after checking its size."""
        if self.size > HEADER_MAX_BYTES:
            raise HeaderTooLarge(f"a {what} of {self.size} bytes (at most {HEADER_MAX_BYTES} are read)", self.offset)
        pos = tarfile.fileobj.tell()
        buf = tarfile.fileobj.read(self.size)
        tarfile.fileobj.seek(pos)
        return buf


def refuse_header(err: HeaderTooLarge, archive: str, where: str = "") -> UnsafeArchiveMember:
    """The error naming the archive and the header's offset."""
    return UnsafeArchiveMember(
        f"refusing {archive}: it holds {err} at {where or f'byte {err.offset}'}; real archives hold no such "
        f"header (and older Pythons parse one in quadratic time, CVE-2024-6232). Re-create the archive."
    )


class _Window(io.RawIOBase):
    """Read-only view of bytes [start, start + size) of an open file descriptor, addressed from 0.

    Uses pread, so many views (and forked worker processes) can share one descriptor.
    """

    def __init__(self, fd: int, start: int, size: int):
        super().__init__()
        self._fd, self._start, self._size, self._pos = fd, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._size - self._pos))
        data = os.pread(self._fd, n, self._start + self._pos) if n else b""
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def check_member(info: tarfile.TarInfo, archive: str) -> None:
    """Refuse members that could escape a directory if extracted, or that we cannot read by offset."""
    name = info.name
    path = PurePosixPath(name)
    problem = None
    if path.is_absolute() or re.match(r"^[A-Za-z]:", name):
        problem = "an absolute path"
    elif ".." in path.parts or "\\" in name:
        problem = "a path that climbs out of the archive (..)" if ".." in path.parts else "a backslash path"
    elif info.issym() or info.islnk():
        problem = f"a link (to {info.linkname!r})"
    elif info.isdev():
        problem = "a device or fifo"
    elif info.issparse():
        problem = "a sparse file"
    elif not (info.isfile() or info.isdir()):
        problem = f"an unsupported member type {info.type!r}"
    elif any(c in name for c in UNNAMEABLE):
        problem = "a name with a tab, newline or '::' that the index cannot name"
    if problem:
        raise UnsafeArchiveMember(
            f"refusing tar member {name!r} in {archive}: it is {problem}. Archives are read in place and "
            f"member names are never used as paths; remove or rename that member (or re-create the archive)."
        )


def _where(archive: str, offset: int, outer: tuple[str, int] | None) -> str:
    """'byte N of a.tar', plus the byte in the file on disk when a.tar is a member of another tar."""
    text = f"byte {offset} of {archive}"
    return text + (f" (byte {outer[1] + offset} of {outer[0]})" if outer else "")


def _check_end(fileobj, end: int, size: int, archive: str, outer) -> None:
    """The listing stopped at `end`: that must be a zero block with only zeros after it."""
    fileobj.seek(end)
    block = fileobj.read(BLOCK)
    if len(block) < BLOCK:
        raise CorruptArchive(
            f"{archive} ends at byte {size} without an end-of-archive marker (expected after the last "
            f"member, at {_where(archive, end, outer)}): the archive is truncated; re-download it"
        )
    if block.count(0) != BLOCK:
        raise CorruptArchive(
            f"{archive}: no valid tar header at {_where(archive, end, outer)}: the listing stops there and "
            f"every member after it would be lost; the archive is damaged, re-download it (check its md5)"
        )
    pos = end + BLOCK
    while chunk := fileobj.read(1 << 20):
        if chunk.count(0) != len(chunk):
            first = pos + next(i for i, b in enumerate(chunk) if b)
            raise CorruptArchive(
                f"{archive}: data continues at {_where(archive, first, outer)} after an end-of-archive "
                f"marker at byte {end}: a zeroed block or a second archive appended; members after it "
                f"would be lost. Re-download or re-create the archive"
            )
        pos += len(chunk)


def scan_tar(fileobj, archive: str, size: int, outer: tuple[str, int] | None = None) -> list[tuple[str, int, int]]:
    """(name, data offset, size) of each regular file in an uncompressed tar of `size` bytes, in archive
    order. outer = (file on disk, byte where this tar starts in it) when the tar is a member of another."""
    members, seen = [], set()
    try:
        with tarfile.open(fileobj=fileobj, mode="r:", tarinfo=BoundedTarInfo) as tar:
            for info in tar:
                check_member(info, archive)
                if info.offset_data + info.size > size:
                    raise CorruptArchive(
                        f"{archive}: member {info.name!r} at {_where(archive, info.offset, outer)} claims "
                        f"{info.size} bytes up to byte {info.offset_data + info.size}, but the archive ends at "
                        f"byte {size}: it is truncated; re-download it"
                    )
                if info.isdir():
                    continue
                if info.name in seen:
                    raise UnsafeArchiveMember(
                        f"refusing tar member {info.name!r} in {archive}: it occurs twice, "
                        f"so which copy is meant is ambiguous; re-create the archive"
                    )
                seen.add(info.name)
                members.append((info.name, info.offset_data, info.size))
            end = tar.offset
    except HeaderTooLarge as err:
        raise refuse_header(err, archive, _where(archive, err.offset, outer)) from None
    except tarfile.ReadError as err:
        at = members[-1][1] + members[-1][2] if members else 0
        raise CorruptArchive(
            f"{archive} is not a readable tar ({err}) after {_where(archive, at, outer)}; re-download it"
        ) from None
    _check_end(fileobj, end, size, archive, outer)
    return members


def _relative(source_path: str) -> PurePosixPath:
    path = PurePosixPath(source_path)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(f"source {source_path!r} must be relative to the raw root, without '..'")
    return path


class SourceReader:
    """Reads the bytes of index sources: folder files and (nested) tar members, by offset.

    Each archive's member table is scanned once per reader and then every read is one pread, so reading
    1.28 M members does not rescan tars. Safe to pickle into worker processes (descriptors reopen lazily).
    """

    def __init__(self, raw_root: str | os.PathLike, files=None):
        self.root = Path(raw_root)
        # files: the pack's rectrain.data.rawfiles.RawFiles, which re-checks every file it opens and caps
        # image sizes; None (the index) opens and reads plainly.
        self.files = files
        self._fds: dict[str, int] = {}
        self._tables: dict[tuple[str, ...], dict[str, tuple[int, int]]] = {}

    def __getstate__(self):
        return {"root": self.root, "files": self.files, "_fds": {}, "_tables": self._tables}

    def _fd(self, rel: str) -> int:
        # The packer's threads share one reader: if two open the same archive at once, keep one
        # descriptor and close the other (reads are pread, so sharing it is safe).
        fd = self._fds.get(rel)
        if fd is None:
            path = self.root / _relative(rel)
            mine = self.files.open(path) if self.files else os.open(path, os.O_RDONLY)
            fd = self._fds.setdefault(rel, mine)
            if fd != mine:
                os.close(mine)
        return fd

    def span(self, chain: tuple[str, ...]) -> tuple[int, int, int]:
        """(fd, start, size) of an archive file or a member of one (chain = path, member, member...)."""
        fd = self._fd(chain[0])
        if len(chain) == 1:
            return fd, 0, os.fstat(fd).st_size
        table = self.members(chain[:-1])
        if chain[-1] not in table:
            raise FileNotFoundError(f"no member {chain[-1]!r} in {SEP.join(chain[:-1])} (under {self.root})")
        start, size = table[chain[-1]]
        return fd, start, size

    def scan(self, chain: tuple[str, ...]) -> list[tuple[str, int, int]]:
        """Member (name, absolute offset, size) of the tar named by chain, without caching the table."""
        fd, start, size = self.span(chain)
        outer = (chain[0], start) if len(chain) > 1 else None
        members = scan_tar(_Window(fd, start, size), SEP.join(chain), size, outer)
        return [(name, start + off, sz) for name, off, sz in members]

    def members(self, chain: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        if chain not in self._tables:
            self._tables[chain] = {name: (off, size) for name, off, size in self.scan(chain)}
        return self._tables[chain]

    def locate(self, source: str) -> tuple[str, int, int]:
        """(file relative to root, offset, size) where the source's bytes lie."""
        chain = tuple(source.split(SEP))
        if len(chain) == 1:
            return source, 0, (self.root / _relative(source)).stat().st_size
        _, start, size = self.span(chain)
        return chain[0], start, size

    def read(self, source: str) -> bytes:
        chain = tuple(source.split(SEP))
        if len(chain) == 1:
            path = self.root / _relative(source)
            return self.files.read(path) if self.files else path.read_bytes()
        _, start, size = self.span(chain)
        return self.read_span(chain[0], start, size, source)

    def read_span(self, rel: str, start: int, size: int, source: str = "") -> bytes:
        """Bytes [start, start + size) of the archive file `rel` under the root: a member located by
        scan(), read without building or caching a member table (the pack's storage-order reads)."""
        if self.files:
            self.files.check_size(size, source or rel)
        data = os.pread(self._fd(rel), size, start)
        if len(data) != size:
            raise OSError(f"{source or rel}: archive ended after {len(data)} of {size} bytes (truncated download?)")
        return data

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
