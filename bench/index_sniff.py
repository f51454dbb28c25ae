"""What reading each file's first bytes would add to the index (bench/RESULTS.md, "Index: content sniffing").

    .venv/bin/python bench/index_sniff.py --images 4000 --work /tmp/sniff

Writes --images small JPEGs into 40 class folders twice: once named .JPEG (the index takes them by
their extension, unread) and once named .dat (the index reads the first 12 bytes of each to recognise
it). Times rectrain.data.index.discover on both, from the page cache, and again after
posix_fadvise(DONTNEED) on every file so the first bytes come from the disk (the directory entries
and inodes stay cached: a lower bound on a cold run).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from PIL import Image  # noqa: E402

from rectrain.data.index import discover  # noqa: E402


def write_tree(root: Path, images: int, ext: str) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 120, 200)).save(buf, "JPEG")
    for split, n in (("train", images), ("val", 40)):
        for i in range(n):
            folder = root / split / f"c{i % 40:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"img_{i}{ext}").write_bytes(buf.getvalue())


def drop_cache(root: Path) -> None:
    os.sync()
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def timed(root: Path, cold: bool) -> float:
    if cold:
        drop_cache(root)
    start = time.perf_counter()
    found = discover(root)
    assert len(found.train) > 0
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--work", type=Path, default=Path("/tmp/rectrain-sniff"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    for ext in (".JPEG", ".dat"):
        write_tree(args.work / ext.lstrip("."), args.images, ext)
    for cold in (False, True):
        for ext in (".JPEG", ".dat"):
            root = args.work / ext.lstrip(".")
            times = [timed(root, cold) for _ in range(args.repeats)]
            per = min(times) / (args.images + 40) * 1e6
            print(
                f"{'disk' if cold else 'page cache'} {ext:5s}: {', '.join(f'{t:.3f}' for t in times)} s ({per:.1f} us/file)"
            )
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
