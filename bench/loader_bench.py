"""Loader benchmark: images/s of the training loaders, side by side, on the same cores and JPEGs.

    python bench/loader_bench.py [--images 1000] [--cores N] [--image-size 224] [--rounds 5]

Generates ImageNet-like JPEGs (~500x375, ~110 KB), writes them both as an ImageFolder tree and as a
.rec/.idx (bytes passed through, as `pack.resize: 0` does), then measures steady-state train-mode
throughput (random-resized-crop + flip + normalise) of
  dali         rectrain's DALI loader from the .rec (CPU decode here; the default train.loader)
  dali-before  the DALI loader as it was at --before-ref (git show), imported beside today's: the
               mxnet reader's contiguous shard through its 16384-record shuffle buffer, before
               issue 36 gave it a new permutation every epoch (only with --only ... dali-before)
  torch        rectrain's pure-PyTorch loader from the .rec
  imagefolder  torchvision ImageFolder + DataLoader on the raw folders (the classic recipe)
  ceiling      PIL decode + RandomResizedCrop in `cores` processes, no batching, no tensors
Each loader gets `cores` decode threads/workers.  Three tables: wall-clock img/s and images per
CPU-second over the timed passes' steady window (each pass from its first batch to its last; CPU =
this process's threads plus its live worker processes, psutil, read at the same moments as the clock),
and images per CPU-second over the whole call (os.times(): the untimed warm-up pass and every epoch's
start-up included - pipeline builds, worker forks - which a real 1.28 M-image epoch amortises to
nothing but a few hundred images do not).  On a machine shared with other jobs the CPU figures are far
steadier than wall time.  Rounds interleave the loaders (order reversed every other round) so a noisy
machine slows all of them alike; cells are the median over rounds [min-max], ratios the median of the
within-round ratios.  The targets are judged on the two steady figures.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import io
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))  # this checkout's rectrain, not an installed one

TARGETS = {"ceiling": 0.90, "imagefolder": 1.5}
# The last commit whose DALI loader read a contiguous shard through the mxnet reader's shuffle buffer.
BEFORE_REF = "e178b28f57511dbb92c646c19ba5e3e86236f278"


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


def _cpu_seconds() -> float:
    """CPU seconds so far of this process (all its threads: DALI's) and of its live child processes
    (DataLoader workers, the ceiling's pool), read while they run: os.times() sees a child only after
    it has exited and been waited for."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def _timed_passes(make_iter, n_images: int, passes: int) -> tuple[float, float, int]:
    """(steady-state images/s, steady-state images per CPU-second, images processed in all) over
    `passes` passes after one untimed warm-up pass.

    Each pass is measured from its first item to its last: per-epoch start-up (worker processes, a
    pipeline build, the first prefetch, the workers' shutdown) is paid once per epoch, which is noise on
    ImageNet's 1.28 M images but would dominate a benchmark of a few hundred.  Wall clock and CPU
    are read at the same two moments, so both figures describe the same steady window; the whole-run
    CPU figure (start-ups included) is main's os.times() measure."""
    total = sum(make_iter(0))
    elapsed, cpu, seen = 0.0, 0.0, 0
    for p in range(1, passes + 1):
        first = last = None
        overhead = 0.0  # the CPU the readings themselves cost (the ceiling's are per image), not the loader's
        for batch in make_iter(p):
            total += batch
            t = time.thread_time()
            now = (time.perf_counter(), _cpu_seconds())
            if first is None:
                first = now
                continue
            overhead += time.thread_time() - t
            seen += batch
            last = now
        elapsed += last[0] - first[0]
        cpu += last[1] - first[1] - overhead
    return seen / elapsed, seen / cpu, total


def before_dali_loader(ref: str, folder: Path):
    """The DaliLoader class of `ref`'s loaders/dali.py, imported beside today's (git show; the file in
    `folder`); `ref` may also be a copy of that file (a machine without the repository's history)."""
    if Path(ref).is_file():
        source = Path(ref).read_bytes()
    else:
        show = ["git", "-C", str(REPO), "show", f"{ref}:workflow/rectrain/loaders/dali.py"]
        source = subprocess.run(show, capture_output=True, check=True).stdout
    path = folder / "dali_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("rectrain.loaders.dali_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module.DaliLoader


def bench_rectrain(
    kind: str, rec: str, idx: str, cores: int, image_size: int, batch: int, n: int, passes: int, make=None
) -> float:
    """`kind` through build_loader, or the loader class `make` (dali-before)."""
    from rectrain.loaders import LoaderSpec, build_loader

    spec = LoaderSpec(rec, idx, batch_size=batch, image_size=image_size, train=True, workers=cores)
    loader = make(spec) if make else build_loader(kind, spec)
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
    ap.add_argument("--before-ref", default=BEFORE_REF, help="the commit whose DALI loader dali-before runs")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="loader_bench_") as tmp:
        t0 = time.perf_counter()
        folder, rec, idx, mean_bytes = build_data(Path(tmp), args.images)
        old_dali = before_dali_loader(args.before_ref, Path(tmp)) if "dali-before" in args.only else None
        print(
            f"{args.images} JPEGs 500x375, mean {mean_bytes / 1024:.0f} KB, generated in "
            f"{time.perf_counter() - t0:.0f} s; {args.cores} cores; crop {args.image_size}; batch {args.batch}",
            file=sys.stderr,
        )
        runs = {
            "dali": lambda: bench_rectrain(
                "dali", rec, idx, args.cores, args.image_size, args.batch, args.images, args.passes
            ),
            "dali-before": lambda: bench_rectrain(
                "dali", rec, idx, args.cores, args.image_size, args.batch, args.images, args.passes, make=old_dali
            ),
            "torch": lambda: bench_rectrain(
                "torch", rec, idx, args.cores, args.image_size, args.batch, args.images, args.passes
            ),
            "imagefolder": lambda: bench_imagefolder(
                folder, args.cores, args.image_size, args.batch, args.images, args.passes
            ),
            "ceiling": lambda: bench_ceiling(folder, args.cores, args.image_size, args.images, args.passes),
        }
        # metric -> loader -> one value per round
        table = {metric: {name: [] for name in args.only} for metric in METRICS}
        for r in range(args.rounds):
            order = args.only if r % 2 == 0 else list(reversed(args.only))
            for name in order:
                before = os.times()
                wall_ips, steady_per_cpu, images = runs[name]()
                after = os.times()
                gc.collect()  # the loader's pipeline goes before the next loader builds one
                # CPU seconds of this process and of its finished children (loader workers, pool).
                whole_per_cpu = images / sum(after[i] - before[i] for i in range(4))
                for metric, value in zip(METRICS, (wall_ips, steady_per_cpu, whole_per_cpu), strict=True):
                    table[metric][name].append(value)
                print(
                    f"round {r}: {name:12s} {wall_ips:8.1f} img/s  {steady_per_cpu:7.1f} img per CPU-s steady  "
                    f"{whole_per_cpu:7.1f} whole run",
                    file=sys.stderr,
                    flush=True,
                )
    print_tables(table, args.only)


# What each round measures: the first two over the timed passes' steady window (_timed_passes), the
# third over the whole call, untimed warm-up pass and every epoch's start-up included.
METRICS = ("img/s", "img per CPU-s", "img per CPU-s, whole run")


def _ratios(values: dict, name: str, ref: str) -> list[float]:
    # Ratios within each round: a load burst on the shared machine slows one round's loaders together,
    # so the median of within-round ratios is steadier than a ratio of medians or of best-ofs.
    return [a / b for a, b in zip(values[name], values[ref], strict=True)]


def _cell(xs: list[float]) -> str:
    """Median [min-max] over the rounds."""
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]" if xs else "-"


