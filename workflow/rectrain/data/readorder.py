"""Read the raw images in storage order and still write the .rec in the seeded shuffled order.

The .rec must be globally shuffled: DALI shards it into contiguous slices and shuffles only inside a
small window, so a class-ordered file would give each rank a subset of the classes. Reading the raw
images in that shuffled order is one random read per image: fine on an SSD, ~100-150 images/s on an
HDD or a network share (1.28 M images: hours, against ~15 minutes to read 140 GB sequentially).

So the pack can read in storage order - folders in path order and each folder's files by inode
number (files written one after another get rising inode numbers and, mostly, rising disk blocks),
each archive's members by offset, and the tars nested in an archive in the order they lie in it -
and shuffle externally through the fast storage: each record goes to one of K bucket files beside
the .rec, bucket b taking the records whose seeded output position falls in the b-th K-th of the
file. The .rec is then assembled bucket by bucket in output order: a bucket's records are read back
with pread (fast storage, its pages asked for ahead) and the bucket is deleted once written. The .rec
is byte for byte the one a direct pack writes. It costs one more write and read of the data on the
fast storage, one bucket of extra disk (1/K of the data) and 12 bytes of memory per image.

`choose` decides (pack.read_order: auto) from the raw root's device: shuffled reads when it is
non-rotational, storage order when it spins or has no block device (a network share).
"""

from __future__ import annotations

import array
import contextlib
import os
import posixpath
import threading
from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np

from rectrain import safefs, storage
from rectrain.data.archives import READ_ERRORS, SEP, SourceReader
from rectrain.data.indextable import IndexTable

READ_ORDERS = ("auto", "storage", "shuffled")
BUCKET_BYTES = 1 << 30  # the extra disk space the external shuffle needs at its peak
MAX_BUCKETS = 256  # open files while reading; beyond it buckets grow instead
BUCKET_BUFFER = 64 << 10
BUCKET_INFIX = ".bucket"
ASSEMBLE_CHUNK = 8192
READER_THREAD = "pack-reader"
READ_AHEAD_ITEMS = 1024  # besides the byte budget: a folder of tiny files is not read ahead without end


def choose(requested: str, raw_root: Path, sysfs_root=None) -> dict:
    """{requested, used: storage|shuffled, reason, raw: {path, device, rotational}}."""
    raw = storage.device_info(raw_root, sysfs_root)
    where = f"the raw root {raw['path']}"
    if requested != "auto":
        used, reason = requested, f"pack.read_order: {requested} in the config"
    elif raw["rotational"] is False:
        used = "shuffled"
        reason = (
            f"auto: {where} is on a non-rotational device ({raw['device']}): a random read costs what a "
            "sequential one does, so images are read straight in the shuffled output order (no bucket pass)"
        )
    elif raw["rotational"]:
        used = "storage"
        reason = (
            f"auto: {where} is on a rotational disk ({raw['device']}): shuffled reads would seek once per "
            "image, so it is read in storage order and shuffled through bucket files on the fast storage"
        )
    else:
        used = "storage"
        reason = (
            f"auto: no block device found under {where} (a network share, overlay or tmpfs): read in "
            "storage order, which a network share serves sequentially; set pack.read_order: shuffled when "
            "it is local flash or RAM"
        )
    return {"requested": requested, "used": used, "reason": reason, "raw": raw}


