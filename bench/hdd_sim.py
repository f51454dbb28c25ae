"""A read-only view of a folder that costs what a 7,200 rpm hard disk would: for benchmarks only.

    python bench/hdd_sim.py SOURCE MOUNTPOINT --stats stats.json [--seek-ms 12.7] [--near-ms 5.2] [--mb-s 150]

This machine has no spinning disk, so the pack's read order (rectrain.data.readorder) cannot be
timed on one. This FUSE file system (fusepy over libfuse 2: `apt-get install libfuse2`,
`pip install fusepy`) passes every file of SOURCE through unchanged and, before answering a read,
sleeps for the time one disk head would take to serve it:

  - where the bytes lie: each file's physical extents on the real disk under SOURCE (FIEMAP), so
    files lie where ext4 put them (a folder's files together, in the order they were written);
  - a jump of the head forward by at most --skip-mib costs the time to pass over those bytes; a jump
    of at most --near-mib either way a short seek (--near-ms: track-to-track plus half a rotation at
    7,200 rpm, ~1 + 4.2 ms); any longer jump an average seek (--seek-ms: ~8.5 + 4.2 ms);
  - then the bytes themselves at --mb-s.

Requests are served one at a time (one head): readers in parallel threads or processes queue, as on
a disk. Metadata (stat, directory listings, open) is free, which favours random readers. The kernel
keeps no cache of this view (direct_io), so every run pays in full; inode numbers pass through, so a
reader that sorts by inode sees the source's order. On unmount it writes --stats: reads, seeks,
bytes, and the seconds the head was busy.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import stat
import struct
import time
from dataclasses import dataclass

try:
    from fuse import FUSE, FuseOSError, Operations
except (ImportError, OSError) as err:  # the cost model stays importable (its tests); serving needs both
    FUSE = FuseOSError = None
    Operations = object
    MISSING = f"bench/hdd_sim.py needs libfuse 2 and fusepy (envs/requirements-bench.txt): {err}"

FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_HEADER = "=QQIIII"  # start, length, flags, mapped extents, extent count, reserved
FIEMAP_EXTENT = "=QQQQQIIII"  # logical, physical, length, 2 reserved, flags, 3 reserved: 56 bytes
MAX_EXTENTS = 256


def extents(path: str) -> list[tuple[int, int, int]]:
    """(logical, physical, length) of each extent of the file, from the file system."""
    head, one = struct.calcsize(FIEMAP_HEADER), struct.calcsize(FIEMAP_EXTENT)
    buf = bytearray(head + MAX_EXTENTS * one)
    struct.pack_into(FIEMAP_HEADER, buf, 0, 0, 2**64 - 1, FIEMAP_FLAG_SYNC, 0, MAX_EXTENTS, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf)
    finally:
        os.close(fd)
    mapped = struct.unpack_from(FIEMAP_HEADER, buf, 0)[3]
    return [struct.unpack_from(FIEMAP_EXTENT, buf, head + i * one)[:3] for i in range(mapped)]


@dataclass(frozen=True)
class Disk:
    seek_s: float = 0.0127  # average seek 8.5 ms + half a rotation at 7,200 rpm
    near_s: float = 0.0052  # track-to-track 1 ms + half a rotation
    bytes_per_s: float = 150e6
    skip_bytes: int = 1 << 20
    near_bytes: int = 64 << 20


class Head:
    """Where the disk head is and what moving it costs.  FUSE runs single-threaded here (nothreads),
    so requests reach it one at a time, as they reach one head."""

    def __init__(self, disk: Disk):
        self.disk, self.at = disk, -1
        self.stats = {"reads": 0, "seeks": 0, "short_seeks": 0, "bytes": 0, "busy_s": 0.0}

    def move(self, gap: int) -> float:
        if 0 <= gap <= self.disk.skip_bytes:
            return gap / self.disk.bytes_per_s
        if abs(gap) <= self.disk.near_bytes:
            self.stats["short_seeks"] += 1
            return self.disk.near_s
        self.stats["seeks"] += 1
        return self.disk.seek_s

    def cost(self, spans: list[tuple[int, int]]) -> float:
        seconds = 0.0
        for physical, length in spans:
            seconds += self.move(physical - self.at) + length / self.disk.bytes_per_s
            self.at = physical + length
        return seconds

    def serve(self, spans: list[tuple[int, int]], nbytes: int) -> None:
        seconds = self.cost(spans)
        self.stats["reads"] += 1
        self.stats["bytes"] += nbytes
        self.stats["busy_s"] += seconds
        time.sleep(seconds)


def physical_spans(layout: list[tuple[int, int, int]], offset: int, size: int) -> list[tuple[int, int]]:
    """The disk spans (physical, length) holding bytes [offset, offset + size) of a file."""
    spans = []
    for logical, physical, length in layout:
        lo, hi = max(offset, logical), min(offset + size, logical + length)
        if lo < hi:
            spans.append((physical + lo - logical, hi - lo))
    return spans


class SlowView(Operations):
    def __init__(self, source: str, head: Head, stats_path: str):
        self.source, self.head, self.stats_path = os.path.realpath(source), head, stats_path
        self.layouts: dict[int, list[tuple[int, int, int]]] = {}

    def _real(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def getattr(self, path, fh=None):
        try:
            st = os.lstat(self._real(path))
        except OSError as err:
            raise FuseOSError(err.errno) from None
        keys = ("st_mode", "st_size", "st_ino", "st_nlink", "st_uid", "st_gid", "st_atime", "st_mtime", "st_ctime")
        return {k: getattr(st, k) for k in keys}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._real(path))]

    def open(self, path, flags):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise FuseOSError(errno.EROFS)
        fd = os.open(self._real(path), os.O_RDONLY)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            self.layouts[fd] = extents(self._real(path))
        return fd

    def read(self, path, size, offset, fh):
        data = os.pread(fh, size, offset)
        self.head.serve(physical_spans(self.layouts.get(fh, []), offset, len(data)), len(data))
        return data

    def release(self, path, fh):
        self.layouts.pop(fh, None)
        os.close(fh)

    def destroy(self, path):
        with open(self.stats_path, "w") as f:
            json.dump(self.head.stats, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--stats", required=True, help="JSON file written on unmount")
    ap.add_argument("--seek-ms", type=float, default=1e3 * Disk.seek_s)
    ap.add_argument("--near-ms", type=float, default=1e3 * Disk.near_s)
    ap.add_argument("--mb-s", type=float, default=Disk.bytes_per_s / 1e6)
    ap.add_argument("--skip-mib", type=float, default=Disk.skip_bytes / 2**20)
    ap.add_argument("--near-mib", type=float, default=Disk.near_bytes / 2**20)
    args = ap.parse_args()
    if FUSE is None:
        raise SystemExit(MISSING)
    disk = Disk(
        args.seek_ms / 1e3, args.near_ms / 1e3, args.mb_s * 1e6, int(args.skip_mib * 2**20), int(args.near_mib * 2**20)
    )
    head = Head(disk)
    view = SlowView(args.source, head, args.stats)
    FUSE(view, args.mountpoint, foreground=True, nothreads=True, ro=True, use_ino=True, direct_io=True)


if __name__ == "__main__":
    main()
