"""Read a packed .rec/.idx pair back completely before anything is allowed to trust it.

Checks every record (framing, order and offsets against the .idx, IRHeader id = .idx key, label =
the index's label for that id and within the class count, no record missing or extra) and fully
decodes an evenly spread sample. The pack runs this on its temporary files and publishes the pair
only when it passes; the CLI re-checks any existing pair.

    python -m rectrain.data.verify --rec F/train.rec --idx F/train.idx --index results/demo/index --split train
"""

from __future__ import annotations

import argparse
import io
import json
import time

import numpy as np
from PIL import Image

from rectrain import cli
from rectrain.data.fit import ORIGINAL, Fit
from rectrain.data.indextable import BadIndex, load
from rectrain.recordio import RecordIOError, iter_idx, scan_records, unpack_record


class VerifyError(RuntimeError):
    """The pair is not what the index says it should be; the message names the record."""


class Expected:
    """Record id -> label of every record the pair must hold, in arrays: ~5 bytes a record where a
    dict took ~100 (1.28 M records). Ids are looked up in a dense table when they are compact (the
    index's ids are 0..N-1), else by binary search."""

    def __init__(self, ids, labels):
        ids, labels = np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)
        self.count = len(ids)
        self._base = int(ids.min()) if self.count else 0
        span = int(ids.max()) - self._base + 1 if self.count else 0
        self._dense = span <= 2 * self.count + 1024
        if self._dense:
            self._labels = np.full(span, -1, dtype=np.int32)  # -1: not expected (labels are >= 0)
            self._labels[ids - self._base] = labels
        else:
            order = np.argsort(ids, kind="stable")
            self._ids, self._labels = ids[order], labels[order].astype(np.int32)
        self.seen = np.zeros(len(self._labels), dtype=bool)

    def __len__(self) -> int:
        return self.count

    def slot(self, key: int) -> int | None:
        """Where the record id is kept, or None when it is not expected."""
        if self._dense:
            s = key - self._base
            return s if 0 <= s < len(self._labels) and self._labels[s] >= 0 else None
        s = int(np.searchsorted(self._ids, key))
        return s if s < self.count and self._ids[s] == key else None

    def label(self, slot: int) -> int:
        return int(self._labels[slot])


def _check_record(offset: int, key: int, payload: bytes, expected: Expected, num_classes: int) -> bytes:
    """The record's image bytes once its header agrees with the .idx and the index."""
    header, image = unpack_record(payload)
    if header.id != key:
        raise VerifyError(f"record at byte offset {offset} has id {header.id} but its .idx key is {key}")
    slot = expected.slot(key)
    if slot is None:
        raise VerifyError(f"record id {key} at byte offset {offset} is not an index row that was packed")
    if expected.seen[slot]:
        raise VerifyError(f"record id {key} appears twice (second at byte offset {offset})")
    expected.seen[slot] = True
    label = header.label
    if header.flag != 0 or label != int(label) or not 0 <= int(label) < num_classes:
        raise VerifyError(
            f"record id {key}: label {label!r} (flag {header.flag}) is not a class index in 0..{num_classes - 1}"
        )
    if int(label) != expected.label(slot):
        raise VerifyError(f"record id {key}: label {int(label)} but the index says {expected.label(slot)}")
    return image


def verify_pair(
    rec_path, idx_path, expected: Expected, num_classes: int, fit: Fit = ORIGINAL, sample: int = 64, *, progress=None
) -> dict:
    """Verify the pair against ``expected`` (every record that must be there, with its label),
    reading the .rec and the .idx side by side (nothing per record kept but a bit in ``expected``).
    ``fit``: the pack's size rule, which each decoded sample must obey.
    ``progress(done)`` is called after each record. Returns {records, decoded, verify_s}; raises
    VerifyError/RecordIOError."""
    start = time.time()
    n = len(expected)
    sample_at = {round(i * (n - 1) / max(sample - 1, 1)) for i in range(min(sample, n))} if n else set()
    count = decoded = 0
    expected.seen[:] = False
    entries = iter_idx(idx_path)
    for i, (offset, payload) in enumerate(scan_records(rec_path)):
        entry = next(entries, None)
        if entry is None:
            raise VerifyError(f"{rec_path} holds a record at byte offset {offset} beyond the {i} in {idx_path}")
        key, idx_offset = entry
        if offset != idx_offset:
            raise VerifyError(f"record {i} (key {key}) starts at byte offset {offset} but {idx_path} says {idx_offset}")
        image = _check_record(offset, key, payload, expected, num_classes)
        if i in sample_at:
            _check_decodes(key, image, fit)
            decoded += 1
        count += 1
        if progress is not None:
            progress(count)
    listed = count + sum(1 for _ in entries)
    if listed != count:
        raise VerifyError(f"{rec_path} holds {count} records but {idx_path} lists {listed}: truncated .rec")
    if count != n:
        raise VerifyError(f"{idx_path} lists {count} records but {n} were packed")
    return {"records": count, "decoded": decoded, "verify_s": round(time.time() - start, 3)}


def _check_decodes(key: int, image: bytes, fit: Fit) -> None:
    try:
        with Image.open(io.BytesIO(image), formats=("JPEG",)) as im:  # the pack stores only JPEG
            im.load()
            mode, size = im.mode, im.size
    except Exception as err:
        raise VerifyError(f"record id {key} does not decode: {err}") from None
    if mode not in ("RGB", "L"):
        raise VerifyError(f"record id {key} decodes as {mode}, not RGB or grayscale")
    if fit.size(*size) != size:
        raise VerifyError(f"record id {key} is {size[0]}x{size[1]}: larger than the pack's {fit.describe()}")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rec", required=True)
    parser.add_argument("--idx", required=True)
    parser.add_argument("--index", required=True, help="index directory (holds <split>.tsv, classes.tsv)")
    parser.add_argument("--split", required=True)
    parser.add_argument("--manifest", help="pack manifest: records it lists as skipped are not expected")
    parser.add_argument("--resize", type=int, default=0, help="pack.resize the pair was packed with")
    parser.add_argument("--max-side", type=int, default=0, help="pack.max_side the pair was packed with")
    parser.add_argument("--sample", type=int, default=64)


def _run(args: argparse.Namespace, cfg: None) -> None:
    skipped = set()
    if args.manifest:
        with open(args.manifest) as f:
            skipped = {row["id"] for row in json.load(f)["skipped_files"]}
    table, num_classes = load(args.index, args.split)
    keep = ~np.isin(table.ids, np.fromiter(skipped, dtype=np.int64, count=len(skipped)))
    expected = Expected(table.ids[keep], table.labels[keep])
    fit = Fit(args.resize, args.max_side)
    print(json.dumps(verify_pair(args.rec, args.idx, expected, num_classes, fit, args.sample)))


def main(argv=None) -> int:
    """Exit 1 when the pair fails (the line names the record), 0 with the result as JSON on stdout."""
    errors = {BadIndex: 1, VerifyError: 1, RecordIOError: 1}
    return cli.main("verify", None, _arguments, _run, argv, errors=errors)


if __name__ == "__main__":
    cli.end(main())
