"""rectrain.loaders.readahead: the training records read ahead of the step by reader threads, in chunks
sorted by offset - exactly the order's records, in its order, from any batch on."""

import gc
import os
import threading
import time

import numpy as np
import pytest

from rectrain.loaders import readahead
from rectrain.loaders.order import blocks_of, train_order
from rectrain.loaders.readahead import ReadAhead, ReadPlan, ReadPool, plan_for, spans
from rectrain.recordio import IndexedRecordReader, IRHeader, RecordWriter, pack_record

N = 101  # records; not a multiple of world x batch


@pytest.fixture(scope="module")
def id_pair(tmp_path_factory):
    """N records written in a shuffled order, record key k labelled k with k's bytes as its image, of
    varying sizes (so spans cross records of several lengths)."""
    folder = tmp_path_factory.mktemp("ids")
    rec, idx = folder / "ids.rec", folder / "ids.idx"
    with RecordWriter(rec, idx) as w:
        for key in np.random.default_rng(3).permutation(N).tolist():
            w.write(key, pack_record(IRHeader(0, float(key), key, 0), image_of(key)))
    return str(rec), str(idx)


def image_of(key: int) -> bytes:
    return bytes([key % 251]) * (200 + 37 * key)


def small_blocks(reader, batch):
    """Quasi-random blocks of ~1.5 KB and windows of ~3 batches: several of each in this small .rec."""
    blocks = blocks_of(reader.offsets, reader.file_size, batch, block_bytes=1500, window_bytes=3 * batch * 2000)
    assert len(blocks.starts) > 10 and blocks.window_batches >= 2
    return blocks


def orders(reader, rank, world, batch):
    """(name, the rank's order, its ReadPlan) for the permutation and the quasi-random order."""
    n, blocks = len(reader), small_blocks(reader, batch)
    return [
        ("permutation", train_order(n, rank, world, batch, 5, 2), plan_for(None)),
        ("quasi-random", train_order(n, rank, world, batch, 5, 2, blocks=blocks), plan_for(blocks.window_batches)),
    ]


def test_the_read_ahead_yields_exactly_the_orders_records_in_order_at_every_batch_boundary_from_any_start(id_pair):
    """Every pass, the first batch of an uninterrupted epoch or of a resumed one alike: batch k is the
    records at positions k x batch ... of the order (labels and bytes), read in other threads - the
    quasi-random order's one request at a time (a disk's one head), the permutation's several at once."""
    reader = IndexedRecordReader(*id_pair)
    keys, batch = reader.file_keys, 4
    threads, in_flight, most = set(), [0], {}
    nth_span, lock = reader.nth_span, threading.Lock()

    def traced(wanted):
        with lock:
            threads.add(threading.current_thread().name)
            in_flight[0] += 1
            most[name] = max(most.get(name, 0), in_flight[0])
        try:
            return nth_span(wanted)
        finally:
            with lock:
                in_flight[0] -= 1

    reader.nth_span = traced
    for name, order, plan in orders(reader, 1, 2, batch):
        pool = ReadPool(plan.streams)
        batches = len(order) // batch
        for start in range(batches):
            ahead = ReadAhead(reader, order, batch, plan, pool)
            for k in range(start, batches):
                images, labels = ahead.batch(k)
                want = keys[order[k * batch : (k + 1) * batch]]
                assert labels.tolist() == want.tolist(), f"{name}: batch {k} of a pass from batch {start}"
                assert [im.tobytes() for im in images] == [image_of(int(key)) for key in want]
            ahead.close()
        pool.close()
    assert threads and not threads & {threading.current_thread().name}, f"read in {threads}"
    assert most["quasi-random"] == 1 and plan_for(None).streams > 1, most


