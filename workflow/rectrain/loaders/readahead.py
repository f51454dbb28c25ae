"""A training epoch's records read ahead of the step, off the training thread.

The DALI loader's external source (rectrain.loaders.dali.EpochRecords) is called in the thread that
runs the training step, and until issue 52 it read each record there, one os.pread after another: one
seek per record on a hard disk (~80 img/s at most on bench/hdd_sim.py's 7,200 rpm disk), and ~0.05
CPU-ms an image of the training thread from the page cache.  Here a small pool of reader threads
(READ_THREADS; os.pread releases the GIL) reads the epoch's order in chunks of whole batches, each
chunk's records sorted by offset, as its ReadPlan (plan_for) says:
- the quasi-random order (rectrain.loaders.order, a hard disk's): a chunk is one window; its blocks are
  read whole, one request each (IndexedRecordReader.nth_span; records within GAP_BYTES of each other
  share a request, so a rank's share of a block interleaved with other ranks' records is one read),
  by ONE reader thread, one request at a time in offset order, window after window - a disk has one
  head: on bench/hdd_sim.py two windows read at once by four threads interleaved their requests and
  paid a seek for each (bench/RESULTS.md,
  "Quasi-random order and reads off the training thread");
- the permutation (an SSD's, the page cache's): chunks of CHUNK_BATCHES batches, every record its own
  request unless adjacent in the file, READ_THREADS threads and requests in flight.
While the training thread takes the batches of one chunk, the next `ahead` chunks are read; it waits
only for a chunk not in yet, and spends two slices per batch and a few submissions per chunk (the
records land at their batch positions in the reader threads, which also free them).

Host memory: at most 1 + `ahead` chunks of records per rank - for the quasi-random order two windows
(WINDOW_BYTES each: 2 GiB), for the permutation 1 + AHEAD_CHUNKS chunks of CHUNK_BATCHES batches (12
batches, ~85 MB at ImageNet's 110 KB and batch 64) - plus the request being parsed (<= MAX_READ_BYTES).
A batch's records follow from the order and the batch index alone: the pool keeps no state a
checkpoint would need, and a pass started at batch k reads from batch k on (a mid-epoch resume).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from rectrain.recordio import IndexedRecordReader, header_label, unpack_record

READ_THREADS = 4
# Records closer than this on disk are read by one request, the bytes between them included: a hard disk
# passes over a megabyte faster than it seeks (bench/hdd_sim.py's skip distance), and a block of one
# rank's records interleaved with other ranks' is still one read.
GAP_BYTES = 1 << 20
MAX_READ_BYTES = 16 << 20
# The permutation's chunk: its records read in offset order, and how many chunks are read ahead.
CHUNK_BATCHES = 4
AHEAD_CHUNKS = 2


class ReadStats:
    """What a loader's reader threads did: records, bytes and requests read; `busy_s`, the wall seconds
    at least one request was in flight (bytes / busy_s: the rate the storage delivered while asked),
    out of `elapsed_s` from the first request to the end of the last; `wait_s`, the training thread's
    seconds blocked on a chunk not read yet."""

    def __init__(self):
        self._lock = threading.Lock()
        self.records = self.bytes = self.requests = 0
        self.busy_s = self.wait_s = 0.0
        self._in_flight, self._since = 0, 0.0
        self._first = self._last = None

    def begin(self) -> None:
        with self._lock:
            if not self._in_flight:
                self._since = time.perf_counter()
                self._first = self._first or self._since
            self._in_flight += 1

    def end(self, records: int, nbytes: int) -> None:
        with self._lock:
            self._in_flight -= 1
            if not self._in_flight:
                self._last = time.perf_counter()
                self.busy_s += self._last - self._since
            self.records += records
            self.bytes += nbytes
            self.requests += 1

    def waited(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "records": self.records,
                "bytes": self.bytes,
                "requests": self.requests,
                "busy_s": round(self.busy_s, 3),
                "elapsed_s": round(self._last - self._first, 3) if self._last else 0.0,
                "wait_s": round(self.wait_s, 3),
            }


class ReadPool:
    """A loader's reader threads (started at the first read) and their ReadStats, for all its epochs."""

    def __init__(self, threads: int = READ_THREADS):
        self.threads, self.stats = threads, ReadStats()
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, fn, *args) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="rectrain-reader")
        return self._executor.submit(fn, *args)

    def close(self, wait: bool = False) -> None:
        """Stop the threads: reads not started are cancelled, those under way finish (`wait`: first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
            self._executor = None


@dataclass(frozen=True)
class ReadPlan:
    """How an order's chunks are read: batches per chunk, chunks read ahead, the gap a request bridges,
    and the reader threads = requests in flight (each stream reads its share of a chunk's requests in
    offset order; with one, the chunks too are read one after the other)."""

    chunk_batches: int
    ahead: int
    gap_bytes: int
    streams: int


def plan_for(window_batches: int | None) -> ReadPlan:
    """The quasi-random order's (a window per chunk, one ahead, one stream) or the permutation's."""
    if window_batches:
        return ReadPlan(window_batches, 1, GAP_BYTES, 1)
    return ReadPlan(CHUNK_BATCHES, AHEAD_CHUNKS, 0, READ_THREADS)


def spans(reader: IndexedRecordReader, indices: np.ndarray, gap_bytes: int = GAP_BYTES) -> list[list[int]]:
    """The distinct file-order `indices`, ascending, grouped into the spans one request each reads:
    the next record joins a span when it starts within gap_bytes of the span's end (0: adjacent) and
    the span stays within MAX_READ_BYTES."""
    wanted = np.unique(indices)
    if not len(wanted):
        return []
    offsets, n = reader.offsets, len(reader.offsets)
    starts = offsets[wanted]
    ends = np.where(wanted + 1 < n, offsets[np.minimum(wanted + 1, n - 1)], reader.file_size)
    cut = np.flatnonzero(starts[1:] - ends[:-1] > gap_bytes) + 1
    out = []
    for run in np.split(wanted, cut):  # runs within the gap; each split again at MAX_READ_BYTES
        first = int(offsets[run[0]])
        pieces = (ends[np.searchsorted(wanted, run)] - first) // MAX_READ_BYTES
        out += [part.tolist() for part in np.split(run, np.flatnonzero(np.diff(pieces)) + 1)]
    return out


def read_span(reader: IndexedRecordReader, wanted: list[int], stats: ReadStats) -> dict[int, tuple[np.ndarray, int]]:
    """{file-order index: (encoded image as uint8, label)} of one span, read with one request."""
    stats.begin()
    nbytes = 0
    try:
        payloads = reader.nth_span(wanted)
        nbytes = reader.end_of(wanted[-1]) - int(reader.offsets[wanted[0]])
    finally:
        stats.end(len(wanted) if nbytes else 0, nbytes)
    out = {}
    for i, payload in payloads.items():
        header, data = unpack_record(payload)
        out[i] = (np.frombuffer(data, np.uint8), header_label(header))
    return out


class Chunk:
    """One chunk of an epoch's order: the record at order position `first + p` lands in images[p] and
    labels[p], put there by the chunk's streams (futures), so a batch is two slices."""

    def __init__(self, first: int, wanted: np.ndarray):
        self.first, self.wanted = first, wanted
        self.images: list[np.ndarray | None] = [None] * len(wanted)
        self.labels = np.empty(len(wanted), np.int64)
        self.futures: list[Future] = []

    def drop(self) -> None:
        """Let the records go (submitted to a reader thread, which then pays for freeing them)."""
        self.images.clear()


