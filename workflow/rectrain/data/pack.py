"""Pack one split of the index into an MXNet RecordIO pair on fast storage.

    python -m rectrain.data.pack --config-json '{"resize": 0, "quality": 90, "shuffle_seed": 0, ...}' \\
        --index results/demo/index --raw results/demo/raw --split train \\
        --rec results/fast_storage/demo/train.rec --idx results/fast_storage/demo/train.idx \\
        --manifest results/demo/pack/train.manifest.json --threads 8

Records go out in a seeded shuffled order (DALI shuffles only inside a small window), each with
id = the index row id and label = the index label, so any record traces back to its source file.
A pool of threads reads, checks, (re)encodes and frames images; the main thread writes them in
order. At most a fixed number of batches are in flight, so memory does not grow with the dataset.

One image never ends the pack: whatever fails on it (unreadable, corrupt, a decompression bomb,
out of memory, a record too large, a bug) makes it a skip with the reason, listed in the manifest.
Too many skips (pack.max_skipped_share) or none packed at all fail the pack, naming the top reasons.

Nothing is trusted half-written: the pair is written as ``*.partial``, read back completely by
rectrain.data.verify, and only then renamed. A reader never sees a new .rec with an old .idx: the old
.idx is deleted before anything else, and the new one is renamed into place last, after its .rec; so
while an .idx exists, the .rec beside it is the one it indexes. A lock on the pair
(``.<name>.rec.lock``) stops a second pack of the same pair at once, naming the first; each split
has its own, so the train and val packs still run side by side. A killed pack leaves only
``*.partial`` and atomic-write temporaries, which the next run deletes under that lock.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import logging
import os
import random
import socket
import sys
import tarfile
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from rectrain import storage
from rectrain.atomic import fsync_path, publish, temporary_name, write_json
from rectrain.config import ConfigError, stage_block
from rectrain.data.archives import SourceReader
from rectrain.data.images import Skip, prepare
from rectrain.data.verify import VerifyError, verify_pair
from rectrain.log import setup
from rectrain.recordio import RecordIOError, RecordWriter, frame_payload, pack_record
from rectrain.tables import read_tsv

BATCH = 32  # images per task: amortises scheduling, small enough to keep every thread busy
IN_FLIGHT_PER_WORKER = 4
PROGRESS_EVERY_S = 5.0
PARTIAL = ".partial"
TOP_REASONS = 3  # skip causes named when the pack fails for too many skips

log = logging.getLogger("rectrain.data.pack")  # not __name__: that is __main__ under python -m


class PackFailed(RuntimeError):
    """The split cannot be published as packed (too many or all images skipped); names the cause."""


class PackBusy(RuntimeError):
    """Another pack holds the lock of this output pair; names it."""


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

    def __init__(self, raw_root: str, cfg: dict):
        self.reader = SourceReader(Path(raw_root).resolve())
        self.resize, self.quality, self.check_scan_data = cfg["resize"], cfg["quality"], cfg["check_scan_data"]

    def one(self, rid: int, source: str, label: int) -> tuple[bytes, str | None]:
        """(framed record, repair reason or None); Skip when the image cannot be packed."""
        try:
            data = self.reader.read(source)
        except (OSError, KeyError, ValueError, tarfile.TarError) as err:
            raise Skip(f"cannot read source: {err}") from None
        image, repaired = prepare(data, self.resize, self.quality, self.check_scan_data)
        try:
            return frame_payload(pack_record((0, float(label), rid, 0), image)), repaired
        except RecordIOError as err:
            raise Skip(f"record too large: {err}") from None

    def batch(self, rows: list[tuple[int, str, int]]) -> list[tuple[bytes, str | None] | Skip]:
        out = []
        for rid, source, label in rows:
            try:
                out.append(self.one(rid, source, label))
            except Skip as err:
                out.append(err)
            except MemoryError:  # this image's buffers are gone with the frames; the next ones fit again
                out.append(Skip("out of memory: MemoryError while reading, decoding or encoding this image"))
            except Exception as err:  # one file must never end a pack that may have run for hours
                log.warning(f"unexpected error on id {rid} {source}:", exc_info=True)
                out.append(Skip(f"unexpected error: {type(err).__name__}: {err}"))
        return out


# ---- parent side -------------------------------------------------------------------------------


def load_index(index_dir: Path, split: str) -> tuple[list[int], list[str], list[int], int]:
    """ids, sources, labels of <split>.tsv and the class count from classes.tsv."""
    tsv = index_dir / f"{split}.tsv"
    rows = read_tsv(tsv)
    ids = [int(r["id"]) for r in rows]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{tsv}: duplicate ids; rebuild the index (rule index_raw)")
    num_classes = len(read_tsv(index_dir / "classes.tsv"))
    labels = [int(r["label"]) for r in rows]
    bad = next((i for i, lab in zip(ids, labels, strict=True) if not 0 <= lab < num_classes), None)
    if bad is not None:
        raise SystemExit(f"{tsv}: id {bad} has a label outside 0..{num_classes - 1}; rebuild the index")
    return ids, [r["source"] for r in rows], labels, num_classes


def source_bytes(raw_root: Path, sources: list[str]) -> int:
    """Bytes the sources occupy; an archive member counts as its whole outer archive, once."""
    total = 0
    archives = set()
    for src in sources:
        if "::" in src:
            archives.add(src.split("::", 1)[0])
            continue
        try:
            total += os.path.getsize(raw_root / src)
        except OSError:
            pass  # reported per image as a skip when the worker cannot read it
    for archive in archives:
        try:
            total += os.path.getsize(raw_root / archive)
        except OSError:
            pass
    return total


def _remove(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def exclusive(rec: Path, split: str):
    """Hold the lock of the pair written at ``rec``; a second pack of it raises PackBusy naming the
    first. flock, not a lock file's mere existence: the kernel drops it when its holder dies, so a
    killed pack never blocks the next one. The file stays (removing it would race a new holder)."""
    rec.parent.mkdir(parents=True, exist_ok=True)
    lock = rec.with_name(f".{rec.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
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
    """Delete what an interrupted pack of these outputs left: ``*.partial`` and atomic-write
    temporaries. Only under the lock: another live pack's files are never touched."""
    for final in finals:
        stale = [final.with_name(final.name + PARTIAL)]
        stale += final.parent.glob(temporary_name(final).name.rsplit(".tmp", 1)[0] + ".tmp*")
        for path in stale:
            if path.exists():
                log.info(f"removing {path}, left by an interrupted pack")
                _remove(path)


