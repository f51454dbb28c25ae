"""Generate the embedded demo ImageNet: a small, deterministic, ImageNet-shaped dataset.

The same images are written in every layout a real user has, so the indexer can be shown to give
the same rows for each of them:

    train/<wnid>/<wnid>_<n>.JPEG                       extracted train
    val/<wnid>/ILSVRC2012_val_XXXXXXXX.JPEG            foldered val
    val_flat/ILSVRC2012_val_XXXXXXXX.JPEG              flat val (labels below)
    LOC_val_solution.csv, LOC_synset_mapping.txt       Kaggle label files
    devkit/ILSVRC2012_validation_ground_truth.txt      devkit ground truth (1-based ILSVRC2012_ID per line)
    devkit/meta.csv                                    ILSVRC2012_ID,WNID,words (the devkit keeps this in
                                                       meta.mat, a MATLAB file; the indexer reads either)
    archives/ILSVRC2012_img_train.tar                  one <wnid>.tar per class, like the official download
    archives/ILSVRC2012_img_val.tar                    flat val JPEGs
    archives/ILSVRC2012_devkit_t12.tar.gz              ILSVRC2012_devkit_t12/data/{ground truth, meta.csv}
    archives/LOC_val_solution.csv, archives/LOC_synset_mapping.txt
    defects.json                                       the planted bad files and what the packer must do
    .done                                              written last: the rule's output

Every class is a colour palette plus a texture drawn at a random phase, angle jitter and scale,
with a blob of a third colour and pixel noise: a small CNN learns it in a few CPU epochs at 64 px
after random-resized-crop and flip, so end-to-end accuracy proves the labels stayed aligned.

Determinism: each image has its own RNG seeded by (seed, split, class, number); PIL's JPEG encoder
is deterministic for fixed settings; tar headers carry no time, owner or mode from the machine.
"""

from __future__ import annotations

import argparse
import colorsys
import csv
import gzip
import io
import json
import logging
import math
import shutil
import tarfile
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

import numpy as np
from PIL import Image

from rectrain import cli, settings
from rectrain.data.archives import (
    DEVKIT_DIR,
    DEVKIT_TGZ,
    GROUND_TRUTH,
    KAGGLE_CSV,
    META_CSV,
    SYNSET_MAPPING,
    TRAIN_TAR,
    VAL_TAR,
)

# Named, not __name__: run as `python -m`, this module is __main__, outside the configured "rectrain" logger.
log = logging.getLogger("rectrain.data.demo")

# The first ImageNet-1k classes (sorted wnids, as in LOC_synset_mapping.txt), so the demo looks
# like the real thing; further classes get synthetic wnids that sort after every real one.
REAL_CLASSES = [
    ("n01440764", "tench, Tinca tinca"),
    ("n01443537", "goldfish, Carassius auratus"),
    ("n01484850", "great white shark, white shark, man-eater, man-eating shark, Carcharodon carcharias"),
    ("n01491361", "tiger shark, Galeocerdo cuvieri"),
    ("n01494475", "hammerhead, hammerhead shark"),
    ("n01496331", "electric ray, crampfish, numbfish, torpedo"),
    ("n01498041", "stingray"),
    ("n01514668", "cock"),
    ("n01514859", "hen"),
    ("n01518878", "ostrich, Struthio camelus"),
    ("n01530575", "brambling, Fringilla montifringilla"),
    ("n01531178", "goldfinch, Carduelis carduelis"),
    ("n01532829", "house finch, linnet, Carpodacus mexicanus"),
    ("n01534433", "junco, snowbird"),
    ("n01537544", "indigo bunting, indigo finch, indigo bird, Passerina cyanea"),
    ("n01558993", "robin, American robin, Turdus migratorius"),
    ("n01560419", "bulbul"),
    ("n01580077", "jay"),
    ("n01582220", "magpie"),
    ("n01592084", "chickadee"),
]

# ImageNet photos are mostly landscape 4:3, some portrait and square.
ASPECTS = (4 / 3, 4 / 3, 4 / 3, 3 / 2, 1.0, 3 / 4, 2 / 3, 16 / 9)
PATTERNS = ("stripes", "checker", "rings", "dots")
SPLIT_TRAIN, SPLIT_VAL = 1, 2
# Top-level entries this generator owns; removed before a run so stale files never survive.
OWNED = (
    "train",
    "val",
    "val_flat",
    "devkit",
    "archives",
    KAGGLE_CSV,
    SYNSET_MAPPING,
    "defects.json",
    ".done",
)

