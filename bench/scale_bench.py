"""ImageNet scale: does the pipeline's cost per image stay flat and its memory bounded from 10 k to 1.28 M?

    .venv/bin/python bench/scale_bench.py --sizes 10000 100000 [1281167] [--layouts folders archives]
        [--work /tmp/rectrain_scale] [--index-only] [--clean] [--table-only]

For each size and raw layout (bench/scale_data.py writes the tree: N tiny JPEGs in 1000 classes, as
class folders and as the official nested archives) it runs the stages the way the Snakemake rules
call them, each in its own process, into a run folder laid out as the workflow lays it out:
  index      python -m rectrain.data.index (rule index_raw)
  pack       python -m rectrain.data.pack, pass-through (resize 0), train then val (rule pack; the pack
             verifies its own output before publishing it)
  verify     python -m rectrain.data.verify on the published train pair (a second, independent read)
  torch, dali  the training loaders (CPU decode) on the train .rec/.idx: seconds from building the
             loader to its first batch of epoch 0, then the rest of a pass over --loader-images images
  report     python -m rectrain.report on the real index and pack outputs plus synthetic train/eval
             telemetry of this size (2 epochs x N/256 steps x 2 ranks; tests/helpers/synthetic_run)
  dry-run    snakemake -n on the finished run folder (every output present): must find nothing to do
Per stage: wall time, time per image (of the split the stage reads) and peak memory (the RSS high-water
mark of the stage's process and its worker processes, from wait4). Each (size, layout) writes
result.json under --work; the table and the growth factors between sizes cover every result there,
so sizes can be run one at a time. Verdicts against issue 12's targets are printed last.
A benchmark, not a test: generated data stays under --work (outside the repo); --clean deletes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "workflow"))

import scale_data  # noqa: E402
from pack_bench import _cpu_name  # noqa: E402

DS = "scale"
STAGES = ("index", "pack train", "pack val", "verify", "torch", "dali", "report", "dry-run")
# Issue 12's targets at 1.28 M images.
MAX_GROWTH = 1.25  # time per image at the largest size / at the size before it
MAX_PEAK_MIB = 512  # index and pack peak memory
MAX_DRYRUN_S = 3.0
DRYRUN_REPEATS = 5  # the box's noise moves one dry-run by +-1 s: the verdict is on the median
MAX_FIRST_BATCH_S = 10.0
LOADER_BATCH, LOADER_IMAGE_SIZE = 256, 64
TIME = "/usr/bin/time"  # GNU time: the peak RSS of a command tree


@dataclass
class Stage:
    wall_s: float
    peak_mib: float
    cpu_s: float
    images: int
    detail: dict

    @property
    def us_per_image(self) -> float:
        return 1e6 * self.wall_s / self.images if self.images else float("nan")


def run_stage(
    cmd: list[str], log: Path, cwd: Path | None = None, env: dict | None = None
) -> tuple[float, float, float]:
    """(wall s, peak RSS MiB, CPU s) of cmd run to completion; its output goes to log. The peak is the
    kernel's high-water mark of the command and the children it waited for, as /usr/bin/time reports it:
    measured from a process of our own (getrusage of a direct child) it would start at this process's
    RSS, which a forked child inherits as its high-water mark until exec."""
    log.parent.mkdir(parents=True, exist_ok=True)
    peak_file = log.with_suffix(".maxrss")
    with open(log, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [TIME, "-f", "%M", "-o", str(peak_file), *map(str, cmd)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(map(str, cmd[:4]))} failed (exit {proc.returncode}); its log {log}:\n{log.read_text()[-3000:]}"
        )
    peak_kib = int(peak_file.read_text().split()[-1])
    return wall, peak_kib / 1024, usage.ru_utime + usage.ru_stime


def stage_env() -> dict:
    venv_bin = str(Path(sys.executable).parent)
    return dict(os.environ, PYTHONPATH=str(REPO / "workflow"), PATH=f"{venv_bin}{os.pathsep}{os.environ['PATH']}")


class Run:
    """One (size, layout): its run folder (the workflow's layout under run/) and its stage results."""

    def __init__(self, work: Path, n: int, layout: str):
        self.n, self.layout = n, layout
        self.data = work / str(n) / "data"
        self.raw = self.data / layout
        self.dir = work / str(n) / layout
        self.run = self.dir / "run"
        self.index = self.run / "results" / DS / "index"
        self.pack = self.run / "results" / DS / "pack"
        self.fast = self.run / "fast" / DS
        self.stages: dict[str, Stage] = {}

    def stage(self, name: str, cmd: list[str], images: int, cwd: Path | None = None, **detail) -> Stage:
        wall, peak, cpu = run_stage(cmd, self.dir / "logs" / f"{name.replace(' ', '_')}.log", cwd, stage_env())
        self.stages[name] = Stage(wall, peak, cpu, images, detail)
        print(f"  {name:<11}{wall:>9.2f} s{peak:>9.0f} MiB  {self.stages[name].us_per_image:>8.1f} us/img", flush=True)
        return self.stages[name]

    def rows(self, split: str) -> int:
        with open(self.index / f"{split}.tsv", "rb") as f:
            return sum(1 for _ in f) - 1

    def config(self) -> dict:
        return {"dataset": DS, "raw": str(self.raw), "pack": {"fast_storage": "fast"}}


def py(module: str, *args) -> list[str]:
    return [sys.executable, "-m", module, *map(str, args)]


def pack_cmd(r: Run, split: str, threads: int) -> list[str]:
    return py(
        "rectrain.data.pack",
        *("--config-json", json.dumps({"resize": 0}), "--index", r.index, "--raw", r.raw, "--split", split),
        *("--rec", r.fast / f"{split}.rec", "--idx", r.fast / f"{split}.idx"),
        *("--manifest", r.pack / f"{split}.manifest.json", "--threads", threads),
    )


def data_stages(r: Run, threads: int, loader_images: int) -> None:
    r.stage("index", py("rectrain.data.index", "--config-json", "{}", "--raw", r.raw, "--out", r.index), r.n)
    for split in ("train", "val"):
        r.stage(f"pack {split}", pack_cmd(r, split, threads), r.rows(split))
    rec, idx = r.fast / "train.rec", r.fast / "train.idx"
    verify = ("--rec", rec, "--idx", idx, "--index", r.index, "--split", "train")
    r.stage("verify", py("rectrain.data.verify", *verify, "--manifest", r.pack / "train.manifest.json"), r.n)
    for kind in ("torch", "dali"):
        probe = [sys.executable, __file__, "probe-loader", kind, rec, idx, min(r.n, loader_images), threads]
        stage = r.stage(kind, list(map(str, probe)), min(r.n, loader_images))
        stage.detail.update(json.loads((r.dir / "logs" / f"{kind}.log").read_text().splitlines()[-1]))


def probe_loader(kind: str, rec: str, idx: str, images: int, workers: int) -> None:
    """Child process of the torch/dali stage: prints JSON {import_s, first_batch_s, images, img_s}."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 - imports are not the loader's start-up: timed apart

    if kind == "dali":
        import nvidia.dali.plugin.pytorch  # noqa: F401
    from rectrain.loaders import LoaderSpec, build_loader

    spec = LoaderSpec(rec, idx, batch_size=LOADER_BATCH, image_size=LOADER_IMAGE_SIZE, train=True, workers=workers)
    t1 = time.perf_counter()
    loader = build_loader(kind, spec)
    seen, first = 0, None
    for _, labels in loader.epoch(0):
        seen += len(labels)
        first = first or time.perf_counter()
        if seen >= images:
            break
    t2 = time.perf_counter()
    steady = (seen - LOADER_BATCH) / (t2 - first) if seen > LOADER_BATCH else float("nan")
    print(json.dumps({"import_s": t1 - t0, "first_batch_s": first - t1, "images": seen, "img_s": steady}))


def write_telemetry(r: Run, epochs: int = 2, world: int = 2) -> None:
    """Synthetic train and eval outputs of this dataset size (2 ranks, batch 128), for the report."""
    import pandas as pd
    from helpers import synthetic_run as syn

    train, ev = r.run / "results" / DS / "main" / "train", r.run / "results" / DS / "main" / "eval"
    for d in (train, ev):
        d.mkdir(parents=True, exist_ok=True)
    steps = math.ceil(r.n / (world * 128))
    syn.make_steps({rank: 0.02 for rank in range(world)}, epochs=epochs, steps=steps, images=128).to_csv(
        train / "steps.csv", index=False
    )
    syn.make_system(n=600).to_csv(train / "system.csv", index=False)
    syn.make_epochs(epochs).to_csv(train / "epochs.csv", index=False)
    (train / "run.json").write_text(json.dumps(syn.make_run(world_size=world, gpus=world, epochs=epochs)))
    (train / "model.pt").write_bytes(b"synthetic")
    classes = pd.read_csv(r.index / "classes.tsv", sep="\t", keep_default_na=False, dtype={"wnid": str, "name": str})
    syn.make_per_class(classes).to_csv(ev / "per_class.csv", index=False)
    metrics = {"top1": 0.7, "top5": 0.9, "loss": 1.2, "images": r.rows("val"), "images_per_s": 2000.0}
    (ev / "metrics.json").write_text(json.dumps({**metrics, "loader": "dali", "checkpoint": str(train / "model.pt")}))


def write_benchmark(r: Run, rule: str, name: str, stage: Stage | None) -> Path:
    """A Snakemake benchmark TSV: this bench's measurement of the stage, or a synthetic row (train, evaluate)."""
    from helpers.synthetic_run import BENCH_COLUMNS

    wall, peak, cpu = (stage.wall_s, stage.peak_mib, stage.cpu_s) if stage else (3600.0, 4000.0, 7000.0)
    row = [wall, time.strftime("%H:%M:%S", time.gmtime(wall)), peak, peak, peak, peak, 0.0, 0.0, 50.0, cpu]
    path = r.run / "benchmarks" / rule / f"{name}.tsv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\t".join(BENCH_COLUMNS) + "\n" + "\t".join(map(str, row)) + "\n")
    return path