def test_each_chunk_is_read_in_offset_order_and_a_quasi_random_block_is_one_request(id_pair, monkeypatch):
    """The requests of one chunk go out in ascending offsets, one per span; a quasi-random window of one
    rank reads its blocks whole: no more requests than blocks it touches, each a run of contiguous
    records (no gap bridged here: GAP_BYTES 0, else this small .rec would be one request)."""
    monkeypatch.setattr(readahead, "GAP_BYTES", 0)
    reader = IndexedRecordReader(*id_pair)
    batch = 4
    for name, order, plan in orders(reader, 0, 1, batch):
        chunk = plan.chunk_batches
        for c in range(len(order) // batch // chunk):
            wanted = order[c * chunk * batch : (c + 1) * chunk * batch]
            got = spans(reader, wanted, plan.gap_bytes)
            flat = [i for span in got for i in span]
            assert flat == sorted(set(wanted.tolist())), f"{name}: chunk {c} not read once each in offset order"
            if name == "quasi-random":
                assert all(span == list(range(span[0], span[-1] + 1)) for span in got), "a span skips a record"
                blocks = np.searchsorted(small_blocks(reader, batch).starts, flat, side="right")
                assert len(got) <= len(set(blocks.tolist())), f"window {c}: more requests than blocks"


def test_the_read_ahead_holds_the_chunk_taken_and_at_most_ahead_more(id_pair, monkeypatch):
    """The memory bound: after each batch, the chunk it came from and at most `ahead` chunks submitted;
    with one reader thread (a disk's), a chunk done with is freed before the next one is read."""
    reader = IndexedRecordReader(*id_pair)
    order = train_order(len(reader), 0, 1, 4, 1, 0)
    events = []
    read_stream, drop = readahead.read_stream, readahead.Chunk.drop

    def logged_read(reader, chunk, plan, stream, stats):
        events.append(("read", chunk.first))
        return read_stream(reader, chunk, plan, stream, stats)

    def logged_drop(chunk):
        events.append(("drop", chunk.first))
        drop(chunk)

    monkeypatch.setattr(readahead, "read_stream", logged_read)
    monkeypatch.setattr(readahead.Chunk, "drop", logged_drop)
    for ahead, streams in ((0, 2), (1, 2), (2, 2), (1, 1)):
        pool, events[:] = ReadPool(streams), []
        reads = ReadAhead(reader, order, 4, ReadPlan(2, ahead, 0, streams), pool)
        for k in range(len(order) // 4):
            reads.batch(k)
            assert len(reads._pending) <= ahead and reads._current[0] == k // 2
        reads.close()
        pool.close(wait=True)
        if streams == 1:  # chunk c's drop (c starts at 8c) runs before chunk c + 2 is read
            for c in range(len(order) // 8 - 2):
                assert events.index(("drop", 8 * c)) < events.index(("read", 8 * (c + 2))), events


def test_a_failed_read_reaches_the_training_thread_naming_the_rec(id_pair, tmp_path):
    """A .rec cut short after its .idx was written: the batch that needs the lost records raises the
    reader's error (offset and file) in the caller, not a silent hole in the batch."""
    rec, idx = id_pair
    cut = tmp_path / "cut.rec"
    data = open(rec, "rb").read()
    cut.write_bytes(data[: len(data) // 2])
    reader = IndexedRecordReader(cut, idx)
    order = np.argsort(-reader.offsets)[:8]  # the last records of the file first
    with pytest.raises(Exception, match="cut.rec"):
        ReadAhead(reader, order, 4, plan_for(None), ReadPool()).batch(0)


def test_reader_threads_reading_first_at_once_open_the_rec_once(id_pair, monkeypatch):
    """Eight threads reading a fresh reader at the same moment share one descriptor: none is left open
    behind the reader's back (a leaked one kept the .rec open after the loader was gone).  The open is
    slowed down so that all eight are inside it together."""
    rec, idx = id_pair
    gc.collect()
    before = open_descriptors(rec)
    reader = IndexedRecordReader(rec, idx)
    real_open = os.open

    def slow_open(*args, **kwargs):
        time.sleep(0.05)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(os, "open", slow_open)
    start = threading.Barrier(8)

    def first_read():
        start.wait()
        reader.nth(0)

    workers = [threading.Thread(target=first_read) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert open_descriptors(rec) == before + 1
    reader.close()
    assert open_descriptors(rec) == before, "a descriptor of the .rec leaked"


def open_descriptors(path: str) -> int:
    """This process's open descriptors of `path`."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(path)
        except OSError:  # the listing's own descriptor, closed since
            pass
    return found
