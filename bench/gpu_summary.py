"""summary.txt for bench/gpu_check.sh: what ran on which GPU, how fast, whether the GPU waited, the
report's diagnosis (rectrain.report.diagnosis on the same telemetry), the efficiency table and the 11 GB check.

    python bench/gpu_summary.py --dataset gpudemo --out bench/out/gpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from rectrain.config import check_config  # noqa: E402
from rectrain.report import diagnosis  # noqa: E402


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def summary(results: Path, out: Path) -> str:
    lines = []
    train = results / "train"
    run = json.loads(_read(train / "run.json") or "{}")
    if not run:
        lines.append(f"pipeline: no {train / 'run.json'} - training did not finish (see logs/ in this folder)")
    else:
        gpus = (
            ", ".join(
                f"{g.get('name')} ({g.get('memory_total_mb')} MB, driver {g.get('driver')})"
                for g in run.get("gpus") or []
            )
            or "none"
        )
        lines += [
            f"GPUs: {gpus}; torch {run.get('torch')}, CUDA {run.get('cuda')}, DALI {run.get('dali')}",
            f"train: {run.get('model')} @{run.get('image_size')}px {run.get('precision')}, batch "
            f"{run.get('batch_size')} x accum {run.get('grad_accum')} x {run.get('world_size')} ranks, "
            f"loader {run.get('loader')} (requested {run.get('loader_requested')}), decode: {run.get('decode')}",
            f"preflight: {run.get('preflight')}",
        ]
        if run.get("loader_note"):
            lines.append(f"loader note: {run['loader_note']}")
        steps = pd.read_csv(train / "steps.csv")
        system = pd.read_csv(train / "system.csv")
        epochs = pd.read_csv(train / "epochs.csv")
        wait = diagnosis.overall_data_wait_share(steps)
        util = diagnosis.gpu_util_mean(system)
        lines.append(
            "epochs: "
            + "; ".join(
                f"{int(r.epoch)}: {r.images_per_s:.0f} img/s, val top-1 {r.val_top1:.3f}" for r in epochs.itertuples()
            )
        )
        lines.append(f"data-wait share (steady steps, all ranks): {wait:.3f}" if wait is not None else "no steps")
        lines.append(
            "GPU util mean: " + (", ".join(f"GPU {i}: {u:.0f} %" for i, u in util.items()) or "no GPU columns")
        )
        manifests = {
            p.name.split(".")[0]: json.loads(p.read_text()) for p in (results / "pack").glob("*.manifest.json")
        }
        report_cfg = check_config({"dataset": "x"}, REPO / "config" / "schema.yaml", workdir=REPO)["report"]
        lines.append("diagnosis:")
        for f in diagnosis.diagnose(steps, system, run, manifests, report_cfg):
            lines.append(f"  [{f.severity}] {f.title}: {f.measured} -> {f.fix}")
    metrics = _read(results / "eval" / "metrics.json")
    lines.append(f"eval: {metrics.strip() if metrics else 'missing'}")
    lines.append("efficiency (bench/gpu_efficiency.py):")
    lines.append(_read(out / "gpu_efficiency.md") or "  missing (see gpu_check.log)")
    lines.append("11 GB cap (bench/oom_cap.py):")
    lines.append(_read(out / "oom_cap.txt") or "  missing (see gpu_check.log)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="gpudemo")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    text = summary(REPO / "results" / args.dataset, args.out)
    (args.out / "summary.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
