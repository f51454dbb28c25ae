"""Index a raw ImageNet: which file (or tar member) is which class.

Layouts understood (docs/architecture.md, "index_raw"), relative to the raw root (or to ILSVRC/Data/CLS-LOC, Kaggle's):
  folders      train/<wnid>/*.JPEG + val/<wnid>/*.JPEG
  flat-kaggle  train/<wnid>/*.JPEG + flat val (val/ or val_flat/) labelled by LOC_val_solution.csv
  flat-devkit  train/<wnid>/*.JPEG + flat val labelled by the devkit's ILSVRC2012_validation_ground_truth.txt
               with the ILSVRC2012_ID -> wnid map from meta.mat (needs scipy) or meta.csv
               (ILSVRC2012_ID,WNID,words; what the demo writes), found in devkit/,
               ILSVRC2012_devkit_t12/data/ or inside ILSVRC2012_devkit_t12.tar.gz
  archives     ILSVRC2012_img_train.tar (a tar of per-class tars) + ILSVRC2012_img_val.tar, in the raw
               root or its archives/ folder, read in place: never extracted. Val labels from
               LOC_val_solution.csv, else the devkit.
  tiny-imagenet  train/<wnid>/images/*.JPEG + val/images/ labelled by val/val_annotations.txt (the raw
               root, or its tiny-imagenet-200/ as the zip extracts); names from words.txt, and a
               warning when wnids.txt lists other classes than train holds
"auto" takes train folders over the train archive, and for val: Tiny-ImageNet's, foldered, then Kaggle
CSV, then devkit. An image anywhere below a class folder is of that class (the log says how many class
folders hold images in sub-folders); hidden sub-folders are listed.

Subsets (index.classes, index.per_class: rectrain.data.subset) are taken from what discovery found, so
every layout takes them alike; the log says what was kept.

Outputs (tab-separated, header row): train.tsv and val.tsv (id, source, label, wnid; ids 0..N-1 in
sorted(source) order), classes.tsv (label, wnid, name; labels = sorted train wnids, as
`im2rec --recursive` numbers them), unclassified.tsv (source, reason). A source is a path relative to
the raw root, or `archive.tar::member`, or `outer.tar::inner.tar::member`.

The indexer only classifies; bad image content is the packer's job. A file is an image when its
extension (any case) is one of a format the pack opens (rectrain.data.formats), or else when its first
bytes are one: in a folder only, archive members by name. Every file under the layout's
folders is accounted for: indexed, or listed in unclassified.tsv with the reason (not an image,
a name the TSVs cannot hold: tab, line break, '::' or not UTF-8 - see name_problem - outside any
class folder, no ground truth, not a regular file: FIFOs, sockets and devices
would block or feed the packer garbage; symbolic links are followed only when they resolve inside the
raw root, or inside a split folder that is itself a link the user made). Layout detection ignores hidden and empty folders (a stray `val/.ipynb_checkpoints/` does not
make a flat val foldered).

Loud failures (LayoutError, CorruptArchive, UnsafeArchiveMember), never a silently short index:
  - a split with no images names the split, the layout detected and what was found instead, unless
    the config's index.absent_splits lists it;
  - an archive listing that stops before a valid end-of-archive, or a member running past the end of
    its archive, names the archive and the byte offset (rectrain.data.archives);
  - with the official ILSVRC2012_img_train.tar, whole-class evidence is an error: a per-class tar with
    no images, or val labels naming classes the train archive lacks. (With folders, the same findings
    are warnings: a train subset with the full val is a legitimate experiment.)
Warnings, said once each in the log: counts of the official archives that differ from 1000 classes /
1,281,167 train / 50,000 val (both numbers), class names that are not WordNet ids (fine for a custom
dataset), empty class folders, val classes that train lacks.
Tar member names are never used as filesystem paths; a member that is absolute, climbs with `..`,
is a link or a device is refused with an error naming the archive and the member.
Untrusted datasets (issue 26): files found by a fixed name (the archives, LOC_*, the devkit,
Tiny-ImageNet's label files) are read only when they resolve inside the raw root or a linked split
folder, or when the config's index.allow_outside_root names them (else a warning with the target,
never the content); label files and the unpacked devkit are read up to LABEL_MAX_BYTES; tar headers are
bounded before tarfile parses them (rectrain.data.archives); folders are walked with a stack, so
any depth is indexed.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import logging
import os
import re
import stat
import tarfile
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator

from rectrain import cli, settings
from rectrain.atomic import replacing
from rectrain.config import expand_path
from rectrain.data import subset
from rectrain.data.archives import (
    DEVKIT_DIR,
    DEVKIT_TGZ,
    GROUND_TRUTH,
    KAGGLE_CSV,
    META_CSV,
    META_MAT,
    OFFICIAL_COUNTS,
    SEP,
    SYNSET_MAPPING,
    TINY_ROOT,
    TINY_VAL_LABELS,
    TINY_WNIDS,
    TINY_WORDS,
    TRAIN_TAR,
    UNNAMEABLE,
    VAL_TAR,
    BoundedTarInfo,
    CorruptArchive,
    HeaderTooLarge,
    SourceReader,
    UnsafeArchiveMember,
    check_member,
    refuse_header,
)
from rectrain.data.formats import HEAD_BYTES, SUPPORTED_FORMATS, extension, extensions, named_format, sniff
from rectrain.safefs import special_file

# Named, not __name__: run as `python -m`, this module is __main__, outside the configured "rectrain" logger.
log = logging.getLogger("rectrain.data.index")

VAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})$")
WNID = re.compile(r"n\d{8}")
LAYOUTS = ("auto", "folders", "flat-kaggle", "flat-devkit", "archives", "tiny-imagenet")
# What to rearrange when a split is not found: the pipeline always detects (no config key forces a layout).
ARRANGE = (
    f"Arrange the raw root (the config's raw:, or its ILSVRC/Data/CLS-LOC/) as one of the layouts the index "
    f"reads: train/<wnid>/*.JPEG or {TRAIN_TAR}; and val/<wnid>/*.JPEG, a flat val/ (or val_flat/) of "
    f"ILSVRC2012_val_*.JPEG beside {KAGGLE_CSV} or the devkit ground truth, or {VAL_TAR}; or Tiny-ImageNet's "
    f"val/images/ with val/{TINY_VAL_LABELS}."
)
SPLITS = ("train", "val")


class LayoutError(Exception):
    """The raw root does not hold a layout we can index (the message says what was looked for)."""


class Rows:
    """The (source, wnid) rows of one split, held compactly: ImageNet's 1.28 M rows as Python tuples of
    strings would take ~200 MB, here ~40 bytes each. Rows come in groups sharing a source prefix (a
    class folder, a per-class tar, the flat val): per row only the rest of the source (UTF-8, in one
    buffer) and a class code are kept. Iterating yields (source, wnid) tuples, one at a time."""

    def __init__(self):
        self._names = bytearray()
        self._ends = array("q")  # row i's name is _names[_ends[i - 1]:_ends[i]]
        self._codes = array("i")  # row i's wnid is wnids[_codes[i]]
        self._groups: list[tuple[str, int]] = []  # (prefix, first row), in the order added
        self.wnids: list[str] = []
        self._code: dict[str, int] = {}

    def group(self, prefix: str) -> None:
        """Rows added from now on have sources prefix + name."""
        self._groups.append((prefix, len(self._ends)))

    @property
    def prefix(self) -> str:
        """The prefix of the group rows are added to now."""
        return self._groups[-1][0]

    def add(self, name: str, wnid: str) -> None:
        if (code := self._code.get(wnid)) is None:
            code = self._code[wnid] = len(self.wnids)
            self.wnids.append(wnid)
        # surrogateescape: a file name that is not valid UTF-8 comes back exactly as os.scandir gave it
        self._names += name.encode("utf-8", "surrogateescape")
        self._ends.append(len(self._names))
        self._codes.append(code)

    def __len__(self) -> int:
        return len(self._ends)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        for g, (prefix, lo) in enumerate(self._groups):
            yield from self._group_rows(prefix, lo, self._group_end(g))

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (Rows, list)) else NotImplemented

    def _group_end(self, g: int) -> int:
        return self._groups[g + 1][1] if g + 1 < len(self._groups) else len(self._ends)

    def _group_rows(self, prefix: str, lo: int, hi: int) -> Iterator[tuple[str, str]]:
        names, ends, codes, wnids = self._names, self._ends, self._codes, self.wnids
        start = ends[lo - 1] if lo else 0
        for i in range(lo, hi):
            yield prefix + names[start : ends[i]].decode("utf-8", "surrogateescape"), wnids[codes[i]]
            start = ends[i]

    def classes(self) -> set[str]:
        """The wnids that have at least one row."""
        return {self.wnids[c] for c in set(self._codes)}

    def sorted(self) -> Iterator[tuple[str, str]]:
        """The rows in sorted() order, sorting one group at a time: group by prefix, then rows inside it,
        which is the same order when no prefix starts another (class folders and tars never do; else
        every row is sorted at once)."""
        order = sorted(range(len(self._groups)), key=lambda g: self._groups[g][0])
        prefixes = [self._groups[g][0] for g in order]
        if any(b.startswith(a) for a, b in zip(prefixes, prefixes[1:], strict=False)):
            yield from sorted(self)
            return
        for g in order:
            prefix, lo = self._groups[g]
            yield from sorted(self._group_rows(prefix, lo, self._group_end(g)))

    def select(self, wnids: set[str], sources: set[str] | None = None) -> Rows:
        """The rows of these wnids (given `sources`, only those sources), in their groups."""
        kept = Rows()
        for g, (prefix, lo) in enumerate(self._groups):
            kept.group(prefix)
            for source, wnid in self._group_rows(prefix, lo, self._group_end(g)):
                if wnid in wnids and (sources is None or source in sources):
                    kept.add(source[len(prefix) :], wnid)
        return kept

    def keep(self, wnids: set[str]) -> tuple[Rows, list[tuple[str, str]]]:
        """(the rows of these wnids, the other rows as (source, wnid))."""
        kept, dropped = Rows(), []
        for g, (prefix, lo) in enumerate(self._groups):
            kept.group(prefix)
            for source, wnid in self._group_rows(prefix, lo, self._group_end(g)):
                if wnid in wnids:
                    kept.add(source[len(prefix) :], wnid)
                else:
                    dropped.append((source, wnid))
        return kept, dropped


@dataclass
class Found:
    """What discovery saw: (source, wnid) rows per split, unclassified (source, reason), class names.

    layout: per split, how it was read; warnings: findings to say once in the log (see module doc)."""

    train: Rows = field(default_factory=Rows)
    val: Rows = field(default_factory=Rows)
    unclassified: list[tuple[str, str]] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)
    layout: dict[str, str] = field(default_factory=dict)
    detected: dict[str, str] = field(default_factory=dict)  # per split: folders, flat, archives or absent
    warnings: list[str] = field(default_factory=list)
    # Per split, the slice of `unclassified` its discovery produced (what was "found instead").
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Per split: (files in the official archive, per-class tars) when read from one, for the count check.
    archive_counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Class folders (or per-class tars) that held no image.
    empty_classes: dict[str, list[str]] = field(default_factory=dict)
    # How the layout was read where it is not the plain one (images in sub-folders of a class folder):
    # said once each in the log, as information.
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- classification helpers


def name_problem(name: str) -> str | None:
    """Why a file or folder name cannot be written to the index TSVs, or None. The TSVs are UTF-8 lines
    of tab-separated fields, as im2rec's .lst and DALI's file lists are: a tab or line break inside a
    name would need quoting that line-based readers (the pack's, im2rec's) do not undo."""
    if "\t" in name:
        return "name contains a tab, which separates the index's columns: rename the file"
    if "\n" in name or "\r" in name:
        return "name contains a line break (newline or carriage return), which ends an index row: rename the file"
    if SEP in name:
        return f"name contains {SEP!r}, which separates an archive from its member in a source: rename the file"
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # os.scandir's surrogateescape for bytes that are not UTF-8
            return (
                "name is not valid UTF-8 (shown with its odd bytes as \\xNN; e.g. Latin-1 from an old system) and "
                "the index is UTF-8: rename it to UTF-8, e.g. convmv -f latin1 -t utf8 -r --notest <folder>"
            )
    return None


def unclassifiable(name: str, folder: Path | None = None) -> str | None:
    """Why a file cannot be an index row, or None. A name whose extension (any case) is a supported
    format's is taken unread (the pack checks the content of every image it reads); any other file
    in `folder` is taken when its first bytes are one (rectrain.data.formats says why not all)."""
    if (problem := name_problem(name)) is not None:
        return problem
    # String operations, not PurePosixPath: this runs once per file of a 1.28 M-file tree.
    base = name.rpartition("/")[2]
    if base.startswith("."):
        return "hidden file (e.g. macOS ._ metadata)"
    if named_format(base) is not None:
        return None
    why = f"not an image extension ({extension(base) or 'none'}; accepted, any case: {', '.join(sorted(extensions()))})"
    if folder is None:
        return why
    if _sniff_file(folder / base) is not None:
        return None
    return f"{why} and its first bytes are none of {', '.join(SUPPORTED_FORMATS)}"


def _sniff_file(path: Path) -> str | None:
    try:
        with open(path, "rb") as fh:
            return sniff(fh.read(HEAD_BYTES))
    except OSError:  # unreadable: listed as not an image; the reason says what was looked for
        return None


def _rel(path: Path, raw: Path) -> str:
    return path.relative_to(raw).as_posix()


class _Kinds:
    """Classify directory entries by their type without a stat where the entry already knows it (the
    d_type os.scandir returns): only regular files are indexed, symbolic links only when they resolve
    inside the raw root (or inside the split's own folder, which may be a link the user made)."""

    def __init__(self, raw: Path, tops: Iterable[Path]):
        self.raw = raw
        self.roots = tuple({os.path.realpath(p) for p in (raw, *tops)})

    def inside(self, target: str) -> bool:
        return any(target == root or target.startswith(root.rstrip(os.sep) + os.sep) for root in self.roots)

    def of(self, entry: os.DirEntry) -> tuple[str, str]:
        """('file' | 'dir' | 'other', reason for 'other')."""
        if entry.is_file(follow_symlinks=False):
            return "file", ""
        if entry.is_dir(follow_symlinks=False):
            return "dir", ""
        if not entry.is_symlink():
            return "other", f"{special_file(entry.stat(follow_symlinks=False).st_mode)}, not a regular file"
        target = os.path.realpath(entry.path)
        if not self.inside(target):
            return "other", f"symbolic link resolving outside the raw root (to {target})"
        try:
            mode = os.stat(entry.path).st_mode
        except OSError as err:
            return "other", f"broken or looping symbolic link ({err.strerror})"
        if stat.S_ISREG(mode):
            return "file", ""
        if stat.S_ISDIR(mode):
            return "dir", ""
        return "other", f"symbolic link to {special_file(mode)}, not a regular file"


def _scan(folder: Path) -> list[os.DirEntry]:
    with os.scandir(folder) as it:
        return sorted(it, key=lambda e: e.name)


def _files_below(folder: Path) -> Iterator[Path]:
    """Every non-directory below folder (links and special files too, never followed): for listing.
    A stack, not recursion: a dataset can nest folders deeper than Python's recursion limit."""
    todo = [folder]
    while todo:
        here = todo.pop()
        if here.is_symlink():
            yield here
            continue
        below = []
        for entry in _scan(here):
            if entry.is_dir(follow_symlinks=False):
                below.append(Path(entry.path))
            else:
                yield Path(entry.path)
        todo.extend(reversed(below))


def _hidden(name: str) -> bool:
    return name.startswith(".")


def walk_class_folders(top: Path, raw: Path, found: Found, kinds: _Kinds) -> Rows:
    """(source, wnid) rows for images in top/<wnid>/ and its sub-folders (Tiny-ImageNet's
    <wnid>/images/): an image below a class folder is of that class. Everything else goes to
    found.unclassified."""
    rows, empty, nested = Rows(), [], []
    for entry in _scan(top):
        path = Path(entry.path)
        kind, why = kinds.of(entry)
        if kind != "dir":
            found.unclassified.append((_rel(path, raw), why or "outside any class directory"))
        elif _hidden(entry.name) or (problem := name_problem(entry.name)) is not None:
            why = "hidden class directory" if _hidden(entry.name) else f"class directory {problem}"
            found.unclassified += [(_rel(p, raw), why) for p in _files_below(path)]
        else:
            before = len(rows)
            rows.group(_rel(path, raw) + "/")  # sources built as strings: no Path per file
            if _walk_class(path, "", entry.name, found, kinds, rows):
                nested.append(entry.name)
            if len(rows) == before:
                empty.append(entry.name)
    if empty:
        found.empty_classes[_rel(top, raw)] = empty
    if nested:
        found.notes.append(
            f"{_rel(top, raw)}/: {len(nested)} class folders hold images in sub-folders (e.g. "
            f"{', '.join(nested[:3])}); an image below a class folder is of that class"
        )
    return rows


def _walk_class(folder: Path, below: str, wnid: str, found: Found, kinds: _Kinds, rows: Rows) -> bool:
    """Add folder's images as rows of wnid (names relative to the class folder: below + name), its
    sub-folders' too; returns whether a sub-folder held an image. A stack of folders, not recursion:
    a dataset can nest folders deeper than Python's recursion limit."""
    nested, prefix, todo = False, rows.prefix, [(folder, below)]
    while todo:
        here, below = todo.pop()
        before, subs = len(rows), []
        for sub in _scan(here):
            kind, why = kinds.of(sub)
            name = below + sub.name
            if kind == "dir" and _hidden(sub.name):
                found.unclassified += [
                    (_rel(p, kinds.raw), f"hidden folder below class directory {wnid}")
                    for p in _files_below(Path(sub.path))
                ]
            elif kind == "dir":
                subs.append((Path(sub.path), name + "/"))
            elif kind == "other":
                found.unclassified.append((prefix + name, why))
            elif (reason := unclassifiable(name, here)) is not None:
                found.unclassified.append((prefix + name, reason))
            else:
                rows.add(name, wnid)
        nested = nested or (here is not folder and len(rows) > before)
        todo.extend(reversed(subs))
    return nested


def label_flat(
    prefix: str, names: Iterable[str], truth: dict[str, str], how: str, found: Found, *, folder: Path | None = None
) -> Rows:
    """Rows of the sources prefix + name, labelled by truth (val stem -> wnid) from each name's last
    part. Unlabelled or odd files are listed. folder: where the names are on disk (None in an archive),
    for the content of a file whose extension names no image format."""
    rows = Rows()
    rows.group(prefix)
    for name in names:
        base = PurePosixPath(name).name
        if (reason := unclassifiable(base, folder)) is not None:
            found.unclassified.append((prefix + name, reason))
        elif (wnid := truth.get(PurePosixPath(base).stem)) is None:
            found.unclassified.append((prefix + name, f"no ground truth for this image in {how}"))
        else:
            rows.add(name, wnid)
    return rows


# ---------------------------------------------------------------- label files

# Label files and the devkit come with the dataset: read up to this much. The largest real one,
# Tiny-ImageNet's words.txt, is 2.6 MB; the devkit .tar.gz unpacks to about 10 MB.
LABEL_MAX_BYTES = 64 << 20


def _bounded(fh, what: str, how: str = "") -> bytes:
    data = fh.read(LABEL_MAX_BYTES + 1)
    if len(data) > LABEL_MAX_BYTES:
        raise LayoutError(
            f"{what} holds over {LABEL_MAX_BYTES >> 20} MiB{' ' + how if how else ''}: not read, no real label file "
            f"or devkit is that large (the largest, Tiny-ImageNet's words.txt, is 2.6 MB). Replace it with the "
            f"original download."
        )
    return data


def read_label_file(path: Path) -> bytes:
    """A label file's bytes, up to LABEL_MAX_BYTES (else a LayoutError naming it)."""
    with open(path, "rb") as fh:
        return _bounded(fh, str(path))


def _label_text(path: Path) -> str:
    return read_label_file(path).decode("utf-8")


def read_kaggle_solution(path: Path) -> dict[str, str]:
    """LOC_val_solution.csv: ImageId -> wnid (first token of PredictionString)."""
    with io.StringIO(_label_text(path), newline="") as fh:
        reader = csv.DictReader(fh)
        if not reader.fieldnames or not {"ImageId", "PredictionString"} <= set(reader.fieldnames):
            raise LayoutError(f"{path}: expected the Kaggle header 'ImageId,PredictionString', got {reader.fieldnames}")
        return {row["ImageId"]: row["PredictionString"].split()[0] for row in reader if row["PredictionString"].strip()}


def read_synset_mapping(path: Path) -> dict[str, str]:
    """LOC_synset_mapping.txt: 'wnid readable name' per line."""
    names = {}
    for line in _label_text(path).splitlines():
        wnid, _, name = line.strip().partition(" ")
        if wnid:
            names[wnid] = name.strip()
    return names


def read_tiny_annotations(path: Path) -> dict[str, str]:
    """Tiny-ImageNet's val_annotations.txt: 'val_0.JPEG<TAB>n03444034<TAB>x0<TAB>y0<TAB>x1<TAB>y1' per
    line; image stem -> wnid (the stem, as the other val labels are keyed)."""
    truth = {}
    for lineno, line in enumerate(_label_text(path).splitlines(), 1):
        fields = line.split("\t")
        if len(fields) < 2 or not fields[0] or not fields[1]:
            if line.strip():
                raise LayoutError(f"{path}:{lineno}: expected '<image><TAB><wnid><TAB>box', got {line!r}")
            continue
        truth[fields[0].rpartition(".")[0] or fields[0]] = fields[1]
    return truth


def read_tiny_words(path: Path, wnids: set[str]) -> dict[str, str]:
    """Tiny-ImageNet's words.txt ('wnid<TAB>words' for all 82,115 WordNet ids): the names of wnids."""
    names = {}
    for line in _label_text(path).splitlines():
        wnid, _, words = line.partition("\t")
        if wnid in wnids:
            names[wnid] = words.strip()
    return names


def _check_tiny_wnids(path: Path, found: Found) -> None:
    """A warning when wnids.txt lists other classes than the train folders hold."""
    listed = set(_label_text(path).split())
    have = found.train.classes()
    if listed != have:
        missing, extra = sorted(listed - have), sorted(have - listed)
        found.warnings.append(
            f"{path.name} lists {len(listed)} classes, train holds {len(have)}: {len(missing)} listed without images"
            f" (e.g. {', '.join(missing[:3]) or '-'}), {len(extra)} not listed (e.g. {', '.join(extra[:3]) or '-'})"
        )


def parse_meta(data: bytes, name: str) -> dict[int, tuple[str, str]]:
    """ILSVRC2012_ID -> (wnid, words) from meta.csv (demo) or the devkit's meta.mat (needs scipy)."""
    if name.endswith(".csv"):
        rows = csv.DictReader(io.StringIO(data.decode()))
        return {int(r["ILSVRC2012_ID"]): (r["WNID"], r["words"]) for r in rows}
    try:
        from scipy.io import loadmat
    except ImportError:
        raise LayoutError(
            f"{name} is a MATLAB file and reading it needs scipy, which is not installed. Either "
            f"`pip install scipy` into the environment, or put LOC_val_solution.csv (Kaggle) next to the "
            f"val images, or use foldered val/<wnid>/ images."
        ) from None
    synsets = loadmat(io.BytesIO(data), squeeze_me=True)["synsets"]
    # A struct array (ILSVRC2012_ID, WNID, words, gloss, num_children, ...), read by field name; the
    # leaves (the 1000 classes) have no children.
    return {int(s["ILSVRC2012_ID"]): (str(s["WNID"]), str(s["words"])) for s in synsets if int(s["num_children"]) == 0}


@dataclass
class Devkit:
    where: str
    truth: list[int]  # ILSVRC2012_ID of val image i+1
    meta: dict[int, tuple[str, str]]

    def labels(self) -> dict[str, str]:
        missing = sorted(set(self.truth) - set(self.meta))
        if missing:
            raise LayoutError(
                f"{self.where}: ground truth uses ILSVRC2012_IDs {missing[:5]} that the meta file does not map"
            )
        return {f"ILSVRC2012_val_{i:08d}": self.meta[t][0] for i, t in enumerate(self.truth, start=1)}


def _devkit_files(tgz: Path) -> dict[str, bytes]:
    """The ground truth and meta files inside the devkit .tar.gz, unpacked in memory up to
    LABEL_MAX_BYTES: a small .tar.gz can unpack to gigabytes (1 MB of gzip holds 1 GB of zeros)."""
    with gzip.open(tgz) as gz:
        data = _bounded(gz, str(tgz), "unpacked")
    files = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:", tarinfo=BoundedTarInfo) as tar:
            for info in tar:
                check_member(info, str(tgz))
                if info.isfile() and PurePosixPath(info.name).name in (GROUND_TRUTH, META_MAT, META_CSV):
                    files[PurePosixPath(info.name).name] = tar.extractfile(info).read()
    except HeaderTooLarge as err:
        raise refuse_header(err, str(tgz)) from None
    return files


def _any_file(paths: Iterable[Path]) -> Path | None:
    return _first(paths)


def find_devkit(dirs: list[Path], tgzs: list[Path], usable=_any_file) -> Devkit | None:
    """The devkit ground truth and its id map, from an extracted folder or read inside the .tar.gz.
    usable(paths): the first of paths that may be read (_Raw.file: only inside the raw root)."""
    for folder in dirs:
        if gt := usable([folder / GROUND_TRUTH]):
            meta = usable(folder / m for m in (META_MAT, META_CSV))
            if meta is None:
                raise LayoutError(f"{gt} has no meta.mat or meta.csv beside it to map ILSVRC2012_IDs to wnids")
            return Devkit(
                str(folder), [int(x) for x in read_label_file(gt).split()], parse_meta(read_label_file(meta), meta.name)
            )
    for tgz in filter(None, (usable([t]) for t in tgzs)):
        files = _devkit_files(tgz)
        meta_name = META_MAT if META_MAT in files else META_CSV
        if GROUND_TRUTH not in files or meta_name not in files:
            raise LayoutError(f"{tgz}: expected {GROUND_TRUTH} and meta.mat (or meta.csv) inside")
        return Devkit(str(tgz), [int(x) for x in files[GROUND_TRUTH].split()], parse_meta(files[meta_name], meta_name))
    return None


# ---------------------------------------------------------------- discovery


def _first(paths: Iterable[Path], test=Path.is_file) -> Path | None:
    return next((p for p in paths if test(p)), None)


def _has_class_dirs(folder: Path) -> bool:
    """A folder holding at least one visible, non-empty sub-folder: hidden ones (.ipynb_checkpoints,
    .git) and empty ones do not make a flat folder look foldered."""
    if not folder.is_dir():
        return False
    for entry in _scan(folder):
        if entry.is_dir() and not _hidden(entry.name) and any(not _hidden(e.name) for e in os.scandir(entry.path)):
            return True
    return False


def _has_files(folder: Path) -> bool:
    return folder.is_dir() and any(e.is_file() and not _hidden(e.name) for e in os.scandir(folder))


def _describe(folder: Path, raw: Path) -> str:
    """What a folder holds, for an error that says what was found instead of what was looked for."""
    if not folder.is_dir():
        return f"{_rel(folder, raw)}/ does not exist"
    entries = _scan(folder)
    dirs = [e for e in entries if e.is_dir()]
    hidden = sum(_hidden(e.name) for e in dirs)
    empty = sum(not _hidden(e.name) and not any(not _hidden(x.name) for x in os.scandir(e.path)) for e in dirs)
    return (
        f"{_rel(folder, raw)}/ holds {len(entries) - len(dirs)} files and {len(dirs)} folders "
        f"({hidden} hidden, {empty} empty; hidden and empty folders are not classes)"
    )


class _Raw:
    """Where things are under one raw root. Files found by a fixed name (the archives, label files,
    devkit) are used only when they resolve inside the raw root (or a split folder the user linked),
    or when the config's index.allow_outside_root names them: a dataset from elsewhere can hold a
    LOC_synset_mapping.txt linked to any file this user may read."""

    def __init__(self, raw: Path, allow_outside: Iterable[str] = ()):
        self.raw = raw
        nested_roots = [raw / "ILSVRC" / "Data" / "CLS-LOC", raw / TINY_ROOT]  # Kaggle's, Tiny-ImageNet's zip
        self.images = _first([*nested_roots, raw], lambda p: (p / "train").is_dir()) or raw
        self.archive_dirs = [raw, raw / "archives"]
        self.train_dir = self.images / "train" if _has_class_dirs(self.images / "train") else None
        self.val_folders = self.images / "val" if _has_class_dirs(self.images / "val") else None
        self.val_flat = _first([self.images / "val", self.images / "val_flat"], _has_files)
        tops = (self.images, self.train_dir, self.val_folders, self.val_flat)
        self.kinds = _Kinds(raw, [p for p in tops if p is not None])
        self.allowed = {os.path.realpath(p) for p in allow_outside}
        self.refused: list[str] = []  # fixed-name files not read, with the reason
        self._locate_fixed_names()
        self._devkit: Devkit | None | bool = False

    def _locate_fixed_names(self) -> None:
        raw, images, tiny_val = self.raw, self.images, self.images / "val"
        self.tiny_labels = self.file([tiny_val / TINY_VAL_LABELS])
        self.tiny_val = tiny_val / "images" if self.tiny_labels and _has_files(tiny_val / "images") else None
        self.tiny_wnids, self.tiny_words = self.file([images / TINY_WNIDS]), self.file([images / TINY_WORDS])
        self.train_tar = self.file(d / TRAIN_TAR for d in self.archive_dirs)
        self.val_tar = self.file(d / VAL_TAR for d in self.archive_dirs)
        label_dirs = [raw, images, raw / "archives"]
        self.kaggle_csv = self.file(d / KAGGLE_CSV for d in label_dirs)
        self.mapping = self.file(d / SYNSET_MAPPING for d in label_dirs)
        self.devkit_dirs = [raw / "devkit", raw / "devkit" / "data", raw / DEVKIT_DIR, raw / "archives" / DEVKIT_DIR]
        self.devkit_tgzs = [d / DEVKIT_TGZ for d in self.archive_dirs]

    def file(self, paths: Iterable[Path]) -> Path | None:
        """The first of paths that is a regular file we may read (see the class doc); one that
        resolves elsewhere is skipped and said in self.refused (its path, never its content)."""
        for path in paths:
            if not path.is_file():
                continue
            target = os.path.realpath(path)
            if self.kinds.inside(target) or target in self.allowed:
                return path
            why = (
                f"{self.rel(path)} resolves outside the raw root (to {target}): not read, a link that came with "
                f"a dataset could point at any file. If it is yours, list it in the config's index.allow_outside_root"
            )
            if why not in self.refused:
                self.refused.append(why)
        return None

    def devkit(self) -> Devkit | None:
        if self._devkit is False:
            self._devkit = find_devkit(self.devkit_dirs, self.devkit_tgzs, self.file)
        return self._devkit

    def rel(self, path: Path) -> str:
        return _rel(path, self.raw)


def link_rules(raw: Path) -> _Kinds:
    """The folders whose files the index admits through links, as _Kinds: the pack re-applies the
    rule to every source it opens (rectrain.data.rawfiles)."""
    return _Raw(Path(raw)).kinds


def _need(thing, what: str, layout: str, raw: Path, instead: str = ""):
    if not thing:
        found = f"; found instead: {instead}" if instead else ""
        if layout == "auto":  # the pipeline's case: the raw root is what the user can change
            raise LayoutError(f"no {what} under {raw}{found}. {ARRANGE}")
        raise LayoutError(
            f"--layout {layout}: no {what} under {raw}{found}. Run python -m rectrain.data.index with another "
            f"--layout (auto detects; or one of {', '.join(LAYOUTS[1:])}), or with --raw at a folder holding it."
        )
    return thing


def index_train_tar(r: _Raw, reader: SourceReader, found: Found) -> Rows:
    """Rows of the per-class tars inside the train archive. An empty per-class tar is an error: the
    official archive has none, so its class vanishing means a damaged download."""
    outer = r.rel(r.train_tar)
    rows, files, classes = Rows(), 0, 0
    for name, _, _ in reader.scan((outer,)):
        if not name.endswith(".tar") or any(c in name for c in UNNAMEABLE):
            found.unclassified.append((f"{outer}{SEP}{name}", "not a per-class <wnid>.tar"))
            files += 1
            continue
        wnid, members, before = PurePosixPath(name).stem, reader.scan((outer, name)), len(rows)
        classes, files = classes + 1, files + len(members)
        prefix = f"{outer}{SEP}{name}{SEP}"
        rows.group(prefix)
        for member, _, _ in members:
            if (reason := unclassifiable(member)) is not None:
                found.unclassified.append((prefix + member, reason))
            else:
                rows.add(member, wnid)
        if len(rows) == before:
            raise LayoutError(
                f"{outer}{SEP}{name} holds no images ({len(members)} members): class {wnid} would be missing "
                f"from training. The official archive has no empty class; re-download it (check its md5)."
            )
    found.archive_counts["train"] = (files, classes)
    return rows


def _val_labels(r: _Raw, prefer: str | None, layout: str) -> tuple[dict[str, str], str]:
    """(val stem -> wnid, description) from the Kaggle CSV or the devkit."""
    if prefer in (None, "kaggle") and r.kaggle_csv:
        return read_kaggle_solution(r.kaggle_csv), r.rel(r.kaggle_csv)
    if prefer in (None, "devkit") and (devkit := r.devkit()):
        return devkit.labels(), f"devkit ground truth ({os.path.relpath(devkit.where, r.raw)})"
    wanted = {
        "kaggle": KAGGLE_CSV,
        "devkit": f"{GROUND_TRUTH} (devkit/, {DEVKIT_DIR}/ or {DEVKIT_TGZ})",
        None: f"{KAGGLE_CSV} or devkit {GROUND_TRUTH}",
    }[prefer]
    return _need(None, f"val labels ({wanted})", layout, r.raw)


def _index_train(r: _Raw, layout: str, reader: SourceReader, found: Found) -> None:
    if layout == "archives" or (layout == "auto" and not r.train_dir and r.train_tar):
        _need(r.train_tar, TRAIN_TAR, layout, r.raw)
        found.train = index_train_tar(r, reader, found)
        found.detected["train"] = "archives"
        found.layout["train"] = f"{r.rel(r.train_tar)} (per-class tars, read in place)"
        return
    also = "" if layout != "auto" else f" or {TRAIN_TAR}"
    _need(r.train_dir, f"train/<wnid>/ folders{also}", layout, r.raw, _describe(r.images / "train", r.raw))
    found.train = walk_class_folders(r.train_dir, r.raw, found, r.kinds)
    found.detected["train"] = "folders"
    found.layout["train"] = f"{r.rel(r.train_dir)}/<wnid>/"


def _val_layout(r: _Raw, layout: str, absent: bool) -> str | None:
    """folders, flat or archives; None when there is no val at all and the config says it is absent."""
    if absent and not (r.val_folders or r.val_flat or r.val_tar):
        return None
    if layout != "auto":
        forced = {"folders": "folders", "flat-kaggle": "flat", "flat-devkit": "flat", "archives": "archives"}
        return forced.get(layout, "tiny")
    if r.tiny_val:  # before val/<wnid>/: Tiny-ImageNet's val/images/ is not a class
        return "tiny"
    if r.val_folders:
        return "folders"
    if r.val_flat and (r.kaggle_csv or r.devkit()):
        return "flat"
    if r.val_tar:
        return "archives"
    instead = _describe(r.images / "val", r.raw)
    if r.val_flat:
        instead = f"a flat {r.rel(r.val_flat)}/ but neither {KAGGLE_CSV} nor the devkit ground truth to label it"
    raise LayoutError(
        f"val: no val images under {r.raw}: expected val/<wnid>/, a flat val/ with {KAGGLE_CSV} or the "
        f"devkit ground truth, or {VAL_TAR}; found instead: {instead}. If this dataset has no val split on "
        f"purpose, set index: {{absent_splits: [val]}} in the config."
    )


def _index_flat_val(r: _Raw, folder: Path, truth: dict[str, str], how: str, found: Found) -> None:
    """found.val: the images directly in folder, labelled by truth (image stem -> wnid)."""
    names = []
    for entry in _scan(folder):
        kind, why = r.kinds.of(entry)
        path = Path(entry.path)
        if kind == "dir":
            found.unclassified += [(r.rel(p), "directory inside flat val") for p in _files_below(path)]
        elif kind == "other":
            found.unclassified.append((r.rel(path), why))
        else:
            names.append(entry.name)
    found.val = label_flat(r.rel(folder) + "/", names, truth, how, found, folder=folder)
    found.layout["val"] = f"{r.rel(folder)}/ labelled by {how}"


def _index_val(r: _Raw, layout: str, reader: SourceReader, found: Found, absent: bool) -> None:
    kind = _val_layout(r, layout, absent)
    found.detected["val"] = kind or "absent"
    if kind is None:
        found.layout["val"] = "absent (index.absent_splits in the config)"
    elif kind == "folders":
        _need(r.val_folders, "val/<wnid>/ folders", layout, r.raw, _describe(r.images / "val", r.raw))
        found.val = walk_class_folders(r.val_folders, r.raw, found, r.kinds)
        found.layout["val"] = f"{r.rel(r.val_folders)}/<wnid>/"
    elif kind == "flat":
        what = "flat val folder (val/ or val_flat/ holding ILSVRC2012_val_*.JPEG)"
        _need(r.val_flat, what, layout, r.raw, _describe(r.images / "val", r.raw))
        truth, how = _val_labels(r, {"flat-kaggle": "kaggle", "flat-devkit": "devkit"}.get(layout), layout)
        _index_flat_val(r, r.val_flat, truth, how, found)
    elif kind == "tiny":
        what = f"Tiny-ImageNet val (val/images/ beside val/{TINY_VAL_LABELS})"
        _need(r.tiny_val, what, layout, r.raw, _describe(r.images / "val", r.raw))
        _index_flat_val(r, r.tiny_val, read_tiny_annotations(r.tiny_labels), r.rel(r.tiny_labels), found)
    else:
        _need(r.val_tar, VAL_TAR, layout, r.raw)
        truth, how = _val_labels(r, None, layout)
        outer = r.rel(r.val_tar)
        names = [name for name, _, _ in reader.scan((outer,))]
        found.val = label_flat(f"{outer}{SEP}", names, truth, how, found)
        found.archive_counts["val"] = (len(names), 0)
        found.layout["val"] = f"{outer} (read in place) labelled by {how}"


def discover(
    raw_root: str | os.PathLike, layout: str = "auto", absent_splits: Iterable[str] = (), allow_outside=()
) -> Found:
    """Classify every file of the chosen (or detected) layout; see the module doc. absent_splits: splits
    the config says are missing on purpose (no error when they hold no images); allow_outside: paths of
    fixed-name files that may resolve outside the raw root (index.allow_outside_root)."""
    raw = Path(raw_root)
    if not raw.is_dir():
        raise LayoutError(
            f"raw root {raw} is not a directory: set raw: in the config to your ImageNet folder "
            f"(or null for the generated demo)"
        )
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown --layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    absent = set(absent_splits)
    r, found = _Raw(raw, allow_outside), Found()
    try:
        with SourceReader(raw) as reader:
            _index_train(r, layout, reader, found)
            found.spans["train"] = (0, len(found.unclassified))
            start = len(found.unclassified)
            _index_val(r, layout, reader, found, "val" in absent)
        missing = _keep_train_classes(found)
        found.spans["val"] = (start, len(found.unclassified))
        _check_not_empty(found, absent)
    except LayoutError as err:
        if r.refused:  # what was looked for may be one of them
            raise LayoutError(f"{err} Not read: {'; '.join(r.refused)}.") from None
        raise
    found.warnings += r.refused
    _check_classes(found, missing)
    if r.mapping:
        found.names = read_synset_mapping(r.mapping)
    elif r._devkit:
        found.names = {wnid: words for wnid, words in r._devkit.meta.values()}
    elif r.tiny_words:
        found.names = read_tiny_words(r.tiny_words, found.train.classes())
    if r.tiny_wnids:
        _check_tiny_wnids(r.tiny_wnids, found)
    return found


# ---------------------------------------------------------------- checks on what was found


def _keep_train_classes(found: Found) -> Counter:
    """Val rows of a wnid that is not a train class move to unclassified; returns those wnids' counts."""
    found.val, dropped = found.val.keep(found.train.classes())
    found.unclassified += [(source, f"wnid {wnid} is not one of the train classes") for source, wnid in dropped]
    return Counter(wnid for _, wnid in dropped)


def _check_not_empty(found: Found, absent: set[str]) -> None:
    """A split with no images is an error naming the split, the layout detected and what was there."""
    for split in SPLITS:
        if getattr(found, split) or split in absent:
            continue
        lo, hi = found.spans[split]
        reasons = Counter(reason for _, reason in found.unclassified[lo:hi])
        instead = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(3))
        instead = f"{instead} (e.g. {found.unclassified[lo][0]})" if instead else "no files at all"
        fix = (
            "train defines the classes, so it cannot be absent"
            if split == "train"
            else "if this dataset has no val split on purpose, set index: {absent_splits: [val]} in the config"
        )
        raise LayoutError(
            f"{split}: no images indexed. Layout detected: {found.detected[split]} ({found.layout[split]}). "
            f"Found instead: {instead}. {ARRANGE} {fix[0].upper()}{fix[1:]}."
        )


