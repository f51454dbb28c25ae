"""Time per epoch and img/s at each training resolution (train.progressive; one row without a schedule):
from epochs.csv's `resolution` column, the steady step rates of those epochs in steps.csv, and the
calibration run.json holds for that resolution (its `by_resolution`, else the run's one)."""

from __future__ import annotations

from typing import Mapping

import pandas as pd

from rectrain.report.stats import steady_steps


def synthetic_at(calibration: Mapping | None, resolution: int) -> float | None:
    """All ranks' synthetic img/s at `resolution` (None when not measured)."""
    cal = calibration or {}
    if cal.get("by_resolution"):
        cal = cal["by_resolution"].get(str(resolution)) or {}
    if cal.get("skipped"):
        return None
    rates = [float(v) for v in (cal.get("images_per_s") or {}).values()]
    return sum(rates) if rates else None


def steady_rate(steps: pd.DataFrame) -> float | None:
    """All ranks' steady img/s over `steps` (each rank's images over its step time, summed)."""
    s = steady_steps(steps)
    if s.empty:
        return None
    per = s.groupby("rank")[["images", "wall_s"]].sum()
    per = per[per["wall_s"] > 0]
    return float((per["images"] / per["wall_s"]).sum()) if not per.empty else None


def resolution_rows(epochs: pd.DataFrame, steps: pd.DataFrame, run: Mapping | None) -> list[dict]:
    """One row per training resolution, smallest first: epochs trained at it, mean training time per
    epoch, mean img/s (epochs.csv), steady img/s of all ranks (steps.csv) and the calibration's at that
    resolution with their ratio.  Empty for an epochs.csv written before the column existed."""
    if epochs.empty or "resolution" not in epochs:
        return []
    rows = []
    for res, group in epochs.groupby("resolution"):
        res = int(res)
        mine = steps[steps["epoch"].isin(group["epoch"])] if not steps.empty else steps
        steady, synthetic = steady_rate(mine), synthetic_at((run or {}).get("calibration"), res)
        rows.append(
            {
                "resolution": res,
                "epochs": len(group),
                "epoch_s": float(group["wall_s"].mean()),
                "img_s": float(group["images_per_s"].mean()),
                "steady_img_s": steady,
                "synthetic_img_s": synthetic,
                "efficiency": steady / synthetic if steady and synthetic else None,
            }
        )
    return rows
