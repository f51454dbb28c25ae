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
import logging
import sys
import time

from PIL import Image

from rectrain.log import setup
from rectrain.recordio import RecordIOError, read_idx, scan_records, unpack_record
from rectrain.tables import read_tsv

log = logging.getLogger("rectrain.data.verify")  # not __name__: that is __main__ under python -m


class VerifyError(RuntimeError):
    """The pair is not what the index says it should be; the message names the record."""


def verify_pair(
    rec_path, idx_path, expected_labels: dict[int, int], num_classes: int, resize: int = 0, sample: int = 64
) -> dict:
    """Verify the pair against ``expected_labels`` (record id -> label of every record that must be
    there). Returns {records, bytes, decoded, verify_s}; raises VerifyError/RecordIOError."""
    start = time.time()
    idx = read_idx(idx_path)
    if len(idx) != len(expected_labels):
        raise VerifyError(f"{idx_path} lists {len(idx)} records but {len(expected_labels)} were packed")
    n = len(idx)
    sample_at = {round(i * (n - 1) / max(sample - 1, 1)) for i in range(min(sample, n))} if n else set()
    seen = set()
    count = 0
    decoded = 0
    for i, (offset, payload) in enumerate(scan_records(rec_path)):
        if i >= n:
            raise VerifyError(f"{rec_path} holds a record at byte offset {offset} beyond the {n} in {idx_path}")
        key, idx_offset = idx[i]
        if offset != idx_offset:
            raise VerifyError(f"record {i} (key {key}) starts at byte offset {offset} but {idx_path} says {idx_offset}")
        header, image = unpack_record(payload)
        if header.id != key:
            raise VerifyError(f"record at byte offset {offset} has id {header.id} but its .idx key is {key}")
        if key in seen:
            raise VerifyError(f"record id {key} appears twice (second at byte offset {offset})")
        seen.add(key)
        if key not in expected_labels:
            raise VerifyError(f"record id {key} at byte offset {offset} is not an index row that was packed")
        label = header.label
        if header.flag != 0 or label != int(label) or not 0 <= int(label) < num_classes:
            raise VerifyError(
                f"record id {key}: label {label!r} (flag {header.flag}) is not a class index in 0..{num_classes - 1}"
            )
        if int(label) != expected_labels[key]:
            raise VerifyError(f"record id {key}: label {int(label)} but the index says {expected_labels[key]}")
        if i in sample_at:
            _check_decodes(key, image, resize)
            decoded += 1
        count += 1
    if count != n:
        raise VerifyError(f"{rec_path} holds {count} records but {idx_path} lists {n}: truncated .rec")
    return {"records": count, "decoded": decoded, "verify_s": round(time.time() - start, 3)}


def _check_decodes(key: int, image: bytes, resize: int) -> None:
    try:
        with Image.open(io.BytesIO(image), formats=("JPEG",)) as im:  # the pack stores only JPEG
            im.load()
            mode, size = im.mode, im.size
    except Exception as err:
        raise VerifyError(f"record id {key} does not decode: {err}") from None
    if mode not in ("RGB", "L"):
        raise VerifyError(f"record id {key} decodes as {mode}, not RGB or grayscale")
    if resize and min(size) > resize:
        raise VerifyError(f"record id {key} is {size[0]}x{size[1]}: shorter side above resize {resize}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Verify a packed .rec/.idx pair against its index.")
    parser.add_argument("--rec", required=True)
    parser.add_argument("--idx", required=True)
    parser.add_argument("--index", required=True, help="index directory (holds <split>.tsv, classes.tsv)")
    parser.add_argument("--split", required=True)
    parser.add_argument("--manifest", help="pack manifest: records it lists as skipped are not expected")
    parser.add_argument("--resize", type=int, default=0)
    parser.add_argument("--sample", type=int, default=64)
    args = parser.parse_args(argv)
    setup("")
    skipped = set()
    if args.manifest:
        with open(args.manifest) as f:
            skipped = {row["id"] for row in json.load(f)["skipped_files"]}
    rows = read_tsv(f"{args.index}/{args.split}.tsv")
    expected = {int(r["id"]): int(r["label"]) for r in rows if int(r["id"]) not in skipped}
    num_classes = len(read_tsv(f"{args.index}/classes.tsv"))
    try:
        result = verify_pair(args.rec, args.idx, expected, num_classes, args.resize, args.sample)
    except (VerifyError, RecordIOError) as err:
        log.error(f"verify: FAILED: {err}")
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
