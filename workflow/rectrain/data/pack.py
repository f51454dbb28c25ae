"""Pack one split of the index into an MXNet RecordIO pair on fast storage.

    python -m rectrain.data.pack --config-json '{"resize": 0, "max_side": null, "quality": 90, "shuffle_seed": 0, ...}' \\
        --index results/demo/index --raw results/demo/raw --split train \\
        --rec results/fast_storage/demo/train.rec --idx results/fast_storage/demo/train.idx \\
        --manifest results/demo/pack/train.manifest.json --threads 8

Records go out in a seeded shuffled order (DALI shuffles only inside a small window), each with
id = the index row id and label = the index label, so any record traces back to its source file.
A pool of threads reads, checks, (re)encodes and frames images; the main thread writes them in
order. At most a fixed number of batches are in flight and the index is held as arrays
(rectrain.data.indextable), so memory grows by ~50-60 bytes per image (bench/RESULTS.md), not with the data.

pack.read_order picks how the raw images are read (rectrain.data.readorder): straight in the
output order (by the workers), or in storage order - archive members by offset, folders by path and
inode, for a raw root on an HDD or a network share - by one reader thread of its own, shuffled
through bucket files beside the .rec. The .rec is
the same either way; the manifest says which ran and why. Every pack.progress_s seconds the log
says images done of total, img/s and the ETA of each step (read, assemble, verify).

One image never ends the pack: whatever fails on it (unreadable, corrupt, a decompression bomb,
out of memory, a record too large, a bug) makes it a skip with the reason, listed in the manifest.
Too many skips (pack.max_skipped_share) or none packed at all fail the pack, naming the top reasons;
too many stop it at the skip that makes them so (a wrong raw path fails in the first 1 %, not the last).

Nothing is trusted half-written: the pair is written as ``*.partial``, read back completely by
rectrain.data.verify, and only then renamed. A reader never sees a new .rec with an old .idx: the old
.idx is deleted before anything else, and the new one is renamed into place last, after its .rec; so
while an .idx exists, the .rec beside it is the one it indexes. A lock on the pair
(``.<name>.rec.lock``) stops a second pack of the same pair at once, naming the first; each split
has its own, so the train and val packs still run side by side. A killed pack leaves only
``*.partial``, bucket files and atomic-write temporaries, which the next run deletes under that lock.

Nothing found in the folder or the raw root is trusted (issue #26): the folder is checked like the
staging folder (rectrain.safefs), the lock is opened and every file created without following a link,
and leftovers are found by lstat, so a planted link is never written through; each source is reopened
under the index's rules (rectrain.data.rawfiles), so a link, FIFO or huge file swapped in after the
index is a skip, not a leak or a hang; at most IN_FLIGHT_BYTES of sources are in flight; a full disk
stops the pack (DiskFull) naming what was written and what is needed, with its files removed; and a
pair another working directory published is not replaced (rectrain.data.pairowner).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import random
import shutil
import socket
import stat
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from rectrain import cli, safefs, storage, usage
from rectrain.atomic import fsync_path, publish, temporary_prefix, write_json
from rectrain.config import ConfigError
from rectrain.data import indextable, pairowner, readorder, space
from rectrain.data.archives import READ_ERRORS, SEP, SourceReader
from rectrain.data.fit import Fit, pack_fit
from rectrain.data.images import Skip, prepare
from rectrain.data.indextable import BadIndex, IndexTable
from rectrain.data.rawfiles import RawFiles, Refused
from rectrain.data.verify import Expected, VerifyError, verify_pair
from rectrain.progress import Progress
from rectrain.recordio import RecordIOError, RecordWriter, frame_payload, pack_record
from rectrain.settings import PackSettings

BATCH = 32  # images per task: amortises scheduling, small enough to keep every thread busy
IN_FLIGHT_PER_WORKER = 4
# Source bytes in flight - read ahead by the storage order, or to be read by the workers and then held
# as records until the writer takes them: a batch closes at BATCH_BYTES, and no new one is submitted
# while more than IN_FLIGHT_BYTES are in flight, so large files cannot pile up in memory.
BATCH_BYTES = 16 << 20
IN_FLIGHT_BYTES = 256 << 20
PARTIAL = ".partial"
TOP_REASONS = 3  # skip causes named when the pack fails for too many skips

log = logging.getLogger("rectrain.data.pack")  # not __name__: that is __main__ under python -m


class PackFailed(RuntimeError):
    """The split cannot be published as packed (too many or all images skipped); names the cause."""


class PackBusy(RuntimeError):
    """Another pack holds the lock of this output pair; names it."""


class DiskFull(storage.StorageError):
    """The fast storage filled up during the pack; what was started is removed and nothing published."""


class NotVerified(RuntimeError):
    """The written pair failed its read-back (VerifyError, RecordIOError): left as *.partial, not published."""


# ---- worker side -------------------------------------------------------------------------------

# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_FREED_BYTES = 64 << 20


def _keep_freed_memory() -> None:
    """Linux/glibc: reuse freed image buffers instead of handing them back to the kernel.

    Every image needs fresh ~1 MB buffers (decode, resize, encode). glibc serves blocks that large
    with mmap, or trims them off the heap when freed, so each one page-faults its memory back in:
    ~170 faults and ~0.4 ms of kernel time per image, 10-15 % of a resize pack (measured on 500x375
    JPEGs). Keeping up to 64 MB of freed memory in the heap bounds the footprint by the largest
    images; buffers above 64 MB (huge photos) are still mapped and returned.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_FREED_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_FREED_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc: the allocator's own policy applies