def _check_classes(found: Found, missing: Counter) -> None:
    """Whole-class evidence (an error with the official train archive, a warning with folders), then the
    once-only warnings: official counts, non-wnid class names, empty class folders."""
    if missing:
        text = (
            f"{sum(missing.values())} val images of {len(missing)} classes that train lacks "
            f"(e.g. {', '.join(sorted(missing)[:3])}) are listed in unclassified.tsv"
        )
        if found.detected["train"] == "archives":
            raise LayoutError(
                f"whole classes missing from {TRAIN_TAR}: {text}. The official train archive has every val "
                f"class, so it is incomplete or damaged: re-download it (check its md5)."
            )
        found.warnings.append(f"val: {text}; expected only when train is a subset made on purpose")
    for where, empty in found.empty_classes.items():
        found.warnings.append(
            f"{len(empty)} class folders in {where}/ hold no images and are not classes (e.g. {', '.join(empty[:3])})"
        )
    wnids = sorted(found.train.classes())
    if odd := [w for w in wnids if not WNID.fullmatch(w)]:
        found.warnings.append(
            f"{len(odd)} of {len(wnids)} train classes are not WordNet ids (n + 8 digits), e.g. "
            f"{', '.join(odd[:3])}: fine for a custom dataset; labels are the sorted class names"
        )
    if differ := _official_differences(found):
        found.warnings.append(
            f"counts differ from the official ILSVRC2012 archives: {'; '.join(differ)}. Expected for a subset "
            f"made on purpose; otherwise an archive is incomplete: check its md5 against the download page"
        )


