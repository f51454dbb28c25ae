"""Numbers from the step and system telemetry and run.json that the diagnosis, the efficiency and the
report share."""

from __future__ import annotations

import re
from typing import Mapping

import pandas as pd

from rectrain.train.telemetry import GPU_FIELDS

_GPU_COLUMN = re.compile(rf"^gpu(\d+)_({'|'.join(GPU_FIELDS)})$")


def steady_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """Steps without the first one of every (rank, epoch): that one includes pipeline start-up
    (reader prefetch, worker spawn), which is not a steady-state input stall."""
    if steps.empty:
        return steps
    first = steps.groupby(["rank", "epoch"])["step"].transform("min")
    rest = steps[steps["step"] != first]
    return rest if not rest.empty else steps


def data_wait_share_by_rank(steps: pd.DataFrame) -> pd.Series:
    """Share of step wall time each rank spent waiting for its next batch (index: rank)."""
    s = steady_steps(steps)
    if s.empty:
        return pd.Series(dtype=float)
    sums = s.groupby("rank")[["data_wait_s", "wall_s"]].sum()
    share = sums["data_wait_s"] / sums["wall_s"].where(sums["wall_s"] > 0)
    return share.dropna().clip(lower=0.0, upper=1.0)


def overall_data_wait_share(steps: pd.DataFrame) -> float | None:
    s = steady_steps(steps)
    total = float(s["wall_s"].sum()) if not s.empty else 0.0
    if total <= 0:
        return None
    return min(1.0, max(0.0, float(s["data_wait_s"].sum()) / total))


def gpu_indices(system: pd.DataFrame) -> list[int]:
    """GPU indices that have telemetry columns; empty on CPU-only hosts (the columns are absent)."""
    found = {int(m.group(1)) for c in system.columns if (m := _GPU_COLUMN.match(c))}
    return sorted(found)


def gpu_memory_peak(system: pd.DataFrame) -> dict[int, tuple[float, float]]:
    """GPU index -> (peak used MB, total MB)."""
    out = {}
    for i in gpu_indices(system):
        used, total = system.get(f"gpu{i}_mem_used_mb"), system.get(f"gpu{i}_mem_total_mb")
        if used is None or total is None or used.dropna().empty or total.dropna().empty:
            continue
        out[i] = (float(used.max()), float(total.max()))
    return out


def gpu_util_mean(system: pd.DataFrame) -> dict[int, float]:
    out = {}
    for i in gpu_indices(system):
        col = system.get(f"gpu{i}_util")
        if col is not None and not col.dropna().empty:
            out[i] = float(col.mean())
    return out


def during_steps(system: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The system samples taken while some rank was inside an epoch's training steps (from its first
    step's end to its last's): start-up, validation and per-epoch set-up left out, which dominate a
    short run's wall time and would make a busy GPU look idle. All samples when none fall inside."""
    if system.empty or steps.empty or "time" not in steps or "time" not in system:
        return system
    windows = steps.groupby("epoch")["time"].agg(["min", "max"])
    inside = pd.Series(False, index=system.index)
    for lo, hi in windows.itertuples(index=False):
        inside |= system["time"].between(lo, hi)
    return system[inside] if inside.any() else system


def train_setting(run: Mapping | None, key: str):
    """A training setting as the run used it: run.json's own field, else its copy of the train block."""
    run = run or {}
    return run[key] if key in run else (run.get("config") or {}).get(key)
