"""The DALI training loader on a simulated hard disk and from the page cache, side by side in one run.

    sudo .venv/bin/python bench/hdd_loader_bench.py [--images 3000] [--rounds 3] [--hdd-batches 15]
        [--window-mib 64] [--runs ...] [--device cpu] [--sim-python PYTHON] [--seek-ms 12.7] [--near-ms 5.2]
        [--mb-s 150]

Writes --images ImageNet-like JPEGs (bench/loader_bench.py's, ~110 KB, 500x375) as a .rec/.idx onto a
fresh ext4 file system in a loop-mounted image (root needed: bench/hdd_bench.py's DataDisk), so the
.rec has a real disk's extents, and runs rectrain's DALI training loader (2 threads, crop 224, batch
64, CPU) over it, every run a fresh loader:
  cache         today's loader (train.order: permutation, reads in the reader threads) on the .rec
                itself, in the page cache
  cache-before  the loader of --before-ref (git show: the main branch before issue 52, each record read
                in the training thread in turn), the same .rec
  hdd-quasi     today's loader, train.order: quasi-random, on bench/hdd_sim.py's view of the .rec (a
                7,200 rpm head: every read sleeps its seek and transfer time, nothing cached)
  hdd-perm      today's loader, train.order: permutation, on the view (--hdd-batches batches)
  hdd-before    the --before-ref loader on the view (--hdd-batches batches): what issue 52 measured
  hdd-quasi-x4  (only when named) hdd-quasi with READ_THREADS reader threads instead of one: two windows
                read at once, their requests interleaved at the head
Rounds interleave the runs; each hdd run mounts the view afresh (its head statistics per run).
Printed per run: img/s over the pass from its first batch to its last (steady; a quasi-random pass's
first window is read before its first batch, so the pass rate with the start-up is printed too), the
training thread's CPU-ms per batch inside the external source's callback (thread_time: the reads'
cost to that thread), and the head's reads, seeks and busy seconds; then medians [min-max] and
within-round ratios against the page cache and against what the simulated disk streams sequentially
(--mb-s over the mean record).

The quasi-random window is --window-mib per rank (the loader's is rectrain.loaders.order.WINDOW_BYTES,
1 GiB): a .rec of a few hundred MB must hold several windows for the steady rate to include reading
one window while the previous one decodes, as an ImageNet epoch does; blocks are the loader's.
Needs libfuse 2 and fusepy for --sim-python (envs/requirements-bench.txt).  With only the cache runs
(`--runs cache cache-before`) it needs neither, nor root: the pair is written to a temporary folder;
`--device cuda:0` runs them on a GPU (bench/GPU_RUNBOOK.md, "Reads").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "workflow"))

from hdd_bench import DataDisk, SlowMount  # noqa: E402
from loader_bench import before_dali_loader, make_jpeg  # noqa: E402

from rectrain.loaders import LoaderSpec, order, readahead  # noqa: E402
from rectrain.recordio import IRHeader, RecordWriter, pack_record  # noqa: E402

BEFORE_REF = "18e1619"  # main before issue 52: the reads in the training thread, one record after another
RUNS = ("cache", "cache-before", "hdd-quasi", "hdd-perm", "hdd-before")
EXTRA_RUNS = ("hdd-quasi-x4",)


def write_pair(folder: Path, n: int, classes: int = 10) -> float:
    """train.rec/.idx of n JPEGs labelled key % classes, in a shuffled order as the pack writes; the mean
    record's bytes."""
    rng = np.random.default_rng(0)
    images = [make_jpeg(rng) for _ in range(min(n, 500))]  # reused: a decode costs the same, writing is quicker
    with RecordWriter(folder / "train.rec", folder / "train.idx") as w:
        for key in rng.permutation(n).tolist():
            w.write(key, pack_record(IRHeader(0, float(key % classes), key, 0), images[key % len(images)]))
    os.sync()  # blocks allocated before the view reads their addresses
    return (folder / "train.rec").stat().st_size / n


