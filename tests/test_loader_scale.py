"""The loaders' start-up on ImageNet's 1.28 M-record .idx: the .idx is parsed into arrays
(recordio.idx_arrays), the record reader and the epoch order hold arrays, not Python objects per
record, and give the same records and the same order as the list-based code did."""

import math
import tracemalloc
from pathlib import Path

import pytest
import torch
from helpers.train_data import write_rec

from rectrain.loaders import epoch_seed, train_batches_per_epoch
from rectrain.loaders.pytorch import ShardSampler
from rectrain.recordio import IndexedRecordReader, RecordIOError, idx_arrays, read_idx


def test_idx_arrays_equal_read_idx(tmp_path):
    _, idx = write_rec(tmp_path, [i % 3 for i in range(17)])
    keys, offsets = idx_arrays(idx)
    assert list(zip(keys.tolist(), offsets.tolist(), strict=True)) == read_idx(idx)


def test_idx_arrays_take_a_missing_last_newline_and_refuse_extra_fields_like_read_idx(tmp_path):
    idx = tmp_path / "x.idx"
    idx.write_text("3\t0\n1\t40\n2\t80")
    keys, offsets = idx_arrays(idx)
    assert keys.tolist() == [3, 1, 2] and offsets.tolist() == [0, 40, 80]
    # DALI stops reading an .idx at a line with a third field: one strict parser refuses it (issue 38)
    idx.write_text("3\t0\textra\n1\t40\n")
    with pytest.raises(RecordIOError, match=r"x\.idx:1: expected 'key<TAB>offset'"):
        idx_arrays(idx)


@pytest.mark.parametrize("text", ["0\t0\n1\tten\n", "0\t0\n\n1\t8\n", "0\n"])
def test_a_malformed_idx_line_is_named(tmp_path, text):
    idx = tmp_path / "bad.idx"
    idx.write_text(text)
    with pytest.raises(RecordIOError, match=r"bad\.idx:\d+: expected 'key<TAB>offset'"):
        idx_arrays(idx)


def test_reader_reads_each_key_and_refuses_duplicates(tmp_path):
    rec, idx = write_rec(tmp_path, [i % 4 for i in range(12)])
    reader = IndexedRecordReader(rec, idx)
    assert len(reader) == 12 and sorted(reader.keys) == list(range(12))
    for i, key in enumerate(reader.keys):
        assert reader.nth(i) == (key, reader.read(key))
    with pytest.raises(KeyError, match="record key 99 is not in"):
        reader.offset(99)
    text = Path(idx).read_text()
    Path(idx).write_text(text + text.splitlines(keepends=True)[0])
    with pytest.raises(RecordIOError, match="appears twice"):
        IndexedRecordReader(rec, idx)


def test_reader_holds_a_few_bytes_per_record(tmp_path):
    n = 200_000
    idx = tmp_path / "big.idx"
    idx.write_text("".join(f"{k}\t{64 * k}\n" for k in range(n)))
    (tmp_path / "big.rec").write_bytes(b"")
    tracemalloc.start()
    reader = IndexedRecordReader(tmp_path / "big.rec", idx)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(reader) == n
    # four int64 arrays (keys and offsets, in key and in file order); a dict and two lists were ~150
    assert held / n < 40, f"{held / n:.0f} bytes per record"


@pytest.mark.parametrize("n,world,batch,rank", [(103, 2, 8, 1), (100, 3, 7, 2), (64, 1, 16, 0)])
def test_shard_order_is_the_padded_permutation_as_before(n, world, batch, rank):
    sampler = ShardSampler(n, rank, world, batch, shuffle=True, seed=5, pad_to_batch=True)
    sampler.set_epoch(3)
    g = torch.Generator().manual_seed(epoch_seed(5, 3, 0))
    order = torch.randperm(n, generator=g).tolist()
    total = world * train_batches_per_epoch(n, world, batch) * batch
    expected = (order * math.ceil(total / n))[:total][rank::world]
    got = list(sampler)
    assert got == expected and len(got) == len(sampler) and all(type(i) is int for i in got)


def test_eval_shards_cover_every_record_once():
    shards = [list(ShardSampler(10, r, 3, 4, shuffle=False, seed=0, pad_to_batch=False)) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(10)) and shards[0] == [0, 3, 6, 9]