def bucket_count(needed_bytes: int) -> int:
    return int(min(MAX_BUCKETS, max(1, -(-needed_bytes // BUCKET_BYTES))))


def bucket_glob(partial_rec: Path) -> str:
    """Pattern of the bucket files beside the partial .rec (for the cleanup after a killed pack)."""
    return f"{partial_rec.name}{BUCKET_INFIX}*"


# ---- the storage order -------------------------------------------------------------------------


def _group_key(source: str) -> tuple[str, ...]:
    """The folder or the innermost archive a source lies in."""
    chain = source.split(SEP)
    return ("archive", *chain[:-1]) if len(chain) > 1 else ("folder", posixpath.dirname(source))


def _group_position(key: tuple[str, ...], reader: SourceReader) -> tuple:
    """Sort key of a group: folders by path; archives by file, a nested one by where it starts."""
    if key[0] == "folder":
        return (0, key[1], 0)
    chain = key[1:]
    if len(chain) == 1:
        return (1, chain[0], 0)
    try:
        return (1, chain[0], reader.span(chain)[1])
    except READ_ERRORS:
        return (1, chain[0], -1)  # unreadable: its rows become skips, wherever they are read


def _folder_order(root: Path, folder: str, sources: list[str]) -> list[tuple[int, None]]:
    """(index into sources, no location) in inode order; a vanished file sorts first (it is a skip)."""
    try:
        with os.scandir(root / folder) as entries:
            inode = {e.name: e.inode() for e in entries}
    except OSError:
        inode = {}
    ranked = sorted(range(len(sources)), key=lambda i: (inode.get(posixpath.basename(sources[i]), 0), i))
    return [(i, None) for i in ranked]


def _archive_order(reader: SourceReader, chain: tuple[str, ...], sources: list[str]) -> list[tuple[int, object]]:
    """(index into sources, location) in offset order. A location is (file, offset, size), or the
    error that makes the source unreadable (one scan of the archive, not one per member)."""
    try:
        listing = reader.scan(chain)
    except READ_ERRORS as err:
        return [(i, err) for i in range(len(sources))]
    wanted = {s.split(SEP)[-1]: i for i, s in enumerate(sources)}
    found = [(wanted.pop(name), (chain[0], offset, size)) for name, offset, size in listing if name in wanted]
    archive = SEP.join(chain)
    missing = [
        (i, FileNotFoundError(f"no member {name!r} in {archive} (under {reader.root})")) for name, i in wanted.items()
    ]
    return missing + found


def storage_order(table: IndexTable, reader: SourceReader) -> Iterator[tuple[int, int, str, int, object]]:
    """(row, id, source, label, location or None) for every index row, in storage order."""
    keys: dict[tuple[str, ...], int] = {}
    gid = array.array("q")
    for source in table.iter_sources():
        gid.append(keys.setdefault(_group_key(source), len(keys)))
    gids = np.frombuffer(gid, dtype=np.int64) if len(gid) else np.zeros(0, np.int64)
    rows_by_group = np.argsort(gids, kind="stable")
    bounds = np.concatenate(([0], np.cumsum(np.bincount(gids, minlength=len(keys)))))
    del gid, gids
    for key in sorted(keys, key=lambda k: _group_position(k, reader)):
        g = keys[key]
        rows = rows_by_group[bounds[g] : bounds[g + 1]]
        sources = table.sources(rows)
        ids, labels, rows = table.ids[rows].tolist(), table.labels[rows].tolist(), rows.tolist()
        if key[0] == "folder":
            ranked = _folder_order(reader.root, key[1], sources)
        else:
            ranked = _archive_order(reader, key[1:], sources)
        for i, where in ranked:
            yield rows[i], ids[i], sources[i], labels[i], where


def read_in_order(items: Iterator[tuple], reader: SourceReader) -> Iterator[tuple]:
    """The storage-order items with each one's bytes (or the error reading it) in place of its
    location, read here one after another.  One stream of reads is what a disk head serves fastest:
    worker threads reading their own batches would interleave their streams, and the head would seek
    between them on nearly every image (bench/hdd_bench.py)."""
    for row, rid, source, label, where in items:
        if not isinstance(where, Exception):
            try:
                where = reader.read(source) if where is None else reader.read_span(*where, source)
            except READ_ERRORS as err:
                where = err.with_traceback(None)  # its frames would hold bytes read while it waits
            except MemoryError:
                where = MemoryError("out of memory while reading it")
        yield row, rid, source, label, where


class ReadAhead:
    """read_in_order on a thread of its own (READER_THREAD), up to `max_bytes` of sources ahead of
    the consumer: still one stream of reads in storage order, but the pack's main thread, which also
    hands batches to the workers, takes their records and spools them, no longer stalls the reads,
    nor do they stall it (from the page cache a read is a few syscalls; on a disk it is the wait).

        with ReadAhead(items, reader, max_bytes) as ahead:
            for row, rid, source, label, data in ahead: ...

    An item larger than the budget is still read, once nothing else is waiting. Leaving the block
    (an error, Ctrl-C) stops the thread after its current read; an error of the reader's own (not a
    read error, which becomes the item's value) is raised in the consumer."""

    def __init__(self, items, reader: SourceReader, max_bytes: int):
        self._items, self._reader, self._max = items, reader, max_bytes
        self._ready: deque = deque()  # (item, its bytes) in read order; item None: the end
        self._held, self._stop, self._error = 0, False, None
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._read, name=READER_THREAD, daemon=True)

    def _room(self, size: int) -> bool:
        if not self._ready:
            return True
        return self._held + size <= self._max and len(self._ready) < READ_AHEAD_ITEMS

    def _read(self) -> None:
        try:
            for item in read_in_order(self._items, self._reader):
                size = len(item[4]) if isinstance(item[4], bytes) else 0
                with self._cv:
                    while not (self._stop or self._room(size)):
                        self._cv.wait()
                    if self._stop:
                        return
                    self._ready.append((item, size))
                    self._held += size
                    self._cv.notify_all()
        except BaseException as err:  # handed to the consumer, whose thread can report it
            self._error = err
        with self._cv:
            self._ready.append((None, 0))
            self._cv.notify_all()

    def __iter__(self) -> Iterator[tuple]:
        while True:
            with self._cv:
                while not self._ready:
                    self._cv.wait()
                item, size = self._ready.popleft()
                self._held -= size
                self._cv.notify_all()
            if item is None:
                if self._error is not None:
                    raise self._error
                return
            yield item

    def __enter__(self) -> "ReadAhead":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._stop = True
            self._ready.clear()  # the bytes read ahead are not wanted any more
            self._cv.notify_all()
        self._thread.join()


# ---- the external shuffle ----------------------------------------------------------------------


class Buckets:
    """Records spooled in read order into K files by output position, then assembled in output order.

    positions[row] is the row's place in the .rec; per row only its bucket offset and length are kept.
    """

    def __init__(self, partial_rec: Path, positions: np.ndarray, k: int):
        self.n, self.k, self.positions = len(positions), k, positions
        self.paths = [partial_rec.with_name(f"{partial_rec.name}{BUCKET_INFIX}{b:04d}") for b in range(k)]
        self.offset = np.zeros(self.n, dtype=np.int64)
        self.length = np.zeros(self.n, dtype=np.uint32)  # 0: skipped (a framed record is never empty)
        self._tell = [0] * k
        self._files = []
        for path in self.paths:  # created new: a link planted under a bucket's name is never written through
            self._files.append(open(safefs.create_new(path), "wb", buffering=BUCKET_BUFFER))

    def put(self, row: int, framed: bytes) -> None:
        b = int(self.positions[row]) * self.k // self.n
        self._files[b].write(framed)
        self.offset[row], self.length[row] = self._tell[b], len(framed)
        self._tell[b] += len(framed)

    @property
    def spooled_bytes(self) -> int:
        return sum(self._tell)

    def _close(self) -> None:
        for f in self._files:
            f.close()

    def assemble(self, writer, order: np.ndarray, ids: np.ndarray, progress) -> None:
        """Write every spooled record to `writer` in output order; each bucket is deleted once written.
        progress(done) is called as positions are done."""
        self._close()
        for b, path in enumerate(self.paths):
            lo, hi = -(-b * self.n // self.k), -(-(b + 1) * self.n // self.k)  # positions p: p * k // n == b
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)  # read the bucket ahead, in file order
                for start in range(lo, hi, ASSEMBLE_CHUNK):  # a bucket's rows as Python ints: chunk by chunk
                    rows = order[start : min(start + ASSEMBLE_CHUNK, hi)]
                    spans = zip(ids[rows].tolist(), self.offset[rows].tolist(), self.length[rows].tolist(), strict=True)
                    for rid, offset, length in spans:
                        if length:
                            writer.write_framed(rid, os.pread(fd, length, offset))
                    progress(start + len(rows))
            finally:
                os.close(fd)
            os.unlink(path)

    def remove(self) -> None:
        """Delete whatever buckets are left (on an error; a kill leaves them to the next run)."""
        for f in self._files:
            with contextlib.suppress(OSError):  # a full disk cannot take the buffered rest: deleted anyway
                f.close()
        for path in self.paths:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