class CallbackClock:
    """The training thread's CPU seconds inside a dali module's EpochRecords.__call__ (`cls`: the loader's
    external source, where the reads ran before issue 52 and where they are only waited for now)."""

    def __init__(self, cls):
        self.cpu_s, self.calls = 0.0, 0
        inner = cls.__call__

        def timed(records, iteration):
            t = time.thread_time()
            try:
                return inner(records, iteration)
            finally:
                self.cpu_s += time.thread_time() - t
                self.calls += 1

        cls.__call__ = timed


def one_pass(make, spec: LoaderSpec, epoch: int, batches: int, clock: CallbackClock) -> dict:
    """One pass of `batches` batches of a fresh loader: steady img/s (first batch to last), img/s with
    the start-up (from the epoch's call), the callback's CPU-ms per batch."""
    loader = make(spec)
    clock.cpu_s, clock.calls = 0.0, 0
    started = time.perf_counter()
    first = last = None
    seen = 0
    for k, (_, labels) in enumerate(loader.epoch(epoch)):
        last = time.perf_counter()
        if first is None:
            first = last
        else:
            seen += len(labels)
        if k + 1 >= batches:
            break
    if getattr(loader, "reads", None) is not None:  # reads ahead of a pass left early: done before the unmount
        loader._release_pipelines()
        loader.reads.close(wait=True)
    loader.reader.close()
    del loader
    gc.collect()  # its pipeline goes before the next run builds its own
    return {
        "img_s": seen / (last - first),
        "pass_img_s": (seen + spec.batch_size) / (last - started),
        "callback_ms": 1e3 * clock.cpu_s / max(clock.calls, 1),
    }


def spec_at(root: Path, kind: str, device: str = "cpu") -> LoaderSpec:
    """The loader of issue 52's measurement on the pair in `root`, reading in train.order `kind`; on a GPU
    (`device` cuda:<i>) with DALI's mixed decoder, where the training thread launches the kernels."""
    rec, idx = str(root / "train.rec"), str(root / "train.idx")
    return LoaderSpec(rec, idx, batch_size=64, image_size=224, workers=2, order=kind, device=device)


def with_threads(make, threads: int, spec: LoaderSpec):
    """A loader whose quasi-random window is read by `threads` reader threads (plan_for's: one)."""
    loader = make(spec)
    loader.read_plan = dataclasses.replace(loader.read_plan, streams=threads)
    loader.reads = readahead.ReadPool(threads)
    return loader


def one_run(args, name: str, epoch: int, folder: Path, out: Path, loaders: dict) -> dict:
    """Run `name` (RUNS) once: a fresh loader, on a freshly mounted view for the hdd runs."""
    make, clock = loaders["before" if name.endswith("before") else "today"]
    kind = "quasi-random" if name.startswith("hdd-quasi") else "permutation"
    if name == "hdd-quasi-x4":
        make = functools.partial(with_threads, make, readahead.READ_THREADS)
    batches = args.hdd_batches if name in ("hdd-perm", "hdd-before") else args.images // 64
    if not name.startswith("hdd"):
        return one_pass(make, spec_at(folder, kind, args.device), epoch, batches, clock)
    with SlowMount(args, folder, out / "mnt", out / f"{name}.stats.json") as mount:
        result = one_pass(make, spec_at(out / "mnt", kind, args.device), epoch, batches, clock)
    return {**result, "head": mount.result}


def run(args, folder: Path, out: Path) -> dict:
    """Every run of every round, interleaved (order reversed every other round): {run name: [results]}."""
    from rectrain.loaders import dali

    old = before_dali_loader(args.before_ref, out)
    loaders = {
        "today": (dali.DaliLoader, CallbackClock(dali.EpochRecords)),
        "before": (old, CallbackClock(old.__init__.__globals__["EpochRecords"])),
    }
    order.WINDOW_BYTES = args.window_mib << 20
    results = {name: [] for name in args.runs}
    for r in range(args.rounds):
        for name in args.runs if r % 2 == 0 else list(reversed(args.runs)):
            result = one_run(args, name, r, folder, out, loaders)
            results[name].append(result)
            print(
                f"round {r} {name:13s} {result['img_s']:7.1f} img/s steady, {result['pass_img_s']:7.1f} with start-up,"
                f" callback {result['callback_ms']:.3f} CPU-ms/batch  {result.get('head') or ''}",
                file=sys.stderr,
                flush=True,
            )
    return results


