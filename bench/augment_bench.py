"""RandAugment's CPU cost per image: DALI's operators (rectrain's DALI loader, CPU decode, 2 threads) against
timm's PIL RandAugment (rectrain's torch loader: a DataLoader with 2 worker processes running timm's
rand_augment_transform), side by side in one run, at 224 px.

    python bench/augment_bench.py [--policy rand-m9-mstd0.5-inc1] [--images 512] [--cores 2] [--rounds 5]

The data is bench/loader_bench.py's: ImageNet-like JPEGs (~500x375, ~110 KB) in a .rec.  Four sources,
interleaved per round (order reversed every other round): each loader with train.augment.policy none
and with the policy; each measured over loader_bench's steady window (the timed passes from their first
batch to their last, after an untimed warm-up pass; CPU = this process's threads plus its live worker
processes, psutil).  Prints img/s and images per CPU-second of each source, median [min-max] over the
rounds, then the policy's own cost: CPU-ms per image with the policy minus without it, per loader, and
the ratio timm / DALI within each round.  On the shared 2-core box the CPU figures are far steadier
than wall time.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "workflow"))  # this checkout's rectrain, not an installed one
sys.path.insert(0, str(BENCH))
# ... in the torch loader's forkserver and workers too
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(BENCH.parent / "workflow"), os.environ.get("PYTHONPATH"))))

from loader_bench import _timed_passes, build_data  # noqa: E402

SOURCES = ("dali", "dali+policy", "torch", "torch+policy")


def measure(source: str, policy: str, rec: str, idx: str, args) -> tuple[float, float]:
    """(img/s, images per CPU-second) of one source over the steady window of --passes passes."""
    from rectrain.loaders import LoaderSpec, build_loader
    from rectrain.loaders.augment import parse_policy

    kind, _, with_policy = source.partition("+")
    spec = LoaderSpec(
        rec,
        idx,
        batch_size=args.batch,
        image_size=args.image_size,
        workers=args.cores,
        augment=parse_policy(policy if with_policy else "none"),
    )
    loader = build_loader(kind, spec)
    img_s, per_cpu_s, _ = _timed_passes(lambda e: (len(y) for _, y in loader.epoch(e)), args.images, args.passes)
    return img_s, per_cpu_s


def cell(xs: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def report(table: dict, policy: str) -> None:
    """The sources' table and the policy's own CPU-ms per image, each loader, and timm / DALI."""
    print(f"\n| source ({policy}) | img/s | img per CPU-s |\n|---|---:|---:|")
    for source in SOURCES:
        print(f"| {source} | {cell(table[source]['img/s'])} | {cell(table[source]['img per CPU-s'])} |")
    cost = {}
    for kind in ("dali", "torch"):
        with_, without = table[f"{kind}+policy"]["img per CPU-s"], table[kind]["img per CPU-s"]
        cost[kind] = [1000 / a - 1000 / b for a, b in zip(with_, without, strict=True)]
    ratio = [t / d for t, d in zip(cost["torch"], cost["dali"], strict=True)]
    print(f"\nthe policy's own CPU time per image (with it - without it), median [min-max] over {len(ratio)} rounds:")
    print(f"| DALI, {SOURCES[1]} | {cell(cost['dali'], '.2f')} ms |")
    print(f"| timm (PIL), {SOURCES[3]} | {cell(cost['torch'], '.2f')} ms |")
    print(f"| timm / DALI, within each round | {cell(ratio, '.2f')} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="rand-m9-mstd0.5-inc1")
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--cores", type=int, default=2, help="DALI threads / DataLoader worker processes")
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2, help="timed passes over the data per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="augment_bench_") as tmp:
        t0 = time.perf_counter()
        _, rec, idx, mean_bytes = build_data(Path(tmp), args.images)
        print(
            f"{args.images} JPEGs 500x375, mean {mean_bytes / 1024:.0f} KB, made in {time.perf_counter() - t0:.0f} s; "
            f"{args.cores} threads / workers; crop {args.image_size}; batch {args.batch}; policy {args.policy}",
            file=sys.stderr,
        )
        table = {s: {"img/s": [], "img per CPU-s": []} for s in SOURCES}
        for r in range(args.rounds):
            for source in SOURCES if r % 2 == 0 else reversed(SOURCES):
                img_s, per_cpu = measure(source, args.policy, rec, idx, args)
                gc.collect()  # the loader's pipeline or workers go before the next one starts
                table[source]["img/s"].append(img_s)
                table[source]["img per CPU-s"].append(per_cpu)
                print(f"round {r}: {source:13s} {img_s:7.1f} img/s {per_cpu:7.1f} img per CPU-s", file=sys.stderr)
    report(table, args.policy)


if __name__ == "__main__":
    main()
