"""Pack one split of the index into an MXNet RecordIO pair on fast storage.

    python -m rectrain.pack --config-json '{"resize": 0, "quality": 90, "shuffle_seed": 0, ...}' \\
        --index results/demo/index --raw results/demo/raw --split train \\
        --rec results/fast_storage/demo/train.rec --idx results/fast_storage/demo/train.idx \\
        --manifest results/demo/pack/train.manifest.json --threads 8

Records go out in a seeded shuffled order (DALI shuffles only inside a small window), each with
id = the index row id and label = the index label, so any record traces back to its source file.
Worker processes read, check and (re)encode images; the parent writes them in order. At most a
fixed number of batches are in flight, so memory does not grow with the dataset.

Nothing is trusted half-written: the pair is written as ``*.partial``, read back completely by
rectrain.verify, and only then renamed (.rec first, .idx last; readers need both). A killed pack
leaves only .partial files, which the next run deletes.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import signal
import sys
import tarfile
import time
from collections import deque
from multiprocessing import Pool
from pathlib import Path

from rectrain import storage
from rectrain.images import Skip, prepare
from rectrain.recordio import IRHeader, RecordIOError, RecordWriter, frame_payload, pack_record
from rectrain.verify import VerifyError, read_tsv, verify_pair

BATCH = 32  # images per task: large enough to amortise IPC, small enough to keep workers busy
IN_FLIGHT_PER_WORKER = 4
PROGRESS_EVERY_S = 5.0
PARTIAL = ".partial"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- worker side -------------------------------------------------------------------------------

_worker: dict = {}


def _die_with_parent() -> None:
    """Linux: a SIGKILLed pack must not leave workers running (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_FREED_BYTES = 64 << 20


def _keep_freed_memory() -> None:
    """Linux/glibc: reuse freed image buffers instead of handing them back to the kernel.

    Every image needs fresh ~1 MB buffers (decode, resize, encode; in the parent, each batch of
    records). glibc serves blocks that large with mmap, or trims them off the heap when freed, so
    each one page-faults its memory back in: ~170 faults and ~0.4 ms of kernel time per image in a
    worker, 10-15 % of a resize pack, and ~10 % of a pass-through pack's wall time in the parent
    (measured on 500x375 JPEGs). Keeping up to 64 MB of freed memory in the heap bounds a process's
    footprint by its largest images; buffers above 64 MB (huge photos) are still mapped and returned.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_FREED_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_FREED_BYTES)
    except (OSError, AttributeError):
        pass  # not glibc: the allocator's own policy applies


def _init_worker(raw_root: str, resize: int, quality: int, parent: int) -> None:
    _die_with_parent()
    _keep_freed_memory()
    if os.getppid() != parent:
        os._exit(1)
    from rectrain.index import open_source

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides what Ctrl-C does
    _worker.update(raw_root=raw_root, resize=resize, quality=quality, open_source=open_source)


def _pack_one(rid: int, source: str, label: int) -> tuple[int, bytes, str, str | None]:
    """(id, framed record or b'', 'packed'|'repaired'|'skipped', reason)."""
    try:
        data = _worker["open_source"](_worker["raw_root"], source)
    except (OSError, KeyError, ValueError, tarfile.TarError) as err:
        return rid, b"", "skipped", f"cannot read source: {err}"
    try:
        image, repaired = prepare(data, _worker["resize"], _worker["quality"])
    except Skip as err:
        return rid, b"", "skipped", str(err)
    framed = frame_payload(pack_record(IRHeader(0, float(label), rid, 0), image))
    return rid, framed, ("repaired" if repaired else "packed"), repaired


def _pack_batch(rows: list[tuple[int, str, int]]) -> list:
    return [_pack_one(*row) for row in rows]


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
    bad = next((i for i, lab in zip(ids, labels) if not 0 <= lab < num_classes), None)
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


def _publish(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        log(f"pack {self.split}: {done}/{self.total} images ({100 * done / max(self.total, 1):.1f} %), "
            f"{rate:.0f} img/s, {nbytes / 1e6 / elapsed:.1f} MB/s, ETA {eta_s}, "
            f"skipped {skipped}, repaired {repaired}")


def pack_split(cfg: dict, index_dir: Path, raw_root: Path, split: str, rec: Path, idx: Path,
               threads: int, sysfs_root=None) -> dict:
    """Pack, verify and publish one split; returns the manifest dict."""
    t0 = time.time()
    ids, sources, labels, num_classes = load_index(index_dir, split)
    n = len(ids)
    resize, quality = int(cfg.get("resize", 0)), int(cfg.get("quality", 90))
    rec.parent.mkdir(parents=True, exist_ok=True)
    tmp_rec, tmp_idx = rec.with_name(rec.name + PARTIAL), idx.with_name(idx.name + PARTIAL)
    # An older pair must not survive a failed run looking valid: the .idx goes first.
    _remove(idx, rec, tmp_idx, tmp_rec)

    needed = storage.estimate_needed_bytes(source_bytes(raw_root, sources), n, resize, quality)
    result = storage.preflight(rec.parent, needed, sysfs_root)
    log(f"pack {split}: {n} images -> {rec} (device {result['device']}, rotational "
        f"{result['rotational']}, {result['free_bytes'] / 1e9:.1f} GB free, ~{needed / 1e9:.2f} GB needed)")
    if result["warning"]:
        log(result["warning"])

    order = list(range(n))
    random.Random(cfg.get("shuffle_seed", 0)).shuffle(order)
    threads = max(1, int(threads))
    progress = Progress(split, n)
    repaired, skipped = [], []
    expected = {}
    done = 0
    with Pool(threads, initializer=_init_worker,
              initargs=(str(raw_root), resize, quality, os.getpid())) as pool, \
            RecordWriter(tmp_rec, tmp_idx) as writer:
        pending = deque()

        def drain_one() -> None:
            nonlocal done
            for rid, framed, status, reason in pending.popleft().get():
                done += 1
                j = position[rid]
                if status == "skipped":
                    skipped.append({"id": rid, "source": sources[j], "reason": reason})
                    continue
                if status == "repaired":
                    repaired.append({"id": rid, "source": sources[j], "reason": reason})
                writer.write_framed(rid, framed)
                expected[rid] = labels[j]
            progress.update(done, writer.tell(), len(skipped), len(repaired))

        position = {rid: j for j, rid in enumerate(ids)}
        for b in range(0, n, BATCH):
            batch = [(ids[j], sources[j], labels[j]) for j in order[b:b + BATCH]]
            pending.append(pool.apply_async(_pack_batch, (batch,)))
            if len(pending) >= threads * IN_FLIGHT_PER_WORKER:
                drain_one()
        while pending:
            drain_one()
        writer.close(sync=True)
        bytes_written = writer.tell()
    pack_s = time.time() - t0
    progress.update(done, bytes_written, len(skipped), len(repaired), force=True)
    skipped.sort(key=lambda r: r["id"])
    repaired.sort(key=lambda r: r["id"])
    for item in skipped:
        log(f"skipped id {item['id']} {item['source']}: {item['reason']}")
    for item in repaired:
        log(f"repaired id {item['id']} {item['source']}: {item['reason']}")

    log(f"verify {split}: reading back {len(expected)} records")
    check = verify_pair(tmp_rec, tmp_idx, expected, num_classes, resize)
    _publish(tmp_rec, rec)
    _publish(tmp_idx, idx)  # last: a .rec without its .idx is never taken for a pair
    wall = time.time() - t0
    log(f"pack {split}: verified and published {rec} and {idx} in {wall:.1f} s")
    return {
        "split": split, "rec": str(rec), "idx": str(idx),
        "discovered": n, "packed": len(expected), "skipped": len(skipped),
        "repaired": repaired, "skipped_files": skipped,
        "bytes_written": bytes_written, "wall_s": round(wall, 3), "pack_s": round(pack_s, 3),
        "verify_s": check["verify_s"], "verified_decoded": check["decoded"],
        "images_per_s": round(n / wall, 1) if wall else None,
        "mb_per_s": round(bytes_written / 1e6 / wall, 2) if wall else None,
        "resize": resize, "quality": quality, "shuffle_seed": cfg.get("shuffle_seed", 0),
        "threads": threads, "num_classes": num_classes, "storage": result,
    }


def write_manifest(manifest: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + PARTIAL)
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-json", required=True, help="the config's pack block as JSON")
    parser.add_argument("--index", required=True, type=Path, help="index directory (<split>.tsv, classes.tsv)")
    parser.add_argument("--raw", required=True, type=Path, help="raw dataset root the index's sources are under")
    parser.add_argument("--split", required=True)
    parser.add_argument("--rec", required=True, type=Path)
    parser.add_argument("--idx", required=True, type=Path)
    parser.add_argument("--manifest", required=True, type=Path)
    parser.add_argument("--threads", type=int, default=None, help="worker processes (default: pack.threads)")
    args = parser.parse_args(argv)
    cfg = json.loads(args.config_json)
    _keep_freed_memory()  # the parent receives and writes ~0.5 MB of records per batch
    threads = args.threads or cfg.get("threads", 1)
    try:
        manifest = pack_split(cfg, args.index, args.raw, args.split, args.rec, args.idx, threads)
    except storage.StorageError as err:
        log(f"pack {args.split}: ERROR: {err}")
        return 2
    except (VerifyError, RecordIOError) as err:
        log(f"pack {args.split}: ERROR: the written pair failed verification and was not published "
            f"(left as *{PARTIAL} for inspection): {err}")
        return 3
    write_manifest(manifest, args.manifest)
    log(f"pack {args.split}: manifest {args.manifest}: {manifest['packed']} packed, "
        f"{manifest['skipped']} skipped, {len(manifest['repaired'])} repaired, "
        f"{manifest['images_per_s']} img/s, {manifest['mb_per_s']} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
