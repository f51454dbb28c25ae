"""Check an existing .rec/.idx pair (im2rec's, or any RecordIO writer's) and hand it to training in
place of the index and the pack, with the outputs they make: the pair on fast storage, a manifest per
split (results/<ds>/pack/<split>.manifest.json) and results/<ds>/index/classes.tsv.

    python -m rectrain.data.byo_recordio --config-json '{"train": {"rec": "...", "idx": "..."}}' \\
        --fast results/fast_storage/demo --pack-dir results/demo/pack --index-dir results/demo/index

Every record is read once, in file order: framing (magic, lengths, continuation flags, padding), the
.idx against the .rec (every line a record start, every record listed, lines in file order), the
IRHeader (one label, a whole number >= 0; the .lst's label for that key when a .lst is given), the
class count (a class list's length, else the .lst's folders, else the largest label + 1), and every
image through the pack's own check (rectrain.data.images.prepare, strict scan-data decode). An image the
pack would have re-encoded (PNG, GIF, CMYK JPEG, ...) is kept as it is, once DALI's own decoder has read
it: DALI would stop mid-epoch at a GIF. The first failure ends the check naming the record (its number,
.idx key and byte offset).

The user's files are never written: a pair that passes is symlinked into fast storage. DALI shards
read contiguous slices of the file, so a class-ordered train file (im2rec without shuffling) would
give each rank a few classes: recordio.order says whether that is refused or the records are copied,
byte for byte and without re-encoding, in a shuffled order into fast storage.
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import logging
import math
import os
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from rectrain import cli, safefs, settings, storage
from rectrain.atomic import fresh_name, fsync_path, publish, replacing, write_json
from rectrain.data import pairowner
from rectrain.data.formats import HEAD_BYTES, sniff
from rectrain.data.images import Skip, prepare
from rectrain.data.pack import BATCH_BYTES, PackBusy, exclusive, remove_leftovers
from rectrain.progress import Progress
from rectrain.recordio import IndexedRecordReader, RecordIOError, RecordWriter, idx_arrays, scan_records, unpack_record

log = logging.getLogger(__name__)

# A train file whose label runs are fewer than this share of a shuffled file's expected count is
# class-ordered: shuffled ImageNet has ~1.28 M runs (labels change at almost every record), im2rec
# without shuffling 1000 (one per class). Half leaves a shuffled file dozens of standard deviations
# clear even at a few dozen records, and flags any file sorted or grouped by class.
ORDERED_RUNS_SHARE = 0.5
SHUFFLE_SEED = 0
# Without a class list the class count is the largest label + 1. Labels may skip classes (a subset of
# ImageNet keeps its 0-999 labels), but a count this far above the distinct labels is one stray label
# (1e9 ended in MemoryError, 2e6 made a 2,000,001-class model): more unused classes than this, and than
# the labels in use, are refused.
MAX_UNUSED_CLASSES = 1000
_BATCH = 256  # records decoded per batch of thread-pool work
# Records held for one batch: it closes at _BATCH records or once they hold BATCH_BYTES (the pack's
# rectrain.data.pack.BATCH_BYTES), so memory does not follow the records' sizes (12 records of 100 MB
# were all held before the first was decoded, 1.38 GB). A single record is capped at MAX_RECORD_BYTES,
# the pack's default pack.max_image_bytes, before any of it is read.
MAX_RECORD_BYTES = 64 << 20


class PairError(RuntimeError):
    """The pair is not usable as it is; the message names the record and the fix."""


@dataclass
class Walked:
    """What one pass over a split's pair found."""

    split: str
    keys: list = field(default_factory=list)  # .idx keys in file order
    labels: list = field(default_factory=list)
    unusual: list = field(default_factory=list)  # {id, reason}: the pack would have re-encoded these
    formats: Counter = field(default_factory=Counter)  # records per image format (rectrain.data.formats)
    bytes: int = 0
    identity: dict = field(default_factory=dict)  # rec, idx: pairowner.file_identity before the check read them
    check_s: float = 0.0
    decode_s: float = 0.0


