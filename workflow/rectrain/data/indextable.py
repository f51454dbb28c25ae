"""One split of the index (<split>.tsv) as compact columns, for the pack and the verifier.

At ImageNet scale (1.28 M rows) the table as a list of per-row dicts took ~0.5 KB a row (most of the
pack's 840 MB). Here a row costs 20 bytes: its id and label in arrays and where its line starts in
the file; a row's source is read back from the file when it is needed (the TSV is ~70 MB at 1.28 M
rows and stays in the page cache, which no process's memory counts).

The file is the index stage's TSV (header `id, source, label, wnid`, tab-separated, written by
csv.writer): a field is quoted only when it holds a double quote, which the csv module then parses.
"""

from __future__ import annotations

import array
import csv
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from rectrain.tables import read_classes

COLUMNS = ("id", "source", "label")


class BadIndex(ValueError):
    """The index TSV is malformed; the message names the file, the line and the fix."""


def _fields(line: bytes) -> list[str]:
    text = line.decode("utf-8").rstrip("\r\n")
    if '"' in text:  # csv.writer quoted a field holding a quote
        return next(csv.reader([text], delimiter="\t"))
    return text.split("\t")


class IndexTable:
    """ids and labels (numpy arrays, index rows in file order) and each row's source on demand."""

    def __init__(self, path: Path, ids: np.ndarray, labels: np.ndarray, starts: np.ndarray, source_col: int):
        self.path, self.ids, self.labels, self._starts, self._col = path, ids, labels, starts, source_col
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self.ids)

    def source(self, row: int) -> str:
        start, end = int(self._starts[row]), int(self._starts[row + 1])
        line = os.pread(self._fd, end - start, start).split(b"\n", 1)[0]
        return _fields(line)[self._col]

    def sources(self, rows) -> list[str]:
        """The rows' sources; a run of consecutive rows (a folder of a sorted index) in one read."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) > 1 and rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all():
            start, end = int(self._starts[rows[0]]), int(self._starts[rows[-1] + 1])
            lines = [line for line in os.pread(self._fd, end - start, start).split(b"\n") if line.strip()]
            if len(lines) == len(rows):
                return [_fields(line)[self._col] for line in lines]
        return [self.source(r) for r in rows.tolist()]

    def iter_sources(self) -> Iterator[str]:
        """Every row's source in file order, read sequentially."""
        with open(self.path, "rb") as f:
            f.readline()
            for line in f:
                if line.strip():
                    yield _fields(line)[self._col]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()


def _columns(header: bytes, path: Path) -> tuple[int, int, int]:
    names = _fields(header)
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise BadIndex(f"{path} lacks the column(s) {', '.join(missing)}: rerun the index stage (index_raw)")
    return names.index("id"), names.index("source"), names.index("label")


def read_table(path: str | os.PathLike) -> IndexTable:
    """The TSV's rows as an IndexTable; a malformed row is an error naming its line."""
    path = Path(path)
    ids, labels, starts = array.array("q"), array.array("q"), array.array("q")
    with open(path, "rb") as f:
        header = f.readline()
        id_col, source_col, label_col = _columns(header, path)
        pos = len(header)
        for lineno, line in enumerate(f, 2):
            if line.strip():
                fields = _fields(line)
                try:
                    if len(fields) <= source_col:
                        raise IndexError
                    ids.append(int(fields[id_col]))
                    labels.append(int(fields[label_col]))
                except (ValueError, IndexError):
                    raise BadIndex(
                        f"{path}:{lineno}: expected id, source and label, got {line!r}; rebuild the index (index_raw)"
                    ) from None
                starts.append(pos)
            pos += len(line)
    starts.append(pos)
    arrays = (np.frombuffer(a, dtype=np.int64) if len(a) else np.zeros(0, np.int64) for a in (ids, labels, starts))
    return IndexTable(path, *arrays, source_col)


def load(index_dir: Path, split: str) -> tuple[IndexTable, int]:
    """The split's table and the class count; unique ids and labels within the classes, or an error."""
    tsv = Path(index_dir) / f"{split}.tsv"
    table = read_table(tsv)
    num_classes = len(read_classes(Path(index_dir) / "classes.tsv"))
    ids = np.sort(table.ids)
    dup = np.flatnonzero(ids[1:] == ids[:-1])
    if len(dup):
        raise BadIndex(f"{tsv}: id {ids[dup[0]]} occurs twice; rebuild the index (rule index_raw)")
    bad = np.flatnonzero((table.labels < 0) | (table.labels >= num_classes))
    if len(bad):
        raise BadIndex(
            f"{tsv}: id {table.ids[bad[0]]} has a label outside 0..{num_classes - 1}; rebuild the index (index_raw)"
        )
    return table, num_classes
