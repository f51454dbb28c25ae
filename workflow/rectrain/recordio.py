"""MXNet RecordIO (.rec + .idx), written and read natively, byte for byte as mxnet 1.9.1 does.

Framing (dmlc-core recordio): each part is ``uint32 magic, uint32 lrec, data, zero pad to 4``
with ``lrec = cflag << 29 | length``. A payload holding the magic word at a 4-byte-aligned offset
is cut there into parts (cflag 1 first, 2 middle, 3 last) and the magic itself is dropped; readers
put it back. Only the last part is padded: the cut points are aligned, so earlier parts already are.

Payload = IRHeader ``'<IfQQ'`` (flag, label, id, id2) + [flag float32 labels] + image bytes.
The ``.idx`` is text, ``key\\toffset\\n`` per record, offset of the record's first magic word.
"""

from __future__ import annotations

import ctypes
import io
import numbers
import os
import re
import struct
import threading
from collections import namedtuple
from typing import Callable, Iterator

import numpy as np

from rectrain import safefs

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)
_FRAME = struct.Struct("<II")
_LENGTH_MASK = (1 << 29) - 1
MAX_PAYLOAD = 1 << 29  # dmlc refuses records of 2**29 bytes or more

IRHeader = namedtuple("IRHeader", "flag label id id2")
_IR = struct.Struct("<IfQQ")
IR_SIZE = _IR.size  # 24


class RecordIOError(ValueError):
    """A .rec/.idx pair that is not valid RecordIO; the message names the byte offset."""


def pack_record(header: IRHeader, image_bytes: bytes) -> bytes:
    """Payload for one record, as ``mxnet.recordio.pack``.

    A scalar label goes in the header (flag forced to 0); a sequence of labels is stored as
    ``flag`` float32 values after the header, with the header label 0.
    """
    header = IRHeader(*header)
    if isinstance(header.label, numbers.Number):
        return _IR.pack(0, header.label, header.id, header.id2) + bytes(image_bytes)
    labels = [float(x) for x in header.label]
    extra = struct.pack(f"<{len(labels)}f", *labels)
    return _IR.pack(len(labels), 0.0, header.id, header.id2) + extra + bytes(image_bytes)


def unpack_record(payload: bytes) -> tuple[IRHeader, bytes]:
    """Split a payload into (IRHeader, image bytes); label is a tuple of floats when flag > 0."""
    if len(payload) < IR_SIZE:
        raise RecordIOError(f"payload of {len(payload)} bytes is shorter than the {IR_SIZE}-byte IRHeader")
    header = IRHeader(*_IR.unpack_from(payload, 0))
    body = IR_SIZE
    if header.flag > 0:
        end = body + 4 * header.flag
        if end > len(payload):
            raise RecordIOError(
                f"IRHeader says {header.flag} float labels but the payload has only "
                f"{len(payload) - body} bytes after the header"
            )
        header = header._replace(label=struct.unpack_from(f"<{header.flag}f", payload, body))
        body = end
    return header, payload[body:]


def header_label(header: IRHeader) -> int:
    """The record's class: the header's label, or the first of its float labels (flag > 0)."""
    label = header.label
    return int(label[0] if isinstance(label, tuple) else label)


def _libc_memmem():
    """glibc's memmem, or None. Every record is searched for the magic word: memmem does it ~2.5x
    faster than bytes.find (15 vs 39 us for a 70 KB JPEG) and, called through ctypes, without the
    GIL, so the pack's threads search in parallel."""
    try:
        memmem = ctypes.CDLL(None).memmem
    except (OSError, AttributeError):
        return None
    memmem.restype = ctypes.c_void_p
    memmem.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    return memmem


_memmem = _libc_memmem()


def _magic_finder(data: bytes) -> Callable[[int], int]:
    """find(start) -> offset of the next magic word in data at or after start, or -1."""
    if _memmem is None or type(data) is not bytes:
        return lambda start: data.find(MAGIC_BYTES, start)
    ref = ctypes.c_char_p(data)  # points into data itself (no copy) and keeps it alive
    base = ctypes.cast(ref, ctypes.c_void_p).value

    def find(start: int) -> int:
        hit = _memmem(base + start, len(data) - start, MAGIC_BYTES, len(MAGIC_BYTES)) if start < len(data) else None
        return -1 if hit is None else hit - base

    return find