# Planted defects: (kind, expected packer action, why). Order fixes which class gets which.
# Actions: repair (decode, fix, re-encode), skip (listed, not packed), keep (stored byte for byte).
DEFECTS = (
    ("cmyk", "repair", "CMYK JPEG (22 in real ImageNet train, e.g. n01739381_1309.JPEG): convert to RGB"),
    ("png", "repair", "PNG named .JPEG (real: n02105855_2933.JPEG): re-encode as JPEG"),
    ("grayscale", "keep", "single-channel JPEG: valid as is (decoders output it as RGB)"),
    ("truncated", "skip", "JPEG cut off half-way: cannot be decoded completely"),
    ("zero_byte", "skip", "empty file"),
    ("not_image", "skip", "text file named .JPEG"),
    ("exif_rotated", "repair", "EXIF orientation 6: apply the rotation, drop the tag"),
    ("progressive", "keep", "progressive JPEG: valid as is (GPU decoders fall back to the CPU for it)"),
)
STRAY_NAME = "Thumbs.db"  # a file real users' class folders carry; the indexer must list, not pack it


@dataclass(frozen=True)
class ClassStyle:
    bg: tuple[float, float, float]
    fg: tuple[float, float, float]
    blob: tuple[float, float, float]
    pattern: str
    angle: float  # radians
    period: float  # texture period as a fraction of the shorter side


def class_list(n: int) -> list[tuple[str, str]]:
    """(wnid, name) for n classes, sorted by wnid."""
    synthetic = [(f"n9{k:07d}", f"synthetic class {k}") for k in range(n - len(REAL_CLASSES))]
    return (REAL_CLASSES + synthetic)[:n]


def _rgb(h: float, s: float, v: float) -> tuple[float, float, float]:
    return tuple(255.0 * c for c in colorsys.hsv_to_rgb(h % 1.0, s, v))


def class_style(seed: int, k: int, n_classes: int) -> ClassStyle:
    """Hues are spread evenly around the wheel so palettes stay apart; pattern/angle add shape cues."""
    rng = np.random.default_rng([seed, 0, k])
    hue = (k + rng.uniform(-0.15, 0.15)) / n_classes
    return ClassStyle(
        bg=_rgb(hue + 0.5 + rng.uniform(-0.08, 0.08), rng.uniform(0.25, 0.5), rng.uniform(0.35, 0.6)),
        fg=_rgb(hue, rng.uniform(0.75, 1.0), rng.uniform(0.8, 1.0)),
        blob=_rgb(hue + 0.25, rng.uniform(0.6, 0.9), rng.uniform(0.5, 0.9)),
        pattern=PATTERNS[k % len(PATTERNS)],
        angle=(k * 0.61803 * math.pi + rng.uniform(-0.2, 0.2)) % math.pi,
        period=rng.uniform(0.12, 0.3),
    )


def image_size(rng: np.random.Generator, min_size: int, max_size: int) -> tuple[int, int]:
    """(width, height): shorter side >= min_size, longer side <= max_size, ImageNet-like aspect."""
    aspect = ASPECTS[rng.integers(len(ASPECTS))]
    longer = int(rng.integers(min_size, max_size + 1))
    shorter = max(min_size, min(longer, round(longer / max(aspect, 1 / aspect))))
    return (longer, shorter) if aspect >= 1 else (shorter, longer)