def _official_differences(found: Found) -> list[str]:
    differ = []
    if "train" in found.archive_counts:
        files, classes = found.archive_counts["train"]
        if classes != OFFICIAL_COUNTS["classes"]:
            differ.append(f"{TRAIN_TAR} holds {classes:,} classes (official: {OFFICIAL_COUNTS['classes']:,})")
        if files != OFFICIAL_COUNTS["train"]:
            differ.append(f"{TRAIN_TAR} holds {files:,} train files (official: {OFFICIAL_COUNTS['train']:,})")
    if "val" in found.archive_counts and found.archive_counts["val"][0] != OFFICIAL_COUNTS["val"]:
        files = found.archive_counts["val"][0]
        differ.append(f"{VAL_TAR} holds {files:,} val files (official: {OFFICIAL_COUNTS['val']:,})")
    return differ


def take_subset(found: Found, classes, per_class: int | None, seed: int) -> subset.Kept | None:
    """Keep index.classes (resolved by rectrain.data.subset) and at most `per_class` train images of each,
    validation whole for them; None when neither is set.  After discovery, so every layout takes it alike."""
    wanted = subset.resolve(classes)
    if wanted is None and per_class is None:
        return None
    present = found.train.classes()
    before = (len(present), len(found.train), len(found.val))
    if wanted is not None:
        subset.check_classes(wanted, present)
    keep = set(wanted) if wanted is not None else present
    sources = subset.chosen_sources(found.train.select(keep), per_class, seed) if per_class else None
    found.train, found.val = found.train.select(keep, sources), found.val.select(keep)
    return subset.Kept(len(keep), before[0], len(found.train), before[1], len(found.val), before[2], per_class)


