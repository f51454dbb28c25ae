"""Index a raw ImageNet: which file (or tar member) is which class.

Layouts understood (SPEC section 2), relative to the raw root (or to ILSVRC/Data/CLS-LOC, Kaggle's):
  folders      train/<wnid>/*.JPEG + val/<wnid>/*.JPEG
  flat-kaggle  train/<wnid>/*.JPEG + flat val (val/ or val_flat/) labelled by LOC_val_solution.csv
  flat-devkit  train/<wnid>/*.JPEG + flat val labelled by the devkit's ILSVRC2012_validation_ground_truth.txt
               with the ILSVRC2012_ID -> wnid map from meta.mat (needs scipy) or meta.csv
               (ILSVRC2012_ID,WNID,words; what the demo writes), found in devkit/,
               ILSVRC2012_devkit_t12/data/ or inside ILSVRC2012_devkit_t12.tar.gz
  archives     ILSVRC2012_img_train.tar (a tar of per-class tars) + ILSVRC2012_img_val.tar, in the raw
               root or its archives/ folder, read in place: never extracted. Val labels from
               LOC_val_solution.csv, else the devkit.
"auto" takes train folders over the train archive, and for val: foldered, then Kaggle CSV, then devkit.

Outputs (tab-separated, header row): train.tsv and val.tsv (id, source, label, wnid; ids 0..N-1 in
sorted(source) order), classes.tsv (label, wnid, name; labels = sorted train wnids, as
`im2rec --recursive` numbers them), unclassified.tsv (source, reason). A source is a path relative to
the raw root, or `archive.tar::member`, or `outer.tar::inner.tar::member`.

The indexer only classifies; bad image content is the packer's job. Files it cannot classify (not an
image extension, outside any class folder, no ground truth) are listed in unclassified.tsv.
Tar member names are never used as filesystem paths; a member that is absolute, climbs with `..`,
is a link or a device is refused with an error naming the archive and the member.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import re
import sys
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator

from rectrain.data.archives import SEP, UNNAMEABLE, SourceReader, UnsafeArchiveMember, check_member

IMAGE_EXTS = (".jpeg", ".jpg", ".png")  # im2rec's default --exts
TRAIN_TAR, VAL_TAR = "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar"
DEVKIT_TGZ = "ILSVRC2012_devkit_t12.tar.gz"
GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
KAGGLE_CSV, SYNSET_MAPPING = "LOC_val_solution.csv", "LOC_synset_mapping.txt"
VAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})$")
LAYOUTS = ("auto", "folders", "flat-kaggle", "flat-devkit", "archives")


class LayoutError(Exception):
    """The raw root does not hold a layout we can index (the message says what was looked for)."""


@dataclass
class Found:
    """What discovery saw: (source, wnid) rows per split, unclassified (source, reason), class names."""

    train: list[tuple[str, str]] = field(default_factory=list)
    val: list[tuple[str, str]] = field(default_factory=list)
    unclassified: list[tuple[str, str]] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)
    layout: dict[str, str] = field(default_factory=dict)


def log(msg: str) -> None:
    print(f"[index] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- classification helpers


def unclassifiable(name: str) -> str | None:
    """Why a file name cannot be an index row, or None."""
    if any(c in name for c in UNNAMEABLE):
        return "name contains a tab, newline or '::'"
    if PurePosixPath(name).name.startswith("."):
        return "hidden file (e.g. macOS ._ metadata)"
    suffix = PurePosixPath(name).suffix.lower()
    if suffix not in IMAGE_EXTS:
        return f"not an image extension ({suffix or 'none'}; accepted: {', '.join(IMAGE_EXTS)})"
    return None


def _rel(path: Path, raw: Path) -> str:
    return path.relative_to(raw).as_posix()


def _files_below(folder: Path) -> Iterator[Path]:
    for dirpath, _, files in os.walk(folder):
        for name in sorted(files):
            yield Path(dirpath) / name


def walk_class_folders(top: Path, raw: Path, found: Found) -> list[tuple[str, str]]:
    """(source, wnid) for images in top/<wnid>/; everything else goes to found.unclassified."""
    rows = []
    for entry in sorted(os.scandir(top), key=lambda e: e.name):
        path = Path(entry.path)
        if not entry.is_dir():
            found.unclassified.append((_rel(path, raw), "outside any class directory"))
            continue
        if entry.name.startswith(".") or any(c in entry.name for c in UNNAMEABLE):
            found.unclassified += [(_rel(p, raw), "hidden or unnameable class directory") for p in _files_below(path)]
            continue
        for sub in sorted(os.scandir(path), key=lambda e: e.name):
            sub_path = Path(sub.path)
            if sub.is_dir():
                found.unclassified += [
                    (_rel(p, raw), f"nested below class directory {entry.name}") for p in _files_below(sub_path)
                ]
            elif (reason := unclassifiable(sub.name)) is not None:
                found.unclassified.append((_rel(sub_path, raw), reason))
            else:
                rows.append((_rel(sub_path, raw), entry.name))
    return rows


def label_flat(items: Iterable[tuple[str, str]], truth: dict[str, str], how: str, found: Found) -> list:
    """items: (source, file name); truth: val stem -> wnid. Unlabelled or odd files are listed."""
    rows = []
    for source, name in items:
        if (reason := unclassifiable(name)) is not None:
            found.unclassified.append((source, reason))
        elif (wnid := truth.get(PurePosixPath(name).stem)) is None:
            found.unclassified.append((source, f"no ground truth for this image in {how}"))
        else:
            rows.append((source, wnid))
    return rows


# ---------------------------------------------------------------- label files


def read_kaggle_solution(path: Path) -> dict[str, str]:
    """LOC_val_solution.csv: ImageId -> wnid (first token of PredictionString)."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        if not reader.fieldnames or not {"ImageId", "PredictionString"} <= set(reader.fieldnames):
            raise LayoutError(f"{path}: expected the Kaggle header 'ImageId,PredictionString', got {reader.fieldnames}")
        return {row["ImageId"]: row["PredictionString"].split()[0] for row in reader if row["PredictionString"].strip()}


