"""rectrain.loaders.order: the training order both loaders read, split across ranks as DistributedSampler."""

import numpy as np
import pytest

from rectrain.loaders import train_batches_per_epoch, train_padding
from rectrain.loaders.order import eval_order, permutation, train_order


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
