"""The input efficiency at each training resolution (train.progressive; one row without a schedule):
the steady step rates of the epochs at that resolution (epochs.csv's `resolution` column, steps.csv)
against the calibration run.json holds for it (its `by_resolution`, else the run's one).  Time per
epoch at each resolution and its projection to ImageNet: rectrain.report.projection.per_resolution."""

from __future__ import annotations

from typing import Mapping

import pandas as pd

from rectrain.report.efficiency import steady_rates, synthetic_at


def resolution_rows(epochs: pd.DataFrame, steps: pd.DataFrame, run: Mapping | None) -> list[dict]:
    """One row per training resolution, smallest first: epochs trained at it, steady img/s of all ranks
    (steps.csv) and the calibration's at that resolution with their ratio.  Empty for an epochs.csv
    written before the column existed."""
    if epochs.empty or "resolution" not in epochs:
        return []
    rows = []
    for res, group in epochs.groupby("resolution"):
        res = int(res)
        mine = steps[steps["epoch"].isin(group["epoch"])] if not steps.empty else steps
        steady = sum(steady_rates(mine).values()) or None
        synthetic = synthetic_at((run or {}).get("calibration"), res)
        rows.append(
            {
                "resolution": res,
                "epochs": len(group),
                "steady_img_s": steady,
                "synthetic_img_s": synthetic,
                "efficiency": steady / synthetic if steady and synthetic else None,
            }
        )
    return rows