def read_synset_mapping(path: Path) -> dict[str, str]:
    """LOC_synset_mapping.txt: 'wnid readable name' per line."""
    names = {}
    for line in path.read_text().splitlines():
        wnid, _, name = line.strip().partition(" ")
        if wnid:
            names[wnid] = name.strip()
    return names


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
    # Fields: ILSVRC2012_ID, WNID, words, gloss, num_children, ...; leaves (the 1000 classes) have no children.
    return {int(s[0]): (str(s[1]), str(s[2])) for s in synsets if int(s[4]) == 0}


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


def find_devkit(dirs: list[Path], tgzs: list[Path]) -> Devkit | None:
    """The devkit ground truth and its id map, from an extracted folder or read inside the .tar.gz."""
    for folder in dirs:
        gt = folder / GROUND_TRUTH
        if gt.is_file():
            meta = next((folder / m for m in ("meta.mat", "meta.csv") if (folder / m).is_file()), None)
            if meta is None:
                raise LayoutError(f"{gt} has no meta.mat or meta.csv beside it to map ILSVRC2012_IDs to wnids")
            return Devkit(
                str(folder), [int(x) for x in gt.read_text().split()], parse_meta(meta.read_bytes(), meta.name)
            )
    for tgz in tgzs:
        if not tgz.is_file():
            continue
        with tarfile.open(tgz, mode="r:gz") as tar:
            files = {}
            for info in tar:
                check_member(info, str(tgz))
                if info.isfile() and PurePosixPath(info.name).name in (GROUND_TRUTH, "meta.mat", "meta.csv"):
                    files[PurePosixPath(info.name).name] = tar.extractfile(info).read()
        meta_name = "meta.mat" if "meta.mat" in files else "meta.csv"
        if GROUND_TRUTH not in files or meta_name not in files:
            raise LayoutError(f"{tgz}: expected {GROUND_TRUTH} and meta.mat (or meta.csv) inside")
        return Devkit(str(tgz), [int(x) for x in files[GROUND_TRUTH].split()], parse_meta(files[meta_name], meta_name))
    return None


# ---------------------------------------------------------------- discovery


def _first(paths: Iterable[Path], test=Path.is_file) -> Path | None:
    return next((p for p in paths if test(p)), None)


def _has_subdirs(folder: Path) -> bool:
    return folder.is_dir() and any(e.is_dir() for e in os.scandir(folder))


def _has_files(folder: Path) -> bool:
    return folder.is_dir() and any(e.is_file() for e in os.scandir(folder))


