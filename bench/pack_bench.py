"""Pack vs im2rec: the same images, the same cores, measured side by side in one run.

    .venv/bin/python bench/pack_bench.py [--images 10000] [--threads N] [--repeats 3]

Generates ImageNet-like JPEGs (~500x375, q90, class folders), then packs them with
``python -m rectrain.data.pack`` and with mxnet 1.9.1's ``python -m mxnet.tools.im2rec`` (from
.venv-mxnet, `make mxnet-env`), pass-through and ``resize 256``, alternating the two tools on each
repeat so a noisy machine affects both. Both processes are pinned to the same cores. Our time
includes the read-back verification of every record; im2rec does none. Prints images/s of both and
the ratio (target: >= 1.2 pass-through, >= 2.0 resize 256), and the CPU time per image of each
tool (all its processes), which other tenants of a shared machine cannot inflate; then each tool's
whole-process wall and CPU seconds with their spread over the repeats. The headline
ratio is the whole job, fixed costs included; a second table splits each tool's time into a fixed
cost per run (from a 10-image run) and the per-image rate beyond it. Last, the cost of checking a
pass-through JPEG's scan data (rectrain.data.images.check_scan: a strict 1/8-scale grayscale decode)
per image, one thread, against the header parse alone and a full RGB decode (on the first
CHECK_SAMPLE images: a cost per image). The load average is printed before and after the runs: on a
shared box the wall columns move with it, the CPU columns much less. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
MXPY = REPO / ".venv-mxnet" / "bin" / "python"
SMALL = 10  # images in the run that measures each tool's fixed cost
CHECK_SAMPLE = 2000  # images the one-thread scan-check cost is measured on
# (mode, pack.resize, pack.check_scan_data, pack.read_order): the default pass-through decodes each
# JPEG's scan data (1/8 scale) to check it; im2rec never decodes, so the check's cost is shown by a run
# without it. read_order auto picks storage order on a disk that reports itself rotational (virtual
# disks often do), so a run with shuffled reads shows what that order costs from the page cache.
MODES = (
    ("pass-through", 0, True, "auto"),
    ("pass-through, shuffled reads", 0, True, "shuffled"),
    ("pass-through, no scan check", 0, False, "auto"),
    ("resize 256", 256, True, "auto"),
)
TARGETS = {
    "pass-through": 1.2,
    "pass-through, shuffled reads": 1.2,
    "pass-through, no scan check": 1.2,
    "resize 256": 2.0,
}
sys.path.insert(0, str(REPO / "workflow"))

from rectrain.data import images  # noqa: E402
from rectrain.data import index as rindex  # noqa: E402


def imagenet_like(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    """A photo-like picture: smooth colour field, edges and sensor noise (compresses like ImageNet)."""
    field = rng.uniform(0, 255, size=(rng.integers(6, 14), rng.integers(8, 18), 3)).astype(np.uint8)
    img = np.asarray(Image.fromarray(field).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    stripes = 40 * np.sin((xx * rng.uniform(0.02, 0.2) + yy * rng.uniform(0.02, 0.2)))[..., None]
    img = img + stripes + rng.normal(0, 9, size=img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def make_images(raw: Path, n: int, classes: int = 10) -> None:
    marker = raw / f".made_{n}_v2"
    if marker.exists():
        return
    shutil.rmtree(raw, ignore_errors=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        w, h = (500, 375) if i % 4 else (375, 500)
        w, h = w + int(rng.integers(-40, 40)), h + int(rng.integers(-30, 30))
        folder = raw / "train" / f"n{i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        imagenet_like(rng, w, h).save(folder / f"n{i % classes:08d}_{i}.JPEG", quality=90)
    for k in range(classes):  # the indexer wants a val split too; it is not benchmarked
        folder = raw / "val" / f"n{k:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        imagenet_like(rng, 500, 375).save(folder / f"ILSVRC2012_val_{k + 1:08d}.JPEG", quality=90)
    marker.touch()


def pinned(cores: list[int]):
    return lambda: os.sched_setaffinity(0, cores)


def timed(cmd: list[str], cores: list[int], env=None) -> tuple[float, float]:
    """(wall s, CPU s of the command and all its processes): CPU time is what other tenants of a
    shared box cannot inflate."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, preexec_fn=pinned(cores), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run(args) -> dict:
    out = Path(args.out).resolve()
    raw = out / "raw"
    make_images(raw, args.images)
    index_dir = out / "index"
    rindex.write_index(rindex.discover(raw), index_dir)
    n = len((index_dir / "train.tsv").read_text().splitlines()) - 1
    src_mb = sum(p.stat().st_size for p in (raw / "train").rglob("*.JPEG")) / 1e6
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    threads = len(cores)

    mx = out / "im2rec"
    shutil.rmtree(mx, ignore_errors=True)
    mx.mkdir(parents=True)
    subprocess.run(
        [str(MXPY), "-m", "mxnet.tools.im2rec", "--list", "--recursive", str(mx / "train"), str(raw / "train")],
        check=True,
        capture_output=True,
    )
    for p in raw.rglob("*.JPEG"):  # warm the page cache for both tools
        p.read_bytes()

    # The same job on a few images: what each tool pays whatever the dataset size (interpreter,
    # imports - mxnet's alone is ~1.3 s of CPU -, process pools, our verification and fsync).
    small_index = out / "index_small"
    small_index.mkdir(exist_ok=True)
    rows = (index_dir / "train.tsv").read_text().splitlines(keepends=True)
    (small_index / "train.tsv").write_text("".join(rows[: SMALL + 1]))
    shutil.copy(index_dir / "classes.tsv", small_index / "classes.tsv")
    lst = (mx / "train.lst").read_text().splitlines(keepends=True)
    (mx / "small.lst").write_text("".join(lst[:SMALL]))

    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    results = {}
    for mode, resize, scan, read_order in MODES:
        ours_out = out / "ours" / mode.replace(" ", "").replace(",", "")
        mx_flags = ["--pass-through"] if resize == 0 else ["--resize", str(resize)]

        def ours_cmd(index: Path, resize=resize, scan=scan, order=read_order, ours_out=ours_out) -> list[str]:
            cfg = {"resize": resize, "quality": 90, "shuffle_seed": 0, "check_scan_data": scan, "read_order": order}
            return [
                sys.executable,
                "-m",
                "rectrain.data.pack",
                "--config-json",
                json.dumps(cfg),
                "--index",
                str(index),
                "--raw",
                str(raw),
                "--split",
                "train",
                "--rec",
                str(ours_out / "train.rec"),
                "--idx",
                str(ours_out / "train.idx"),
                "--manifest",
                str(ours_out / "train.manifest.json"),
                "--threads",
                str(threads),
            ]

        def mx_cmd(prefix: str, mx_flags=mx_flags) -> list[str]:
            return [
                str(MXPY),
                "-m",
                "mxnet.tools.im2rec",
                "--num-thread",
                str(threads),
                "--quality",
                "90",
                *mx_flags,
                str(mx / prefix),
                str(raw / "train"),
            ]

        times = {key: [] for key in ("ours", "im2rec", "ours_small", "im2rec_small")}
        cpus = {key: [] for key in times}
        for rep in range(args.repeats):
            pair = [("ours", ours_cmd(index_dir), env), ("im2rec", mx_cmd("train"), None)]
            for name, cmd, cmd_env in pair if rep % 2 == 0 else pair[::-1]:
                wall, cpu = timed(cmd, cores, cmd_env)
                times[name].append(wall)
                cpus[name].append(cpu)
        sizes = {
            "ours_mb": (ours_out / "train.rec").stat().st_size / 1e6,
            "im2rec_mb": (mx / "train.rec").stat().st_size / 1e6,
        }
        for _ in range(args.repeats):
            for name, cmd, cmd_env in (
                ("ours_small", ours_cmd(small_index), env),
                ("im2rec_small", mx_cmd("small"), None),
            ):
                wall, cpu = timed(cmd, cores, cmd_env)
                times[name].append(wall)
                cpus[name].append(cpu)
        t = {key: statistics.median(v) for key, v in times.items()}
        c = {key: statistics.median(v) for key, v in cpus.items()}
        # per-image cost = slope between the small and the full run; fixed cost = the rest
        ours_per, mx_per = ((t[k] - t[k + "_small"]) / (n - SMALL) for k in ("ours", "im2rec"))
        results[mode] = {
            "ours_img_s": n / t["ours"],
            "im2rec_img_s": n / t["im2rec"],
            "ratio": t["im2rec"] / t["ours"],
            "ours_cpu_ms_per_img": 1e3 * c["ours"] / n,
            "im2rec_cpu_ms_per_img": 1e3 * c["im2rec"] / n,
            "cpu_ratio": c["im2rec"] / c["ours"],
            "ours_fixed_s": t["ours_small"] - SMALL * ours_per,
            "im2rec_fixed_s": t["im2rec_small"] - SMALL * mx_per,
            "ours_steady_img_s": 1 / ours_per,
            "im2rec_steady_img_s": 1 / mx_per,
            "steady_ratio": mx_per / ours_per,
            "ours_s": times["ours"],
            "im2rec_s": times["im2rec"],
            "ours_cpu_s": cpus["ours"],
            "im2rec_cpu_s": cpus["im2rec"],
            "read_order": json.loads((ours_out / "train.manifest.json").read_text())["read_order"]["used"],
            "ours_small_s": times["ours_small"],
            "im2rec_small_s": times["im2rec_small"],
            **sizes,
        }
    return {
        "images": n,
        "source_mb": src_mb,
        "threads": threads,
        "cores": cores,
        "repeats": args.repeats,
        "cpu": _cpu_name(),
        "results": results,
        "scan_check_ms_per_img": scan_check_cost(raw),
    }