class _Packer:
    """Reads, checks, (re)encodes and frames images; called from the pool's threads.

    Threads, not processes: Pillow releases the GIL while it decodes, resizes and encodes, and
    records need no pickling or pipe copies to reach the writer (measured: pass-through -35 % CPU,
    resize -8 %). Threads also die with the pack, so a SIGKILL leaves nothing running.
    """

    def __init__(self, raw_root: str, pack: PackSettings):
        root = Path(raw_root).resolve()
        self.reader = SourceReader(root, RawFiles(root, pack.max_image_bytes))
        self.fit, self.quality, self.check_scan_data = (
            pack_fit(pack.resize, pack.max_side),
            pack.quality,
            pack.check_scan_data,
        )

    def one(self, rid: int, source: str, label: int, data=None) -> tuple[bytes, str | None]:
        """(framed record, repair reason or None); Skip when the image cannot be packed. `data` is the
        source's bytes when the storage order read them already, or the error reading them."""
        if data is None:
            try:
                data = self.reader.read(source)
            except READ_ERRORS as err:
                data = err
        if isinstance(data, Exception):
            raise Skip(str(data) if isinstance(data, Refused) else f"cannot read source: {data}")
        fit, quality = self.fit, self.quality
        image, repaired = prepare(data, fit.shorter, quality, self.check_scan_data, source, max_side=fit.longer)
        try:
            return frame_payload(pack_record((0, float(label), rid, 0), image)), repaired
        except RecordIOError as err:
            raise Skip(f"record too large: {err}") from None

    def batch(self, items: list[tuple]) -> list[tuple[bytes, str | None] | Skip]:
        """items: (row, id, source, label, its bytes, the error reading them, or None: read it here).
        A skip comes back as a new Skip holding only its message: the raised one's traceback would keep
        the image's bytes alive until the writer takes the batch (up to threads x 4 x 32 results)."""
        out = []
        for _, rid, source, label, data in items:
            try:
                out.append(self.one(rid, source, label, data))
            except Skip as err:
                out.append(Skip(str(err)))
            except MemoryError:  # this image's buffers are gone with the frames; the next ones fit again
                out.append(Skip("out of memory: MemoryError while reading, decoding or encoding this image"))
            except Exception as err:  # one file must never end a pack that may have run for hours
                log.warning("unexpected error on id %s %s:", rid, source, exc_info=True)
                out.append(Skip(f"unexpected error: {type(err).__name__}: {err}"))
        return out