def _example(skip: dict) -> str:
    """A skipped file and its reason's details (after the kind, which the summary names already)."""
    details = skip["reason"].split(":", 1)[1].strip() if ":" in skip["reason"] else ""
    return f"{skip['source']}: {details}" if details else skip["source"]


def check_skips(split: str, n: int, skipped: list[dict], max_share: float) -> None:
    """PackFailed when nothing or too little of the split could be packed, naming the top reasons."""
    if n == 0:
        raise PackFailed(f"the index lists no images for split {split}: nothing to pack; rebuild the index")
    share = len(skipped) / n
    if len(skipped) < n and share <= max_share:
        return
    kinds = Counter(Skip(s["reason"]).kind for s in skipped)
    example = {}
    for s in skipped:
        example.setdefault(Skip(s["reason"]).kind, s)
    top = "; ".join(
        f"{count} x {kind} (e.g. {_example(example[kind])})" for kind, count in kinds.most_common(TOP_REASONS)
    )
    what = "all" if len(skipped) == n else f"{len(skipped)} ({100 * share:.1f} %) of the"
    raise PackFailed(
        f"{what} {n} images of split {split} were skipped, above pack.max_skipped_share = {max_share}; "
        f"nothing was published. Top reasons: {top}. That many is a wrong `raw` path, an unmounted or "
        "failing disk or a dataset in another format, not a few bad files: fix that, or raise "
        "pack.max_skipped_share if these files really are unusable."
    )


class Progress:
    def __init__(self, split: str, total: int):
        self.split, self.total = split, total
        self.start = self.last = time.time()

    def update(self, done: int, nbytes: int, skipped: int, repaired: int, force: bool = False) -> None:
        now = time.time()
        if not force and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        rate = done / elapsed
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta != float("inf") else "?"
        log.info(
            f"pack {self.split}: {done}/{self.total} images ({100 * done / max(self.total, 1):.1f} %), "
            f"{rate:.0f} img/s, {nbytes / 1e6 / elapsed:.1f} MB/s, ETA {eta_s}, "
            f"skipped {skipped}, repaired {repaired}"
        )


