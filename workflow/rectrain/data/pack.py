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


def pack_split(
    cfg: dict, index_dir: Path, raw_root: Path, split: str, rec: Path, idx: Path, threads: int, sysfs_root=None
) -> dict:
    """Pack, verify and publish one split; returns the manifest dict."""
    t0 = time.time()
    ids, sources, labels, num_classes = load_index(index_dir, split)
    n = len(ids)
    resize, quality = cfg["resize"], cfg["quality"]
    rec.parent.mkdir(parents=True, exist_ok=True)
    tmp_rec, tmp_idx = rec.with_name(rec.name + PARTIAL), idx.with_name(idx.name + PARTIAL)
    # An older pair must not survive a failed run looking valid, and no reader may pair the new
    # .rec with the old .idx: the .idx goes first, durably, and comes back only after the new .rec.
    _remove(idx, rec, tmp_idx, tmp_rec)
    fsync_path(idx.parent)

    needed = storage.estimate_needed_bytes(source_bytes(raw_root, sources), n, resize, quality)
    result = storage.preflight(rec.parent, needed, sysfs_root)
    log.info(
        f"pack {split}: {n} images -> {rec} (device {result['device']}, rotational "
        f"{result['rotational']}, {result['free_bytes'] / 1e9:.1f} GB free, ~{needed / 1e9:.2f} GB needed)"
    )
    if result["warning"]:
        log.warning(result["warning"])

    order = list(range(n))
    random.Random(cfg["shuffle_seed"]).shuffle(order)
    threads = max(1, int(threads))
    progress = Progress(split, n)
    repaired, skipped = [], []
    expected = {}
    done = 0
    packer = _Packer(str(raw_root), cfg)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="pack")
    try:
        with RecordWriter(tmp_rec, tmp_idx) as writer:
            pending = deque()  # (rows, future) in output order; bounded, so memory is too

            def drain_one() -> None:
                nonlocal done
                rows, future = pending.popleft()
                for (rid, source, label), result in zip(rows, future.result(), strict=True):
                    if isinstance(result, Skip):
                        skipped.append({"id": rid, "source": source, "reason": str(result)})
                        continue
                    framed, reason = result
                    if reason is not None:
                        repaired.append({"id": rid, "source": source, "reason": reason})
                    writer.write_framed(rid, framed)
                    expected[rid] = label
                done += len(rows)
                progress.update(done, writer.tell(), len(skipped), len(repaired))

            for b in range(0, n, BATCH):
                rows = [(ids[j], sources[j], labels[j]) for j in order[b : b + BATCH]]
                pending.append((rows, pool.submit(packer.batch, rows)))
                if len(pending) >= threads * IN_FLIGHT_PER_WORKER:
                    drain_one()
            while pending:
                drain_one()
            writer.close()
            bytes_written = writer.tell()
        pack_s = time.time() - t0
        progress.update(done, bytes_written, len(skipped), len(repaired), force=True)
        skipped.sort(key=lambda r: r["id"])
        repaired.sort(key=lambda r: r["id"])
        for item in skipped:
            log.info(f"skipped id {item['id']} {item['source']}: {item['reason']}")
        for item in repaired:
            log.info(f"repaired id {item['id']} {item['source']}: {item['reason']}")
        try:
            check_skips(split, n, skipped, cfg["max_skipped_share"])
        except PackFailed:
            _remove(tmp_rec, tmp_idx)  # nothing in them to inspect: every skip is in the log
            raise

        log.info(f"verify {split}: reading back {len(expected)} records")
        # Forcing the pair to disk waits on the device, reading it back on the page cache: overlap
        # them (~10 % of a pass-through pack's wall time). Both finish before anything is published.
        synced = pool.submit(fsync_path, tmp_rec, tmp_idx)
        check = verify_pair(tmp_rec, tmp_idx, expected, num_classes, resize)
        synced.result()
    finally:
        pool.shutdown(cancel_futures=True)  # on an error or Ctrl-C, do not finish queued batches
        packer.reader.close()
    publish(tmp_rec, rec)
    publish(tmp_idx, idx)  # last: a .rec without its .idx is never taken for a pair
    wall = time.time() - t0
    log.info(f"pack {split}: verified and published {rec} and {idx} in {wall:.1f} s")
    return {
        "split": split,
        "rec": str(rec),
        "idx": str(idx),
        "discovered": n,
        "packed": len(expected),
        "skipped": len(skipped),
        "repaired": repaired,
        "skipped_files": skipped,
        "bytes_written": bytes_written,
        "wall_s": round(wall, 3),
        "pack_s": round(pack_s, 3),
        "verify_s": check["verify_s"],
        "verified_decoded": check["decoded"],
        "images_per_s": round(n / wall, 1) if wall else None,
        "mb_per_s": round(bytes_written / 1e6 / wall, 2) if wall else None,
        "resize": resize,
        "quality": quality,
        "shuffle_seed": cfg["shuffle_seed"],
        "max_skipped_share": cfg["max_skipped_share"],
        "check_scan_data": cfg["check_scan_data"],
        "threads": threads,
        "num_classes": num_classes,
        "storage": result,
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
            manifest = pack_split(
                cfg, args.index, args.raw, args.split, args.rec, args.idx, args.threads or cfg["threads"]
            )
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
