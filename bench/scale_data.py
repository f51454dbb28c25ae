"""An ImageNet-shaped raw tree at any size, fast: N tiny JPEGs in 1000 wnid-named classes.

    .venv/bin/python bench/scale_data.py --images 100000 --out /tmp/rectrain_scale/100000 [--layouts folders archives]

Writes, under --out (never inside the repo: 1.28 M files are ~5 GB):
    folders/train/<wnid>/<wnid>_<n>.JPEG            the extracted-folder layout (raw root: folders/)
    folders/val/<wnid>/ILSVRC2012_val_XXXXXXXX.JPEG
    archives/ILSVRC2012_img_train.tar               one <wnid>.tar per class, like the official download
    archives/ILSVRC2012_img_val.tar                 flat val JPEGs                   (raw root: archives/)
    archives/ILSVRC2012_devkit_t12.tar.gz           ground truth + meta.csv, written by the demo's helper
    archives/LOC_synset_mapping.txt
    .done-<layout>                                  written last per layout, with the counts

Every image is one of a small pool of distinct tiny JPEGs (16-40 px, a few hundred bytes), made
unique by a JPEG comment segment carrying its number, so no two files have the same bytes while
the whole tree costs one write per file. Val has ImageNet's val/train ratio (50,000 / 1,281,167),
at least one image per class. Class names and wnids come from the demo (rectrain.data.demo).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import struct
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from rectrain.data import demo  # noqa: E402
from rectrain.data.archives import KAGGLE_CSV, OFFICIAL_COUNTS, TRAIN_TAR, VAL_TAR  # noqa: E402

CLASSES = OFFICIAL_COUNTS["classes"]
VAL_SHARE = OFFICIAL_COUNTS["val"] / OFFICIAL_COUNTS["train"]
LAYOUTS = ("folders", "archives")
POOL = 64


def jpeg_pool(size: int = POOL, seed: int = 0) -> list[bytes]:
    """`size` distinct tiny JPEGs: noise blocks of 16-40 px, quality 75 (~300-900 bytes each)."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(size):
        w, h = (int(v) for v in rng.integers(16, 41, size=2))
        coarse = rng.integers(0, 256, size=(max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((w, h), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=75)
        pool.append(buf.getvalue())
    return pool


def unique(jpeg: bytes, number: int) -> bytes:
    """The JPEG with a comment segment (COM, 0xFFFE) after SOI naming `number`: distinct bytes, same pixels."""
    text = b"rectrain scale %d" % number
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">H", len(text) + 2) + text + jpeg[2:]


def per_class_counts(n: int, classes: int = CLASSES) -> list[int]:
    """n images over the classes as evenly as possible (the first n % classes classes get one more)."""
    base, extra = divmod(n, classes)
    return [base + (k < extra) for k in range(classes)]


def val_count(n: int, classes: int = CLASSES) -> int:
    return max(classes, round(n * VAL_SHARE))


class _Images:
    """Image bytes number i: pool entry i % pool size, made unique by its number."""

    def __init__(self, seed: int):
        self.pool = jpeg_pool(seed=seed)

    def __call__(self, i: int) -> bytes:
        return unique(self.pool[i % len(self.pool)], i)


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def train_names(wnid: str, count: int) -> list[str]:
    return [f"{wnid}_{n}.JPEG" for n in range(1, count + 1)]


def write_folders(root: Path, classes: list, counts: list[int], val: dict, images: _Images) -> None:
    """root/train/<wnid>/ and root/val/<wnid>/."""
    number = 0
    for (wnid, _), count in zip(classes, counts, strict=True):
        folder = root / "train" / wnid
        folder.mkdir(parents=True, exist_ok=True)
        for name in train_names(wnid, count):
            _write_file(f"{folder}/{name}", images(number))
            number += 1
    for wnid, _ in classes:
        (root / "val" / wnid).mkdir(parents=True, exist_ok=True)
    for i, k in enumerate(val["labels"], start=1):
        _write_file(f"{root}/val/{classes[k][0]}/ILSVRC2012_val_{i:08d}.JPEG", images(number))
        number += 1


def write_archives(root: Path, classes: list, counts: list[int], val: dict, images: _Images) -> None:
    """root/ILSVRC2012_img_train.tar (a tar of per-class tars) and root/ILSVRC2012_img_val.tar."""
    root.mkdir(parents=True, exist_ok=True)
    number = 0
    with tarfile.open(root / TRAIN_TAR, mode="w", format=tarfile.USTAR_FORMAT) as outer:
        for (wnid, _), count in zip(classes, counts, strict=True):
            files = []
            for name in train_names(wnid, count):
                files.append((name, images(number)))
                number += 1
            demo.tar_member(outer, f"{wnid}.tar", demo.tar_bytes(files))
    with tarfile.open(root / VAL_TAR, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, _ in enumerate(val["labels"], start=1):
            demo.tar_member(tar, f"ILSVRC2012_val_{i:08d}.JPEG", images(number))
            number += 1


def val_plan(n_val: int, classes: list, seed: int) -> dict:
    """Val labels (every class at least once, interleaved) and the label-file rows demo writes from them."""
    labels = np.resize(np.arange(len(classes)), n_val)
    np.random.default_rng([seed, 3]).shuffle(labels)
    ilsvrc_id = np.random.default_rng([seed, 4]).permutation(len(classes)) + 1
    stems = [f"ILSVRC2012_val_{i:08d}" for i in range(1, n_val + 1)]
    solution = [(stem, f"{classes[k][0]} 0 0 1 1 ") for stem, k in zip(stems, labels.tolist(), strict=True)]
    truth = [int(ilsvrc_id[k]) for k in labels.tolist()]
    return {"labels": labels.tolist(), "label_files": (labels, solution, truth, ilsvrc_id)}


def write_label_files(root: Path, classes: list, val: dict) -> None:
    """The devkit (.tar.gz with ground truth and meta.csv) and the synset mapping in root, by the demo's
    own writer; the Kaggle CSV it also writes is removed so val is labelled from the devkit, as with the
    official download. (The writer puts the archive copies in <dir>/archives, hence the staging dir.)"""
    stage = root.parent / f".{root.name}_labels"
    shutil.rmtree(stage, ignore_errors=True)
    demo._write_label_files(stage, classes, val["label_files"])
    for item in (stage / "archives").iterdir():
        if item.name != KAGGLE_CSV:
            shutil.move(str(item), root / item.name)
    shutil.rmtree(stage)


def generate(n: int, out: Path, layouts=LAYOUTS, seed: int = 0) -> dict:
    """Write the requested layouts of an n-image train set (and its val) under out; returns counts and
    seconds per layout. A layout whose .done marker matches is kept, not rewritten."""
    classes, counts = demo.class_list(CLASSES), per_class_counts(n)
    val = val_plan(val_count(n), classes, seed)
    summary = {"train": n, "val": len(val["labels"]), "classes": CLASSES, "seed": seed}
    images, seconds = _Images(seed), {}
    for layout in layouts:
        root, done = out / layout, out / f".done-{layout}"
        if done.is_file() and root.is_dir() and json.loads(done.read_text()) == summary:
            continue
        done.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        t0 = time.perf_counter()
        if layout == "folders":
            write_folders(root, classes, counts, val, images)
        else:
            write_archives(root, classes, counts, val, images)
            write_label_files(root, classes, val)
        seconds[layout] = time.perf_counter() - t0
        done.write_text(json.dumps(summary))
    return {**summary, "seconds": seconds}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, required=True, help="train images (ImageNet: 1281167)")
    ap.add_argument("--out", type=Path, required=True, help="where to write (outside the repo)")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(json.dumps(generate(args.images, args.out.resolve(), args.layouts, args.seed)))


if __name__ == "__main__":
    main()
