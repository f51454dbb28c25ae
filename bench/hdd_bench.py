"""The pack's read order on a simulated hard disk: storage order against shuffled reads and im2rec.

    sudo .venv/bin/python bench/hdd_bench.py [--images 2000] [--classes 50] [--threads 2]
        [--sim-python PYTHON] [--seek-ms 12.7] [--near-ms 5.2] [--mb-s 150]

Raw ImageNet usually sits on an HDD or a network share; this machine has neither. The bench writes
ImageNet-like JPEGs (bench/pack_bench.py's generator), copies them class folder by class folder (as
ImageNet's per-class archives are extracted) onto a fresh ext4 file system in a loop-mounted image
file (root needed), then serves that through bench/hdd_sim.py, a FUSE view that sleeps what one disk
head would take for each read (the files' real block addresses in the image, a short or a long seek
per jump, bytes at --mb-s), and packs them pass-through three ways, each on a freshly mounted view:
  storage    python -m rectrain.data.pack with pack.read_order: storage (folders in path order, files
             by inode, then the external shuffle through bucket files on the local disk)
  shuffled   the same with pack.read_order: shuffled (one random read per image, the .rec order)
  im2rec     mxnet's im2rec --pass-through on its own shuffled list (reads in list order)
It prints wall time, images/s, the head's seeks and busy seconds per run, and the ratios against
storage order. The .rec of both packs is the same file byte for byte (checked). A model, not a disk:
metadata is free and the cache of a real drive is absent; the parameters are printed with the result.
Needs libfuse 2 (`apt-get install libfuse2`) and fusepy for --sim-python (envs/requirements-bench.txt).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "workflow"))

from pack_bench import MXPY, _cpu_name, make_images, timed  # noqa: E402

from rectrain.data import index as rindex  # noqa: E402

RUNS = ("storage", "shuffled", "im2rec")


class SlowMount:
    """bench/hdd_sim.py serving `source` at `mountpoint` for one run; its stats once unmounted."""

    def __init__(self, args, source: Path, mountpoint: Path, stats: Path):
        self.cmd = [
            args.sim_python,
            str(REPO / "bench" / "hdd_sim.py"),
            str(source),
            str(mountpoint),
            "--stats",
            str(stats),
            "--seek-ms",
            str(args.seek_ms),
            "--near-ms",
            str(args.near_ms),
            "--mb-s",
            str(args.mb_s),
        ]
        self.mountpoint, self.stats = mountpoint, stats

    def __enter__(self):
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.stats.unlink(missing_ok=True)
        self.proc = subprocess.Popen(self.cmd)
        deadline = time.monotonic() + 20
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"hdd_sim did not mount (exit {self.proc.poll()}): {' '.join(self.cmd)}")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        subprocess.run(["umount", str(self.mountpoint)], check=False)
        self.proc.wait(timeout=30)
        self.result = json.loads(self.stats.read_text()) if self.stats.exists() else {}


def pack_cmd(args, index_dir: Path, raw: Path, out: Path, order: str) -> list[str]:
    cfg = {"resize": 0, "quality": 90, "shuffle_seed": 0, "check_scan_data": True, "read_order": order}
    return [
        sys.executable,
        "-m",
        "rectrain.data.pack",
        "--config-json",
        json.dumps(cfg),
        "--index",
        str(index_dir),
        "--raw",
        str(raw),
        "--split",
        "train",
        "--rec",
        str(out / "train.rec"),
        "--idx",
        str(out / "train.idx"),
        "--manifest",
        str(out / "train.manifest.json"),
        "--threads",
        str(args.threads),
    ]


def im2rec_cmd(args, prefix: Path, root: Path) -> list[str]:
    flags = ["--num-thread", str(args.threads), "--quality", "90", "--pass-through"]
    return [str(MXPY), "-m", "mxnet.tools.im2rec", *flags, str(prefix), str(root)]


def one_run(args, name: str, out: Path, raw: Path, index_dir: Path) -> dict:
    mnt, cores = out / "mnt", sorted(os.sched_getaffinity(0))[: args.threads]
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    with SlowMount(args, raw, mnt, out / f"{name}.stats.json") as mount:
        if name == "im2rec":
            cmd = im2rec_cmd(args, out / "im2rec" / "train", mnt / "train")
            wall, cpu = timed(cmd, cores)
        else:
            wall, cpu = timed(pack_cmd(args, index_dir, mnt, out / name, name), cores, env)
    rec = out / name / "train.rec"
    return {"wall_s": wall, "cpu_s": cpu, "head": mount.result, "rec_sha256": _sha256(rec) if rec.exists() else None}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class DataDisk:
    """A fresh ext4 file system in an image file, loop-mounted: the raw images' own disk, with their
    blocks laid out as extracting them onto an empty data disk lays them out."""

    def __init__(self, image: Path, mountpoint: Path, nbytes: int):
        self.image, self.mountpoint, self.nbytes = image, mountpoint, nbytes

    def __enter__(self):
        subprocess.run(["umount", str(self.mountpoint)], capture_output=True)
        self.image.unlink(missing_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.nbytes)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(self.image)], check=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-o", "loop", str(self.image), str(self.mountpoint)], check=True)
        return self

    def __exit__(self, *exc):
        subprocess.run(["umount", str(self.mountpoint)], check=False)
        self.image.unlink(missing_ok=True)


def extract_by_class(src: Path, dst: Path) -> None:
    """Copy each class folder whole, files in name order, one folder after the other."""
    for folder in sorted(p for p in src.iterdir() if p.is_dir()):
        (dst / folder.name).mkdir(parents=True)
        for f in sorted(folder.iterdir()):
            shutil.copyfile(f, dst / folder.name / f.name)
    os.sync()  # blocks are allocated before the view reads their addresses


def run(args) -> dict:
    out = Path(args.out).resolve()
    made = out / "made"
    make_images(made, args.images, args.classes)
    size = sum(p.stat().st_size for p in made.rglob("*.JPEG"))
    with DataDisk(out / "disk.img", out / "disk", 3 * size + (256 << 20)) as disk:
        raw = disk.mountpoint
        for split in ("train", "val"):
            extract_by_class(made / split, raw / split)
        return measure(args, out, raw)


def measure(args, out: Path, raw: Path) -> dict:
    index_dir = out / "index"
    rindex.write_index(rindex.discover(raw), index_dir)
    n = len((index_dir / "train.tsv").read_text().splitlines()) - 1
    (out / "im2rec").mkdir(parents=True, exist_ok=True)
    listing = [str(MXPY), "-m", "mxnet.tools.im2rec", "--list", "--recursive", str(out / "im2rec" / "train")]
    subprocess.run([*listing, str(raw / "train")], check=True, capture_output=True)
    runs = {name: one_run(args, name, out, raw, index_dir) for name in args.runs}
    return {"images": n, "source_mb": _source_mb(raw), "threads": args.threads, "cpu": _cpu_name(), "runs": runs}


def _source_mb(raw: Path) -> float:
    return sum(p.stat().st_size for p in (raw / "train").rglob("*.JPEG")) / 1e6


def report(result: dict, args) -> str:
    runs, n = result["runs"], result["images"]
    lines = [
        f"{n} images ({result['source_mb']:.0f} MB) in {args.classes} class folders, {result['threads']} threads, "
        f"{result['cpu']}; simulated disk: seek {args.seek_ms} ms, short seek {args.near_ms} ms, {args.mb_s} MB/s",
        "| run | wall s | img/s | seeks (long + short) | head busy s | CPU s | wall vs storage order |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = runs.get("storage", {}).get("wall_s")
    for name, r in runs.items():
        head = r["head"]
        ratio = f"{r['wall_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {r['wall_s']:.1f} | {n / r['wall_s']:.0f} | {head.get('seeks', '?')} + {head.get('short_seeks', '?')} | "
            f"{head.get('busy_s', float('nan')):.1f} | {r['cpu_s']:.1f} | {ratio} |"
        )
    if "storage" in runs and "shuffled" in runs:
        same = runs["storage"]["rec_sha256"] == runs["shuffled"]["rec_sha256"]
        lines.append(f"storage-order .rec {'identical to' if same else 'DIFFERS FROM'} the shuffled-read .rec")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--classes", type=int, default=50)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    ap.add_argument("--sim-python", default=sys.executable, help="a python with fusepy (runs bench/hdd_sim.py)")
    ap.add_argument("--seek-ms", type=float, default=12.7, help="a long seek, incl. half a rotation")
    ap.add_argument("--near-ms", type=float, default=5.2, help="a seek of at most 64 MiB, incl. half a rotation")
    ap.add_argument("--mb-s", type=float, default=150.0)
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "hdd"))
    args = ap.parse_args()
    result = run(args)
    (Path(args.out) / "result.json").write_text(json.dumps(result, indent=1))
    print(report(result, args))


if __name__ == "__main__":
    main()