def draw(style: ClassStyle, rng: np.random.Generator, size: tuple[int, int]) -> tuple[Image.Image, tuple]:
    """One RGB image of the class and the blob's bounding box (x1, y1, x2, y2)."""
    w, h = size
    short = min(w, h)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    # Scale and phase jitter keep the texture recognisable under random-resized-crop, not memorisable.
    period = style.period * short * rng.uniform(0.75, 1.33)
    angle = style.angle + rng.uniform(-0.15, 0.15)
    u = (x * math.cos(angle) + y * math.sin(angle)) / period + rng.uniform(0, 1)
    v = (-x * math.sin(angle) + y * math.cos(angle)) / period + rng.uniform(0, 1)
    if style.pattern == "stripes":
        mask = 0.5 + 0.5 * np.sin(2 * math.pi * u)
    elif style.pattern == "checker":
        mask = ((np.floor(u) + np.floor(v)) % 2).astype(np.float32)
    elif style.pattern == "rings":
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        mask = 0.5 + 0.5 * np.sin(2 * math.pi * np.hypot(x - cx, y - cy) / period)
    else:  # dots
        mask = ((u % 1 - 0.5) ** 2 + (v % 1 - 0.5) ** 2 < 0.09).astype(np.float32)
    mask = mask[..., None]
    bright = rng.uniform(0.85, 1.15)
    img = (np.array(style.bg) * (1 - mask) + np.array(style.fg) * mask) * bright
    # The blob: an ellipse at a random place and scale, like an object on a background.
    rx, ry = short * rng.uniform(0.12, 0.3), short * rng.uniform(0.12, 0.3)
    cx, cy = rng.uniform(rx, w - rx), rng.uniform(ry, h - ry)
    inside = ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 <= 1.0
    img[inside] = np.array(style.blob) * bright
    img += rng.normal(0.0, 10.0, img.shape)
    pixels = np.clip(img, 0, 255).astype(np.uint8)
    box = (int(cx - rx), int(cy - ry), int(math.ceil(cx + rx)), int(math.ceil(cy + ry)))
    return Image.fromarray(pixels), box


def jpeg_bytes(img: Image.Image, quality: int, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, **kwargs)
    return buf.getvalue()


