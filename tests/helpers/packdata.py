"""Tiny raw datasets for the pack tests: clean JPEGs of every kind plus each defect, with an index."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from helpers.views import view
from rectrain.data import demo
from rectrain.data.images import read_jpeg_header

# A 4-class demo of 3 + 2 small images per class, without planted defects: the index tests' raw root.
TINY_DEMO = {
    "classes": 4,
    "train_per_class": 3,
    "val_per_class": 2,
    "min_size": 24,
    "max_size": 40,
    "quality": 80,
    "seed": 7,
    "bad_files": False,
}
TINY_WNIDS = [wnid for wnid, _ in demo.class_list(TINY_DEMO["classes"])]


def tiny_demo_raw(tmp_path_factory, name: str) -> Path:
    """TINY_DEMO generated under a fresh temporary folder `name`; its raw root."""
    out = tmp_path_factory.mktemp(name) / "raw"
    demo.generate(view("demo", TINY_DEMO), out)
    return out


REPO = Path(__file__).resolve().parents[2]


def photo(w: int, h: int, seed: int) -> Image.Image:
    """A smooth gradient with noise: compresses like a photo, and orientation is visible."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 127 // max(w + h - 2, 1)], -1)
    noise = rng.integers(0, 24, size=(h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def jpeg(img: Image.Image, quality: int = 90, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality, **kw)
    return buf.getvalue()


def kinds(seed: int = 0) -> dict[str, bytes]:
    """Content for each case the packer must handle, keyed by kind: a clean baseline JPEG and the
    demo's planted defects, made by the demo's own generator."""
    img = photo(120, 90, seed)
    return {"baseline": jpeg(img), **{kind: demo.defect_bytes(kind, img, 90) for kind, _, _ in demo.DEFECTS}}


# kind -> what the packer does: keep (byte for byte), repair or skip, as the demo's defects.json says
EXPECTED = {"baseline": "keep", **{kind: action for kind, action, _ in demo.DEFECTS}}


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def with_jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """The JPEG with its frame header (SOF) claiming another size: a decompression bomb's header."""
    info = read_jpeg_header(data)
    sof = data.index(bytes([0xFF, info.sof]))
    return data[: sof + 5] + height.to_bytes(2, "big") + width.to_bytes(2, "big") + data[sof + 9 :]


def corrupt_scan(data: bytes) -> bytes:
    """Zeros over a stretch of the entropy-coded data; the end-of-image marker stays intact."""
    start = data.index(b"\xff\xda") + 200
    return data[:start] + b"\x00" * 200 + data[start + 200 :]


def postscript() -> bytes:
    """A valid EPS file: Pillow's EPS plugin would open it and run Ghostscript to render it."""
    return (
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 48\n%%EndComments\n"
        b"newpath 0 0 moveto 64 48 lineto stroke showpage\n%%EOF\n"
    )


def gray16_png(width: int = 64, height: int = 48) -> bytes:
    """A 16-bit grayscale ramp over the full range: clipped to 8 bits, all of it but the first
    256 levels would be white."""
    ramp = np.linspace(0, 65535, width * height).reshape(height, width).astype(np.uint16)
    return png_bytes(Image.fromarray(ramp))


def transparent_png(width: int = 64, height: int = 48) -> bytes:
    """Left half opaque red; right half fully transparent over hidden bright green."""
    rgba = np.zeros((height, width, 4), np.uint8)
    rgba[:, : width // 2] = (255, 0, 0, 255)
    rgba[:, width // 2 :] = (0, 255, 0, 0)
    return png_bytes(Image.fromarray(rgba))


def animated_gif(frames: int = 3) -> bytes:
    colours = [(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 0)]
    images = [Image.new("RGB", (32, 24), colours[i % len(colours)]) for i in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, "GIF", save_all=True, append_images=images[1:], duration=100, loop=0)
    return buf.getvalue()


def write_dataset(root: Path, files: list[tuple[str, int, bytes]], classes: int) -> tuple[Path, Path]:
    """Write raw files and an index like rectrain.data.index does; files = (source, label, bytes).
    An archive member (`a.tar::m`) is only indexed: the caller writes the archive.
    Returns (raw_root, index_dir)."""
    raw, index = root / "raw", root / "index"
    index.mkdir(parents=True, exist_ok=True)
    written = {}
    for source, _, data in files:
        if source not in written and "::" not in source:
            path = raw / source
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            written[source] = True
    wnids = [f"n{k:08d}" for k in range(classes)]
    with open(index / "train.tsv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(["id", "source", "label", "wnid"])
        for i, (source, label, _) in enumerate(files):
            w.writerow([i, source, label, wnids[label]])
    with open(index / "classes.tsv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(["label", "wnid", "name"])
        for k, wnid in enumerate(wnids):
            w.writerow([k, wnid, f"class {k}"])
    return raw, index


def kinds_dataset(root: Path) -> tuple[Path, Path, dict[int, str]]:
    """One file per kind, plus clean fillers so the shuffle is visible; returns (raw, index, id->kind)."""
    files, kind_of = [], {}
    for kind, data in kinds().items():
        kind_of[len(files)] = kind
        files.append((f"train/c{len(files) % 3}/{kind}.JPEG", len(files) % 3, data))
    for n in range(12):
        files.append((f"train/c{n % 3}/clean_{n}.JPEG", n % 3, jpeg(photo(64 + n, 48 + n, 100 + n))))
    raw, index = write_dataset(root, files, classes=3)
    return raw, index, kind_of


def pack_args(raw: Path, index: Path, out: Path, cfg_json: str = "{}", threads: int = 1, split: str = "train"):
    """The pack command line's arguments as the rule passes them; outputs under out/fast and out/pack."""
    return [
        "--config-json",
        cfg_json,
        "--index",
        str(index),
        "--raw",
        str(raw),
        "--split",
        split,
        "--rec",
        str(out / "fast" / f"{split}.rec"),
        "--idx",
        str(out / "fast" / f"{split}.idx"),
        "--manifest",
        str(out / "pack" / f"{split}.manifest.json"),
        "--threads",
        str(threads),
    ]


def run_pack(
    raw: Path,
    index: Path,
    out: Path,
    cfg: dict | None = None,
    threads: int = 2,
    env: dict | None = None,
    split: str = "train",
    **popen,
) -> subprocess.CompletedProcess:
    """`python -m rectrain.data.pack` as the rule runs it; outputs under out/. These datasets plant a
    few unreadable files among a dozen or so, far above a real dataset's share: the skip limit is
    raised unless a test sets it."""
    cfg = {"resize": 0, "quality": 90, "shuffle_seed": 0, "max_skipped_share": 0.5, **(cfg or {})}
    cmd = [sys.executable, "-m", "rectrain.data.pack", *pack_args(raw, index, out, json.dumps(cfg), threads, split)]
    full_env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"), **(env or {}))
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, **{"timeout": 300, **popen})


def fake_sysfs(root: Path, path: Path, rotational: bool, partition: bool = True) -> Path:
    """A sysfs tree in which ``path``'s st_dev is a partition of disk 'sdz' with the given rotational."""
    st = os.stat(path)
    disk = root / "devices" / "pci0000:00" / "block" / "sdz"
    (disk / "queue").mkdir(parents=True, exist_ok=True)
    (disk / "queue" / "rotational").write_text("1\n" if rotational else "0\n")
    target = disk
    if partition:
        target = disk / "sdz1"
        target.mkdir(exist_ok=True)
        (target / "partition").write_text("1\n")
    link = root / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))
    return root
