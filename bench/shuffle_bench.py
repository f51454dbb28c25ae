"""How independent two epochs' orders are under DALI's mxnet reader shuffle (train.loader: dali).

    .venv/bin/python bench/shuffle_bench.py [--records 40000] [--fills 1024 4096 16384 20000]

fn.readers.mxnet reads its shard in file order through a shuffle buffer of `initial_fill` records,
so a record's position in an epoch stays near its position in the file: two epochs of the same shard
(with 2 ranks a rank reads the same shard every other epoch) are nearly the same order.  Writes a
.rec of tiny JPEGs whose label is the record id, reads shard 0 of 2 with two epoch seeds per buffer
size (labels only, no decode) and prints the Pearson correlation of each record's position in the
two epochs, the share of record pairs that shared a batch in the first epoch and share one again in the
second (against two independent random orders: what a full permutation gives), and the buffer's host memory (initial_fill x the mean record size; ImageNet's full-size
JPEGs average ~110 KB, ~25 KB at pack.resize 256).  A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from rectrain.recordio import IRHeader, RecordWriter, pack_record  # noqa: E402


def write_id_rec(folder: Path, n: int, seed: int = 0) -> tuple[str, str]:
    """A .rec/.idx of n 8x8 JPEGs, record k labelled k, written in a shuffled order as the packer does."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (120, 60, 30)).save(buf, "JPEG")
    jpeg = buf.getvalue()
    rec, idx = folder / "ids.rec", folder / "ids.idx"
    with RecordWriter(rec, idx) as w:
        for key in np.random.default_rng(seed).permutation(n):
            w.write(int(key), pack_record(IRHeader(0, float(key), int(key), 0), jpeg))
    return str(rec), str(idx)


def reader_order(rec: str, idx: str, seed: int, initial_fill: int, shard: int = 0, shards: int = 2) -> np.ndarray:
    """The record ids of one epoch of `shard`, in the order DALI's mxnet reader yields them."""
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=256, num_threads=1, device_id=None, seed=seed)
    def labels_only():
        _, labels = fn.readers.mxnet(
            path=rec, index_path=idx, shard_id=shard, num_shards=shards, random_shuffle=True,
            initial_fill=initial_fill, pad_last_batch=True, stick_to_shard=True, name="Reader",
        )  # fmt: skip
        return labels

    pipe = labels_only()
    pipe.build()
    size = pipe.reader_meta("Reader")["epoch_size_padded"] // shards
    out = []
    while len(out) < size:
        out.extend(int(v) for v in np.array(pipe.run()[0].as_tensor()).ravel())
    return np.array(out[:size])


def position_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of each record's position in order a and in order b (the same records)."""
    pos_b = {rid: i for i, rid in enumerate(b)}
    common = [(i, pos_b[rid]) for i, rid in enumerate(a) if rid in pos_b]
    x, y = np.array(common, dtype=float).T
    return float(np.corrcoef(x, y)[0, 1])


def batch_cooccurrence(a: np.ndarray, b: np.ndarray, batch: int) -> tuple[float, float]:
    """(share of the record pairs that shared a batch of `batch` in order a and share one again in order b,
    the share two independent random orders give): how much of epoch a's batch makeup epoch b repeats."""
    batch_in_b = {rid: i // batch for i, rid in enumerate(b)}
    pairs = again = 0
    for start in range(0, len(a) - batch + 1, batch):
        counts = np.unique(
            [batch_in_b[rid] for rid in a[start : start + batch] if rid in batch_in_b], return_counts=True
        )[1]
        pairs += batch * (batch - 1) // 2
        again += int((counts * (counts - 1) // 2).sum())
    return again / pairs, (batch - 1) / (len(a) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=40000)
    ap.add_argument("--fills", type=int, nargs="+", default=[1024, 4096, 16384, 20000])
    ap.add_argument("--batch", type=int, default=64, help="the batch of the co-occurrence figure")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rec, idx = write_id_rec(Path(tmp), args.records)
        rec_bytes = Path(rec).stat().st_size / args.records
        print(f"{args.records} records, shard 0 of 2; mean record {rec_bytes:.0f} B here")
        print(
            f"initial_fill  correlation  pairs sharing a batch of {args.batch} again (random orders)  "
            "buffer at 110 KB/record  at 25 KB/record"
        )
        for fill in args.fills:
            a, b = reader_order(rec, idx, 11, fill), reader_order(rec, idx, 10018, fill)
            again, random = batch_cooccurrence(a, b, args.batch)
            print(
                f"{fill:>12}  {position_correlation(a, b):>11.3f}  {100 * again:>10.3f} % ({100 * random:.3f} %)"
                f"{fill * 110e3 / 2**30:>30.2f} GiB  {fill * 25e3 / 2**30:>11.2f} GiB"
            )


if __name__ == "__main__":
    main()
