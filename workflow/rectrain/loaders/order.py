"""Which records a rank reads in an epoch, and in what order - the one order both training loaders use.

Training (train.order): a new order of ALL records per epoch, drawn from (seed, epoch) and the same on
every rank, repeated from its start up to world x batches_per_epoch x batch positions (equal full
batches on every rank; the repeats are the counted padding) and dealt round-robin: rank r takes
positions r, r + world, r + 2 world, ...  That is torch's DistributedSampler with set_epoch, as the
sources of the recipes train (FFCV's distributed RANDOM order, torchvision's references): a record
belongs to no rank, so two epochs of one rank share only about 1/world of their records and no order
of one epoch predicts the next (bench/shuffle_bench.py).  Two orders:

- permutation: one permutation of all records.  Every record is a read of its own at its .idx offset:
  free from the page cache or an SSD, one seek per record on a hard disk (bench/RESULTS.md: its seeks
  alone hold the loader to ~80 img/s on a simulated 7,200 rpm disk).
- quasi-random (FFCV's QUASI_RANDOM, made deterministic and distributed): the .rec is cut into blocks
  of BLOCK_BYTES of contiguous records; the blocks are shuffled, their records laid end to end, and
  the records shuffled within windows of world x window_batches x batch positions, so each rank's
  share of a window is exactly window_batches of its batches and about WINDOW_BYTES of records.  A
  rank reads a window as its blocks, whole, in offset order (rectrain.loaders.readahead).  The .rec
  is written shuffled (the pack), so a block is a random sample of the dataset; what the order gives
  up is that records of one block meet in a batch more often than by chance (bench/shuffle_bench.py).

auto (choose_order) takes quasi-random when the .rec's disk is rotational (rectrain.storage), else
the permutation.

Repeated augmentation (train.repeated_aug = k > 1; DeiT's 3, timm's --aug-repeats): timm's
RepeatAugSampler, deterministic from (seed, epoch) like the rest.  Each record of the order is laid k
times in a row ([a, a, a, b, b, b, ...]) and the epoch is the first world x batches_per_epoch x batch
positions of that sequence (spec.epoch_positions: timm's n // 256 x 256 in whole optimizer steps), dealt
round-robin: so an epoch is as long as without repeats, sees about n / k records, each k times, and a
record's k copies sit at k consecutive positions, on k different ranks while world >= k (with fewer
ranks some copies share a rank, as in timm) - each copy augmented by its own rank's draws.  Every epoch
selects others (a new order).  The permutation: timm's sequence exactly (its rank r's indices, from the
same permutation, are the first of ours: tests/test_repeated_aug.py).  Quasi-random: the repeats are
laid within the block sequence (a block's records, each k times) and the window's shuffle moves groups of
a record's k copies, never a copy alone, so the copies stay on k ranks and the reads stay whole blocks
(the window boundary moves by at most k - 1 positions); auto chooses by the disk as without repeats.
k = 1 is the order above, bit for bit.  An order is int64 indices into the .rec's records in file order
(rectrain.recordio.IndexedRecordReader.nth): ~10 MB for ImageNet's 1.28 M records, never a Python
object per record.
Evaluation: every record exactly once, in file order, rank r taking every world-th.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from rectrain.loaders.spec import epoch_positions, epoch_seed, train_batches_per_epoch

ORDERS = ("auto", "permutation", "quasi-random")
# Blocks a hard disk reads near its sequential rate: a 12.7 ms seek (7,200 rpm) then 8 MiB at 150 MB/s
# (56 ms) is 81 % of it (4 MiB: 69 %, 16 MiB: 90 %); FFCV's pages are 8 MiB too.  With the window,
# chosen from bench/shuffle_bench.py's figures at 1.28 M records of 110 KB (bench/RESULTS.md,
# "Quasi-random order and reads off the training thread"): records of one block meet in a batch again
# 2.0x as often as in a full permutation on one rank, 1.25x on two (512 MiB windows: 5.0x and 2.0x;
# 16 MiB blocks: 3.0x and 1.5x), position correlation between epochs <= 0.01; at pack.resize 256's
# ~27 KB, 1.26x and 1.03x.
BLOCK_BYTES = 8 << 20
# Records of one window per rank: the host memory a rank's reads hold is at most two windows (the one
# trained on and the next, read meanwhile: rectrain.loaders.readahead), 2 GiB.
WINDOW_BYTES = 1 << 30


@dataclass(frozen=True)
class OrderChoice:
    """train.order as it runs: requested, used (permutation or quasi-random) and why, in words."""

    requested: str
    used: str
    reason: str
    block_bytes: int | None = None  # quasi-random only, as are the window's batches and bytes per rank
    window_batches: int | None = None
    window_bytes: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def choose_order(requested: str, rec: str, sysfs_root=None) -> OrderChoice:
    """The order train.order=`requested` runs for the .rec at `rec`: auto = quasi-random on a rotational
    disk (rectrain.storage.device_info), the permutation on any other device or none known."""
    from rectrain import storage

    if requested not in ORDERS:
        raise ValueError(f"unknown training order {requested!r}: set train.order to {', '.join(ORDERS)}")
    if requested != "auto":
        return OrderChoice(requested, requested, f"train.order: {requested} in the config")
    dev = storage.device_info(rec, sysfs_root)
    if dev["rotational"]:
        return OrderChoice(
            requested,
            "quasi-random",
            f"auto: the .rec {dev['path']} is on a rotational disk ({dev['device']}): a full permutation would "
            "seek once per record, so blocks of contiguous records are read whole and shuffled within a window",
        )
    if dev["rotational"] is False:
        why = f"is on a non-rotational device ({dev['device']}): a random read costs what a sequential one does"
    else:
        why = (
            "has no block device (a network share, overlay or tmpfs); set train.order: quasi-random if that "
            "storage is slow at random reads"
        )
    return OrderChoice(requested, "permutation", f"auto: the .rec {dev['path']} {why}")


@dataclass(frozen=True)
class Blocks:
    """The quasi-random order's shape for one .rec and batch: `starts`, the file-order index of each
    block's first record and then the record count; `window_batches`, each rank's batches per window."""

    starts: np.ndarray
    window_batches: int


def blocks_of(offsets: np.ndarray, file_size: int, batch: int, block_bytes: int = 0, window_bytes: int = 0) -> Blocks:
    """Blocks of the records whose file-order byte offsets are `offsets`: a record belongs to the block
    its offset falls in (offset // block_bytes), so a block is contiguous on disk and about block_bytes
    long; the window is window_bytes of records per rank at the .rec's mean record size, in whole
    batches (at least one).  0 = BLOCK_BYTES, WINDOW_BYTES."""
    block_bytes, window_bytes = block_bytes or BLOCK_BYTES, window_bytes or WINDOW_BYTES
    n = len(offsets)
    ids = np.asarray(offsets, np.int64) // block_bytes
    starts = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1, [n]]).astype(np.int64)
    mean = file_size / max(n, 1)
    return Blocks(starts, max(1, int(window_bytes // max(batch * mean, 1))))


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's permutation of range(n), the same on every rank (torch's generator: the torch loader's
    order before this module, kept so its runs see the same records)."""
    g = torch.Generator().manual_seed(epoch_seed(seed, epoch, 0))
    return torch.randperm(n, generator=g).numpy()


def quasi_random(
    n: int, blocks: Blocks, world: int, batch: int, seed: int, epoch: int, *, accum: int = 1, repeats: int = 1
) -> np.ndarray:
    """The epoch's quasi-random order, world x batches_per_epoch x batch positions
    (train_batches_per_epoch(n, world, batch, accum, repeats): whole optimizer steps), before it is
    dealt: the blocks in a permutation from (seed, epoch), their records end to end in file order, each
    `repeats` times in a row, repeated from the start as train_order pads, then shuffled within each
    window of world x window_batches x batch positions in groups of a record's `repeats` copies (with
    repeats 1, record by record).  The same on every rank."""
    g = torch.Generator().manual_seed(epoch_seed(seed, epoch, 0))
    starts = blocks.starts
    shuffled = torch.randperm(len(starts) - 1, generator=g).numpy()
    lengths = np.diff(starts)[shuffled]
    # Record k of the sequence is block shuffled[j]'s (k - where that block begins)-th record.
    laid = np.repeat(starts[shuffled] - (np.cumsum(lengths) - lengths), lengths) + np.arange(n)
    total = world * train_batches_per_epoch(n, world, batch, accum, repeats) * batch
    groups = -(-total // repeats)
    laid = np.resize(np.repeat(laid, repeats), groups * repeats)
    window = world * blocks.window_batches * batch
    # A key per group in [w, w + 1) for the window w its first copy is in: sorting shuffles within each
    # window, never across; a group moves whole, so a record's copies stay consecutive (on k ranks).
    keys = torch.rand(groups, generator=g, dtype=torch.float64).numpy() + np.arange(groups) * repeats // window
    order = np.argsort(keys, kind="stable")
    if repeats > 1:
        order = (order[:, None] * repeats + np.arange(repeats)).ravel()
    return laid[order[:total]]


def repeated_permutation(n: int, seed: int, epoch: int, total: int, repeats: int = 1) -> np.ndarray:
    """The permutation order's `total` positions before they are dealt: the epoch's permutation with each
    record `repeats` times in a row (timm's RepeatAugSampler's torch.repeat_interleave), repeated from its
    start as DistributedSampler and RepeatAugSampler pad."""
    perm = permutation(n, seed, epoch)
    return np.resize(np.repeat(perm, repeats) if repeats > 1 else perm, total)


def train_order(
    n: int,
    rank: int,
    world: int,
    batch: int,
    seed: int,
    epoch: int,
    *,
    accum: int = 1,
    blocks: Blocks | None = None,
    repeats: int = 1,
) -> np.ndarray:
    """Record indices rank `rank` trains on in `epoch`, in order: train_batches_per_epoch(n, world,
    batch, accum, repeats) x batch of them (see the module doc): quasi-random over `blocks`, else the
    permutation; each record `repeats` times (train.repeated_aug) on consecutive ranks.  Optimizer step s
    takes global positions [s x G, (s + 1) x G) of the order (G = world x batch x accum); for the
    permutation whatever the world size, so a world size that keeps G (an elastic resume) sums the same
    records into each step (the quasi-random windows are per rank)."""
    if blocks is not None:
        return quasi_random(n, blocks, world, batch, seed, epoch, accum=accum, repeats=repeats)[rank::world].copy()
    total = world * train_batches_per_epoch(n, world, batch, accum, repeats) * batch
    # The copy frees the other ranks' positions.
    return repeated_permutation(n, seed, epoch, total, repeats)[rank::world].copy()


@dataclass(frozen=True)
class TrainOrder:
    """A training loader's order: the choice (what runs and why) and, for quasi-random, its blocks."""

    choice: OrderChoice
    blocks: Blocks | None

    def indices(
        self, n: int, rank: int, world: int, batch: int, seed: int, epoch: int, *, accum: int = 1, repeats: int = 1
    ) -> np.ndarray:
        return train_order(n, rank, world, batch, seed, epoch, accum=accum, blocks=self.blocks, repeats=repeats)

    @property
    def window_batches(self) -> int | None:
        """Batches of one rank's window (quasi-random), the unit its reads are sorted and read ahead in."""
        return self.blocks.window_batches if self.blocks is not None else None


def order_for(requested: str, reader, batch: int, sysfs_root=None) -> TrainOrder:
    """The TrainOrder of train.order=`requested` over the .rec `reader` reads (an IndexedRecordReader)
    at `batch` records a batch."""
    choice = choose_order(requested, reader.rec_path, sysfs_root)
    if choice.used != "quasi-random":
        return TrainOrder(choice, None)
    blocks = blocks_of(reader.offsets, reader.file_size, batch)
    mean = reader.file_size / max(len(reader), 1)
    shape = {
        "block_bytes": BLOCK_BYTES,
        "window_batches": blocks.window_batches,
        "window_bytes": int(blocks.window_batches * batch * mean),
    }
    return TrainOrder(replace(choice, **shape), blocks)


def repeats_words(repeats: int, n: int, world: int, batch: int, accum: int = 1) -> str | None:
    """train.repeated_aug as it ran, in words (run.json's recipe_as_run, the report); None when off."""
    if repeats <= 1:
        return None
    samples = epoch_positions(n, repeats)
    per_rank = train_batches_per_epoch(n, world, batch, accum, repeats) * batch
    where = (
        "each on another rank"
        if world >= repeats
        else f"on {world} rank(s), fewer than the copies: some copies share a rank, as in timm"
    )
    of = f"the {n} train records" + (", rounded down to a multiple of 256" if samples != n else "")
    return (
        f"{repeats} copies of each record (timm's RepeatAugSampler): epochs of {samples} samples ({of}), about "
        f"{-(-samples // repeats)} records {repeats} times each, {where}; {per_rank} per rank in whole optimizer steps"
    )


def eval_order(n: int, rank: int, world: int) -> np.ndarray:
    """Record indices rank `rank` evaluates: every world-th from `rank` on, no padding."""
    return np.arange(rank, n, world)