class _Raw:
    """Where things are under one raw root."""

    def __init__(self, raw: Path):
        self.raw = raw
        kaggle_root = raw / "ILSVRC" / "Data" / "CLS-LOC"
        self.images = kaggle_root if (kaggle_root / "train").is_dir() else raw
        self.archive_dirs = [raw, raw / "archives"]
        self.train_dir = self.images / "train" if _has_subdirs(self.images / "train") else None
        self.val_folders = self.images / "val" if _has_subdirs(self.images / "val") else None
        self.val_flat = _first([self.images / "val", self.images / "val_flat"], _has_files)
        self.train_tar = _first(d / TRAIN_TAR for d in self.archive_dirs)
        self.val_tar = _first(d / VAL_TAR for d in self.archive_dirs)
        label_dirs = [raw, self.images, raw / "archives"]
        self.kaggle_csv = _first(d / KAGGLE_CSV for d in label_dirs)
        self.mapping = _first(d / SYNSET_MAPPING for d in label_dirs)
        self.devkit_dirs = [
            raw / "devkit",
            raw / "devkit" / "data",
            raw / "ILSVRC2012_devkit_t12" / "data",
            raw / "archives" / "ILSVRC2012_devkit_t12" / "data",
        ]
        self.devkit_tgzs = [d / DEVKIT_TGZ for d in self.archive_dirs]
        self._devkit: Devkit | None | bool = False

    def devkit(self) -> Devkit | None:
        if self._devkit is False:
            self._devkit = find_devkit(self.devkit_dirs, self.devkit_tgzs)
        return self._devkit

    def rel(self, path: Path) -> str:
        return _rel(path, self.raw)


def _need(thing, what: str, layout: str, raw: Path):
    if not thing:
        raise LayoutError(
            f"--layout {layout}: no {what} under {raw}. Choose another --layout (or auto), or point "
            f"the config's raw: at a folder holding it."
        )
    return thing


def index_train_tar(r: _Raw, reader: SourceReader, found: Found) -> list[tuple[str, str]]:
    outer = r.rel(r.train_tar)
    rows = []
    for name, _, _ in reader.scan((outer,)):
        if not name.endswith(".tar") or any(c in name for c in UNNAMEABLE):
            found.unclassified.append((f"{outer}{SEP}{name}", "not a per-class <wnid>.tar"))
            continue
        wnid = PurePosixPath(name).stem
        for member, _, _ in reader.scan((outer, name)):
            source = f"{outer}{SEP}{name}{SEP}{member}"
            if (reason := unclassifiable(PurePosixPath(member).name)) is not None:
                found.unclassified.append((source, reason))
            else:
                rows.append((source, wnid))
    return rows


def _val_labels(r: _Raw, prefer: str | None, layout: str) -> tuple[dict[str, str], str]:
    """(val stem -> wnid, description) from the Kaggle CSV or the devkit."""
    if prefer in (None, "kaggle") and r.kaggle_csv:
        return read_kaggle_solution(r.kaggle_csv), r.rel(r.kaggle_csv)
    if prefer in (None, "devkit") and (devkit := r.devkit()):
        return devkit.labels(), f"devkit ground truth ({os.path.relpath(devkit.where, r.raw)})"
    wanted = {
        "kaggle": KAGGLE_CSV,
        "devkit": f"{GROUND_TRUTH} (devkit/, ILSVRC2012_devkit_t12/data/ or {DEVKIT_TGZ})",
        None: f"{KAGGLE_CSV} or devkit {GROUND_TRUTH}",
    }[prefer]
    return _need(None, f"val labels ({wanted})", layout, r.raw)


