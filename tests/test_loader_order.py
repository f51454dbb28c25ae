"""rectrain.loaders.order: the training order both loaders read, split across ranks as DistributedSampler."""

import numpy as np
import pytest

from rectrain.loaders import train_batches_per_epoch, train_padding
from rectrain.loaders.order import blocks_of, choose_order, eval_order, permutation, quasi_random, train_order


@pytest.mark.parametrize("n,world,batch", [(67, 2, 4), (100, 3, 7), (64, 1, 16), (5, 4, 2), (1000, 8, 32)])
def test_the_ranks_of_an_epoch_read_each_record_exactly_once_and_only_the_counted_padding_twice(n, world, batch):
    for epoch in (0, 1):
        ranks = [train_order(n, r, world, batch, seed=3, epoch=epoch) for r in range(world)]
        assert {len(o) for o in ranks} == {train_batches_per_epoch(n, world, batch) * batch}, "equal full batches"
        counts = np.bincount(np.concatenate(ranks), minlength=n)
        assert len(counts) == n and counts.min() >= 1, "a record no rank reads this epoch"
        assert counts.sum() - n == train_padding(n, world, batch), "repeats beyond the counted padding"
        # The padding repeats the permutation's start, each record at most once more (while it is shorter than n).
        repeated = permutation(n, 3, epoch)[: train_padding(n, world, batch)]
        if len(repeated) <= n:
            assert (counts == 1 + np.isin(np.arange(n), repeated)).all()


def test_the_order_is_a_function_of_seed_and_epoch_and_a_new_permutation_every_epoch():
    a, b = (train_order(1000, 1, 2, 10, seed=5, epoch=e) for e in (0, 1))
    assert np.array_equal(a, train_order(1000, 1, 2, 10, seed=5, epoch=0)), "not reproducible"
    assert not np.array_equal(a, train_order(1000, 1, 2, 10, seed=6, epoch=0)), "the seed changes nothing"
    assert abs(np.corrcoef(np.argsort(permutation(1000, 5, 0)), np.argsort(permutation(1000, 5, 1)))[0, 1]) < 0.1
    assert len(set(a.tolist()) & set(b.tolist())) < 0.6 * len(a), "a rank keeps its records from epoch to epoch"


def test_evaluation_reads_every_record_once_in_file_order_across_ranks():
    shards = [eval_order(10, r, 3) for r in range(3)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(10)) and shards[0].tolist() == [0, 3, 6, 9]


@pytest.mark.parametrize("n,world,batch,accum", [(1281167, 2, 256, 8), (1281167, 1, 256, 16), (1281167, 2, 64, 8)])
def test_under_gradient_accumulation_every_optimizer_step_holds_a_full_global_batch(n, world, batch, accum):
    """Issue 46 item 6: ImageNet's micro-batches per rank were not a multiple of grad_accum, so the epoch's
    last step summed 7/8 (13/16, 2/8) of a global batch and still divided by grad_accum."""
    per_rank = train_batches_per_epoch(n, world, batch, accum)
    assert per_rank % accum == 0, "the epoch ends inside an optimizer step"
    assert per_rank * batch * world - n == train_padding(n, world, batch, accum) < world * batch * accum
    old = train_batches_per_epoch(n, world, batch)  # the old count: whole micro-batches only
    assert old % accum != 0, "this case never showed the short last step"