def read_stream(reader, chunk: Chunk, plan: ReadPlan, stream: int, stats: ReadStats) -> None:
    """Stream `stream` of a chunk: every plan.streams-th of its spans, in offset order, each record put
    at its positions in the chunk (a padded order may hold a record twice) - in a reader thread."""
    by_position = np.argsort(chunk.wanted, kind="stable")
    ordered = chunk.wanted[by_position]
    for span in spans(reader, chunk.wanted, plan.gap_bytes)[stream :: plan.streams]:
        records = read_span(reader, span, stats)
        ids = np.array(list(records), np.int64)
        los, his = np.searchsorted(ordered, ids), np.searchsorted(ordered, ids, side="right")
        for (image, label), lo, hi in zip(records.values(), los.tolist(), his.tolist(), strict=True):
            for p in by_position[lo:hi].tolist():
                chunk.images[p], chunk.labels[p] = image, label


class ReadAhead:
    """One epoch's batches of `order` (file-order record indices, `batch` a batch), read by `pool` in
    the chunks of `plan`.  batch(k) returns batch k's (encoded images, int64 labels), waiting only for
    reads still under way; asked for a batch out of sequence (the first of a resumed pass), it reads
    from that batch on.  Per batch the calling thread does two slices; per chunk a few submissions."""

    def __init__(self, reader, order: np.ndarray, batch: int, plan: ReadPlan, pool: ReadPool):
        self.reader, self.order, self.batch_size, self.plan, self.pool = reader, order, batch, plan, pool
        self.chunk = max(1, plan.chunk_batches)
        self.batches = len(order) // batch
        self._first = None  # the first batch this pass reads (a chunk before it is never read)
        self._pending: dict[int, Chunk] = {}
        self._current: tuple[int, Chunk] | None = None

    def _submit(self, c: int) -> None:
        lo = max(c * self.chunk, self._first) * self.batch_size
        hi = min((c + 1) * self.chunk, self.batches) * self.batch_size
        chunk, plan, stats = Chunk(lo, self.order[lo:hi]), self.plan, self.pool.stats
        chunk.futures = [self.pool.submit(read_stream, self.reader, chunk, plan, t, stats) for t in range(plan.streams)]
        self._pending[c] = chunk

    def _take(self, c: int) -> Chunk:
        """Chunk c, waited for (a chunk before it still pending is cancelled)."""
        for j in [j for j in self._pending if j < c]:
            self._cancel(self._pending.pop(j))
        chunk = self._pending.pop(c)
        started = time.perf_counter()
        waited = not all(f.done() for f in chunk.futures)
        for f in chunk.futures:
            f.result()  # a read's error is raised here, in the caller
        if waited:
            self.pool.stats.waited(time.perf_counter() - started)
        self._current = (c, chunk)
        return chunk

    def batch(self, k: int) -> tuple[list[np.ndarray], np.ndarray]:
        c = k // self.chunk
        current = self._current[0] if self._current else None
        if self._first is None or k < self._first or (c != current and c not in self._pending):
            self.close()
            self._first, current = k, None
        if c != current and self._current is not None:
            # The chunk done with is freed before more is read: with one reader thread the drop is
            # queued ahead of the next chunk's read, so at most 1 + ahead chunks are ever held.
            self.pool.submit(self._current[1].drop)
            self._current = None
        last = (self.batches - 1) // self.chunk
        for j in range(c, min(c + self.plan.ahead, last) + 1):
            if j != current and j not in self._pending:
                self._submit(j)
        chunk = self._current[1] if c == current else self._take(c)
        p = k * self.batch_size - chunk.first
        return chunk.images[p : p + self.batch_size], chunk.labels[p : p + self.batch_size]

    @staticmethod
    def _cancel(chunk: Chunk) -> None:
        for f in chunk.futures:
            f.cancel()

    def close(self) -> None:
        """Cancel the reads not started; those under way finish into nothing."""
        for chunk in self._pending.values():
            self._cancel(chunk)
        self._pending.clear()
        self._current = None
