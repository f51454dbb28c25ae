"""How independent two epochs' training orders are: the DALI loader's two orders (train.order:
permutation, a new permutation of all records every epoch; quasi-random, FFCV's shuffled blocks read
whole and shuffled within a window) beside the mxnet reader's shuffle buffer the permutation replaced.

    .venv/bin/python bench/shuffle_bench.py [--records 1280000] [--ranks 2] [--batch 64] [--record-kb 110]
        [--grid] [--before]

The loader's orders are taken from the training loader itself (DaliLoader._records(epoch).order, which
is rectrain.loaders.order.train_order) for every rank of epochs 0, 1 and 2, over an .idx of --records
records of --record-kb each (a sparse .rec of that size: the quasi-random blocks are cut by offset).
Printed, per order and pair of epochs: the Pearson correlation of each record's position in rank 0's
two epochs (over the records rank 0 reads in both), and the share of record pairs that shared a batch
of rank 0 in the first epoch and share a batch (of any rank) again in the second, against a full
permutation's (batch - 1) / (records - 1); then the host memory the loader holds for its order
(tracemalloc: the .idx's arrays and the epoch's order, at this record count) and, for quasi-random,
what its reads hold (two windows per rank, rectrain.loaders.readahead).

--grid also prints the quasi-random figures for other block and window sizes (order.train_order
itself, epochs 0 and 1), what the choice of BLOCK_BYTES and WINDOW_BYTES was made from.
--before also runs what the loader did before issue 36: fn.readers.mxnet reading shard
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


def write_idx_only(folder: Path, n: int, record_bytes: int = 64) -> tuple[str, str]:
    """An .idx of n records of record_bytes each and a sparse .rec of their size: all the loader's orders
    need, at any record count."""
    rec, idx = folder / "ids.rec", folder / "ids.idx"
    with open(rec, "wb") as f:
        f.truncate(n * record_bytes)
    idx.write_text("".join(f"{k}\t{record_bytes * k}\n" for k in range(n)))
    return str(rec), str(idx)


def loader_orders(
    rec: str, idx: str, ranks: int, batch: int, epochs: int, order: str = "permutation"
) -> tuple[dict, int, object]:
    """({(rank, epoch): record indices in the order the DALI training loader reads them}, the bytes the
    loader holds for one epoch's order: its .idx arrays and the order, traced; the loader's OrderChoice)."""
    from rectrain.loaders.dali import DaliLoader

    specs = [
        LoaderSpec(rec, idx, batch_size=batch, image_size=224, rank=r, world_size=ranks, seed=SEED, order=order)
        for r in range(ranks)
    ]  # before tracing: a spec's defaults read the config schema once per process
    tracemalloc.start()
    first = DaliLoader(specs[0])
    order_array = first._records(0).order
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del order_array
    loaders = [first, *map(DaliLoader, specs[1:])]
    orders = {(r, e): loaders[r]._records(e).order for r in range(ranks) for e in range(epochs)}
    return orders, held, first.order.choice


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


def compare(orders: dict, ranks: int, batch: int, n: int, epochs=(1, 2)) -> list[tuple[int, float, float, float]]:
    """(epoch, position correlation with epoch 0, pairs sharing a batch again, a full permutation's share)
    of rank 0's epoch 0 against each of `epochs`."""
    out = []
    for e in epochs:
        again, full = batch_cooccurrence(orders[0, 0], [orders[r, e] for r in range(ranks)], batch, n)
        out.append((e, position_correlation(orders[0, 0], orders[0, e], n), again, full))
    return out


def print_loader(args, rec: str, idx: str) -> None:
    """Both orders as the loader draws them."""
    n, ranks, batch = args.records, args.ranks, args.batch
    for kind in ("permutation", "quasi-random"):
        orders, held, choice = loader_orders(rec, idx, ranks, batch, 3, kind)
        shape = ""
        if choice.block_bytes:
            shape = (
                f" (blocks {choice.block_bytes / 2**20:.0f} MiB, window {choice.window_batches} batches = "
                f"{choice.window_bytes / 2**20:.0f} MiB per rank; its reads hold <= 2 windows = "
                f"{2 * choice.window_bytes / 2**20:.0f} MiB per rank)"
            )
        print(f"{kind}{shape}: the order's host memory {held / 2**20:.1f} MiB per rank (traced)")
        for e, corr, again, full in compare(orders, ranks, batch, n):
            print(f"  epochs 0, {e}: correlation {corr:.3f}, pairs sharing a batch again {100 * again:.4f} % "
                  f"({100 * full:.4f} % for a full permutation: {again / full:.2f}x)")  # fmt: skip


def print_grid(args, rec: str, idx: str) -> None:
    """The quasi-random figures at other block and window sizes (epochs 0 and 1)."""
    from rectrain.loaders import order
    from rectrain.recordio import IndexedRecordReader

    reader = IndexedRecordReader(rec, idx)
    n, ranks, batch = args.records, args.ranks, args.batch
    print(
        "| block MiB | window MiB per rank | disk rate at 12.7 ms/seek, 150 MB/s | correlation | pairs again | x full |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for block in args.blocks:
        for window in args.windows:
            blocks = order.blocks_of(reader.offsets, reader.file_size, batch, block << 20, window << 20)
            orders = {
                (r, e): order.train_order(n, r, ranks, batch, SEED, e, blocks=blocks)
                for r in range(ranks)
                for e in (0, 1)
            }
            ((_, corr, again, full),) = compare(orders, ranks, batch, n, epochs=(1,))
            seq = (block << 20) / 150e6
            print(
                f"| {block} | {window} | {seq / (seq + 0.0127):.0%} | {corr:.3f} | {100 * again:.4f} % | {again / full:.2f}x |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1_280_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="the batch of the co-occurrence figure")
    ap.add_argument("--record-kb", type=float, default=110.0, help="mean record size (ImageNet's JPEGs: ~110 KB)")
    ap.add_argument("--grid", action="store_true", help="also other quasi-random block and window sizes")
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 8, 32], help="--grid's block sizes, MiB")
    ap.add_argument("--windows", type=int, nargs="+", default=[128, 512, 2048], help="--grid's windows, MiB")
    ap.add_argument("--before", action="store_true", help="also the mxnet reader's shuffle buffer (before issue 36)")
    args = ap.parse_args()
    n, ranks, batch = args.records, args.ranks, args.batch
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        rec, idx = write_idx_only(Path(tmp), n, int(args.record_kb * 1000))
        print(f"{n} records of {args.record_kb:g} KB, {ranks} ranks, batch {batch}; .idx written in "
              f"{time.perf_counter() - started:.0f} s")  # fmt: skip
        print_loader(args, rec, idx)
        if args.grid:
            print_grid(args, rec, idx)
    if args.before:
        print_before(n, ranks, batch)


def print_before(n: int, ranks: int, batch: int) -> None:
    """The mxnet reader's shuffle buffer on a .rec of 1-byte records whose label is the record id."""
    with tempfile.TemporaryDirectory() as tmp:
        rec, idx = write_id_rec(Path(tmp), n)
        a, b = (reader_order(rec, idx, epoch_seed(SEED, e, 0), BEFORE_FILL, 0, ranks) for e in (0, 2))
        again, full = batch_cooccurrence(a, [b], batch, n)
        print(
            f"before (mxnet reader, {BEFORE_FILL}), epochs 0, 2: correlation {position_correlation(a, b, n):.3f}, "
            f"pairs sharing a batch again {100 * again:.4f} % ({100 * (batch - 1) / (len(a) - 1):.4f} % within the "
            f"shard); its buffer {BEFORE_FILL} x 110 KB = {BEFORE_FILL * 110e3 / 2**30:.2f} GiB "
            f"(x 25 KB = {BEFORE_FILL * 25e3 / 2**30:.2f} GiB), computed"
        )


if __name__ == "__main__":
    main()