@dataclass(frozen=True)
class Target:
    """Where one split is packed to, and with how many threads."""

    split: str
    rec: Path
    idx: Path
    threads: int
    sysfs_root: str | None = None

    @property
    def partial(self) -> tuple[Path, Path]:
        return self.rec.with_name(self.rec.name + PARTIAL), self.idx.with_name(self.idx.name + PARTIAL)


@dataclass
class Written:
    """What writing the records produced: the labels to verify, the skips and repairs, the bytes."""

    expected: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)
    repaired: list = field(default_factory=list)
    bytes_written: int = 0


def _prepare(target: Target, raw_root: Path, sources: list[str], cfg: dict) -> dict:
    """Clear the old pair and check the disk; returns the storage preflight result."""
    target.rec.parent.mkdir(parents=True, exist_ok=True)
    # An older pair must not survive a failed run looking valid, and no reader may pair the new
    # .rec with the old .idx: the .idx goes first, durably, and comes back only after the new .rec.
    _remove(target.idx, target.rec, *target.partial)
    fsync_path(target.idx.parent)
    n = len(sources)
    needed = storage.estimate_needed_bytes(source_bytes(raw_root, sources), n, cfg["resize"], cfg["quality"])
    result = storage.preflight(target.rec.parent, needed, target.sysfs_root)
    log.info(
        f"pack {target.split}: {n} images -> {target.rec} (device {result['device']}, rotational "
        f"{result['rotational']}, {result['free_bytes'] / 1e9:.1f} GB free, ~{needed / 1e9:.2f} GB needed)"
    )
    if result["warning"]:
        log.warning(result["warning"])
    return result


def _write_records(batches, n: int, packer: _Packer, pool: ThreadPoolExecutor, target: Target) -> Written:
    """Prepare every image on the pool and write the records in the order `batches` yields them (the
    shuffled order); batches are built as they are submitted, so memory stays bounded."""
    out, progress, done = Written(), Progress(target.split, n), 0
    with RecordWriter(*target.partial) as writer:
        pending = deque()  # (batch rows, future) in output order; bounded, so memory is too

        def drain_one() -> None:
            nonlocal done
            batch, future = pending.popleft()
            for (rid, source, label), result in zip(batch, future.result(), strict=True):
                if isinstance(result, Skip):
                    out.skipped.append({"id": rid, "source": source, "reason": str(result)})
                    continue
                framed, reason = result
                if reason is not None:
                    out.repaired.append({"id": rid, "source": source, "reason": reason})
                writer.write_framed(rid, framed)
                out.expected[rid] = label
            done += len(batch)
            progress.update(done, writer.tell(), len(out.skipped), len(out.repaired))

        for batch in batches:
            pending.append((batch, pool.submit(packer.batch, batch)))
            if len(pending) >= target.threads * IN_FLIGHT_PER_WORKER:
                drain_one()
        while pending:
            drain_one()
        writer.close()
        out.bytes_written = writer.tell()
    progress.update(done, out.bytes_written, len(out.skipped), len(out.repaired), force=True)
    return out


def _log_and_check_skips(target: Target, n: int, written: Written, cfg: dict) -> None:
    written.skipped.sort(key=lambda r: r["id"])
    written.repaired.sort(key=lambda r: r["id"])
    for item in written.skipped:
        log.info(f"skipped id {item['id']} {item['source']}: {item['reason']}")
    for item in written.repaired:
        log.info(f"repaired id {item['id']} {item['source']}: {item['reason']}")
    try:
        check_skips(target.split, n, written.skipped, cfg["max_skipped_share"])
    except PackFailed:
        _remove(*target.partial)  # nothing in them to inspect: every skip is in the log
        raise


