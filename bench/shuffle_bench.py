"""How independent two epochs' training orders are: the DALI loader's (train_order, a new permutation of
all records every epoch) beside the mxnet reader's shuffle buffer it replaced.

    .venv/bin/python bench/shuffle_bench.py [--records 1280000] [--ranks 2] [--batch 64] [--before]

The loader's order is taken from the training loader itself (DaliLoader._records(epoch).order, which
is rectrain.loaders.order.train_order) for every rank of epochs 0, 1 and 2.  Printed, per pair of
epochs: the Pearson correlation of each record's position in rank 0's two epochs (over the records
rank 0 reads in both), and the share of record pairs that shared a batch of rank 0 in the first epoch
and share a batch (of any rank) again in the second, against a full permutation's (batch - 1) /
(records - 1); then the host memory the loader holds for its order (tracemalloc: the .idx's arrays
and the epoch's order, at this record count).

--before also runs what the loader did before (today's, issue 36): fn.readers.mxnet reading shard
(rank + epoch) % ranks of a .rec in file order through a 16384-record shuffle buffer, seeded as the
loader seeded it; rank 0 reads shard 0 in epochs 0 and 2, so those two are compared (labels only, no
decode, on a .rec of 1-byte records whose label is the record id).  Its buffer's host memory is
initial_fill x a mean record (ImageNet's full-size JPEGs ~110 KB, pack.resize 256 ~25 KB), computed.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from rectrain.loaders import LoaderSpec, epoch_seed  # noqa: E402
from rectrain.recordio import IRHeader, RecordWriter, pack_record  # noqa: E402

BEFORE_FILL = 16384  # the mxnet reader's initial_fill before issue 36
SEED = 0


def write_id_rec(folder: Path, n: int, seed: int = 0, payload: bytes = b"\0") -> tuple[str, str]:
    """A .rec/.idx of n records, record k labelled k, written in a shuffled order as the packer does."""
    rec, idx = folder / "ids.rec", folder / "ids.idx"
    with RecordWriter(rec, idx) as w:
        for key in np.random.default_rng(seed).permutation(n).tolist():
            w.write(key, pack_record(IRHeader(0, float(key), key, 0), payload))
    return str(rec), str(idx)


def write_idx_only(folder: Path, n: int) -> tuple[str, str]:
    """An .idx of n records (and an empty .rec): all the loader's order needs, at any record count."""
    rec, idx = folder / "ids.rec", folder / "ids.idx"
    rec.write_bytes(b"")
    idx.write_text("".join(f"{k}\t{64 * k}\n" for k in range(n)))
    return str(rec), str(idx)


def loader_orders(rec: str, idx: str, ranks: int, batch: int, epochs: int) -> tuple[dict, int]:
    """({(rank, epoch): record indices in the order the DALI training loader reads them}, the bytes the
    loader holds for one epoch's order: its .idx arrays and the order, traced)."""
    from rectrain.loaders.dali import DaliLoader

    specs = [
        LoaderSpec(rec, idx, batch_size=batch, image_size=224, rank=r, world_size=ranks, seed=SEED)
        for r in range(ranks)
    ]  # before tracing: a spec's defaults read the config schema once per process
    tracemalloc.start()
    first = DaliLoader(specs[0])
    order = first._records(0).order
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del order
    loaders = [first, *map(DaliLoader, specs[1:])]
    return {(r, e): loaders[r]._records(e).order for r in range(ranks) for e in range(epochs)}, held


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


def positions(order: np.ndarray, n: int) -> np.ndarray:
    """Each record's position in `order` (-1: absent; a padded repeat keeps its later position)."""
    pos = np.full(n, -1, np.int64)
    pos[order] = np.arange(len(order))
    return pos


def position_correlation(a: np.ndarray, b: np.ndarray, n: int) -> float:
    """Pearson correlation of each record's position in order a and in order b, over the records in both."""
    pa, pb = positions(a, n), positions(b, n)
    common = (pa >= 0) & (pb >= 0)
    return float(np.corrcoef(pa[common], pb[common])[0, 1])


def batch_cooccurrence(a: np.ndarray, b_ranks: list[np.ndarray], batch: int, n: int) -> tuple[float, float]:
    """(share of the record pairs that shared a batch of `batch` in order a and share one again in the
    orders b_ranks (one per rank reading in the second epoch; a batch is a (rank, index) pair), a
    full permutation's share): how much of the first epoch's batch makeup the second repeats."""
    batch_b = np.full(n, -1, np.int64)
    for r, b in enumerate(b_ranks):
        per_rank = -(-len(b) // batch)
        batch_b[b] = r * per_rank + np.arange(len(b)) // batch
    rows = batch_b[a[: len(a) // batch * batch].reshape(-1, batch)]
    rows.sort(axis=1)
    # In a sorted row, the pairs of equal batches = for each element, how many equal ones precede it.
    col = np.broadcast_to(np.arange(batch), rows.shape)
    starts = np.where(np.concatenate([np.ones((len(rows), 1), bool), rows[:, 1:] != rows[:, :-1]], 1), col, 0)
    again = int(((col - np.maximum.accumulate(starts, axis=1))[rows >= 0]).sum())
    pairs = len(rows) * batch * (batch - 1) // 2
    return again / pairs, (batch - 1) / (n - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_280_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="the batch of the co-occurrence figure")
    ap.add_argument("--before", action="store_true", help="also the mxnet reader's shuffle buffer (today's)")
    args = ap.parse_args()
    n, ranks, batch = args.records, args.ranks, args.batch
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        rec, idx = write_id_rec(Path(tmp), n) if args.before else write_idx_only(Path(tmp), n)
        print(f"{n} records, {ranks} ranks, batch {batch}; data written in {time.perf_counter() - started:.0f} s")
        print("order                          epochs  correlation  pairs sharing a batch again (full permutation)")
        orders, held = loader_orders(rec, idx, ranks, batch, 3)
        for e in (1, 2):
            again, full = batch_cooccurrence(orders[0, 0], [orders[r, e] for r in range(ranks)], batch, n)
            corr = position_correlation(orders[0, 0], orders[0, e], n)
            print(f"loader (train_order)            0, {e}  {corr:>11.3f}  {100 * again:.4f} % ({100 * full:.4f} %)")
        if args.before:
            # Record indices as ids: the .rec's record k has label k (reader_order yields labels).
            a, b = (reader_order(rec, idx, epoch_seed(SEED, e, 0), BEFORE_FILL, 0, ranks) for e in (0, 2))
            again, full = batch_cooccurrence(a, [b], batch, n)
            shard = len(a)
            print(
                f"before (mxnet reader, {BEFORE_FILL})    0, 2  {position_correlation(a, b, n):>11.3f}  "
                f"{100 * again:.4f} % ({100 * (batch - 1) / (shard - 1):.4f} % within the shard)"
            )
        print(f"host memory for the order, per rank: loader {held / 2**20:.1f} MiB (traced)", end="")
        print(
            f"; before: the reader's buffer {BEFORE_FILL} x 110 KB = {BEFORE_FILL * 110e3 / 2**30:.2f} GiB "
            f"(x 25 KB = {BEFORE_FILL * 25e3 / 2**30:.2f} GiB), computed"
        )


if __name__ == "__main__":
    main()
