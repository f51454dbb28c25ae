"""Native MXNet RecordIO: framing, IRHeader packing, split records, corruption reporting."""

import multiprocessing as mp
import pickle
import struct

import pytest

from rectrain.recordio import (
    MAGIC_BYTES,
    IndexedRecordReader,
    IRHeader,
    RecordIOError,
    RecordWriter,
    frame_payload,
    pack_record,
    read_idx,
    scan_records,
    unpack_record,
)


def _write(tmp_path, records):
    rec, idx = tmp_path / "t.rec", tmp_path / "t.idx"
    with RecordWriter(rec, idx) as w:
        for key, payload in records:
            w.write(key, payload)
    return rec, idx


def test_single_record_bytes_match_the_documented_layout():
    payload = b"abcde"  # 5 bytes -> 3 bytes of zero padding
    framed = frame_payload(payload)
    assert framed == bytes.fromhex("0a23d7ce") + struct.pack("<I", 5) + b"abcde" + b"\0\0\0"


def test_scalar_label_header_is_24_bytes_with_flag_zero():
    payload = pack_record(IRHeader(7, 3.0, 42, 0), b"IMG")  # flag is forced to 0 for scalars, as mxnet
    assert payload[:24] == struct.pack("<IfQQ", 0, 3.0, 42, 0)
    header, image = unpack_record(payload)
    assert header == IRHeader(0, 3.0, 42, 0) and image == b"IMG"


def test_multi_float_label_round_trips_after_the_header():
    payload = pack_record(IRHeader(0, [1.5, 2.0, -3.25], 9, 1), b"\xff\xd8jpeg")
    assert payload[:24] == struct.pack("<IfQQ", 3, 0.0, 9, 1)
    assert payload[24:36] == struct.pack("<3f", 1.5, 2.0, -3.25)
    header, image = unpack_record(payload)
    assert header.flag == 3 and header.label == (1.5, 2.0, -3.25) and header.id == 9
    assert image == b"\xff\xd8jpeg"


def test_round_trip_by_key_offset_and_file_order(tmp_path):
    records = [(k, pack_record(IRHeader(0, float(k % 3), k, 0), bytes(range(k % 250)) * (k + 1))) for k in (5, 0, 3, 1)]
    rec, idx = _write(tmp_path, records)
    reader = IndexedRecordReader(rec, idx)
    assert reader.keys == [5, 0, 3, 1] and len(reader) == 4
    for key, payload in records:
        assert reader.read(key) == payload
    assert list(reader) == records
    offsets = [off for _, off in read_idx(idx)]
    assert [off for off, _ in scan_records(rec)] == offsets
    assert all(off % 4 == 0 for off in offsets)
    assert reader.read_at(offsets[2]) == records[2][1]


def test_payload_with_aligned_magic_is_split_into_flagged_parts(tmp_path):
    # magic at aligned offsets 8 and 16, and once unaligned at 21 (which must NOT split)
    payload = b"A" * 8 + MAGIC_BYTES + b"B" * 4 + MAGIC_BYTES + b"C" + MAGIC_BYTES + b"DE"
    framed = frame_payload(payload)
    parts, pos = [], 0
    while pos < len(framed):
        magic, lrec = struct.unpack_from("<II", framed, pos)
        assert magic == 0xCED7230A
        cflag, length = lrec >> 29, lrec & ((1 << 29) - 1)
        parts.append((cflag, framed[pos + 8 : pos + 8 + length]))
        pos += 8 + length + (-length % 4)
    assert parts == [(1, b"A" * 8), (2, b"B" * 4), (3, b"C" + MAGIC_BYTES + b"DE")]
    rec, idx = _write(tmp_path, [(0, payload), (1, b"next")])
    reader = IndexedRecordReader(rec, idx)
    assert reader.read(0) == payload and reader.read(1) == b"next"


def test_payload_starting_and_ending_with_magic(tmp_path):
    payload = MAGIC_BYTES + b"xyzw" + MAGIC_BYTES
    rec, idx = _write(tmp_path, [(0, payload)])
    assert IndexedRecordReader(rec, idx).read(0) == payload


