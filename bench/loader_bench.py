"""Loader benchmark: images/s of the training loaders, side by side, on the same cores and JPEGs.

    python bench/loader_bench.py [--images 800] [--cores N] [--image-size 224] [--rounds 2]

Generates ImageNet-like JPEGs (~500x375, ~110 KB), writes them both as an ImageFolder tree and as a
.rec/.idx (bytes passed through, as `pack.resize: 0` does), then measures steady-state train-mode
throughput (random-resized-crop + flip + normalise) of
  dali         rectrain's DALI loader from the .rec (CPU decode here; the default train.loader)
  torch        rectrain's pure-PyTorch loader from the .rec
  imagefolder  torchvision ImageFolder + DataLoader on the raw folders (the classic recipe)
  ceiling      PIL decode + RandomResizedCrop in `cores` processes, no batching, no tensors
Each loader gets `cores` decode threads/workers.  Besides wall-clock img/s the table gives images per
CPU-second (this process plus its finished worker processes, os.times()): on a machine shared with
other jobs that measure of cost per image is far steadier than wall time.  Rounds interleave the loaders (order reversed every
other round) so a noisy machine slows all of them alike; the table gives each loader's median img/s
and the median over rounds of the within-round ratios to the ceiling and to ImageFolder.
Steady state: the first pass over the data (start-up, page cache) is not timed, and each timed pass
starts its clock at its first batch (see _timed_passes).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

TARGETS = {"ceiling": 0.90, "imagefolder": 1.5}


def make_jpeg(rng: np.random.Generator, size=(500, 375), quality=90) -> bytes:
    """A photo-like JPEG: smooth colour fields plus texture, ~110 KB at 500x375 q90."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack(
        [
            np.sin(xx / rng.uniform(20, 80) + rng.uniform(0, 6)) * 60
            + rng.uniform(80, 170)
            + np.cos(yy / rng.uniform(20, 80)) * 40
            for _ in range(3)
        ],
        axis=-1,
    )
    texture = rng.normal(0, 26, (h, w, 3))
    pixels = np.clip(base + texture, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def build_data(root: Path, n: int, classes: int = 10) -> tuple[Path, str, str, float]:
    from rectrain.recordio import IRHeader, RecordWriter, pack_record

    rng = np.random.default_rng(0)
    folder = root / "folder"
    sizes = []
    rec, idx = str(root / "train.rec"), str(root / "train.idx")
    with RecordWriter(rec, idx) as w:
        for key in range(n):
            label = key % classes
            data = make_jpeg(rng)
            sizes.append(len(data))
            d = folder / f"n{label:08d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{key}.JPEG").write_bytes(data)
            w.write(key, pack_record(IRHeader(0, float(label), key, 0), data))
    return folder, rec, idx, float(np.mean(sizes))


def _timed_passes(make_iter, n_images: int, passes: int) -> tuple[float, int]:
    """(steady-state images/s over `passes` passes after one untimed warm-up pass, images processed).

    Each pass's clock starts when its first item arrives: per-epoch start-up (worker processes, a
    pipeline build, the first prefetch) is paid once per epoch, which is noise on ImageNet's 1.28 M
    images but would dominate a benchmark of a few hundred."""
    total = sum(make_iter(0))
    elapsed, seen = 0.0, 0
    for p in range(1, passes + 1):
        t0 = None
        for batch in make_iter(p):
            total += batch
            if t0 is None:
                t0 = time.perf_counter()
                continue
            seen += batch
        elapsed += time.perf_counter() - t0
    return seen / elapsed, total


def bench_rectrain(
    kind: str, rec: str, idx: str, cores: int, image_size: int, batch: int, n: int, passes: int
) -> float:
    from rectrain.loaders import LoaderSpec, build_loader

    loader = build_loader(
        kind, LoaderSpec(rec, idx, batch_size=batch, image_size=image_size, train=True, workers=cores)
    )
    return _timed_passes(lambda e: (len(y) for _, y in loader.epoch(e)), n, passes)