def discover(raw_root: str | os.PathLike, layout: str = "auto") -> Found:
    """Classify every file of the chosen (or detected) layout; see the module doc."""
    raw = Path(raw_root)
    if not raw.is_dir():
        raise LayoutError(
            f"raw root {raw} is not a directory: set raw: in the config to your ImageNet folder "
            f"(or null for the generated demo)"
        )
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown --layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    r, found = _Raw(raw), Found()
    reader = SourceReader(raw)

    # Train.
    if layout == "archives" or (layout == "auto" and not r.train_dir and r.train_tar):
        _need(r.train_tar, TRAIN_TAR, layout, raw)
        found.train = index_train_tar(r, reader, found)
        found.layout["train"] = f"{r.rel(r.train_tar)} (per-class tars, read in place)"
    else:
        _need(r.train_dir, "train/<wnid>/ folders" + ("" if layout != "auto" else f" or {TRAIN_TAR}"), layout, raw)
        found.train = walk_class_folders(r.train_dir, raw, found)
        found.layout["train"] = f"{r.rel(r.train_dir)}/<wnid>/"

    # Val: foldered, then flat + Kaggle CSV, then flat + devkit, then the val archive.
    if layout == "auto":
        if r.val_folders:
            layout_val = "folders"
        elif r.val_flat and (r.kaggle_csv or r.devkit()):
            layout_val = "flat"
        elif r.val_tar:
            layout_val = "archives"
        else:
            raise LayoutError(
                f"no val images under {raw}: expected val/<wnid>/, a flat val/ with {KAGGLE_CSV} or "
                f"the devkit ground truth, or {VAL_TAR}"
            )
    else:
        layout_val = {"folders": "folders", "flat-kaggle": "flat", "flat-devkit": "flat", "archives": "archives"}[
            layout
        ]
    prefer = {"flat-kaggle": "kaggle", "flat-devkit": "devkit"}.get(layout)

    if layout_val == "folders":
        _need(r.val_folders, "val/<wnid>/ folders", layout, raw)
        found.val = walk_class_folders(r.val_folders, raw, found)
        found.layout["val"] = f"{r.rel(r.val_folders)}/<wnid>/"
    elif layout_val == "flat":
        _need(r.val_flat, "flat val folder (val/ or val_flat/ holding ILSVRC2012_val_*.JPEG)", layout, raw)
        truth, how = _val_labels(r, prefer, layout)
        items = []
        for entry in sorted(os.scandir(r.val_flat), key=lambda e: e.name):
            if entry.is_dir():
                found.unclassified += [(r.rel(p), "directory inside flat val") for p in _files_below(Path(entry.path))]
            else:
                items.append((r.rel(Path(entry.path)), entry.name))
        found.val = label_flat(items, truth, how, found)
        found.layout["val"] = f"{r.rel(r.val_flat)}/ labelled by {how}"
    else:
        _need(r.val_tar, VAL_TAR, layout, raw)
        truth, how = _val_labels(r, None, layout)
        outer = r.rel(r.val_tar)
        items = [(f"{outer}{SEP}{name}", PurePosixPath(name).name) for name, _, _ in reader.scan((outer,))]
        found.val = label_flat(items, truth, how, found)
        found.layout["val"] = f"{outer} (read in place) labelled by {how}"
    reader.close()

    if not found.train:
        raise LayoutError(
            f"no train images found ({found.layout['train']}); see unclassified files: {found.unclassified[:3]}"
        )
    if r.mapping:
        found.names = read_synset_mapping(r.mapping)
    elif r._devkit:
        found.names = {wnid: words for wnid, words in r._devkit.meta.values()}
    return found


# ---------------------------------------------------------------- output


def _write_tsv(path: Path, header: list[str], rows: Iterable) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh, delimiter="\t", lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


def write_index(found: Found, out: Path) -> dict:
    """Write the four TSVs; returns counts. Val images of a wnid that is not a train class are unclassified."""
    wnids = sorted({wnid for _, wnid in found.train})
    label = {wnid: i for i, wnid in enumerate(wnids)}
    unclassified = list(found.unclassified)
    val = []
    for source, wnid in found.val:
        if wnid in label:
            val.append((source, wnid))
        else:
            unclassified.append((source, f"wnid {wnid} is not one of the train classes"))
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, rows in (("train", found.train), ("val", val)):
        rows = sorted(rows)
        _write_tsv(
            out / f"{split}.tsv",
            ["id", "source", "label", "wnid"],
            ((i, source, label[wnid], wnid) for i, (source, wnid) in enumerate(rows)),
        )
        counts[split] = len(rows)
    _write_tsv(out / "classes.tsv", ["label", "wnid", "name"], ((label[w], w, found.names.get(w, "")) for w in wnids))
    _write_tsv(out / "unclassified.tsv", ["source", "reason"], sorted(unclassified))
    counts.update(classes=len(wnids), unclassified=len(unclassified))
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Index a raw ImageNet (folders, flat val or the official tars).")
    parser.add_argument("--raw", required=True, type=Path, help="raw ImageNet root")
    parser.add_argument("--out", required=True, type=Path, help="output folder (results/<dataset>/index)")
    parser.add_argument("--layout", choices=LAYOUTS, default="auto", help="force a layout (default: detect)")
    args = parser.parse_args(argv)
    try:
        found = discover(args.raw, args.layout)
    except (LayoutError, UnsafeArchiveMember) as exc:
        raise SystemExit(f"index: {exc}") from None
    for split, how in found.layout.items():
        log(f"{split}: {how}")
    counts = write_index(found, args.out)
    reasons = Counter(reason for _, reason in found.unclassified)
    log(
        f"train {counts['train']} images, val {counts['val']} images, {counts['classes']} classes, "
        f"{counts['unclassified']} unclassified -> {args.out}"
    )
    for reason, n in reasons.most_common(5):
        log(f"  unclassified: {n} x {reason}")


if __name__ == "__main__":
    main()