def scan_check_cost(raw: Path, passes: int = 5) -> dict:
    """CPU ms per image (this thread's CPU time, which other tenants cannot inflate), best of ``passes``,
    over the generated JPEGs (read into memory first)."""
    import simplejpeg

    datas = [p.read_bytes() for p in sorted((raw / "train").rglob("*.JPEG"))[:CHECK_SAMPLE]]
    infos = [images.read_jpeg_header(d) for d in datas]
    steps = {
        "header only": lambda d, i: images.read_jpeg_header(d),
        "header + scan check": lambda d, i: (images.read_jpeg_header(d), images.check_scan(d, i)),
        # candidates for a cheaper check: the 1/8 scale saves only the inverse DCT, not the Huffman decode
        "gray decode, full scale": lambda d, i: simplejpeg.decode_jpeg(d, colorspace="GRAY"),
        "Pillow draft gray 1/8 (lenient)": _pillow_draft_gray,
        "full RGB decode": lambda d, i: simplejpeg.decode_jpeg(d, colorspace="RGB"),
    }
    cost = {}
    for name, step in steps.items():
        best = float("inf")
        for _ in range(passes):
            t0 = time.thread_time()
            for data, info in zip(datas, infos, strict=True):
                step(data, info)
            best = min(best, time.thread_time() - t0)
        cost[name] = 1e3 * best / len(datas)
    return cost