def print_tables(table: dict, names: list[str]) -> None:
    """One table per metric (median over rounds, [spread]), then the targets, judged on the steady
    figures: the ones that describe a real epoch of ImageNet, where start-up is amortised to nothing."""
    refs = ["ceiling", "imagefolder", *(["dali-before"] if "dali-before" in names else [])]
    for metric, values in table.items():
        head = " | ".join(f"vs {ref}" for ref in refs)
        print(f"\n{metric}\n| loader | {metric} | {head} |\n|---|---:|{'---:|' * len(refs)}")
        for name in names:
            xs = values[name]
            cells = " | ".join(_cell(_ratios(values, name, ref) if ref in values else []) for ref in refs)
            print(f"| {name} | {statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}] | {cells} |")
    if not {"dali", "ceiling", "imagefolder"} <= set(names):
        return
    for metric in METRICS[:2]:
        worst = {ref: min(_ratios(table[metric], "dali", ref)) for ref in ("ceiling", "imagefolder")}
        median = {ref: statistics.median(_ratios(table[metric], "dali", ref)) for ref in ("ceiling", "imagefolder")}
        ok = all(median[ref] >= TARGETS[ref] for ref in TARGETS)
        every_round = all(worst[ref] >= TARGETS[ref] for ref in TARGETS)
        print(
            f"target on {metric} (default loader dali >= {TARGETS['ceiling']} x ceiling and >= "
            f"{TARGETS['imagefolder']} x ImageFolder, median of rounds): {'met' if ok else 'NOT met'}"
            f" ({'in every round' if every_round else 'not in every round'})"
        )


if __name__ == "__main__":
    main()
