"""The report and the telemetry files at full ImageNet-run size, against the limits of issue 12.

    .venv/bin/python bench/report_scale.py [--epochs 90] [--steps 5005] [--ranks 2] [--classes 1000]

Writes synthetic stage outputs of a finished run (tests/helpers/synthetic_run: 90 epochs x 5005 steps x
2 ranks = 900,900 step rows, one system.csv row a second over the run's 62.6 hours, 1000 classes) into a
temporary folder, then measures:
  build   `python -m rectrain.report` as the rule runs it: wall time and peak RSS   (limit 60 s)
  page    the size of report.html                                                    (limit 5 MB)
  render  headless Chromium opening the page and dumping its DOM, and the same for an
          empty page (the browser's own start-up, for scale)                           (limit 5 s)
  telemetry  a resume that keeps the first 89 epochs of one rank's steps CSV (450,450 rows), and
          the merge of every rank's steps CSV into steps.csv (rectrain.train.telemetry)
and prints each with its verdict.  Load of the machine is printed too: it is shared.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "workflow"), str(REPO / "tests")]

from helpers.synthetic_run import REPORT_CFG, write_run  # noqa: E402

from rectrain.train import telemetry  # noqa: E402

LIMITS = {"build_s": 60.0, "page_mb": 5.0, "render_s": 5.0}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]


def build_report(paths: dict, out: Path) -> tuple[float, float]:
    """(wall s, peak RSS MB) of the report CLI on the synthetic run."""
    config = {"dataset": "demo", "report": dict(REPORT_CFG)}
    dirs = [f"--{k}-dir={paths[k]}" for k in ("train", "eval", "pack", "index")]
    cmd = [sys.executable, "-m", "rectrain.report", "--config-json", json.dumps(config), *dirs]
    cmd += ["--benchmarks", str(paths["benchmarks"]), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "workflow")}
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env)
    wall = time.perf_counter() - t
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def render_s(chromium: str, page: Path, tmp: Path) -> float:
    """Wall time of a fresh headless Chromium loading `page` and dumping its DOM."""
    profile = Path(tempfile.mkdtemp(dir=tmp, prefix="profile-"))
    t = time.perf_counter()
    subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return time.perf_counter() - t


def telemetry_costs(train_dir: Path, tmp: Path, ranks: int, epochs: int) -> dict:
    """Seconds to resume one rank's steps CSV keeping epochs < epochs - 1, and to merge every rank's."""
    import pandas as pd

    live = tmp / "telemetry"
    live.mkdir()
    steps = pd.read_csv(train_dir / "steps.csv")
    for r in range(ranks):
        steps[steps["rank"] == r].to_csv(live / f"steps_rank{r}.csv", index=False)
    t = time.perf_counter()
    telemetry.step_log(live, 0, epochs - 1).close()
    resume = time.perf_counter() - t
    kept = sum(1 for _ in open(live / "steps_rank0.csv")) - 1
    t = time.perf_counter()
    telemetry.merge_steps(live, tmp / "steps.csv", ranks)
    return {"resume_s": resume, "kept_rows": kept, "merge_s": time.perf_counter() - t, "rows": len(steps)}


def verdict(value: float, limit: float) -> str:
    return "PASS" if value < limit else "FAIL"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--steps", type=int, default=5005)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (path printed)")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    tmp = Path(tempfile.mkdtemp(prefix="report-scale-"))
    try:
        t = time.perf_counter()
        span_s = args.epochs * args.steps * 0.5  # make_steps' 0.5 s steps
        paths = write_run(
            tmp,
            wait_share={r: 0.05 for r in range(args.ranks)},
            gpus={r: (85.0, 9000.0, 11264.0) for r in range(args.ranks)},
            epochs=args.epochs,
            steps=args.steps,
            classes=args.classes,
            samples=int(span_s),
            evil=False,
        )
        print(f"synthetic run written in {time.perf_counter() - t:.1f} s: {tmp}")
        page = tmp / "report.html"
        wall, rss = build_report(paths, page)
        mb = page.stat().st_size / 1e6
        print(f"build   {wall:6.1f} s (peak RSS {rss:.0f} MB)  limit {LIMITS['build_s']:.0f} s  {verdict(wall, 60)}")
        print(f"page    {mb:6.2f} MB                    limit {LIMITS['page_mb']:.0f} MB  {verdict(mb, 5)}")
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium:
            empty = tmp / "empty.html"
            empty.write_text("<!DOCTYPE html><title>empty</title>")
            base, full = render_s(chromium, empty, tmp), render_s(chromium, page, tmp)
            print(
                f"render  {full:6.1f} s (empty page {base:.1f} s)  limit {LIMITS['render_s']:.0f} s  {verdict(full, 5)}"
            )
        else:
            print("render  not measured: chromium is not installed")
        tel = telemetry_costs(paths["train"], tmp, args.ranks, args.epochs)
        print(
            f"telemetry: resume keeping {tel['kept_rows']} rows of rank 0 in {tel['resume_s']:.1f} s, "
            f"merge of {tel['rows']} rows in {tel['merge_s']:.1f} s"
        )
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
