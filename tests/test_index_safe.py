"""Untrusted raw datasets (issue 26): what a dataset plants cannot make the index recurse without
limit, read files outside the raw root by a fixed name, hang on a tar header or exhaust memory."""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from helpers.packdata import TINY_DEMO, TINY_WNIDS, tiny_demo_raw

from rectrain import log
from rectrain.data import index
from rectrain.data.archives import DEVKIT_TGZ, TRAIN_TAR, UnsafeArchiveMember
from rectrain.data.demo import tar_bytes
from rectrain.data.index import LayoutError, discover

CFG = TINY_DEMO
WNIDS = TINY_WNIDS
DEPTH = 1200  # deeper than Python's default recursion limit (1000)


@pytest.fixture(scope="module")
def demo_raw(tmp_path_factory):
    return tiny_demo_raw(tmp_path_factory, "safe")


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


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(index.__file__).parents[2]))
    cmd = [sys.executable, "-m", "rectrain.data.index", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


SECRET = "hunter2-private-token"


def test_a_linked_synset_mapping_outside_the_root_is_not_read_and_its_content_appears_nowhere(demo_raw, tmp_path):
    root = foldered(demo_raw, tmp_path / "raw")
    secret = tmp_path / "secrets.txt"
    secret.write_text(f"{WNIDS[0]} {SECRET}\n")
    (root / "LOC_synset_mapping.txt").symlink_to(secret)
    out = tmp_path / "index"
    proc = run_cli("--raw", str(root), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"LOC_synset_mapping.txt resolves outside the raw root (to {secret}): not read" in proc.stderr
    assert "index.allow_outside_root" in proc.stderr
    for written in [proc.stderr, proc.stdout, *(f.read_text() for f in out.iterdir())]:
        assert SECRET not in written
    # the user's own link, named in the config, is read
    allowed = run_cli(
        "--raw", str(root), "--out", str(out), "--config-json", json.dumps({"allow_outside_root": [str(secret)]})
    )
    assert allowed.returncode == 0, allowed.stderr
    assert SECRET in (out / "classes.tsv").read_text() and "not read" not in allowed.stderr


def test_a_linked_train_archive_outside_the_root_is_refused_with_the_reason(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with tarfile.open(elsewhere / TRAIN_TAR, "w") as tar:
        data = tar_bytes([(f"{WNIDS[0]}_1.JPEG", b"x")])
        info = tarfile.TarInfo(f"{WNIDS[0]}.tar")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    root = tmp_path / "raw"
    root.mkdir()
    (root / TRAIN_TAR).symlink_to(elsewhere / TRAIN_TAR)
    with pytest.raises(LayoutError, match=f"Not read: {TRAIN_TAR} resolves outside the raw root"):
        discover(root)
    found = discover(root, absent_splits=["val"], allow_outside=[str(root / TRAIN_TAR)])
    assert list(found.train) == [(f"{TRAIN_TAR}::{WNIDS[0]}.tar::{WNIDS[0]}_1.JPEG", WNIDS[0])]


def train_tar_with_pax(path: Path, digits: int) -> None:
    """The train archive, its one member carrying a pax header whose value is `digits` digits long."""
    inner = tar_bytes([(f"{WNIDS[0]}_1.JPEG", b"x")])
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(f"{WNIDS[0]}.tar")
        info.size, info.pax_headers = len(inner), {"comment": "7" * digits}
        tar.addfile(info, io.BytesIO(inner))


@pytest.mark.parametrize("digits", [50_000, 100_000])  # under and over the header's size bound
def test_a_pax_header_of_many_digits_is_refused_in_well_under_a_second(tmp_path, digits):
    # CVE-2024-6232: Python 3.11.7 (this venv) parses such a header in quadratic time: tarfile alone
    # took 7.2 s at 50k digits and 26 s at 100k on this (shared, loaded) machine.
    root = tmp_path / "raw"
    root.mkdir()
    train_tar_with_pax(root / TRAIN_TAR, digits)
    start = time.perf_counter()
    with pytest.raises(UnsafeArchiveMember, match=f"refusing {TRAIN_TAR}: it holds a pax extended header"):
        discover(root, absent_splits=["val"])
    assert time.perf_counter() - start < 0.5


def test_a_short_pax_header_is_read(tmp_path):
    root = tmp_path / "raw"
    root.mkdir()
    train_tar_with_pax(root / TRAIN_TAR, 20)
    assert len(discover(root, absent_splits=["val"]).train) == 1


BOMB_BYTES = 512 << 20


def devkit_bomb(demo_raw: Path, root: Path) -> None:
    """Train folders, a flat val, and a devkit .tar.gz (2.3 MB at gzip level 1) whose meta.csv unpacks to
    512 MiB of zeros."""
    root.mkdir()
    shutil.copytree(demo_raw / "train", root / "train")
    shutil.copytree(demo_raw / "val_flat", root / "val")

    class Zeros(io.RawIOBase):
        def __init__(self):
            self.left = BOMB_BYTES

        def readinto(self, buf):
            n = min(len(buf), self.left)
            buf[:n] = bytes(n)
            self.left -= n
            return n

    with tarfile.open(root / DEVKIT_TGZ, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("ILSVRC2012_devkit_t12/data/meta.csv")
        info.size = BOMB_BYTES
        tar.addfile(info, Zeros())


def test_a_devkit_that_unpacks_to_512_mib_is_refused_with_index_peak_memory_under_200_mib(demo_raw, tmp_path):
    root = tmp_path / "raw"
    devkit_bomb(demo_raw, root)
    assert (root / DEVKIT_TGZ).stat().st_size < 4 << 20  # 2.3 MB
    # VmHWM, the peak of this process's own memory: ru_maxrss can carry the forking pytest's over exec
    code = (
        "import re\n"
        "from rectrain.data.index import discover, LayoutError\n"
        "try:\n"
        f"    discover({str(root)!r})\n"
        "except LayoutError as err:\n"
        "    print(err)\n"
        "print('peak_kib', re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(index.__file__).parents[2]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"{DEVKIT_TGZ} holds over 64 MiB unpacked: not read" in proc.stdout
    peak_mib = int(proc.stdout.rsplit("peak_kib", 1)[1]) / 1024
    print(f"index peak with a {BOMB_BYTES >> 20} MiB devkit member: {peak_mib:.0f} MiB")
    assert peak_mib < 200


def test_terminal_escape_codes_in_a_class_name_are_escaped_in_the_index_log(demo_raw, tmp_path):
    root = foldered(demo_raw, tmp_path / "raw")
    evil = "cls\x1b[2J\x1b]0;owned\x07\x08\u202eend"  # clear screen, window title, backspace, RTL override
    (root / "train" / WNIDS[0]).rename(root / "train" / evil)
    proc = run_cli("--raw", str(root), "--out", str(tmp_path / "index"))
    assert proc.returncode == 0, proc.stderr
    assert "cls\\x1b[2J\\x1b]0;owned\\x07\\x08\\u202eend" in proc.stderr  # the not-a-WordNet-id warning names it
    assert not any(c in proc.stderr for c in "\x1b\x07\x08\u202e")


def test_a_logged_name_with_a_line_break_or_odd_bytes_cannot_forge_a_log_line(capsys):
    logger = log.setup("pack")
    logger.warning("skipped %s: %s", Path("a.JPEG\n[pack] all images verified\udcff"), "not an image")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[pack] skipped a.JPEG\\n[pack] all images verified\\xff: not an image"]