def bench_imagefolder(folder: Path, cores: int, image_size: int, batch: int, n: int, passes: int) -> float:
    import torch
    from torchvision import datasets, transforms

    tf = transforms.Compose(
        [
            transforms.RandomResizedCrop(image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    loader = torch.utils.data.DataLoader(
        datasets.ImageFolder(str(folder), tf), batch_size=batch, shuffle=True, num_workers=cores
    )
    return _timed_passes(lambda e: (len(y) for _, y in loader), n, passes)


_CROP = None


def _ceiling_init(image_size: int) -> None:
    global _CROP
    from torchvision import transforms

    _CROP = transforms.RandomResizedCrop(image_size)


def _ceiling_one(path: str) -> int:
    with Image.open(path) as im:
        _CROP(im.convert("RGB"))
    return 1


def bench_ceiling(folder: Path, cores: int, image_size: int, n: int, passes: int) -> float:
    files = sorted(str(p) for p in folder.rglob("*.JPEG"))
    with mp.get_context("fork").Pool(cores, initializer=_ceiling_init, initargs=(image_size,)) as pool:
        return _timed_passes(lambda e: pool.imap_unordered(_ceiling_one, files, chunksize=8), n, passes)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2, help="timed passes over the data per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", nargs="*", default=["dali", "torch", "imagefolder", "ceiling"])
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="loader_bench_") as tmp:
        t0 = time.perf_counter()
        folder, rec, idx, mean_bytes = build_data(Path(tmp), args.images)
        print(
            f"{args.images} JPEGs 500x375, mean {mean_bytes / 1024:.0f} KB, generated in "
            f"{time.perf_counter() - t0:.0f} s; {args.cores} cores; crop {args.image_size}; batch {args.batch}",
            file=sys.stderr,
        )
        runs = {
            "dali": lambda: bench_rectrain(
                "dali", rec, idx, args.cores, args.image_size, args.batch, args.images, args.passes
            ),
            "torch": lambda: bench_rectrain(
                "torch", rec, idx, args.cores, args.image_size, args.batch, args.images, args.passes
            ),
            "imagefolder": lambda: bench_imagefolder(
                folder, args.cores, args.image_size, args.batch, args.images, args.passes
            ),
            "ceiling": lambda: bench_ceiling(folder, args.cores, args.image_size, args.images, args.passes),
        }
        ips = {name: [] for name in args.only}
        per_cpu = {name: [] for name in args.only}
        for r in range(args.rounds):
            order = args.only if r % 2 == 0 else list(reversed(args.only))
            for name in order:
                before = os.times()
                wall_ips, images = runs[name]()
                after = os.times()
                # CPU seconds of this process and of its finished children (loader workers, pool).
                cpu = sum(after[i] - before[i] for i in range(4))
                ips[name].append(wall_ips)
                per_cpu[name].append(images / cpu)
                print(
                    f"round {r}: {name:12s} {wall_ips:8.1f} img/s  {images / cpu:7.1f} img per CPU-s",
                    file=sys.stderr,
                    flush=True,
                )

    def ratio(table, name, ref):
        # Median over rounds of the ratio measured within each round: a load burst on the shared
        # machine slows one round's loaders together, so within-round ratios are steadier than best-ofs.
        return statistics.median(a / b for a, b in zip(table[name], table[ref], strict=True)) if ref in table else None

    def fmt(x):
        return "-" if x is None else f"{x:.2f}"

    print(
        "\n| loader | img/s | vs ceiling | vs ImageFolder | img per CPU-s | vs ceiling | vs ImageFolder |"
        "\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for name in args.only:
        print(
            f"| {name} | {statistics.median(ips[name]):.1f} | {fmt(ratio(ips, name, 'ceiling'))} | "
            f"{fmt(ratio(ips, name, 'imagefolder'))} | {statistics.median(per_cpu[name]):.1f} | "
            f"{fmt(ratio(per_cpu, name, 'ceiling'))} | {fmt(ratio(per_cpu, name, 'imagefolder'))} |"
        )
    if {"dali", "ceiling", "imagefolder"} <= set(ips):
        for label, table in (("img/s", ips), ("img per CPU-s", per_cpu)):
            ok = (
                ratio(table, "dali", "ceiling") >= TARGETS["ceiling"]
                and ratio(table, "dali", "imagefolder") >= TARGETS["imagefolder"]
            )
            print(
                f"target on {label} (default loader dali >= {TARGETS['ceiling']} x ceiling and >= "
                f"{TARGETS['imagefolder']} x ImageFolder): {'met' if ok else 'NOT met'}"
            )


if __name__ == "__main__":
    main()
