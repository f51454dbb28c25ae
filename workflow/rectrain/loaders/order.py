"""Which records a rank reads in an epoch, and in what order - the one order both training loaders use.

Training: one permutation of ALL records per epoch, drawn from (seed, epoch) and the same on every
rank, repeated from its start up to world x batches_per_epoch x batch positions (equal full batches
on every rank; the repeats are the counted padding) and dealt round-robin: rank r takes positions r,
r + world, r + 2 world, ...  That is torch's DistributedSampler with set_epoch, as the sources of the
recipes train (FFCV's distributed RANDOM order, torchvision's references): a record belongs to no
rank, so two epochs of one rank share only about 1/world of their records and no order of one epoch
predicts the next (bench/shuffle_bench.py).  A permutation of each rank's fixed shard would keep the
shard's records on the rank for the whole run, which the sources do not.
Evaluation: every record exactly once, in file order, rank r taking every world-th.

An order is int64 indices into the .rec's records in file order (rectrain.recordio.IndexedRecordReader.nth):
~10 MB for ImageNet's 1.28 M records, never a Python object per record.
"""

from __future__ import annotations

import numpy as np
import torch

from rectrain.loaders.spec import epoch_seed, train_batches_per_epoch


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's permutation of range(n), the same on every rank (torch's generator: the torch loader's
    order before this module, kept so its runs see the same records)."""
    g = torch.Generator().manual_seed(epoch_seed(seed, epoch, 0))
    return torch.randperm(n, generator=g).numpy()


def train_order(n: int, rank: int, world: int, batch: int, seed: int, epoch: int, *, accum: int = 1) -> np.ndarray:
    """Record indices rank `rank` trains on in `epoch`, in order: train_batches_per_epoch(n, world,
    batch, accum) x batch of them (see the module doc).  Optimizer step s takes global positions
    [s x G, (s + 1) x G) of the permutation (G = world x batch x accum) whatever the world size, so a
    world size that keeps G (an elastic resume) sums the same records into each step."""
    total = world * train_batches_per_epoch(n, world, batch, accum) * batch
    # The permutation repeated from its start, as DistributedSampler pads; the copy frees the rest.
    return np.resize(permutation(n, seed, epoch), total)[rank::world].copy()


def eval_order(n: int, rank: int, world: int) -> np.ndarray:
    """Record indices rank `rank` evaluates: every world-th from `rank` on, no padding."""
    return np.arange(rank, n, world)