def _cell(xs: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def report(results: dict, args, mean_bytes: float) -> str:
    """Medians [min-max] over the rounds, and ratios within each round."""
    sequential = args.mb_s * 1e6 / mean_bytes
    lines = [
        f"{args.images} records, mean {mean_bytes / 1e3:.0f} KB; DALI loader, 2 threads, crop 224, batch 64, {args.device}; "
        f"quasi-random blocks {order.BLOCK_BYTES >> 20} MiB, window {args.window_mib} MiB; simulated disk: seek "
        f"{args.seek_ms} ms, short seek {args.near_ms} ms, {args.mb_s} MB/s = {sequential:.0f} records/s sequentially",
        "| run | img/s steady | img/s with start-up | training thread in the callback, CPU-ms/batch | head: reads, seeks + short, busy s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, rs in results.items():
        heads = [r["head"] for r in rs if r.get("head")]
        head = "; ".join(f"{h['reads']}, {h['seeks']} + {h['short_seeks']}, {h['busy_s']:.1f}" for h in heads) or "-"
        lines.append(
            f"| {name} | {_cell([r['img_s'] for r in rs])} | {_cell([r['pass_img_s'] for r in rs])} | "
            f"{_cell([r['callback_ms'] for r in rs], '.3f')} | {head} |"
        )
    ratios = []
    if "cache" in results:
        cache = [r["img_s"] for r in results["cache"]]
        for name in ("hdd-quasi", "hdd-perm", "hdd-before", "cache-before"):
            if name in results:
                xs = [r["img_s"] / c for r, c in zip(results[name], cache, strict=True)]
                ratios.append(f"{name} / cache (img/s, within rounds): {_cell(xs, '.2f')}")
    if "hdd-quasi" in results:
        xs = [r["img_s"] / sequential for r in results["hdd-quasi"]]
        ratios.append(f"hdd-quasi / the disk's sequential records/s: {_cell(xs, '.2f')}")
    if {"cache", "cache-before"} <= set(results):
        xs = [
            a["callback_ms"] / b["callback_ms"] for a, b in zip(results["cache"], results["cache-before"], strict=True)
        ]
        ratios.append(f"training thread's CPU in the callback, cache / cache-before: {_cell(xs, '.3f')}")
    return "\n".join(lines + ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hdd-batches", type=int, default=15, help="batches of a permutation pass on the disk")
    ap.add_argument("--window-mib", type=int, default=64, help="the quasi-random window per rank (see above)")
    ap.add_argument("--runs", nargs="+", choices=RUNS + EXTRA_RUNS, default=list(RUNS))
    ap.add_argument("--before-ref", default=BEFORE_REF, help="a commit, or a copy of its loaders/dali.py")
    ap.add_argument("--sim-python", default=sys.executable, help="a python with fusepy (runs bench/hdd_sim.py)")
    ap.add_argument("--seek-ms", type=float, default=12.7)
    ap.add_argument("--near-ms", type=float, default=5.2)
    ap.add_argument("--mb-s", type=float, default=150.0)
    ap.add_argument("--device", default="cpu", help="where batches land: cpu, or cuda:0 (DALI's mixed decoder)")
    ap.add_argument("--out", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hdd_loader_") as tmp:
        out = Path(args.out or tmp).resolve()
        out.mkdir(parents=True, exist_ok=True)
        if not any(name.startswith("hdd") for name in args.runs):  # the page cache only: no disk image, no root
            mean_bytes = write_pair(out, args.images)
            results = run(args, out, out)
        else:
            with DataDisk(out / "disk.img", out / "disk", args.images * 140_000 + (256 << 20)) as disk:
                started = time.perf_counter()
                mean_bytes = write_pair(disk.mountpoint, args.images)
                print(f"pair written in {time.perf_counter() - started:.0f} s", file=sys.stderr)
                results = run(args, disk.mountpoint, out)
    print(report(results, args, mean_bytes))


if __name__ == "__main__":
    main()