def _aligned_magic_positions(data: bytes) -> Iterator[int]:
    """Offsets of the magic word at 4-byte-aligned positions (only those split a record)."""
    find = _magic_finder(data)
    pos = find(0)
    while pos != -1:
        if pos % 4 == 0:
            yield pos
            pos = find(pos + 4)
        else:
            pos = find(pos + 1)


def frame_payload(payload: bytes) -> bytes:
    """The on-disk bytes of one record (all its parts and padding), as dmlc's WriteRecord."""
    n = len(payload)
    if n >= MAX_PAYLOAD:
        raise RecordIOError(f"a record of {n} bytes is too large: RecordIO records must be < 2**29 bytes")
    out = []
    start = 0
    for cut in _aligned_magic_positions(payload):
        out.append(_FRAME.pack(MAGIC, (1 if start == 0 else 2) << 29 | (cut - start)))
        out.append(payload[start:cut])
        start = cut + 4
    out.append(_FRAME.pack(MAGIC, (3 if start else 0) << 29 | (n - start)))
    out.append(payload[start:])
    out.append(b"\0" * (-n % 4))
    return b"".join(out)


class RecordWriter:
    """Writes a .rec and its .idx, as ``mxnet.recordio.MXIndexedRecordIO(idx, rec, 'w')``."""

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike, new: bool = False):
        """new: create both files here and now (rectrain.safefs.create_new), never through a name
        already there (the pack's folder may hold links someone planted)."""
        self.rec_path, self.idx_path = os.fspath(rec_path), os.fspath(idx_path)
        rec, idx = (safefs.create_new(self.rec_path), self.idx_path) if new else (rec_path, idx_path)
        self._rec = open(rec, "wb", buffering=1 << 20)
        try:
            idx = safefs.create_new(idx) if new else idx
            self._idx = open(idx, "w", buffering=1 << 16, newline="\n")
        except BaseException:
            self._rec.close()
            raise
        self._pos = 0
        self.count = 0

    def write(self, key: int, payload: bytes) -> int:
        """Append one record under ``key``; returns its byte offset."""
        return self.write_framed(key, frame_payload(payload))

    def write_framed(self, key: int, framed: bytes) -> int:
        """Append a record already framed by ``frame_payload`` (lets worker processes do the framing)."""
        offset = self._pos
        self._rec.write(framed)
        self._idx.write(f"{int(key)}\t{offset}\n")
        self._pos += len(framed)
        self.count += 1
        return offset

    def tell(self) -> int:
        return self._pos

    def close(self, sync: bool = False) -> None:
        """Flush both files; ``sync`` also forces them to disk (before a rename that publishes them)."""
        for f in (self._rec, self._idx):
            if f.closed:
                continue
            f.flush()
            if sync:
                os.fsync(f.fileno())
            f.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# One .idx line as mxnet writes it and as both mxnet and DALI read it back: ASCII digits, one tab, ASCII
# digits. Python's int() also takes `1_0`, `+5`, spaces and non-ASCII digits, where DALI's reader stops
# (issue #38: the check counted 20 records, DALI read 10). 18 digits keep every value inside int64.
IDX_LINE = re.compile(rb"([0-9]{1,18})\t([0-9]{1,18})\n?")
_IDX_FILE = re.compile(rb"(?:[0-9]{1,18}\t[0-9]{1,18}\n)*(?:[0-9]{1,18}\t[0-9]{1,18})?")


def parse_idx_line(line: bytes, idx_path, lineno: int) -> tuple[int, int]:
    """(key, offset) of one .idx line (IDX_LINE), or RecordIOError naming the file, line and fix."""
    found = IDX_LINE.fullmatch(line)
    if found is None:
        raise RecordIOError(
            f"{idx_path}:{lineno}: expected 'key<TAB>offset' in ASCII digits (as im2rec writes them), got "
            f"{line.decode(errors='replace')!r}: DALI stops reading an .idx at such a line; rebuild the .idx (im2rec)"
        )
    return int(found[1]), int(found[2])


# The longest IDX_LINE: two 18-digit numbers, a tab and the newline.  A line read stops here, so a file
# that is not an .idx (a .rec: megabytes without a newline) is refused at its first line, not read whole.
IDX_LINE_MAX = 38
# The .idx is parsed this many bytes at a time (a 1.28 M-line ImageNet .idx is ~20 MB).
IDX_CHUNK = 1 << 20