# ---- parent side -------------------------------------------------------------------------------


def _remove(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def _refuse_folder(path: Path, why: str) -> storage.StorageError:
    return storage.StorageError(
        f"the pack's folder {path} {why}; the pack refuses it because another user could plant links there "
        "that the pack would write through, or replace the published pair. Remove it (or ask its owner to), "
        "or set pack.fast_storage to a directory you own"
    )


def pack_folder(path: Path) -> Path:
    """<fast_storage>/<dataset>/ checked like the staging folder (rectrain.safefs): created or found as a
    real directory of this user in a safe parent, and made unwritable by other users (umask 002
    leaves it group-writable)."""
    return safefs.owned_dir(path, _refuse_folder, 0o755)


def _open_lock(lock: Path) -> int:
    """The lock file, opened without following a link; a link or a special file there is refused."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise storage.StorageError(
            f"the pack's lock {lock} is a symbolic link (to {os.readlink(lock)}), which no pack creates: someone "
            "put it there to make the pack write through it. The pack never does; remove the link and rerun"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise storage.StorageError(f"the pack's lock {lock} is not a regular file; remove it and rerun")
    return fd


@contextlib.contextmanager
def exclusive(rec: Path, split: str):
    """Hold the lock of the pair written at ``rec``; a second pack of it raises PackBusy naming the
    first. flock, not a lock file's mere existence: the kernel drops it when its holder dies, so a
    killed pack never blocks the next one. The file stays (removing it would race a new holder)."""
    pack_folder(rec.parent)
    lock = rec.with_name(f".{rec.name}.lock")
    fd = _open_lock(lock)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not said who it is"
            raise PackBusy(
                f"another pack is writing {rec} ({holder}; lock {lock}); wait for it to finish or stop it, then rerun"
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, split {split}, started {started}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_leftovers(*finals: Path) -> None:
    """Delete what an interrupted pack of these outputs left: ``*.partial``, the storage order's
    bucket files and atomic-write temporaries. Only under the lock: another live pack's files are never touched."""
    for final in finals:
        partial = final.with_name(final.name + PARTIAL)
        stale = [partial, *final.parent.glob(readorder.bucket_glob(partial))]
        stale += final.parent.glob(temporary_prefix(final) + "*")
        for path in stale:
            if os.path.lexists(path):  # a dangling link too: exists() follows it and says False
                log.info("removing %s, left by an interrupted pack", path)
                _remove(path)


def _example(skip: dict) -> str:
    """A skipped file and its reason's details (after the kind, which the summary names already)."""
    details = skip["reason"].split(":", 1)[1].strip() if ":" in skip["reason"] else ""
    return f"{skip['source']}: {details}" if details else skip["source"]


def _top_reasons(skipped: list[dict]) -> str:
    kinds = Counter(Skip(s["reason"]).kind for s in skipped)
    example = {}
    for s in skipped:
        example.setdefault(Skip(s["reason"]).kind, s)
    return "; ".join(
        f"{count} x {kind} (e.g. {_example(example[kind])})" for kind, count in kinds.most_common(TOP_REASONS)
    )


_TOO_MANY = (
    "That many is a wrong `raw` path, an unmounted or failing disk or a dataset in another format, not a "
    "few bad files: fix that, or raise pack.max_skipped_share if these files really are unusable."
)


def check_skips(split: str, n: int, skipped: list[dict], max_share: float) -> None:
    """PackFailed when nothing or too little of the split could be packed, naming the top reasons."""
    if n == 0:
        raise PackFailed(f"the index lists no images for split {split}: nothing to pack; rebuild the index")
    share = len(skipped) / n
    if len(skipped) < n and share <= max_share:
        return
    what = "all" if len(skipped) == n else f"{len(skipped)} ({100 * share:.1f} %) of the"
    raise PackFailed(
        f"{what} {n} images of split {split} were skipped, above pack.max_skipped_share = {max_share}; "
        f"nothing was published. Top reasons: {_top_reasons(skipped)}. {_TOO_MANY}"
    )


def _progress(what: str, total: int, every_s: float, status=None) -> Progress:
    """The progress lines of one pack step (rectrain.progress): images done of total, img/s, the ETA,
    then whatever `status()` adds (called only when a line is written)."""
    progress = Progress(every_s)
    progress.begin(what, total, (lambda done, per_image: f", {status()}") if status else None, unit="images")
    return progress


@dataclass(frozen=True)
class Target:
    """Where one split is packed to, and how: threads, read order (pack.read_order), seconds
    between progress lines."""

    split: str
    rec: Path
    idx: Path
    threads: int
    sysfs_root: str | None = None
    read_order: str = "auto"
    progress_s: float = 10.0

    @property
    def partial(self) -> tuple[Path, Path]:
        return self.rec.with_name(self.rec.name + PARTIAL), self.idx.with_name(self.idx.name + PARTIAL)


@dataclass
class Written:
    """What packing the records produced: which index rows were packed, the skips and repairs, the
    bytes of the .rec."""

    packed: np.ndarray
    split: str = ""
    max_share: float = 1.0  # pack.max_skipped_share: more skips than this share of the split fail it
    skipped: list = field(default_factory=list)
    repaired: list = field(default_factory=list)
    bytes_written: int = 0
    record_bytes: int = 0  # of the records taken so far (the .rec's size once all are written)
    taken: int = 0  # images done so far, packed or skipped

    def take(self, item: tuple, result) -> bytes | None:
        """The framed record of a worker's result, or None for a skip (listed with its reason).
        PackFailed as soon as the skips exceed max_share of the whole split: the rest cannot save it."""
        row, rid, source, _, _ = item
        self.taken += 1
        if isinstance(result, Skip):
            self.skipped.append({"id": rid, "source": source, "reason": str(result)})
            self._stop_if_lost()
            return None
        framed, reason = result
        if reason is not None:
            self.repaired.append({"id": rid, "source": source, "reason": reason})
        self.packed[row] = True
        self.record_bytes += len(framed)
        return framed

    def _stop_if_lost(self) -> None:
        n, k = len(self.packed), len(self.skipped)
        if k / n <= self.max_share or self.taken == n:  # the last image: check_skips says it as ever
            return
        raise PackFailed(
            f"{k} of the first {self.taken} images of split {self.split} were skipped: already {100 * k / n:.1f} % "
            f"of its {n}, above pack.max_skipped_share = {self.max_share} whatever the other {n - self.taken} "
            f"hold, so the pack stopped there and nothing was published. Top reasons: {_top_reasons(self.skipped)}. "
            f"{_TOO_MANY}"
        )

    def status(self, nbytes: int, elapsed: float) -> str:
        return (
            f"{nbytes / 1e6 / max(elapsed, 1e-9):.1f} MB/s, skipped {len(self.skipped)}, repaired {len(self.repaired)}"
        )


def shuffled_order(n: int, seed: int) -> np.ndarray:
    """Index row at each output position: Python's seeded shuffle (the order every earlier pack
    wrote), run on a compact array instead of a list of 1.28 M int objects."""
    order = array.array("q", range(n))
    random.Random(seed).shuffle(order)
    return np.frombuffer(order, dtype=np.int64) if n else np.zeros(0, np.int64)


def _prepare(target: Target, raw_root: Path, table: IndexTable, pack: PackSettings, choice: dict) -> tuple[dict, int]:
    """Clear the old pair and check the disk; returns the storage preflight result and the number
    of bucket files the storage order spools through (0 when reading in shuffled order)."""
    # An older pair must not survive a failed run looking valid, and no reader may pair the new
    # .rec with the old .idx: the .idx goes first, durably, and comes back only after the new .rec.
    _remove(target.idx, target.rec, *target.partial)
    fsync_path(target.idx.parent)
    n = len(table)
    files = RawFiles(raw_root, pack.max_image_bytes)
    fit = pack_fit(pack.resize, pack.max_side)
    extra = space.reencoded_extra(files, table.iter_sources(), fit, pack.quality)
    needed = storage.estimate_needed_bytes(
        space.source_bytes(raw_root, table.iter_sources()), n, fit.shorter, pack.quality, extra, max_side=fit.longer
    )
    buckets = readorder.bucket_count(needed) if choice["used"] == "storage" else 0
    if buckets:
        needed += -(-needed // buckets)  # the .rec grows while the last bucket is still on disk
    result = storage.preflight(target.rec.parent, needed, target.sysfs_root)
    log.info(
        "pack %s: %d images -> %s (device %s, rotational %s, %.1f GB free, ~%.2f GB needed)",
        target.split,
        n,
        target.rec,
        result["device"],
        result["rotational"],
        result["free_bytes"] / 1e9,
        needed / 1e9,
    )
    log.info("pack %s: read order %s: %s", target.split, choice["used"], choice["reason"])
    if result["warning"]:
        log.warning("%s", result["warning"])
    return result, buckets


def _held(item: tuple, reader: SourceReader) -> int:
    """Source bytes of an item: read already (the storage order), else the size a worker will read."""
    data, source = item[4], item[2]
    if data is not None:
        return len(data) if isinstance(data, bytes) else 0
    try:  # a plain stat on a str: the cost of a Path per image shows at 1.28 M images
        return os.stat(f"{reader.root}/{source}").st_size if SEP not in source else reader.locate(source)[2]
    except READ_ERRORS:
        return 0  # the worker's read fails too: a skip


def _batches(items, reader: SourceReader) -> Iterator[tuple[list, int]]:
    """(batch, source bytes it holds): BATCH items, or fewer once they hold BATCH_BYTES."""
    batch, held = [], 0
    for item in items:
        batch.append(item)
        held += _held(item, reader)
        if len(batch) == BATCH or held >= BATCH_BYTES:
            yield batch, held
            batch, held = [], 0
    if batch:
        yield batch, held


def _pump(items, packer: _Packer, pool: ThreadPoolExecutor, threads: int, sink, progress: Progress) -> None:
    """Prepare `items` on the pool in batches and hand each (item, result) to `sink` in the items'
    order; batches are cut as they are submitted and at most a few per thread (and IN_FLIGHT_BYTES of
    sources) are in flight, so memory stays bounded."""
    pending, done, held = deque(), 0, 0  # (batch, future, bytes held) in item order

    def drain_one() -> None:
        nonlocal done, held
        batch, future, nbytes = pending.popleft()
        for item, result in zip(batch, future.result(), strict=True):
            sink(item, result)
        done += len(batch)
        held -= nbytes
        progress.count(done)

    for batch, nbytes in _batches(items, packer.reader):
        pending.append((batch, pool.submit(packer.batch, batch), nbytes))
        held += nbytes
        while pending and (len(pending) >= threads * IN_FLIGHT_PER_WORKER or held > IN_FLIGHT_BYTES):
            drain_one()
    while pending:
        drain_one()
    progress.count(done, force=True)


def _shuffled_items(table: IndexTable, order: np.ndarray) -> Iterator[tuple]:
    for b in range(0, len(order), BATCH):
        rows = order[b : b + BATCH].tolist()
        labels = table.labels[rows].tolist()
        yield from zip(rows, table.ids[rows].tolist(), table.sources(rows), labels, [None] * len(rows), strict=True)


def _pack_shuffled(
    table: IndexTable, order: np.ndarray, packer: _Packer, pool: ThreadPoolExecutor, target: Target, written: Written
):
    """Read the images in the output order and write each record as it comes (a random read each)."""
    with _stops_when_full(target, written, 0), RecordWriter(*target.partial, new=True) as writer:
        t0 = time.time()
        progress = _progress(
            f"pack {target.split}",
            len(table),
            target.progress_s,
            lambda: written.status(writer.tell(), time.time() - t0),
        )

        def sink(item, result) -> None:
            framed = written.take(item, result)
            if framed is not None:
                writer.write_framed(item[1], framed)

        _pump(_shuffled_items(table, order), packer, pool, target.threads, sink, progress)
        writer.close()
        written.bytes_written = writer.tell()
    return written


def _pack_storage(
    table: IndexTable,
    order: np.ndarray,
    packer: _Packer,
    pool: ThreadPoolExecutor,
    target: Target,
    *,
    k: int,
    written: Written,
):
    """Read the images in storage order into bucket files by output position, then assemble the .rec
    in output order (rectrain.data.readorder), into `written`. Returns (seconds reading, seconds assembling)."""
    n = len(table)
    positions = np.empty(n, dtype=np.int64)
    positions[order] = np.arange(n, dtype=np.int64)
    buckets = readorder.Buckets(target.partial[0], positions, k)
    with _stops_when_full(target, written, 1 / k), contextlib.ExitStack() as cleanup:
        cleanup.callback(buckets.remove)
        t0 = time.time()
        spooled = _progress(
            f"pack {target.split}: read",
            n,
            target.progress_s,
            lambda: written.status(buckets.spooled_bytes, time.time() - t0),
        )

        def sink(item, result) -> None:
            framed = written.take(item, result)
            if framed is not None:
                buckets.put(item[0], framed)

        items = readorder.storage_order(table, packer.reader)
        with readorder.ReadAhead(items, packer.reader, BATCH_BYTES) as ahead:
            _pump(ahead, packer, pool, target.threads, sink, spooled)
        t1 = time.time()
        with RecordWriter(*target.partial, new=True) as writer:
            assembled = _progress(f"pack {target.split}: assemble", n, target.progress_s)
            buckets.assemble(writer, order, table.ids, assembled.count)
            assembled.count(n, force=True)
            writer.close()
            written.bytes_written = writer.tell()
    return t1 - t0, time.time() - t1


@contextlib.contextmanager
def _stops_when_full(target: Target, written: Written, spool_share: float):
    """Turn a full disk (ENOSPC, EDQUOT) under the body into DiskFull, after the body's own cleanup."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise _disk_full(target, written, spool_share, err) from None


def _disk_full(target: Target, written: Written, spool_share: float, err: OSError) -> DiskFull:
    """Remove the partial pair and say what was written, what the split needs at the rate so far (plus
    the one bucket of spool that the storage order keeps beside the .rec: spool_share) and what is free."""
    _remove(*target.partial)
    n = len(written.packed)
    done = int(written.packed.sum()) + len(written.skipped)
    projected = int(written.record_bytes * n / max(done, 1) * (1 + spool_share))
    free = shutil.disk_usage(target.rec.parent).free
    return DiskFull(
        f"fast_storage {target.rec.parent} filled up during the pack of {target.split} ({err.strerror}): "
        f"{written.record_bytes} bytes written for {done} of {n} images; at that rate the split needs about "
        f"{projected} bytes there, {max(projected - written.record_bytes, 0)} more than it wrote, and "
        f"{free} are free now. The partial files are removed and nothing was published. Free space there "
        "(another job may be writing to it) or point pack.fast_storage at a larger disk, then rerun"
    )


def _log_and_check_skips(target: Target, n: int, written: Written, pack: PackSettings) -> None:
    written.skipped.sort(key=lambda r: r["id"])
    written.repaired.sort(key=lambda r: r["id"])
    for item in written.skipped:
        log.info("skipped id %s %s: %s", item["id"], item["source"], item["reason"])
    for item in written.repaired:
        log.info("repaired id %s %s: %s", item["id"], item["source"], item["reason"])
    try:
        check_skips(target.split, n, written.skipped, pack.max_skipped_share)
    except PackFailed:
        _remove(*target.partial)  # nothing in them to inspect: every skip is in the log
        raise


def _records(
    table: IndexTable, raw_root: Path, pack: PackSettings, choice: dict, target: Target, pool
) -> tuple[Written, dict]:
    """Pack every row into the partial pair in the seeded output order; returns what was written and
    the read order's timings."""
    order = shuffled_order(len(table), pack.shuffle_seed)
    packer = _Packer(str(raw_root), pack)
    written = Written(np.zeros(len(table), dtype=bool), target.split, pack.max_skipped_share)
    try:
        if choice["used"] == "storage":
            read_s, assemble_s = _pack_storage(table, order, packer, pool, target, k=choice["buckets"], written=written)
            return written, {"read_s": round(read_s, 3), "assemble_s": round(assemble_s, 3)}
        return _pack_shuffled(table, order, packer, pool, target, written), {}
    except PackFailed:
        _remove(*target.partial)  # stopped early (Written.take): nothing in them to inspect
        raise
    finally:
        packer.reader.close()


def _verify(table: IndexTable, num_classes: int, written: Written, target: Target, pool, fit: Fit) -> dict:
    """Read the partial pair back completely while forcing it to disk."""
    expected = Expected(table.ids[written.packed], table.labels[written.packed])
    log.info("verify %s: reading back %d records", target.split, len(expected))
    progress = _progress(f"verify {target.split}", len(expected), target.progress_s)
    # Forcing the pair to disk waits on the device, reading it back on the page cache: overlap
    # them (~10 % of a pass-through pack's wall time). Both finish before anything is published.
    synced = pool.submit(fsync_path, *target.partial)
    check = verify_pair(*target.partial, expected, num_classes, fit, progress=progress.count)
    synced.result()
    progress.count(check["records"], force=True)
    return check


def pack_split(pack: PackSettings, index_dir: Path, raw_root: Path, target: Target) -> dict:
    """Pack, verify and publish one split; returns the manifest dict."""
    t0 = time.time()
    table, num_classes = indextable.load(index_dir, target.split)
    n = len(table)
    choice = readorder.choose(target.read_order, raw_root, target.sysfs_root)
    storage_result, choice["buckets"] = _prepare(target, raw_root, table, pack, choice)
    target = replace(target, threads=max(1, int(target.threads)))
    pool = ThreadPoolExecutor(target.threads, thread_name_prefix="pack")
    try:
        written, read_timing = _records(table, raw_root, pack, choice, target, pool)
        pack_s = time.time() - t0
        _log_and_check_skips(target, n, written, pack)
        with _stops_when_full(target, written, 0):  # fsync can be the first to learn the disk is full
            check = _verify(table, num_classes, written, target, pool, pack_fit(pack.resize, pack.max_side))
    finally:
        pool.shutdown(cancel_futures=True)  # on an error or Ctrl-C, do not finish queued batches
        table.close()
    publish(target.partial[0], target.rec)
    publish(target.partial[1], target.idx)  # last: a .rec without its .idx is never taken for a pair
    wall = time.time() - t0
    log.info("pack %s: verified and published %s and %s in %.1f s", target.split, target.rec, target.idx, wall)
    timing = {"wall_s": round(wall, 3), "pack_s": round(pack_s, 3), "verify_s": check["verify_s"]}
    facts = {"check": check, "num_classes": num_classes, "n": n, "storage": storage_result}
    facts["read_order"] = {**choice, **read_timing}
    return _manifest(pack, target, written, timing, facts)


def _manifest(pack: PackSettings, target: Target, written: Written, timing: dict, facts: dict) -> dict:
    """The pack manifest (docs/architecture.md): counts add up, discovered = packed + skipped."""
    wall, n = timing["wall_s"], facts["n"]
    return {
        "split": target.split,
        "rec": str(target.rec),
        "idx": str(target.idx),
        "discovered": n,
        "packed": int(written.packed.sum()),
        "skipped": len(written.skipped),
        "repaired": written.repaired,
        "skipped_files": written.skipped,
        "bytes_written": written.bytes_written,
        **timing,
        "verified_decoded": facts["check"]["decoded"],
        "images_per_s": round(n / wall, 1) if wall else None,
        "mb_per_s": round(written.bytes_written / 1e6 / wall, 2) if wall else None,
        "resize": pack.resize,
        "max_side": pack.max_side,
        "quality": pack.quality,
        "shuffle_seed": pack.shuffle_seed,
        "max_skipped_share": pack.max_skipped_share,
        "check_scan_data": pack.check_scan_data,
        "max_image_bytes": pack.max_image_bytes,
        "threads": target.threads,
        "num_classes": facts["num_classes"],
        "storage": facts["storage"],
        "read_order": facts["read_order"],
    }


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", required=True, type=Path, help="index directory (<split>.tsv, classes.tsv)")
    parser.add_argument("--raw", required=True, type=Path, help="raw dataset root the index's sources are under")
    parser.add_argument("--split", required=True)
    parser.add_argument("--rec", required=True, type=Path)
    parser.add_argument("--idx", required=True, type=Path)
    parser.add_argument("--manifest", required=True, type=Path)
    # The threads Snakemake gave the job (pack.threads capped at --cores); the config keeps the configured value.
    parser.add_argument("--threads", type=int, default=None, help="worker threads (default: pack.threads)")


def _run(args: argparse.Namespace, pack: PackSettings) -> None:
    pack_fit(pack.resize, pack.max_side)  # resize and max_side both set: refused before the old pair is touched
    _keep_freed_memory()
    with exclusive(args.rec, args.split):
        pairowner.check(args.rec)  # before anything of the old pair is deleted
        remove_leftovers(args.rec, args.idx, args.manifest, pairowner.stamp_path(args.rec))
        _remove(args.manifest, pairowner.stamp_path(args.rec))  # describe the pair this run replaces
        target = Target(
            args.split,
            args.rec,
            args.idx,
            args.threads or pack.threads,
            read_order=pack.read_order,
            progress_s=pack.progress_s,
        )
        try:
            manifest = pack_split(pack, args.index, args.raw, target)
        except (VerifyError, RecordIOError) as err:
            raise NotVerified(
                f"the written {args.split} pair failed verification and was not published "
                f"(left as *{PARTIAL} for inspection): {err}"
            ) from err
        pairowner.claim(args.rec)
        write_json(args.manifest, {**manifest, "usage": usage.own()})
    log.info(
        "pack %s: manifest %s: %d packed, %d skipped, %d repaired, %s img/s, %s MB/s",
        args.split,
        args.manifest,
        manifest["packed"],
        manifest["skipped"],
        len(manifest["repaired"]),
        manifest["images_per_s"],
        manifest["mb_per_s"],
    )


def main(argv=None) -> int:
    """Exit 2: a config, index, storage or lock problem, or a pair of another run; 3: the written pair failed verification;
    4: too many images skipped (PackFailed). The rule log's lines stay bare, as they always were."""
    errors = {ConfigError: 2, storage.StorageError: 2, PackBusy: 2, pairowner.PairTaken: 2, BadIndex: 2}
    errors.update({NotVerified: 3, PackFailed: 4})
    return cli.main("pack", "pack", _arguments, _run, argv, errors=errors, bare=True)


if __name__ == "__main__":
    cli.end(main())