def pack_split(cfg: dict, index_dir: Path, raw_root: Path, target: Target) -> dict:
    """Pack, verify and publish one split; returns the manifest dict."""
    t0 = time.time()
    ids, sources, labels, num_classes = load_index(index_dir, target.split)
    n = len(ids)
    storage_result = _prepare(target, raw_root, sources, cfg)
    order = list(range(n))
    random.Random(cfg["shuffle_seed"]).shuffle(order)
    batches = ([(ids[j], sources[j], labels[j]) for j in order[b : b + BATCH]] for b in range(0, n, BATCH))
    target = replace(target, threads=max(1, int(target.threads)))
    packer = _Packer(str(raw_root), cfg)
    pool = ThreadPoolExecutor(target.threads, thread_name_prefix="pack")
    try:
        written = _write_records(batches, n, packer, pool, target)
        pack_s = time.time() - t0
        _log_and_check_skips(target, n, written, cfg)
        log.info(f"verify {target.split}: reading back {len(written.expected)} records")
        # Forcing the pair to disk waits on the device, reading it back on the page cache: overlap
        # them (~10 % of a pass-through pack's wall time). Both finish before anything is published.
        synced = pool.submit(fsync_path, *target.partial)
        check = verify_pair(*target.partial, written.expected, num_classes, cfg["resize"])
        synced.result()
    finally:
        pool.shutdown(cancel_futures=True)  # on an error or Ctrl-C, do not finish queued batches
        packer.reader.close()
    publish(target.partial[0], target.rec)
    publish(target.partial[1], target.idx)  # last: a .rec without its .idx is never taken for a pair
    wall = time.time() - t0
    log.info(f"pack {target.split}: verified and published {target.rec} and {target.idx} in {wall:.1f} s")
    timing = {"wall_s": round(wall, 3), "pack_s": round(pack_s, 3), "verify_s": check["verify_s"]}
    return _manifest(
        cfg, target, written, timing, {"check": check, "num_classes": num_classes, "n": n, "storage": storage_result}
    )


def _manifest(cfg: dict, target: Target, written: Written, timing: dict, facts: dict) -> dict:
    """The pack manifest (docs/architecture.md): counts add up, discovered = packed + skipped."""
    wall, n = timing["wall_s"], facts["n"]
    return {
        "split": target.split,
        "rec": str(target.rec),
        "idx": str(target.idx),
        "discovered": n,
        "packed": len(written.expected),
        "skipped": len(written.skipped),
        "repaired": written.repaired,
        "skipped_files": written.skipped,
        "bytes_written": written.bytes_written,
        **timing,
        "verified_decoded": facts["check"]["decoded"],
        "images_per_s": round(n / wall, 1) if wall else None,
        "mb_per_s": round(written.bytes_written / 1e6 / wall, 2) if wall else None,
        "resize": cfg["resize"],
        "quality": cfg["quality"],
        "shuffle_seed": cfg["shuffle_seed"],
        "max_skipped_share": cfg["max_skipped_share"],
        "check_scan_data": cfg["check_scan_data"],
        "threads": target.threads,
        "num_classes": facts["num_classes"],
        "storage": facts["storage"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-json", required=True, help="the config's pack block as JSON (schema fills the rest)")
    parser.add_argument("--index", required=True, type=Path, help="index directory (<split>.tsv, classes.tsv)")
    parser.add_argument("--raw", required=True, type=Path, help="raw dataset root the index's sources are under")
    parser.add_argument("--split", required=True)
    parser.add_argument("--rec", required=True, type=Path)
    parser.add_argument("--idx", required=True, type=Path)
    parser.add_argument("--manifest", required=True, type=Path)
    parser.add_argument("--threads", type=int, default=None, help="worker threads (default: pack.threads)")
    args = parser.parse_args(argv)
    setup("")  # the rule log's lines stay bare, as they always were
    try:
        cfg = stage_block("pack", args.config_json)
    except ConfigError as err:
        log.error(f"pack {args.split}: ERROR: {err}")
        return 2
    _keep_freed_memory()
    try:
        with exclusive(args.rec, args.split):
            remove_leftovers(args.rec, args.idx, args.manifest)
            _remove(args.manifest)  # describes the pair this run replaces
            target = Target(args.split, args.rec, args.idx, args.threads or cfg["threads"])
            manifest = pack_split(cfg, args.index, args.raw, target)
            write_json(args.manifest, manifest)
    except (storage.StorageError, PackBusy) as err:
        log.error(f"pack {args.split}: ERROR: {err}")
        return 2
    except PackFailed as err:
        log.error(f"pack {args.split}: ERROR: {err}")
        return 4
    except (VerifyError, RecordIOError) as err:
        log.error(
            f"pack {args.split}: ERROR: the written pair failed verification and was not published "
            f"(left as *{PARTIAL} for inspection): {err}"
        )
        return 3
    log.info(
        f"pack {args.split}: manifest {args.manifest}: {manifest['packed']} packed, "
        f"{manifest['skipped']} skipped, {len(manifest['repaired'])} repaired, "
        f"{manifest['images_per_s']} img/s, {manifest['mb_per_s']} MB/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