def test_bad_magic_error_names_the_byte_offset(tmp_path):
    rec, idx = _write(tmp_path, [(0, b"first"), (1, b"second"), (2, b"third")])
    second = read_idx(idx)[1][1]
    data = bytearray(rec.read_bytes())
    data[second] ^= 0xFF
    rec.write_bytes(bytes(data))
    reader = IndexedRecordReader(rec, idx)
    assert reader.read(0) == b"first"
    with pytest.raises(RecordIOError, match=rf"byte offset {second}\b"):
        reader.read(1)
    with pytest.raises(RecordIOError, match=rf"byte offset {second}\b"):
        list(scan_records(rec))


def test_truncated_rec_is_reported_not_returned(tmp_path):
    rec, idx = _write(tmp_path, [(0, b"x" * 100), (1, b"y" * 100)])
    last = read_idx(idx)[1][1]
    rec.write_bytes(rec.read_bytes()[:-10])
    with pytest.raises(RecordIOError, match=rf"byte offset {last}.*truncated"):
        IndexedRecordReader(rec, idx).read(1)


def test_nonzero_padding_and_misplaced_continuation_are_rejected(tmp_path):
    rec, idx = _write(tmp_path, [(0, b"abcde")])
    data = bytearray(rec.read_bytes())
    data[-1] = 1
    rec.write_bytes(bytes(data))
    with pytest.raises(RecordIOError, match="non-zero padding at byte offset 15"):
        IndexedRecordReader(rec, idx).read(0)
    # a record that starts with a "last part" flag is not a record start
    rec.write_bytes(MAGIC_BYTES + struct.pack("<I", 3 << 29 | 4) + b"abcd")
    with pytest.raises(RecordIOError, match="byte offset 0 starts with continuation flag 3"):
        IndexedRecordReader(rec, idx).read(0)


def test_malformed_idx_line_is_named(tmp_path):
    rec, idx = _write(tmp_path, [(0, b"a")])
    idx.write_text("0\t0\nbroken line\n")
    with pytest.raises(RecordIOError, match=r"t\.idx:2"):
        IndexedRecordReader(rec, idx)


def _read_in_child(reader, key, queue):
    queue.put(reader.read(key))


def test_reader_survives_pickling_and_works_in_child_processes(tmp_path):
    rec, idx = _write(tmp_path, [(0, b"zero"), (1, b"one")])
    reader = IndexedRecordReader(rec, idx)
    assert reader.read(0) == b"zero"  # opens the descriptor in the parent first
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.read(1) == b"one"
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        queue = ctx.Queue()
        p = ctx.Process(target=_read_in_child, args=(reader, 1, queue))
        p.start()
        assert queue.get(timeout=60) == b"one"
        p.join(timeout=60)
        assert p.exitcode == 0


def test_a_pickled_reader_carries_only_its_file_order_arrays_and_still_looks_keys_up(tmp_path):
    """The torch loader's workers get the reader pickled each epoch: the by-key arrays stay behind."""
    records = [(k, f"record {k}".encode()) for k in (7, 3, 11, 5)]
    rec, idx = _write(tmp_path, records)
    reader = IndexedRecordReader(rec, idx)
    blob = pickle.dumps(reader)
    assert len(blob) < len(pickle.dumps(reader.__dict__)) - 2 * 4 * 8, "two int64 arrays of 4 fewer"
    clone = pickle.loads(blob)
    assert [clone.nth(i) for i in range(4)] == [reader.nth(i) for i in range(4)]
    assert all(clone.read(k) == payload for k, payload in records)
    with pytest.raises(KeyError):
        clone.read(4)


def test_magic_search_cuts_exactly_where_a_plain_byte_scan_does():
    # the fast (memmem) search must find every aligned magic word, skip unaligned ones, and cope
    # with magic words that overlap, end the payload or sit at offset 0
    import random

    from rectrain import recordio

    def plain_scan(data):
        return [i for i in range(0, len(data) - 3, 4) if data[i : i + 4] == MAGIC_BYTES]

    rng = random.Random(0)
    for _ in range(2000):
        parts = [rng.choice([MAGIC_BYTES, MAGIC_BYTES[:2], rng.randbytes(rng.randint(0, 7))]) for _ in range(8)]
        data = b"".join(parts)
        assert list(recordio._aligned_magic_positions(data)) == plain_scan(data), data