def _text(path: str, key: str, errors: str = "strict") -> io.TextIOWrapper:
    """A text reader of a regular file, opened without blocking (safefs.open_regular): a FIFO swapped
    in after the Snakefile's parse is refused naming `key`, never waited on."""
    return io.TextIOWrapper(safefs.open_regular(path, key), encoding="utf-8", errors=errors, newline="")


def read_lst(path: str) -> dict[int, tuple[float, str]]:
    """im2rec's .lst: key -> (label, relative path); lines are `key<TAB>label[<TAB>label...]<TAB>path`."""
    rows = {}
    with _text(path, "recordio.<split>.lst", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.rstrip("\r\n").split("\t")
            if line.strip() == "":
                continue
            try:
                key, labels = int(fields[0]), [float(x) for x in fields[1:-1]]
            except ValueError:
                labels = []
            if len(labels) != 1:
                raise PairError(
                    f"{path}:{lineno}: expected 'key<TAB>label<TAB>path' (one label), got {line!r}: "
                    "pass the .lst im2rec wrote for this pair, or none (recordio.<split>.lst: null)"
                )
            rows[key] = (labels[0], fields[-1])
    return rows


def _check_idx(pair: dict, keys: np.ndarray, offsets: np.ndarray, size: int) -> None:
    """The .idx alone: unique keys, lines in file order, every offset inside the .rec."""
    if len(keys) == 0:
        raise PairError(f"{pair['idx']} lists no records: point recordio at the .idx of a packed pair")
    if (dup := np.flatnonzero(np.diff(np.sort(keys)) == 0)).size:
        raise PairError(f"{pair['idx']}: key {np.sort(keys)[dup[0]]} is listed twice")
    if (past := np.flatnonzero(offsets >= size)).size:
        line = int(past[0])
        raise PairError(
            f"{pair['idx']} line {line + 1} (key {keys[line]}) points at byte offset {offsets[line]}, past the end "
            f"of {pair['rec']} ({size} bytes): a truncated .rec or an .idx of another file; rebuild the pair"
        )
    if (back := np.flatnonzero(np.diff(offsets) <= 0)).size:
        line = int(back[0]) + 1
        raise PairError(
            f"{pair['idx']} line {line + 1} (key {keys[line]}, byte offset {offsets[line]}) is not after the line "
            f"before it ({offsets[line - 1]}): the .idx lines must follow the .rec's record order, as im2rec writes them"
        )


def _next(scan, where: str):
    """The scan's next (offset, payload), or None at the end; a framing error names the record."""
    try:
        return next(scan, None)
    except RecordIOError as err:
        raise PairError(f"{where}: {err}; rebuild the pair (im2rec) or restore the file") from None


def _records(pair: dict, keys: np.ndarray, offsets: np.ndarray):
    """(number, key, offset, payload) of every record, each at the offset its .idx line gives."""
    scan = scan_records(pair["rec"], MAX_RECORD_BYTES)
    for i in range(len(keys)):
        where = f"record {i} (.idx key {keys[i]})"
        found = _next(scan, where)
        if found is None:
            raise PairError(f"{where}: {pair['rec']} ends before byte offset {offsets[i]}: truncated .rec")
        if found[0] != offsets[i]:
            raise PairError(
                f"{where}: {pair['idx']} says byte offset {offsets[i]} but the record there starts at {found[0]}: "
                "the .idx does not belong to this .rec"
            )
        yield i, int(keys[i]), int(offsets[i]), found[1]
    extra = _next(scan, f"after the last record ({len(keys)})")
    if extra is not None:
        raise PairError(f"{pair['rec']} holds a record at byte offset {extra[0]} that {pair['idx']} does not list")


def _label(i: int, key: int, offset: int, payload: bytes, lst: dict | None) -> tuple[int, bytes]:
    where = f"record {i} (.idx key {key}, byte offset {offset})"
    try:
        header, image = unpack_record(payload)
    except RecordIOError as err:
        raise PairError(f"{where}: {err}") from None
    if header.flag != 0:
        raise PairError(f"{where} holds {header.flag} labels: rectrain trains one class label per image")
    if not math.isfinite(header.label) or header.label != int(header.label) or header.label < 0:
        raise PairError(f"{where}: label {header.label!r} is not a class index (a whole number >= 0)")
    if lst is not None:
        listed = lst.get(key)
        if listed is None or listed[0] != header.label:
            said = "does not list it" if listed is None else f"gives label {listed[0]:g} ({listed[1]})"
            raise PairError(f"{where} has label {header.label:g} but the .lst {said}: pass the .lst of this pair")
    return int(header.label), image


def _check_image(item: tuple) -> str | None:
    """The pack's check (rectrain.data.images.prepare): Skip for an image no decoder can use; the
    repair reason for one the pack would have re-encoded."""
    _, where, image = item
    try:
        return prepare(image, 0, 90, True)[1]
    except Skip as err:
        raise PairError(f"{where}: the image does not decode ({err}); rebuild the pair without it") from None


def walk_split(split: str, pair: dict, threads: int, progress_s: float) -> Walked:
    """Check one split's pair record by record (labels against the .lst, images decoded)."""
    start = time.monotonic()
    identity = {kind: pairowner.file_identity(pair[kind]) for kind in ("rec", "idx")}
    size = identity["rec"]["size"]
    keys, offsets = idx_arrays(pair["idx"], max_bytes=size)
    _check_idx(pair, keys, offsets, size)
    lst = read_lst(pair["lst"]) if pair.get("lst") else None
    if lst is not None and len(lst) != len(keys):
        raise PairError(
            f"{pair['lst']} lists {len(lst)} images but {pair['idx']} {len(keys)}: pass the .lst of this pair"
        )
    out = Walked(split, bytes=size, identity=identity)
    progress = Progress(progress_s)
    progress.begin(f"check {split}", len(keys), unit="images")
    batch, held = [], 0
    with ThreadPoolExecutor(threads) as pool:
        for i, key, offset, payload in _records(pair, keys, offsets):
            label, image = _label(i, key, offset, payload, lst)
            del payload  # the image is a slice of it: one copy held, not two
            out.keys.append(key)
            out.labels.append(label)
            batch.append((key, f"{split} record {i} (.idx key {key}, byte offset {offset})", image))
            held += len(image)
            if len(batch) == _BATCH or held >= BATCH_BYTES or i == len(keys) - 1:
                out.decode_s += _check_batch(batch, pool, out)
                batch, held = [], 0
                progress.count(i + 1)
    progress.count(len(keys), force=True)
    out.check_s = time.monotonic() - start
    return out


def _check_batch(batch: list, pool: ThreadPoolExecutor, out: Walked) -> float:
    start = time.monotonic()
    kept = []
    for (key, where, image), reason in zip(batch, pool.map(_check_image, batch), strict=True):
        out.formats[sniff(image[:HEAD_BYTES])] += 1
        if reason is not None:
            out.unusual.append({"id": key, "reason": reason})
            kept.append((where, image))
    check_dali_decodes(kept)
    return time.monotonic() - start


def _plain_jpeg() -> bytes:
    """An 8x8 baseline JPEG: what DALI must decode before its verdict on a record counts."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (128, 128, 128)).save(buf, "JPEG")
    return buf.getvalue()


# How many images one probe pipeline decodes at once; a batch that fails is decoded one by one.
PROBE_BATCH = 64


def decode_errors(images: list[bytes]) -> list[str | None]:
    """DALI's image decoder on each image, on the CPU: None where it decodes, else DALI's reason ("GIF
    images are not supported.").  The GPU's decoder sends every format but JPEG and JPEG 2000 to this
    one (DALI's documentation); measured here with DALI 1.34: PNG, BMP, TIFF, simple WebP and CMYK or
    progressive JPEG decode; GIF and extended WebP (alpha, animation) do not."""
    out: list[str | None] = []
    for start in range(0, len(images), PROBE_BATCH):
        chunk = images[start : start + PROBE_BATCH]
        if _probe(chunk) is None:
            out += [None] * len(chunk)
        else:
            out += [_probe([image]) for image in chunk]
    return out


def _probe(images: list[bytes]) -> str | None:
    """None when DALI's CPU decoder reads every image of this batch, else the reason it gives."""
    from nvidia.dali import fn, pipeline_def  # here: a DALI that does not import is said once (_dali_decode_errors)

    arrays = [np.frombuffer(image, np.uint8) for image in images]

    @pipeline_def(batch_size=len(arrays), num_threads=1, device_id=None, exec_async=False, exec_pipelined=False)
    def probe():
        return fn.decoders.image(fn.external_source(source=lambda: arrays, batch=True), device="cpu")

    pipe = probe()
    try:
        pipe.build()
        pipe.run()
    except RuntimeError as err:
        # DALI's message: "Critical error ... Error in thread 0: [source:line] [source:line] <reason>. File: ..."
        line = next((ln for ln in str(err).splitlines() if "Error in thread" in ln), str(err).splitlines()[0])
        reason = re.sub(r"\[[^\]]*\]\s*", "", line.split(":", 1)[-1]).split(". File:")[0].strip()
        return reason if reason.endswith(".") else reason + "."
    finally:
        del pipe
    return None


@functools.cache
def _dali_decode_errors():
    """decode_errors, or None (said once) where DALI does not import or cannot decode even a plain
    JPEG here: then no record is refused for DALI's sake."""
    try:
        broken = decode_errors([_plain_jpeg()])[0]
    except ImportError as err:
        broken = f"it does not import: {err}"
    if broken is None:
        return decode_errors
    log.warning(
        "DALI cannot be used here (%s): the records kept as they are (PNG, GIF, CMYK JPEG, ...) are not tried "
        "with its decoder; the torch loader (train.loader: torch) decodes them all",
        broken,
    )
    return None


def check_dali_decodes(kept: list[tuple[str, bytes]]) -> None:
    """PairError for the first record kept as it is that DALI's decoder cannot read: the pipeline
    trains with DALI, which would stop there mid-epoch (GIF, extended WebP: decode_errors)."""
    decode_errors = _dali_decode_errors() if kept else None
    if decode_errors is None:
        return
    for (where, image), error in zip(kept, decode_errors([image for _, image in kept]), strict=True):
        if error:
            raise PairError(
                f"{where}: DALI, the loader the pipeline trains with, cannot decode this {sniff(image[:HEAD_BYTES])} "
                f"image ({error}); re-encode it as JPEG: rebuild the pair with im2rec without --pass-through (it "
                "re-encodes every image), or let the pipeline pack the raw images (recordio.train: null)"
            )


def label_runs(labels) -> dict:
    """Runs of equal labels in file order against a shuffled file's expected count; ordered = grouped by class."""
    labels = np.asarray(labels)
    n = len(labels)
    runs = 1 + int(np.count_nonzero(labels[1:] != labels[:-1])) if n else 0
    counts = np.unique(labels, return_counts=True)[1]
    same = float((counts * (counts - 1)).sum() / (n * (n - 1))) if n > 1 else 1.0
    expected = 1 + (n - 1) * (1 - same)
    ordered = len(counts) > 1 and runs < ORDERED_RUNS_SHARE * expected
    return {"label_runs": runs, "expected_if_shuffled": round(expected, 1), "class_ordered": ordered}


def class_table(classes: str | None, train_pair: dict, train: Walked) -> tuple[list[tuple[str, str]], str]:
    """(wnid, name) per label, and where the names came from: the class list (recordio.classes), the
    train pair's .lst's folders, or numbers."""
    if classes:
        with _text(classes, "recordio.classes") as fh:
            lines = [ln.rstrip("\r\n") for ln in fh if ln.strip()]
        return [tuple((ln.split("\t", 1) + [""])[:2]) for ln in lines], f"class list {classes}"
    count = class_count(train)
    if train_pair.get("lst"):
        folders: dict[int, str] = {}
        for label, path in read_lst(train_pair["lst"]).values():
            folder = os.path.dirname(path) or f"class_{int(label)}"
            if folders.setdefault(int(label), folder) != folder:
                raise PairError(
                    f"{train_pair['lst']}: label {int(label)} is given to images in both {folders[int(label)]!r} and "
                    f"{folder!r}: one folder per class expected; pass a class list (recordio.classes)"
                )
        return [(folders.get(k, f"class_{k}"), "") for k in range(count)], f"folders of {train_pair['lst']}"
    return [(f"class_{k}", "") for k in range(count)], "numbered (no .lst or class list given)"


def class_count(train: Walked) -> int:
    """The largest train label + 1, or PairError naming the record with the largest label when that
    leaves more than MAX_UNUSED_CLASSES (and more than the labels in use) without a single image."""
    labels = np.asarray(train.labels, dtype=np.int64)
    count, used = int(labels.max()) + 1, len(np.unique(labels))
    if count - used > max(MAX_UNUSED_CLASSES, used):
        i = int(labels.argmax())
        raise PairError(
            f"train record {i} (.idx key {train.keys[i]}) has label {count - 1}, so the class count would be {count} "
            f"for {used} distinct labels: a stray label, or labels that are not class indices. Give the class list "
            "of this pair (recordio.classes: one class per line, in label order)"
        )
    return count


def check_labels(walked: Walked, num_classes: int, names_from: str) -> None:
    """Every label a class index below num_classes; names the first record outside."""
    labels = np.asarray(walked.labels)
    if (out := np.flatnonzero(labels >= num_classes)).size:
        i = int(out[0])
        raise PairError(
            f"{walked.split} record {i} (.idx key {walked.keys[i]}) has label {labels[i]}, outside the "
            f"{num_classes} classes ({names_from}): give the class list of this pair (recordio.classes)"
        )


def link_pair(pair: dict, rec: Path, idx: Path) -> None:
    """The user's files under the pipeline's names: symlinks, so nothing of theirs is ever written. Each
    link is made under a fresh name (os.symlink never follows one planted there) and renamed into place.
    A source that is the previously published link itself is fine: its real path is the user's file."""
    for source, final in ((pair["rec"], rec), (pair["idx"], idx)):
        real = os.path.realpath(source)
        if Path(real).parent == final.parent.resolve():
            raise PairError(
                f"{source} is inside fast storage ({final.parent}), where the pipeline writes its own pair: "
                "move it elsewhere and point recordio at it there"
            )
        tmp = fresh_name(final)
        os.symlink(real, tmp)
        publish(tmp, final)


def rewrite_shuffled(pair: dict, rec: Path, idx: Path, seed: int = SHUFFLE_SEED) -> int:
    """Copy every record's payload, unchanged, into a new pair in a shuffled order; returns its bytes.
    Both files are created new under fresh names (RecordWriter new=True): nothing planted is followed."""
    reader = IndexedRecordReader(pair["rec"], pair["idx"])
    order = np.random.default_rng(seed).permutation(len(reader))
    rec_tmp, idx_tmp = fresh_name(rec), fresh_name(idx)
    try:
        with RecordWriter(rec_tmp, idx_tmp, new=True) as writer:
            for i in order.tolist():
                writer.write(*reader.nth(i))
            writer.close(sync=True)
        size = writer.tell()
        publish(idx_tmp, idx)
        publish(rec_tmp, rec)
    finally:
        rec_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
    return size


def order_plan(pair: dict, order_rule: str, walked: Walked, fast: Path) -> dict:
    """The record order's verdict, and whether the split's pair is copied shuffled; raises when
    order_rule (recordio.order) is refuse.  Only train is judged: evaluation counts every val record
    whatever their order."""
    order = label_runs(walked.labels)
    order["rewrite"] = bool(order["class_ordered"] and walked.split == "train")
    if not order["rewrite"]:
        return order
    said = (
        f"{pair['rec']} is in class order ({order['label_runs']} runs of equal labels where a shuffled file "
        f"would have about {order['expected_if_shuffled']:.0f}): DALI gives each rank a contiguous slice, so "
        "each would train on a few classes"
    )
    if order_rule == "refuse":
        raise PairError(
            f"{said}. Set recordio.order: shuffle to have the records copied in a shuffled order to "
            f"{fast} (no re-encoding, needs {storage.human_bytes(walked.bytes)} there), or rebuild the pair "
            "with im2rec's default shuffling (no --no-shuffle)"
        )
    log.warning("%s: copying its records in a shuffled order to %s (recordio.order: shuffle)", said, fast)
    return order


def unchanged(pair: dict, walked: Walked) -> None:
    """PairError when the user's .rec or .idx is no longer the file the check read (replaced or
    rewritten while it ran): what would be published is unchecked."""
    for kind in ("rec", "idx"):
        if pairowner.file_identity(pair[kind]) != walked.identity[kind]:
            raise PairError(f"{pair[kind]} changed while it was checked: check it again once it is no longer written")


def _publish_split(pair: dict, walked: Walked, order: dict, fast: Path) -> dict:
    """The split's pair in fast storage, under the pack's rules (rectrain.data.pack.exclusive: the
    folder is this user's and nobody else may write in it, the pair's lock held; a pair another working
    directory published is not replaced): linked, or (order["rewrite"]) copied shuffled and read back.
    The ownership stamp then names this run and what the check read (rectrain.data.pairowner)."""
    rec, idx = fast / f"{walked.split}.rec", fast / f"{walked.split}.idx"
    with exclusive(rec, walked.split):
        pairowner.check(rec)
        remove_leftovers(rec, idx)
        unchanged(pair, walked)
        published = _publish_records(pair, walked, order, fast, rec, idx)
        checked = {kind: pairowner.file_identity(path) for kind, path in (("rec", rec), ("idx", idx))}
        pairowner.claim(rec, checked)
    return published


def _publish_records(pair: dict, walked: Walked, order: dict, fast: Path, rec: Path, idx: Path) -> dict:
    verdict = {k: v for k, v in order.items() if k != "rewrite"}
    if not order["rewrite"]:
        link_pair(pair, rec, idx)
        return {**verdict, "published": "symlinked", "bytes_written": 0}
    storage.preflight(fast, walked.bytes)
    written = rewrite_shuffled(pair, rec, idx)
    keys, offsets = idx_arrays(idx)
    copied = sum(1 for _ in _records({"rec": str(rec), "idx": str(idx)}, keys, offsets))
    if copied != len(walked.keys) or sorted(keys.tolist()) != sorted(walked.keys):
        raise PairError(f"the shuffled copy {rec} holds {copied} records, not the {len(walked.keys)} checked")
    return {**verdict, "published": "rewritten shuffled", "shuffle_seed": SHUFFLE_SEED, "bytes_written": written}


def split_manifest(pair: dict, walked: Walked, published: dict, fast: Path, num_classes: int) -> dict:
    """The pack manifest's keys (docs/architecture.md), plus `existing`: what was checked and how."""
    n = len(walked.keys)
    if walked.unusual:
        log.warning(
            "%s: %d image(s) the pack would have re-encoded are kept as they are, e.g. %s",
            walked.split,
            len(walked.unusual),
            walked.unusual[0],
        )
    return {
        "split": walked.split,
        "rec": str(fast / f"{walked.split}.rec"),
        "idx": str(fast / f"{walked.split}.idx"),
        "discovered": n,
        "packed": n,
        "skipped": 0,
        "repaired": [],
        "skipped_files": [],
        "bytes_written": published["bytes_written"],
        "wall_s": round(walked.check_s, 3),
        "verified_decoded": n,
        "images_per_s": round(n / walked.check_s, 1) if walked.check_s else None,
        "mb_per_s": round(walked.bytes / 1e6 / walked.check_s, 2) if walked.check_s else None,
        "num_classes": num_classes,
        "storage": storage.device_info(os.path.dirname(os.path.realpath(pair["rec"]))),
        "existing": {
            "rec": os.path.realpath(pair["rec"]),
            "idx": os.path.realpath(pair["idx"]),
            "lst": pair.get("lst") and os.path.realpath(pair["lst"]),
            "bytes": walked.bytes,
            "checked_records": n,
            "decode_ms_per_image": round(1000 * walked.decode_s / n, 3),
            "kept_unusual": walked.unusual,
            "formats": dict(walked.formats),
            **published,
        },
    }


def write_classes(path: Path, table: list[tuple[str, str]]) -> None:
    """classes.tsv (label, wnid, name), written as the index writes it."""
    with replacing(path, mode="w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, delimiter="\t", lineterminator="\n")
        writer.writerow(["label", "wnid", "name"])
        writer.writerows((k, wnid, name) for k, (wnid, name) in enumerate(table))


def check_pairs(recordio, fast: Path, pack_dir: Path, index_dir: Path, threads: int) -> dict:
    """Check every configured split (recordio: the block's view), then publish classes.tsv, the pairs
    and (last) the manifests."""
    pairs = {s: pair for s, pair in (("train", recordio.train), ("val", recordio.val)) if pair}
    splits = list(pairs)
    for split in splits:  # before hours of reading; checked again under the pair's lock when publishing
        pairowner.check(fast / f"{split}.rec")
    walked = {s: walk_split(s, pairs[s], threads, recordio.progress_s) for s in splits}
    table, names_from = class_table(recordio.classes, pairs["train"], walked["train"])
    for split in splits:
        check_labels(walked[split], len(table), names_from)
    orders = {split: order_plan(pairs[split], recordio.order, walked[split], fast) for split in splits}
    write_classes(index_dir / "classes.tsv", table)
    manifests = {}
    for split in splits:
        published = _publish_split(pairs[split], walked[split], orders[split], fast)
        manifests[split] = split_manifest(pairs[split], walked[split], published, fast, len(table))
    for split in splits:
        write_json(pack_dir / f"{split}.manifest.json", manifests[split])
        log.info(
            "%s: %d records checked (every image decoded, %.2f ms each), %s; %d classes (%s)",
            split,
            manifests[split]["discovered"],
            manifests[split]["existing"]["decode_ms_per_image"],
            manifests[split]["existing"]["published"],
            len(table),
            names_from,
        )
    fsync_path(pack_dir)
    return manifests


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fast", required=True, type=Path, help="<fast_storage>/<dataset>: where the pair is published"
    )
    parser.add_argument("--pack-dir", required=True, type=Path, help="results/<ds>/pack: the manifests")
    parser.add_argument("--index-dir", required=True, type=Path, help="results/<ds>/index: classes.tsv")
    parser.add_argument("--threads", type=int, default=None, help="image-check threads (default: recordio.threads)")


def _run(args: argparse.Namespace, recordio: settings.RecordioSettings) -> None:
    if not recordio.train:
        raise PairError(
            "recordio.train is not set: name the existing train .rec and .idx (docs/your-data.md, 'Bring your own .rec')"
        )
    args.pack_dir.mkdir(parents=True, exist_ok=True)
    check_pairs(recordio, args.fast, args.pack_dir, args.index_dir, args.threads or recordio.threads)


def main(argv=None) -> int:
    """Exit 1 when a pair fails its check (the line names the record and the fix)."""
    errors = {PairError: 1, RecordIOError: 1, storage.StorageError: 2, PackBusy: 2, pairowner.PairTaken: 2, OSError: 1}
    return cli.main("recordio", "recordio", _arguments, _run, argv, errors=errors)


if __name__ == "__main__":
    cli.end(main())
