"""Untrusted raw datasets (issue 26): what a dataset plants cannot make the index recurse without
limit, read files outside the raw root by a fixed name, hang on a tar header or exhaust memory."""

import os
import shutil
from pathlib import Path

import pytest

from rectrain.data import demo
from rectrain.data.index import discover

CFG = {
    "classes": 4,
    "train_per_class": 3,
    "val_per_class": 2,
    "min_size": 24,
    "max_size": 40,
    "quality": 80,
    "seed": 7,
    "bad_files": False,
}
WNIDS = [wnid for wnid, _ in demo.class_list(4)]
DEPTH = 1200  # deeper than Python's default recursion limit (1000)


@pytest.fixture(scope="module")
def demo_raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("safe") / "raw"
    demo.generate(CFG, out)
    return out


def foldered(demo_raw: Path, root: Path) -> Path:
    root.mkdir()
    shutil.copytree(demo_raw / "train", root / "train")
    shutil.copytree(demo_raw / "val", root / "val")
    return root


def deep_folder(top: Path, depth: int) -> Path:
    """top/d/d/.../d (depth levels), made one level at a time from an open descriptor: a path of
    thousands of characters need not fit any one system call."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            fd, old = os.open("d", os.O_RDONLY, dir_fd=fd), fd
            os.close(old)
    finally:
        os.close(fd)
    return top / "/".join(["d"] * depth)


def remove_deep(top: Path, depth: int) -> None:
    """shutil.rmtree recurses once per level; remove the chain from the bottom up instead."""
    for level in range(depth, 0, -1):
        folder = top / "/".join(["d"] * level)
        for entry in os.scandir(folder):
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(entry.path)
        os.rmdir(folder)


def test_a_folder_1200_levels_deep_is_indexed_without_recursion_error(demo_raw, tmp_path):
    root = foldered(demo_raw, tmp_path / "raw")
    image = root / f"train/{WNIDS[0]}/{WNIDS[0]}_1.JPEG"
    in_class = root / f"train/{WNIDS[0]}"
    hidden = root / f"train/{WNIDS[1]}/.cache"
    try:
        shutil.copy(image, deep_folder(in_class, DEPTH) / "deep.JPEG")
        shutil.copy(image, deep_folder(hidden, DEPTH) / "deep.JPEG")
        found = discover(root)
        deep = "/".join(["d"] * DEPTH)
        assert (f"train/{WNIDS[0]}/{deep}/deep.JPEG", WNIDS[0]) in found.train
        listed = dict(found.unclassified)
        assert listed[f"train/{WNIDS[1]}/.cache/{deep}/deep.JPEG"] == f"hidden folder below class directory {WNIDS[1]}"
    finally:
        remove_deep(in_class, DEPTH)
        remove_deep(hidden, DEPTH)