def run_stages(r: Run) -> None:
    """report (on real index/pack outputs and synthetic telemetry), then snakemake -n on the finished run."""
    write_telemetry(r)
    marks = [
        write_benchmark(r, "index_raw", DS, r.stages["index"]),
        write_benchmark(r, "pack", f"{DS}_train", r.stages["pack train"]),
        write_benchmark(r, "pack", f"{DS}_val", r.stages["pack val"]),
        write_benchmark(r, "train", f"{DS}/main", None),
        write_benchmark(r, "evaluate", f"{DS}/main", None),
    ]
    (r.run / "config.yaml").write_text(json.dumps(r.config()))
    dirs = [f"results/{DS}/{d}" for d in ("main/train", "main/eval", "pack", "index")]
    args = ["--config-json", json.dumps(r.config())]
    args += [f"--{k}-dir" for k in ("train", "eval", "pack", "index")]
    cmd = py("rectrain.report", *args[:2], *(x for pair in zip(args[2:], dirs, strict=True) for x in pair))
    cmd += ["--benchmarks", *map(str, marks), "--out", "results/report.html"]
    r.stage("report", cmd, r.n, cwd=r.run)
    write_benchmark(r, "report", f"{DS}/main", r.stages["report"])
    dry_runs(r)


def dry_runs(r: Run, repeats: int = DRYRUN_REPEATS) -> None:
    """snakemake -n on the finished run `repeats` times, each after `snakemake --version` (Snakemake's
    own start-up: the floor under any dry-run, and how busy the box is right now).  The stage keeps the
    median run; its detail keeps every wall time of both, so the verdict can quote the spread."""
    snakemake = str(Path(sys.executable).parent / "snakemake")
    cmd = [snakemake, "-n", "--cores", "2", "--snakefile", str(REPO / "Snakefile"), "--configfile", "config.yaml"]
    runs, floor = [], []
    for _ in range(repeats):
        floor.append(run_stage([snakemake, "--version"], r.dir / "logs" / "version.log", r.run, stage_env())[0])
        stage = r.stage("dry-run", cmd, r.n, cwd=r.run)
        stage.detail["nothing_to_do"] = "Nothing to be done" in (r.dir / "logs" / "dry-run.log").read_text()
        runs.append(stage)
    median = sorted(runs, key=lambda st: st.wall_s)[len(runs) // 2]
    median.detail.update(
        nothing_to_do=all(st.detail["nothing_to_do"] for st in runs),
        walls=[round(st.wall_s, 3) for st in runs],
        version_walls=[round(w, 3) for w in floor],
    )
    r.stages["dry-run"] = median


def bench_one(work: Path, n: int, layout: str, threads: int, loader_images: int, index_only: bool = False) -> dict:
    r = Run(work, n, layout)
    shutil.rmtree(r.run, ignore_errors=True)
    t0 = time.perf_counter()
    made = scale_data.generate(n, r.data, (layout,))
    print(f"{n} images, {layout}: data ready in {time.perf_counter() - t0:.1f} s {made['seconds']}", flush=True)
    if index_only:
        r.stage("index", py("rectrain.data.index", "--config-json", "{}", "--raw", r.raw, "--out", r.index), r.n)
    else:
        data_stages(r, threads, loader_images)
        run_stages(r)
    result = {
        "images": n,
        "layout": layout,
        "generate_s": made["seconds"].get(layout),
        "stages": {k: {**asdict(v), "us_per_image": v.us_per_image} for k, v in r.stages.items()},
    }
    (r.dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------- table, growth, verdicts


def load_results(work: Path) -> dict[tuple[str, int], dict]:
    found = {}
    for path in sorted(work.glob("*/*/result.json")):
        res = json.loads(path.read_text())
        found[(res["layout"], res["images"])] = res
    return found


def growth(results: dict, layout: str, stage: str) -> list[tuple[int, int, float, float, float]]:
    """(smaller N, larger N, factors of wall time per image, CPU time per image and peak memory) between
    consecutive sizes. CPU time is what the other tenants of a shared machine cannot inflate."""
    sizes = sorted(n for (lay, n), res in results.items() if lay == layout and stage in res["stages"])
    out = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        sa, sb = results[(layout, a)]["stages"][stage], results[(layout, b)]["stages"][stage]
        cpu = (sb["cpu_s"] / sb["images"]) / (sa["cpu_s"] / sa["images"])
        out.append((a, b, sb["us_per_image"] / sa["us_per_image"], cpu, sb["peak_mib"] / sa["peak_mib"]))
    return out


def format_table(results: dict) -> str:
    """Markdown: one row per (layout, stage, size), with the growth factors against the size before.
    us/img is per image the stage read (val for pack val, the first images of the epoch for a loader)."""
    lines = [
        "| layout | stage | N (train) | images read | wall s | us/img | CPU us/img | peak MiB | x us/img | x CPU | x peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in sorted({lay for lay, _ in results}):
        for stage in STAGES:
            factors = {b: rest for _, b, *rest in growth(results, layout, stage)}
            for n in sorted(n for lay, n in results if lay == layout):
                s = results[(layout, n)]["stages"].get(stage)
                if s is None:
                    continue
                grew = " | ".join(f"{x:.2f}" for x in factors[n]) if n in factors else "- | - | -"
                lines.append(
                    f"| {layout} | {stage} | {n:,} | {s['images']:,} | {s['wall_s']:.2f} | {s['us_per_image']:.1f} | "
                    f"{1e6 * s['cpu_s'] / s['images']:.1f} | {s['peak_mib']:.0f} | {grew} |"
                )
    return "\n".join(lines)


def verdicts(results: dict) -> list[str]:
    """Issue 12's targets, checked on the largest size of each layout (growth: against the size before)."""
    lines = []
    for layout in sorted({lay for lay, _ in results}):
        n = max(n for lay, n in results if lay == layout)
        st = results[(layout, n)]["stages"]
        for stage in ("index", "pack train"):
            if stage not in st:
                continue
            g = growth(results, layout, stage)
            if g:
                a, _, wall, cpu, _ = g[-1]
                lines.append(
                    f"{_tag(cpu <= MAX_GROWTH)} {layout} {stage}: time/img x{cpu:.2f} CPU (x{wall:.2f} wall) from "
                    f"{a:,} to {n:,} (target <= {MAX_GROWTH}, on CPU time: other tenants inflate wall time)"
                )
            lines.append(
                f"{_tag(st[stage]['peak_mib'] < MAX_PEAK_MIB)} {layout} {stage}: peak "
                f"{st[stage]['peak_mib']:.0f} MiB at {n:,} (target < {MAX_PEAK_MIB})"
            )
        if "dry-run" in st:
            lines.append(dry_run_verdict(layout, n, st["dry-run"]))
        for kind in ("torch", "dali"):
            if kind in st:
                first = st[kind]["detail"]["first_batch_s"]
                lines.append(
                    f"{_tag(first < MAX_FIRST_BATCH_S)} {layout} {kind} loader: first batch "
                    f"{first:.2f} s on the {n:,}-record .idx, peak {st[kind]['peak_mib']:.0f} MiB "
                    f"(target < {MAX_FIRST_BATCH_S} s)"
                )
    return lines


def dry_run_verdict(layout: str, n: int, d: dict) -> str:
    walls, floor = d["detail"].get("walls", [d["wall_s"]]), d["detail"].get("version_walls", [])
    ok = d["wall_s"] < MAX_DRYRUN_S and d["detail"].get("nothing_to_do")
    spread = f" (runs {min(walls):.2f}-{max(walls):.2f} s" + (
        f"; Snakemake's own start-up, --version, median {sorted(floor)[len(floor) // 2]:.2f} s)" if floor else ")"
    )
    return (
        f"{_tag(ok)} {layout} snakemake -n: median {d['wall_s']:.2f} s of {len(walls)}{spread} at {n:,}, "
        f"{'nothing to do' if d['detail'].get('nothing_to_do') else 'JOBS SCHEDULED'} "
        f"(target < {MAX_DRYRUN_S} s, nothing to do)"
    )


def _tag(ok) -> str:
    return "PASS" if ok else "FAIL"


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{_cpu_name()}, {os.cpu_count()} cores, load average {one:.1f} / {five:.1f} / {fifteen:.1f}"


def main(argv=None) -> None:
    if argv is None and sys.argv[1:2] == ["probe-loader"]:
        kind, rec, idx, images, workers = sys.argv[2:7]
        return probe_loader(kind, rec, idx, int(images), int(workers))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000])
    ap.add_argument("--layouts", nargs="+", choices=scale_data.LAYOUTS, default=list(scale_data.LAYOUTS))
    ap.add_argument("--work", type=Path, default=Path("/tmp/rectrain_scale"))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="pack threads, loader workers")
    ap.add_argument(
        "--loader-images",
        type=int,
        default=10_000,
        help="images each loader reads (its first batch is the start-up time that matters)",
    )
    ap.add_argument("--index-only", action="store_true", help="generate and index only (the index stage's scaling)")
    ap.add_argument("--clean", action="store_true", help="delete each size's data and run folders after it")
    ap.add_argument("--table-only", action="store_true", help="print the table of the results under --work")
    args = ap.parse_args(argv)
    work = args.work.resolve()
    if work.is_relative_to(REPO):
        raise SystemExit(f"--work {work} is inside the repository: generated data must stay outside it")
    print(load_note(), flush=True)
    for n in [] if args.table_only else args.sizes:
        for layout in args.layouts:
            bench_one(work, n, layout, args.threads, args.loader_images, args.index_only)
            if args.clean:
                shutil.rmtree(work / str(n) / layout / "run", ignore_errors=True)
                shutil.rmtree(work / str(n) / "data" / layout, ignore_errors=True)
    results = load_results(work)
    print(format_table(results))
    print("\n".join(verdicts(results)))
    print(load_note())


if __name__ == "__main__":
    main()