def _pillow_draft_gray(data: bytes, info) -> None:
    """Pillow's DCT-domain 1/8 gray decode: no cheaper, and it ignores libjpeg's corrupt-data warnings."""
    import io

    with Image.open(io.BytesIO(data), formats=("JPEG",)) as im:
        im.draft("L", (max(1, im.width // 8), max(1, im.height // 8)))
        im.load()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench" / "out" / "pack"))
    args = parser.parse_args()
    if not MXPY.exists():
        raise SystemExit(".venv-mxnet is missing: run `make mxnet-env` (mxnet 1.9.1 is the im2rec baseline)")
    load_before = os.getloadavg()
    r = run(args)
    r["load_average"] = {"before": load_before, "after": os.getloadavg()}
    print(
        f"{r['images']} images ({r['source_mb']:.1f} MB), {r['threads']} worker threads pinned to cores "
        f"{r['cores']} ({r['cpu']}), median of {r['repeats']} alternating runs; load average (1, 5, 15 min) "
        + " -> ".join("/".join(f"{x:.2f}" for x in r["load_average"][k]) for k in ("before", "after"))
    )
    print(
        f"{'mode':<28}{'rectrain img/s':>16}{'im2rec img/s':>14}{'ratio':>8}{'target':>8}"
        f"{'CPU ms/img ours':>17}{'im2rec':>8}{'CPU ratio':>11}"
    )
    for mode, target in TARGETS.items():
        x = r["results"][mode]
        print(
            f"{mode:<28}{x['ours_img_s']:>16.0f}{x['im2rec_img_s']:>14.0f}{x['ratio']:>8.2f}{target:>8.1f}"
            f"{x['ours_cpu_ms_per_img']:>17.2f}{x['im2rec_cpu_ms_per_img']:>8.2f}{x['cpu_ratio']:>11.2f}"
        )
    print("whole processes (start-up included), median [min-max] of the runs; CPU = user + system, all processes:")
    print(f"{'mode':<28}{'read order':>11}{'wall s ours':>22}{'im2rec':>20}{'CPU s ours':>22}{'im2rec':>20}")
    for mode in TARGETS:
        x = r["results"][mode]
        cells = (_spread(x[key]) for key in ("ours_s", "im2rec_s", "ours_cpu_s", "im2rec_cpu_s"))
        print(f"{mode:<28}{x['read_order']:>11}" + "".join(f"{c:>21} " for c in cells))
    print(f"fixed cost per run (a {SMALL}-image run less its per-image share) and per-image rate beyond it:")
    print(f"{'mode':<28}{'fixed s ours':>14}{'im2rec':>8}{'steady img/s ours':>19}{'im2rec':>8}{'ratio':>8}")
    for mode in TARGETS:
        x = r["results"][mode]
        if min(x["ours_steady_img_s"], x["im2rec_steady_img_s"]) <= 0:
            print(f"{mode:<28}  n/a: run-to-run noise exceeds the per-image time; use more --images")
            continue
        print(
            f"{mode:<28}{x['ours_fixed_s']:>14.2f}{x['im2rec_fixed_s']:>8.2f}{x['ours_steady_img_s']:>19.0f}"
            f"{x['im2rec_steady_img_s']:>8.0f}{x['steady_ratio']:>8.2f}"
        )
    print("pass-through validation, CPU ms per image on one thread (best of 5 passes over the same images):")
    for name, ms in r["scan_check_ms_per_img"].items():
        print(f"  {name:<34}{ms:>7.3f}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