def defect_bytes(kind: str, img: Image.Image, quality: int) -> bytes:
    """The planted defect's file content, built from a normal image of the class."""
    if kind == "cmyk":
        return jpeg_bytes(img.convert("CMYK"), quality)
    if kind == "png":
        buf = io.BytesIO()
        img.save(buf, "PNG")
        return buf.getvalue()
    if kind == "grayscale":
        return jpeg_bytes(img.convert("L"), quality)
    if kind == "truncated":
        data = jpeg_bytes(img, quality)
        return data[: len(data) // 2]
    if kind == "zero_byte":
        return b""
    if kind == "not_image":
        return b"This is not an image. It is a text file that somebody saved with a .JPEG name.\n"
    if kind == "exif_rotated":
        # Orientation 6 = "rotate 90 degrees clockwise to display": store the pixels rotated the other way.
        exif = Image.Exif()
        exif[0x0112] = 6
        return jpeg_bytes(img.transpose(Image.Transpose.ROTATE_90), quality, exif=exif.tobytes())
    if kind == "progressive":
        return jpeg_bytes(img, quality, progressive=True)
    raise ValueError(f"unknown defect kind {kind!r}")


def tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add a regular file whose header depends only on name and size (no time, owner or mode)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def tar_bytes(files: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files:
            tar_member(tar, name, data)
    return buf.getvalue()


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def check_config(demo) -> None:
    """demo.min_size <= demo.max_size; SystemExit naming both keys otherwise."""
    if demo.min_size > demo.max_size:
        raise SystemExit(
            f"demo config: demo.min_size ({demo.min_size}) is larger than demo.max_size "
            f"({demo.max_size}); make min_size <= max_size"
        )


def _clear_owned(out: Path) -> None:
    """Remove what a previous generation wrote, so a rerun never mixes two seeds."""
    out.mkdir(parents=True, exist_ok=True)
    for name in OWNED:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


class _InProcess(Executor):
    """map() in this process: one drawing process needs no pool (and tests stay single-process)."""

    def map(self, fn, *iterables, timeout=None, chunksize=1):
        return map(fn, *iterables)


@dataclass
class _Painter:
    """Draws image n of class k in a split, deterministically from the seed of the demo block's view
    (a declared class, rectrain.settings: the drawing processes receive it pickled as it is)."""

    demo: settings.DemoSettings

    @classmethod
    def of(cls, demo: settings.DemoSettings) -> _Painter:
        return cls(demo)

    def __post_init__(self):
        n = self.demo.classes
        self.classes = class_list(n)
        self.styles = [class_style(self.demo.seed, k, n) for k in range(n)]

    def draw(self, split: int, k: int, n: int) -> tuple[Image.Image, tuple]:
        rng = np.random.default_rng([self.demo.seed, split, k, n])
        return draw(self.styles[k], rng, image_size(rng, self.demo.min_size, self.demo.max_size))

    def jpeg(self, split: int, k: int, n: int) -> bytes:
        return jpeg_bytes(self.draw(split, k, n)[0], self.demo.quality)


def _defects_by_class(n_classes: int, bad_files: bool) -> dict[int, list[int]]:
    """Defects go to distinct classes spread over the class list (round-robin when there are fewer)."""
    by_class: dict[int, list[int]] = {}
    if bad_files:
        for i in range(len(DEFECTS)):
            k = i * n_classes // len(DEFECTS) if n_classes >= len(DEFECTS) else i % n_classes
            by_class.setdefault(k, []).append(i)
    return by_class


def _defect_entry(kind: str, action: str, why: str, wnid: str, name: str) -> dict:
    return {
        "kind": kind,
        "expected": action,
        "why": why,
        "wnid": wnid,
        "source": f"train/{wnid}/{name}",
        "archive_source": f"archives/{TRAIN_TAR}::{wnid}.tar::{name}",
    }


def _class_files(painter: _Painter, k: int, defects: list[int]) -> tuple[list[tuple[str, bytes]], list[dict]]:
    """(name, bytes) of one train class - its images, its planted defects, and (class 0) the stray file -
    and the defects' manifest entries."""
    wnid, manifest = painter.classes[k][0], []
    files = [(f"{wnid}_{n}.JPEG", painter.jpeg(SPLIT_TRAIN, k, n)) for n in range(1, painter.demo.train_per_class + 1)]
    for j, i in enumerate(defects):
        kind, action, why = DEFECTS[i]
        n = painter.demo.train_per_class + 1 + j
        name = f"{wnid}_{n}.JPEG"
        files.append((name, defect_bytes(kind, painter.draw(SPLIT_TRAIN, k, n)[0], painter.demo.quality)))
        manifest.append(_defect_entry(kind, action, why, wnid, name))
    if painter.demo.bad_files and k == 0:
        files.append((STRAY_NAME, b"\x00" * 64))
        why = "not an image extension: the indexer lists it in unclassified.tsv"
        manifest.append(_defect_entry("stray", "unclassified", why, wnid, STRAY_NAME))
    return sorted(files), manifest


def _val_image(painter: _Painter, i: int, k: int) -> tuple[bytes, tuple]:
    img, box = painter.draw(SPLIT_VAL, k, i)
    return jpeg_bytes(img, painter.demo.quality), box


def _write_train(painter: _Painter, out: Path, manifest: list, pool: Executor) -> int:
    """train/<wnid>/ folders and the official-style tar of per-class tars; returns the file count.
    Classes are drawn in parallel (each image has its own RNG) and written in class order."""
    n_train, n_classes = 0, painter.demo.classes
    defects = _defects_by_class(n_classes, painter.demo.bad_files)
    jobs = pool.map(_class_files, repeat(painter), range(n_classes), (defects.get(k, []) for k in range(n_classes)))
    with tarfile.open(out / "archives" / TRAIN_TAR, mode="w", format=tarfile.USTAR_FORMAT) as train_tar:
        for k, ((wnid, _), (files, planted)) in enumerate(zip(painter.classes, jobs, strict=True)):
            manifest.extend(planted)
            for name, data in files:
                write(out / "train" / wnid / name, data)
            tar_member(train_tar, f"{wnid}.tar", tar_bytes(files))
            n_train += len(files)
            log.info("train %d/%d %s: %d files", k + 1, n_classes, wnid, len(files))
    return n_train


def _write_val(painter: _Painter, out: Path, pool: Executor) -> tuple[np.ndarray, list, list, np.ndarray]:
    """val/<wnid>/, val_flat/ and the val tar; returns (labels, Kaggle rows, devkit truth, ILSVRC ids)."""
    seed, n_classes = painter.demo.seed, painter.demo.classes
    # Val: classes interleaved in a fixed random order, numbered 1..N like ILSVRC2012_val_XXXXXXXX.
    val_labels = np.repeat(np.arange(n_classes), painter.demo.val_per_class)
    np.random.default_rng([seed, 3]).shuffle(val_labels)
    # ILSVRC2012_IDs are a permutation of 1..C that differs from wnid order, as in the real devkit.
    ilsvrc_id = np.random.default_rng([seed, 4]).permutation(n_classes) + 1
    solution, truth = [], []
    labels = val_labels.tolist()
    images = pool.map(_val_image, repeat(painter), range(1, len(labels) + 1), labels, chunksize=16)
    with tarfile.open(out / "archives" / VAL_TAR, mode="w", format=tarfile.USTAR_FORMAT) as val_tar:
        for i, (k, (data, (x1, y1, x2, y2))) in enumerate(zip(labels, images, strict=True), start=1):
            wnid = painter.classes[k][0]
            stem = f"ILSVRC2012_val_{i:08d}"
            write(out / "val" / wnid / f"{stem}.JPEG", data)
            write(out / "val_flat" / f"{stem}.JPEG", data)
            tar_member(val_tar, f"{stem}.JPEG", data)
            solution.append((stem, f"{wnid} {x1} {y1} {x2} {y2} "))
            truth.append(int(ilsvrc_id[k]))
    log.info("val: %d images", len(val_labels))
    return val_labels, solution, truth, ilsvrc_id


def _write_label_files(out: Path, classes: list, val: tuple) -> None:
    """Kaggle's CSV and synset mapping, the devkit's ground truth and meta (plain and as .tar.gz)."""
    _, solution, truth, ilsvrc_id = val
    solution_csv = "ImageId,PredictionString\n" + "".join(f"{a},{b}\n" for a, b in solution)
    mapping_txt = "".join(f"{wnid} {name}\n" for wnid, name in classes)
    truth_txt = "".join(f"{t}\n" for t in truth)
    meta = io.StringIO()
    writer = csv.writer(meta, lineterminator="\n")
    writer.writerow(["ILSVRC2012_ID", "WNID", "words"])
    for k in np.argsort(ilsvrc_id).tolist():
        writer.writerow([int(ilsvrc_id[k]), *classes[k]])
    for folder in (out, out / "archives"):
        write(folder / KAGGLE_CSV, solution_csv.encode())
        write(folder / SYNSET_MAPPING, mapping_txt.encode())
    write(out / "devkit" / GROUND_TRUTH, truth_txt.encode())
    write(out / "devkit" / META_CSV, meta.getvalue().encode())
    devkit = tar_bytes(
        [(f"{DEVKIT_DIR}/{GROUND_TRUTH}", truth_txt.encode()), (f"{DEVKIT_DIR}/{META_CSV}", meta.getvalue().encode())]
    )
    with (
        open(out / "archives" / DEVKIT_TGZ, "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
    ):
        gz.write(devkit)


def generate(demo, out: Path, processes: int = 1) -> dict:
    """Write the whole demo tree under out (demo: the demo block's view, rectrain.settings) with
    `processes` drawing processes; returns a summary.  .done is written last.  The files are the same
    whatever the number of processes."""
    check_config(demo)
    _clear_owned(out)
    (out / "archives").mkdir()
    painter, manifest = _Painter.of(demo), []
    with ProcessPoolExecutor(processes) if processes > 1 else _InProcess() as pool:
        n_train = _write_train(painter, out, manifest, pool)
        val = _write_val(painter, out, pool)
    _write_label_files(out, painter.classes, val)
    defects = {"seed": demo.seed, "defects": manifest}
    write(out / "defects.json", (json.dumps(defects, indent=2) + "\n").encode())
    summary = {
        "classes": demo.classes,
        "train_files": n_train,
        "val_images": int(len(val[0])),
        "defects": len(manifest),
    }
    write(out / ".done", (json.dumps(summary, sort_keys=True) + "\n").encode())
    log.info("done: %s", summary)
    return summary


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="raw root to write (results/demo/raw)")
    parser.add_argument("--threads", type=int, default=1, help="drawing processes (the rule's threads)")


def _run(args: argparse.Namespace, demo: settings.DemoSettings) -> None:
    generate(demo, args.out, processes=args.threads)


def main(argv: list[str] | None = None) -> int:
    return cli.main("demo", "demo", _arguments, _run, argv)


if __name__ == "__main__":
    cli.end(main())