def test_a_world_size_that_keeps_the_global_batch_sums_the_same_records_into_every_optimizer_step():
    """2 ranks x batch 4 x accum 1 and 1 rank x batch 4 x accum 2 (an elastic resume's regroup): each
    optimizer step, the last of the epoch included, sees the same set of records."""
    n, seed, epoch, g = 67, 1, 2, 8
    two = [train_order(n, r, 2, 4, seed, epoch, accum=1).reshape(-1, 4) for r in range(2)]
    one = train_order(n, 0, 1, 4, seed, epoch, accum=2).reshape(-1, 8)
    steps_two = [sorted(np.concatenate([two[0][s], two[1][s]]).tolist()) for s in range(len(two[0]))]
    steps_one = [sorted(row.tolist()) for row in one]
    assert steps_two == steps_one and len(steps_one) == -(-n // g)


def _blocks(n=1000, record=1000, world=1, batch=8):
    """Blocks of 20 records of `record` bytes and windows of 3 batches per rank over n records."""
    offsets = np.arange(n, dtype=np.int64) * record
    return blocks_of(offsets, n * record, batch, block_bytes=20 * record, window_bytes=3 * batch * record)


@pytest.mark.parametrize(
    "n,world,batch,accum", [(1000, 1, 8, 1), (1000, 3, 8, 1), (67, 2, 4, 1), (5, 4, 2, 1), (1000, 2, 8, 3)]
)
def test_the_quasi_random_order_is_a_permutation_of_all_records_each_epoch_the_same_on_every_rank(
    n, world, batch, accum
):
    """The ranks' orders, each computed alone, are one order dealt round-robin: every record read, only
    the counted padding (whole optimizer steps under grad_accum) twice; reproducible from (seed, epoch),
    another every epoch and every seed."""
    blocks = _blocks(n, world=world, batch=batch)
    for epoch in (0, 1):
        ranks = [train_order(n, r, world, batch, 3, epoch, accum=accum, blocks=blocks) for r in range(world)]
        per_rank = train_batches_per_epoch(n, world, batch, accum) * batch
        assert {len(o) for o in ranks} == {per_rank}, "equal full batches, whole optimizer steps"
        dealt = np.stack(ranks, axis=1).ravel()
        full = quasi_random(n, blocks, world, batch, 3, epoch, accum=accum)
        assert np.array_equal(dealt, full), "ranks disagree on the order"
        counts = np.bincount(dealt, minlength=n)
        assert len(counts) == n and counts.min() >= 1, "a record no rank reads this epoch"
        assert counts.sum() - n == train_padding(n, world, batch, accum), "repeats beyond the counted padding"
        again = train_order(n, 0, world, batch, 3, epoch, accum=accum, blocks=blocks)
        assert np.array_equal(ranks[0], again), "not reproducible"
    if n > 100:
        a, b, c = (quasi_random(n, blocks, world, batch, s, e) for s, e in ((3, 0), (3, 1), (4, 0)))
        assert not np.array_equal(a, b) and not np.array_equal(a, c), "the epoch or the seed changes nothing"
        assert abs(np.corrcoef(np.argsort(a[:n]), np.argsort(b[:n]))[0, 1]) < 0.15, "epochs correlated"


def test_a_quasi_random_window_is_whole_blocks_shuffled_and_each_ranks_share_is_whole_batches():
    """The window's records are those of whole blocks (but for a block the window boundary cuts) in no
    fixed order, the blocks come in a new order every epoch, and rank r's share of window j is its
    batches j x window_batches ... : the reads of one window are its blocks."""
    n, world, batch = 1000, 2, 8
    blocks = _blocks(n, world=world, batch=batch)
    window = world * blocks.window_batches * batch
    block_of = np.searchsorted(blocks.starts, np.arange(n), side="right") - 1
    sizes = np.bincount(block_of)
    firsts = []
    for epoch in (0, 1):
        full = quasi_random(n, blocks, world, batch, 3, epoch)[:n]
        firsts.append(block_of[full[:window]].tolist())
        for w in range(0, n - window, window):
            held = np.bincount(block_of[full[w : w + window]], minlength=len(sizes))
            assert ((held == 0) | (held == sizes)).sum() >= len(sizes) - 2, "a window holds parts of many blocks"
            assert not np.all(np.diff(full[w : w + window]) > 0), "a window is read in file order, not shuffled"
        rank1 = train_order(n, 1, world, batch, 3, epoch, blocks=blocks)
        share = rank1[: blocks.window_batches * batch]
        assert set(share.tolist()) <= set(full[:window].tolist()), "a rank's first batches leave the first window"
    assert sorted(set(firsts[0])) != sorted(set(firsts[1])), "the same blocks open both epochs"


def test_a_rec_on_a_rotational_disk_picks_the_quasi_random_order_in_both_loaders(tmp_path, monkeypatch):
    """train.order: auto follows rectrain.storage's rotational flag of the .rec's disk (a faked sysfs):
    quasi-random on a hard disk, the permutation on an SSD; a set order is taken as set."""
    from helpers.packdata import fake_sysfs
    from helpers.train_data import write_rec

    from rectrain.loaders import LoaderSpec, build_loader
    from rectrain.storage import SYSFS_ENV

    rec, idx = write_rec(tmp_path, list(range(20)))
    spec = LoaderSpec(rec, idx, batch_size=4, image_size=16, workers=0, seed=1)
    for rotational, used in ((True, "quasi-random"), (False, "permutation")):
        monkeypatch.setenv(SYSFS_ENV, str(fake_sysfs(tmp_path / f"sys{rotational}", tmp_path, rotational)))
        for kind in ("dali", "torch"):
            loader = build_loader(kind, spec)
            assert loader.order.choice.used == used, (kind, loader.order.choice)
            assert (loader.order.blocks is not None) == (used == "quasi-random")
            assert "rotational" in loader.order.choice.reason and "sdz" in loader.order.choice.reason
        assert choose_order("permutation", rec).used == "permutation"
        assert choose_order("quasi-random", rec).used == "quasi-random"
    monkeypatch.setenv(SYSFS_ENV, str(tmp_path / "empty"))  # no block device: a network share, tmpfs
    assert choose_order("auto", rec).used == "permutation"
    with pytest.raises(ValueError, match="train.order"):
        choose_order("random", rec)