def iter_idx(idx_path: str | os.PathLike) -> Iterator[tuple[int, int]]:
    """(key, offset) pairs of an .idx file, in the file's line order, one at a time (a 1.28 M-line
    .idx read into a list takes ~150 MB); every line parsed by parse_idx_line, each read at most
    IDX_LINE_MAX bytes long."""
    with safefs.open_regular(idx_path, "the .idx") as f:
        lineno = 0
        while line := f.readline(IDX_LINE_MAX + 1):
            lineno += 1
            yield parse_idx_line(line, idx_path, lineno)


def read_idx(idx_path: str | os.PathLike) -> list[tuple[int, int]]:
    """(key, offset) pairs of an .idx file, in the file's line order."""
    return list(iter_idx(idx_path))


def idx_arrays(idx_path: str | os.PathLike, max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(keys, offsets) of an .idx as int64 arrays in line order: read_idx's pairs without two Python
    ints and a tuple per line (ImageNet's 1.28 M lines: ~0.2 s and 20 MB instead of ~1.5 s and ~150 MB).
    The whole file must be IDX_LINE lines (the first other one is named); it is parsed as a stream,
    IDX_CHUNK bytes at a time, so a file that is not an .idx (the .rec itself) is refused at its first
    bad line in bounded memory; an .idx above max_bytes is refused before it is read."""
    parts, carry, lineno = [], b"", 0
    with safefs.open_regular(idx_path, "the .idx") as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise RecordIOError(
                f"{idx_path} is {size} bytes, larger than its .rec ({max_bytes} bytes): an .idx has one short line "
                "per record, so this is not the .idx of that .rec; point recordio at the pair's own .idx"
            )
        while chunk := f.read(IDX_CHUNK):
            data = carry + chunk
            whole = data.rfind(b"\n") + 1  # the complete lines; the rest is carried into the next chunk
            data, carry = data[:whole], data[whole:]
            parts.append(_idx_lines(data, idx_path, lineno))
            lineno += data.count(b"\n")
            if len(carry) > IDX_LINE_MAX:  # no line of an .idx is this long: name it
                parse_idx_line(carry[: IDX_LINE_MAX + 1], idx_path, lineno + 1)
    if carry:  # the last line, without its newline
        parts.append(_idx_lines(carry, idx_path, lineno))
    flat = np.concatenate(parts) if parts else np.empty(0, np.int64)
    pairs = flat.reshape(-1, 2)
    return pairs[:, 0].copy(), pairs[:, 1].copy()


def _idx_lines(data: bytes, idx_path, lineno: int) -> np.ndarray:
    """The numbers of whole .idx lines `data` (after line `lineno`), flat; the first bad line is named."""
    if _IDX_FILE.fullmatch(data) is None:
        for n, line in enumerate(io.BytesIO(data), lineno + 1):
            parse_idx_line(line, idx_path, n)
    return np.fromstring(data, dtype=np.int64, sep=" ") if data else np.empty(0, np.int64)


def _check_flag(cflag: int, first: bool, where: str, pos: int, offset: int) -> None:
    """A part's continuation flag: 0 or 1 to start a record, 2 or 3 to continue the one at `offset`."""
    if cflag > 3:
        raise RecordIOError(f"{where}: invalid continuation flag {cflag} at byte offset {pos}")
    if first and cflag not in (0, 1):
        raise RecordIOError(
            f"{where}: record at byte offset {pos} starts with continuation flag "
            f"{cflag} (a middle/last part): the offset is not a record start"
        )
    if not first and cflag not in (2, 3):
        raise RecordIOError(
            f"{where}: part at byte offset {pos} has flag {cflag}, expected a "
            f"continuation (2 or 3) of the split record at byte offset {offset}"
        )


def _refuse_above(max_bytes: int | None, total: int, record: str, pos: int) -> None:
    if max_bytes is not None and total > max_bytes:
        raise RecordIOError(
            f"{record} holds more than {max_bytes} bytes ({total} by its part at byte offset {pos}), more than any "
            "image the pack reads (pack.max_image_bytes' default): re-encode that image smaller, or leave it out"
        )


def _parse_record(
    read: Callable[[int, int], bytes], offset: int, file_size: int, where: str, max_bytes: int | None = None
) -> tuple[bytes, int]:
    """Decode the record starting at ``offset``; returns (payload, offset just past it).

    ``read(off, n)`` returns up to n bytes at off. Every check names the byte offset of the part
    that fails, so a corrupt file points at itself instead of yielding garbage. ``max_bytes`` caps the
    payload, all parts together, before a part is read: a frame header claiming hundreds of MB (one
    part, or continuation parts with no end) costs nothing to refuse.
    """
    parts = []
    pos = offset
    first = True
    total = 0
    while True:
        if pos + 8 > file_size:
            raise RecordIOError(
                f"{where}: record header at byte offset {pos} runs past the end of the "
                f"file ({file_size} bytes): truncated .rec or wrong .idx offset"
            )
        magic, lrec = _FRAME.unpack(read(pos, 8))
        if magic != MAGIC:
            raise RecordIOError(
                f"{where}: bad magic 0x{magic:08x} at byte offset {pos} (expected "
                f"0x{MAGIC:08x}): corrupt .rec or an .idx that does not belong to it"
            )
        cflag, length = lrec >> 29, lrec & _LENGTH_MASK
        _check_flag(cflag, first, where, pos, offset)
        total += length + (0 if first else len(MAGIC_BYTES))
        _refuse_above(max_bytes, total, f"{where}: the record at byte offset {offset}", pos)
        padded = length + (-length % 4)
        data_at = pos + 8
        if data_at + padded > file_size:
            raise RecordIOError(
                f"{where}: record part at byte offset {pos} claims {length} bytes but the "
                f"file ends at {file_size}: truncated .rec"
            )
        chunk = read(data_at, padded)
        if len(chunk) != padded:
            raise RecordIOError(f"{where}: short read of {len(chunk)}/{padded} bytes at byte offset {data_at}")
        if padded != length and any(chunk[length:]):
            bad = next(i for i in range(length, padded) if chunk[i])
            raise RecordIOError(f"{where}: non-zero padding at byte offset {data_at + bad}")
        parts.append(chunk[:length])
        pos = data_at + padded
        if cflag in (0, 3):
            break
        parts.append(MAGIC_BYTES)
        first = False
    return (parts[0] if len(parts) == 1 else b"".join(parts)), pos


def scan_records(rec_path: str | os.PathLike, max_record_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, payload) for every record of a .rec in file order, without an .idx; a record above
    max_record_bytes is refused before it is read (_parse_record)."""
    rec_path = os.fspath(rec_path)
    with safefs.open_regular(rec_path, "the .rec") as f:
        size = os.fstat(f.fileno()).st_size
        buf, buf_start = b"", 0
        chunk = 8 << 20

        def read(off: int, n: int) -> bytes:
            nonlocal buf, buf_start
            if off < buf_start or off + n > buf_start + len(buf):
                buf, buf_start = os.pread(f.fileno(), max(n, chunk), off), off
            return buf[off - buf_start : off - buf_start + n]

        pos = 0
        while pos < size:
            payload, nxt = _parse_record(read, pos, size, rec_path, max_record_bytes)
            yield pos, payload
            pos = nxt


# Held while a reader's descriptor is opened: two threads reading first at once would open it twice and
# leak one (the .rec then stays open: a file system cannot be unmounted).
_OPENING = threading.Lock()


class IndexedRecordReader:
    """Random access to a .rec through its .idx.

    Reads with ``os.pread`` (no shared file position, page-cache friendly). The descriptor is
    opened lazily in each process, so one reader can be handed to DataLoader workers (fork or
    spawn) and each worker gets its own.
    """

    def __init__(self, rec_path: str | os.PathLike, idx_path: str | os.PathLike):
        self.rec_path, self.idx_path = os.fspath(rec_path), os.fspath(idx_path)
        # Arrays, not a dict and lists: a few bytes per record, and forked DataLoader workers share
        # the pages instead of copying them as reference counts change.
        keys, offsets = idx_arrays(self.idx_path)
        in_file = np.argsort(offsets, kind="stable")
        self.file_keys, self._sorted_offsets = keys[in_file], offsets[in_file]
        self._index_keys()
        if (dup := np.flatnonzero(self._by_key[1:] == self._by_key[:-1])).size:
            raise RecordIOError(f"{self.idx_path}: key {self._by_key[dup[0]]} appears twice")
        self._file_size = os.stat(self.rec_path).st_size
        self._fd = None
        self._pid = None

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            with _OPENING:  # reader threads (rectrain.loaders.readahead) share one descriptor, opened once
                if self._fd is None or self._pid != os.getpid():
                    self._fd = os.open(self.rec_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO never blocks
                    self._pid = os.getpid()
        return self._fd

    def _pread(self, off: int, n: int) -> bytes:
        return os.pread(self._descriptor(), n, off)

    @property
    def offsets(self) -> np.ndarray:
        """The records' byte offsets in file order (int64, read-only view): where nth(i) reads."""
        view = self._sorted_offsets.view()
        view.flags.writeable = False
        return view

    @property
    def file_size(self) -> int:
        return self._file_size

    def end_of(self, i: int) -> int:
        """Where the i-th record (file order) ends: the next one's offset, or the file's end."""
        return int(self._sorted_offsets[i + 1]) if i + 1 < len(self._sorted_offsets) else self._file_size

    def nth_span(self, wanted: list[int]) -> dict[int, bytes]:
        """{i: payload} of the records at file-order positions `wanted` (ascending, distinct), read with
        ONE pread from the first one's offset to the last one's end, whatever lies between: a block of
        contiguous records costs one request, not one per record (rectrain.loaders.readahead)."""
        start, end = int(self._sorted_offsets[wanted[0]]), self.end_of(wanted[-1])
        block = self._pread(start, end - start) if end > start else b""  # past a cut file's end: parsed below

        def read(off: int, n: int) -> bytes:
            rel = off - start
            return block[rel : rel + n] if 0 <= rel and rel + n <= len(block) else self._pread(off, n)

        return {i: _parse_record(read, int(self._sorted_offsets[i]), self._file_size, self.rec_path)[0] for i in wanted}

    def read_at(self, offset: int) -> bytes:
        """Payload of the record whose magic word is at ``offset``."""
        # One read covers the whole record when the next record's offset is known.
        i = int(np.searchsorted(self._sorted_offsets, offset, side="right"))
        end = int(self._sorted_offsets[i]) if i < len(self._sorted_offsets) else self._file_size
        if not 0 <= offset < end:
            return _parse_record(self._pread, offset, self._file_size, self.rec_path)[0]
        block = self._pread(offset, end - offset)

        def read(off: int, n: int) -> bytes:
            rel = off - offset
            if rel + n <= len(block):
                return block[rel : rel + n]
            return self._pread(off, n)

        return _parse_record(read, offset, self._file_size, self.rec_path)[0]

    @property
    def keys(self) -> list[int]:
        """Record keys in file order (file_keys is the same as an int64 array)."""
        return self.file_keys.tolist()

    def _index_keys(self) -> None:
        """The keys in order with their offsets, for offset()'s binary search."""
        by_key = np.argsort(self.file_keys, kind="stable")
        self._by_key, self._key_offsets = self.file_keys[by_key], self._sorted_offsets[by_key]

    def offset(self, key: int) -> int:
        if self._by_key is None:  # dropped when pickled (__getstate__)
            self._index_keys()
        i = int(np.searchsorted(self._by_key, key))
        if i == len(self._by_key) or self._by_key[i] != key:
            raise KeyError(f"record key {key} is not in {self.idx_path}")
        return int(self._key_offsets[i])

    def read(self, key: int) -> bytes:
        return self.read_at(self.offset(key))

    def nth(self, i: int) -> tuple[int, bytes]:
        """(key, payload) of the i-th record in file order."""
        return int(self.file_keys[i]), self.read_at(int(self._sorted_offsets[i]))

    def __len__(self) -> int:
        return len(self.file_keys)

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        """(key, payload) in file order."""
        for key, offset in zip(self.file_keys.tolist(), self._sorted_offsets.tolist(), strict=True):
            yield key, self.read_at(offset)

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __getstate__(self):
        # The torch loader's workers get the reader pickled each epoch (rectrain.loaders.pytorch: they start
        # from a forkserver) and read by position (nth): the by-key arrays, half its bytes (~20 MB at
        # ImageNet's 1.28 M records), are rebuilt only where a key is looked up.
        return dict(self.__dict__, _fd=None, _pid=None, _by_key=None, _key_offsets=None)

    def __enter__(self) -> "IndexedRecordReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