# ---------------------------------------------------------------- output


def printable(text: str) -> str:
    """The text with each byte of a non-UTF-8 file name (os.scandir's surrogate escapes) as \\xNN: the
    TSVs are UTF-8, which every reader (ours, pandas) decodes; such names are only ever unclassified
    (name_problem), so train, val and classes never need this."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _write_tsv(path: Path, header: list[str], rows: Iterable, quoting: int = csv.QUOTE_MINIMAL) -> None:
    """Rows streamed (train.tsv has 1.28 M). csv.writer quotes a field holding a double quote, a tab
    or a newline, which csv.reader and pandas.read_csv both undo."""
    with replacing(path, mode="w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, delimiter="\t", lineterminator="\n", quoting=quoting)
        writer.writerow(header)
        writer.writerows(rows)


def _write_unclassified(path: Path, unclassified: list[tuple[str, str]]) -> None:
    """The only table that can hold a tab, a line break or a non-UTF-8 name (shown as \\xNN). The
    minimal quoting leaves a carriage return bare when rows end in a newline, and both readers would
    end the row there: a table holding one is written with every field quoted."""
    rows = sorted((printable(source), printable(reason)) for source, reason in unclassified)
    bare_cr = any("\r" in source for source, _ in rows)
    _write_tsv(path, ["source", "reason"], rows, csv.QUOTE_ALL if bare_cr else csv.QUOTE_MINIMAL)


def write_index(found: Found, out: Path) -> dict:
    """Write the four TSVs; returns counts. discover() has already moved val rows of non-train classes."""
    wnids = sorted(found.train.classes())
    label = {wnid: i for i, wnid in enumerate(wnids)}
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        rows = getattr(found, split)
        _write_tsv(
            out / f"{split}.tsv",
            ["id", "source", "label", "wnid"],
            ((i, source, label[wnid], wnid) for i, (source, wnid) in enumerate(rows.sorted())),
        )
        counts[split] = len(rows)
    _write_tsv(out / "classes.tsv", ["label", "wnid", "name"], ((label[w], w, found.names.get(w, "")) for w in wnids))
    _write_unclassified(out / "unclassified.tsv", found.unclassified)
    counts.update(classes=len(wnids), unclassified=len(found.unclassified))
    return counts


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--raw", required=True, type=Path, help="raw ImageNet root")
    parser.add_argument("--out", required=True, type=Path, help="output folder (results/<dataset>/index)")
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="auto",
        help="force a layout (default: detect; by hand only, the pipeline always detects)",
    )


def _run(args: argparse.Namespace, index: settings.IndexSettings) -> None:
    allow = [expand_path(p, "index.allow_outside_root") for p in index.allow_outside_root]
    found = discover(args.raw, args.layout, index.absent_splits, allow)
    kept = take_subset(found, index.classes, index.per_class, index.seed)
    for split, how in found.layout.items():
        log.info("%s: %s", split, how)
    for note in found.notes:
        log.info("%s", note)
    for warning in found.warnings:
        log.warning("warning: %s", warning)
    counts = write_index(found, args.out)
    if kept:
        log.info("index.classes %s, index.per_class %s: %s", _shown(index.classes), index.per_class, kept.text())
    reasons = Counter(reason for _, reason in found.unclassified)
    log.info(
        "train %d images, val %d images, %d classes, %d unclassified -> %s",
        counts["train"],
        counts["val"],
        counts["classes"],
        counts["unclassified"],
        args.out,
    )
    for reason, n in reasons.most_common(5):
        log.info("  unclassified: %d x %s", n, reason)


def _shown(classes) -> str:
    """index.classes for the log line: a list by its length, a name or path as given."""
    return f"[{len(classes)} names]" if isinstance(classes, list) else str(classes)


def main(argv: list[str] | None = None) -> int:
    errors = {LayoutError: 1, UnsafeArchiveMember: 1, CorruptArchive: 1, subset.SubsetError: 1}
    return cli.main("index", "index", _arguments, _run, argv, errors=errors, config_required=False)


if __name__ == "__main__":
    cli.end(main())
