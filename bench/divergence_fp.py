"""How often the divergence rule (rectrain.train.lifecycle.divergence: the loss band, the parameters'
norm, a non-finite loss) stops a healthy run, and how close healthy runs come to its thresholds.

    OMP_NUM_THREADS=1 .venv/bin/python bench/divergence_fp.py [--epochs 3] [--runs 10]
    .venv/bin/python bench/divergence_fp.py --scan /tmp/suite-basetemp     # after the tests ran there

Without --scan: trains bench/small_set_defaults.py's digits set (1,400 train / 397 val, 16 px, one CPU
process, fp32) `--runs` times - its rows (the schema's defaults, then each setting flipped), then the
defaults under other train.seed values - and prints per run whether the rule stopped it, its last
val top-1, and its telemetry/divergence.json margins: the loss's highest share of its band's top (1 =
stopped), the parameters' norm's highest growth over the run's start (100 = stopped), SGD's longest
update as a share of the weights (1 = stopped).  A run the rule stops is a false positive: these runs
all learn (bench/RESULTS.md, "Defaults on a small real-image set").

With --scan DIR: every training run found under DIR (a telemetry/divergence.json: the tests' runs
left with `-o tmp_path_retention_policy=all --basetemp DIR`), its margins, and the runs that stopped on
divergence (checkpoints/diverged.json, and moved-aside runs' under checkpoints/replaced/), which the
divergence tests provoke on purpose.  A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import small_set_defaults as small  # noqa: E402

KEYS = ("loss_over_band", "norm_growth", "update_share")


def margins(out: Path) -> dict:
    path = out / "telemetry" / "divergence.json"
    return json.loads(path.read_text())["margins"] if path.exists() else {}


def rows(count: int) -> list[tuple[str, dict]]:
    """The bench's rows, then the defaults with train.seed 1, 2, ...: `count` runs in all."""
    listed = [("defaults", {}), *small.FLIPPED.items()]
    seeds = [(f"defaults, train.seed {k}", {"seed": k}) for k in range(1, count)]
    return (listed + seeds)[:count]


def train_all(epochs: int, count: int) -> None:
    stopped = 0
    with tempfile.TemporaryDirectory() as tmp:
        data = small.digits_dataset(Path(tmp) / "digits")
        for k, (name, overrides) in enumerate(rows(count)):
            out = Path(tmp) / f"run{k}"
            try:
                top1, seconds = small.train(data, out, epochs=epochs, **overrides)
                verdict = f"ran to the end, val top-1 {top1:.3f} ({seconds:.0f} s)"
            except RuntimeError as err:
                diverged = "training diverged" in str(err)
                stopped += diverged
                verdict = "STOPPED on divergence" if diverged else f"failed: {str(err)[-300:]}"
            m = margins(out)
            shown = ", ".join(f"{key} {m.get(key, float('nan')):.3g}" for key in KEYS)
            print(f"{name}: {verdict}; margins: {shown}", flush=True)
    print(f"{stopped} of {count} healthy runs stopped by the divergence rule")


def scan(root: Path) -> None:
    found = sorted(root.rglob("telemetry/divergence.json"))
    peaks = {key: 0.0 for key in KEYS}
    for path in found:
        m = json.loads(path.read_text())["margins"]
        for key in KEYS:
            peaks[key] = max(peaks[key], float(m.get(key) or 0.0))
    diverged = sorted(p.parent.parent for p in root.rglob("checkpoints/diverged.json"))
    diverged += sorted(p.parents[3] for p in root.rglob("checkpoints/replaced/*/diverged.json"))
    print(
        f"{len(found)} training runs with margins under {root}; the highest: "
        + ", ".join(f"{k} {v:.3g}" for k, v in peaks.items())
    )
    print(f"{len(diverged)} stopped on divergence:")
    for run in diverged:
        print(f"  {run}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--scan", type=Path, help="report the runs a test session left under this folder instead")
    args = ap.parse_args()
    if args.scan:
        scan(args.scan)
    else:
        train_all(args.epochs, args.runs)


if __name__ == "__main__":
    main()
