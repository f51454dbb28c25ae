"""train.repeated_aug (issue 49 item 7): timm's RepeatAugSampler built into rectrain's own training order
(rectrain.loaders.order), run beside timm's sampler: its epoch length and its sequence, a record's k
copies on k ranks, both train.order kinds, determinism from (seed, epoch), the mid-epoch resume of both
loaders, and k = 1 leaving today's order bit for bit."""

import hashlib
import json

import numpy as np
import pytest
import torch
from helpers import REPO
from helpers.config_edits import filled
from helpers.train_data import write_rec
from timm.data.distributed_sampler import RepeatAugSampler

from rectrain import settings
from rectrain.config import ConfigError, stage_block
from rectrain.loaders import LoaderSpec, build_loader, order, train_batches_per_epoch, train_padding
from rectrain.loaders.order import blocks_of, repeats_words, train_order
from rectrain.loaders.spec import epoch_positions
from rectrain.recordio import IndexedRecordReader


def timm_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """RepeatAugSampler's permutation of an epoch: torch.randperm seeded with the epoch alone."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).numpy()


# (records, ranks, repeats, batch, grad_accum); exact: the global batch divides n // 256 x 256 (or n below 256)
TIMM_CASES = [
    (1000, 2, 3, 8, 1),  # exact
    (1000, 4, 3, 16, 2),  # exact, under gradient accumulation
    (5000, 8, 3, 32, 1),  # exact
    (1000, 1, 3, 8, 1),  # one rank holds every copy
    (1000, 2, 2, 8, 1),  # exact
    (300, 3, 2, 5, 1),  # 256 samples are not whole steps of 15: one step more than timm's floor
    (1000, 3, 4, 7, 2),  # neither
    (100, 2, 3, 4, 1),  # under 256 records: timm's fallback, ceil(n / world) per rank
]


@pytest.mark.parametrize("n,world,repeats,batch,accum", TIMM_CASES)
def test_each_ranks_epoch_is_timms_repeataugsampler_from_the_same_permutation_then_whole_optimizer_steps(
    monkeypatch, n, world, repeats, batch, accum
):
    """With timm's permutation put in place of rectrain's seeding, each rank's order begins with exactly
    the indices timm's RepeatAugSampler yields that rank, and is as long, or up to one optimizer step's
    samples longer where timm's count is not whole optimizer steps (rectrain's epochs are)."""
    monkeypatch.setattr(order, "permutation", timm_permutation)
    step = batch * accum
    exact = epoch_positions(n, repeats) % (world * step) == 0
    for epoch in (0, 1):
        for rank in range(world):
            sampler = RepeatAugSampler(range(n), num_replicas=world, rank=rank, num_repeats=repeats)
            sampler.set_epoch(epoch)
            theirs = list(sampler)
            ours = train_order(n, rank, world, batch, seed=0, epoch=epoch, accum=accum, repeats=repeats)
            assert len(ours) == train_batches_per_epoch(n, world, batch, accum, repeats) * batch
            assert len(ours) % step == 0, "the epoch ends inside an optimizer step"
            assert 0 <= len(ours) - len(sampler) <= step and (len(ours) == len(sampler)) == exact
            assert ours[: len(theirs)].tolist() == theirs, f"rank {rank} epoch {epoch} leaves timm's sequence"


def _blocks(n, world, batch):
    """Blocks of 20 records of 1,000 bytes and windows of 3 batches per rank over n records."""
    offsets = np.arange(n, dtype=np.int64) * 1000
    return blocks_of(offsets, n * 1000, batch, block_bytes=20 * 1000, window_bytes=3 * batch * 1000)


@pytest.mark.parametrize("kind", ["permutation", "quasi-random"])
@pytest.mark.parametrize("n,world,repeats,batch,accum", [(1000, 3, 3, 8, 1), (1000, 4, 3, 8, 2), (67, 4, 3, 2, 1)])
def test_each_record_of_an_epoch_comes_k_times_in_a_row_each_copy_on_another_rank(
    kind, n, world, repeats, batch, accum
):
    """The ranks' orders, each computed alone, dealt back into one: a record's copies are k consecutive
    positions, so with world >= k each copy lands on another rank; every record read comes k times (but
    the one the epoch's end cuts), about epoch_positions / k records; the quasi-random order still reads
    a window from a few whole blocks."""
    blocks = _blocks(n, world, batch) if kind == "quasi-random" else None
    ranks = [train_order(n, r, world, batch, 3, 0, accum=accum, blocks=blocks, repeats=repeats) for r in range(world)]
    dealt = np.stack(ranks, axis=1).ravel()
    assert len(dealt) - epoch_positions(n, repeats) == train_padding(n, world, batch, accum, repeats)
    groups = dealt[: len(dealt) // repeats * repeats].reshape(-1, repeats)
    assert (groups == groups[:, :1]).all(), "a record's copies are not consecutive positions"
    rank_of = np.tile(np.arange(world), len(ranks[0]))
    assert len(np.unique(dealt * world + rank_of)) == len(dealt), "two copies of a record on one rank"
    counts = np.bincount(dealt, minlength=n)
    seen = counts[counts > 0]
    assert (seen != repeats).sum() <= 1 and len(seen) == -(-len(dealt) // repeats)
    if blocks is not None:
        window = world * blocks.window_batches * batch
        block_of = np.searchsorted(blocks.starts, np.arange(n), side="right") - 1
        for w in range(0, len(dealt) - window, window):
            held = len(set(block_of[dealt[w : w + window]].tolist()))
            assert held <= window // (repeats * 20) + 2, f"window {w // window} reads {held} blocks"


@pytest.mark.parametrize("kind", ["permutation", "quasi-random"])
def test_a_repeated_order_is_a_function_of_seed_and_epoch_and_selects_other_records_every_epoch(kind):
    n, world, batch = 1000, 3, 8
    blocks = _blocks(n, world, batch) if kind == "quasi-random" else None

    def rank1(seed, epoch):
        return train_order(n, 1, world, batch, seed, epoch, blocks=blocks, repeats=3)

    a = rank1(5, 0)
    assert np.array_equal(a, rank1(5, 0)), "not reproducible"
    assert not np.array_equal(a, rank1(5, 1)) and not np.array_equal(a, rank1(6, 0)), "epoch or seed changes nothing"
    # An epoch reads ~n / 3 records: two epochs' selections overlap as two random thirds do (~1/3), not wholly.
    everyone = [
        set(np.concatenate([train_order(n, r, world, batch, 5, e, blocks=blocks, repeats=3) for r in range(world)]))
        for e in (0, 1)
    ]
    assert len(everyone[0]) == len(everyone[1]) == 256 and len(everyone[0] & everyone[1]) < 0.6 * 256


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, np.int64).tobytes()).hexdigest()[:16]


# Every rank's order of epoch 1 (seed 3), concatenated, as main's order.py gave it before repeated
# augmentation existed (commit 0dbbde8): k = 1 must leave today's runs' orders as they were.
TODAY = {
    ("permutation", 1000, 2, 8, 1): "e6ad934347f84423",
    ("quasi-random", 1000, 2, 8, 1): "e474d80639f66851",
    ("permutation", 1000, 3, 8, 2): "b8400fc0a7121364",
    ("quasi-random", 1000, 3, 8, 2): "04b4c7a0c3016e1a",
    ("permutation", 67, 2, 4, 1): "2657c053227bb34a",
}


@pytest.mark.parametrize("case", sorted(TODAY))
def test_one_repeat_is_todays_order_bit_for_bit(case):
    kind, n, world, batch, accum = case
    offsets = np.arange(n, dtype=np.int64) * 1000
    blocks = blocks_of(offsets, n * 1000, 8, block_bytes=20 * 1000, window_bytes=3 * 8 * 1000)
    blocks = blocks if kind == "quasi-random" else None
    orders = [train_order(n, r, world, batch, 3, 1, accum=accum, blocks=blocks, repeats=1) for r in range(world)]
    assert _digest(np.concatenate(orders)) == TODAY[case]
    assert train_batches_per_epoch(n, world, batch, accum, 1) == accum * -(-n // (world * batch * accum))


def test_a_world_size_that_keeps_the_global_batch_sums_the_same_repeated_records_into_every_optimizer_step():
    """2 ranks x batch 4 and 1 rank x batch 4 x accum 2 (an elastic resume's regroup), 3 repeats: the
    epoch's steps, the last included, see the same records."""
    n, seed, epoch = 600, 1, 2
    two = [train_order(n, r, 2, 4, seed, epoch, repeats=3).reshape(-1, 4) for r in range(2)]
    one = train_order(n, 0, 1, 4, seed, epoch, accum=2, repeats=3).reshape(-1, 8)
    steps_two = [sorted(np.concatenate([two[0][s], two[1][s]]).tolist()) for s in range(len(two[0]))]
    assert steps_two == [sorted(row.tolist()) for row in one] and len(one) == 512 // 8


@pytest.fixture(scope="module")
def ids_300(tmp_path_factory):
    """300 records, label = record id: over 256, so repeats shorten the epoch to 256 samples."""
    return write_rec(tmp_path_factory.mktemp("ids300"), list(range(300)), size=(16, 12))


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_both_loaders_read_the_repeated_order_in_timms_epoch_length_and_a_resume_goes_on_in_it(ids_300, kind):
    """Read by record id: each rank's epoch is train_order's with 3 repeats - 16 batches of 8 (256
    samples over 2 ranks; 19 without repeats) - and a pass taken up again after 5 batches (from the
    DALI checkpoint, or the torch loader's position) yields the rest of it, the images too."""
    rec, idx = ids_300
    file_ids = IndexedRecordReader(rec, idx).file_keys
    world, batch = 2, 8
    for rank in range(world):
        spec = LoaderSpec(
            rec, idx, batch_size=batch, image_size=16, rank=rank, world_size=world, seed=7,
            workers=1 if kind == "dali" else 0,  # torch's: in the process (what is read does not depend on it)
            order="permutation", repeated_aug=3,
        )  # fmt: skip
        loader = build_loader(kind, spec)
        assert loader.batches_per_epoch == 16 and loader.padding_per_epoch == 0
        whole = [(x.clone(), y.clone()) for x, y in loader.epoch(1)]
        expected = file_ids[train_order(300, rank, world, batch, 7, 1, repeats=3)].tolist()
        assert [i for _, y in whole for i in y.tolist()] == expected
        first = loader.epoch(1)
        for _ in range(5):
            next(first)
        again = build_loader(kind, spec)
        rest = list(again.epoch(1, 5, loader.state()))
        assert len(rest) == 11
        for (x, y), (xr, yr) in zip(whole[5:], rest, strict=True):
            assert torch.equal(y, yr) and torch.equal(x, xr), "a resumed pass left the repeated order"


def test_the_report_words_and_the_key_check_of_repeated_augmentation():
    """run.json's recipe_as_run line says what ran (None when off), and a count under 1 fails naming the key."""
    assert repeats_words(1, 1000, 2, 8) is None
    words = repeats_words(3, 1000, 2, 8)
    assert "3 copies" in words and "epochs of 768 samples (the 1000 train records, rounded down" in words
    assert "some copies share a rank" in words and "about 256 records 3 times each" in words
    assert "each on another rank" in repeats_words(3, 1000, 4, 8)
    with pytest.raises(ConfigError, match="repeated_aug"):
        stage_block("train", json.dumps({"repeated_aug": 0}))


def test_the_deit_s_preset_repeats_each_record_three_times_and_still_validates_shortened():
    """deit-s.yaml sets DeiT's 3 repeats; the preset, shortened as tests/test_recipes_today.py runs it on
    the demo (48 records: under 256, every record 3 times over an epoch of 48 samples), validates."""
    cfg = filled(REPO / "config" / "imagenet-2gpu.yaml", REPO / "config" / "recipes" / "deit-s.yaml")
    short = {**cfg["train"], "epochs": 1, "image_size": 32, "batch_size": 8, "global_batch": 16}
    s = settings.train(stage_block("train", json.dumps(short)))
    assert s.loaders.repeated_aug == 3
    assert train_batches_per_epoch(48, 2, 8, 1, 3) == train_batches_per_epoch(48, 2, 8) == 3
