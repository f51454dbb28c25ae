"""Epochs that ran slower than the run's others, and whether other processes used the CPUs then.

A run whose epochs 5-6 went from ~100 to ~20 img/s while another program kept the CPUs busy got a
diagnosis that named only the disk.  The sampler writes the machine's busy CPU (system.csv's
cpu_percent) and the job's own processes' (job_cpu_percent, on the same scale: 100 = every CPU of the
machine), so what other processes used is their difference.  The rule, from measured numbers only:

- each epoch's rate: the images all ranks trained in it over the wall clock from its first step's
  start to its last step's end (steps.csv; validation and checkpoints between epochs left out);
- slow: below report.slow_epoch_ratio x the median epoch's rate; consecutive slow epochs are one span,
  held against the median rate of the epochs that were not slow;
- other processes' share: the mean of cpu_percent - job_cpu_percent over the system samples taken
  within the span's epochs, against the same over the other epochs;
- named when it is at least report.other_cpu_percent points above the other epochs': the other
  processes' load coincides with the slowdown.

Pure functions over parsed telemetry, like diagnosis.py.
"""

from __future__ import annotations

import pandas as pd

from rectrain.report.diagnosis import Finding
from rectrain.settings import ReportSettings


def epoch_windows(steps: pd.DataFrame) -> pd.DataFrame:
    """Per epoch (index): start, end (unix seconds) and the rate of all ranks (img/s)."""
    if steps.empty:
        return pd.DataFrame(columns=["start", "end", "rate"])
    g = steps.assign(start=steps["time"] - steps["wall_s"]).groupby("epoch")
    out = pd.DataFrame({"start": g["start"].min(), "end": g["time"].max(), "images": g["images"].sum()})
    span = (out["end"] - out["start"]).where(lambda s: s > 0)
    return out.assign(rate=out["images"] / span).dropna(subset=["rate"])


def slow_spans(rates: pd.Series, ratio: float) -> list[list[int]]:
    """Runs of consecutive epochs below `ratio` x the median epoch's rate."""
    slow = [int(e) for e, r in rates.items() if r < ratio * float(rates.median())]
    spans: list[list[int]] = []
    for e in slow:
        if spans and spans[-1][-1] == e - 1:
            spans[-1].append(e)
        else:
            spans.append([e])
    return spans


def other_share(system: pd.DataFrame, windows: pd.DataFrame) -> tuple[float, float] | None:
    """(other processes' mean CPU %, the job's own) over the samples inside `windows`; None without any."""
    inside = pd.Series(False, index=system.index)
    for start, end in windows[["start", "end"]].itertuples(index=False):
        inside |= system["time"].between(start, end)
    rows = system[inside].dropna(subset=["cpu_percent", "job_cpu_percent"])
    if rows.empty:
        return None
    own = rows["job_cpu_percent"].astype(float)
    return float((rows["cpu_percent"].astype(float) - own).clip(lower=0).mean()), float(own.mean())


def _epochs(span: list[int]) -> str:
    return f"epoch {span[0]}" if len(span) == 1 else f"epochs {span[0]}-{span[-1]}"


def other_processes(steps: pd.DataFrame, system: pd.DataFrame, report: ReportSettings) -> Finding | None:
    """The finding for the first span of slow epochs during which other processes used the CPUs (see
    the module doc); None when no span qualifies or the telemetry lacks the job's own CPU."""
    if system.empty or "job_cpu_percent" not in system or system["job_cpu_percent"].dropna().empty:
        return None
    windows = epoch_windows(steps)
    if len(windows) < 2:
        return None
    ratio, limit = float(report.slow_epoch_ratio), float(report.other_cpu_percent)
    for span in slow_spans(windows["rate"], ratio):
        rest = windows.drop(index=span)
        during, before = other_share(system, windows.loc[span]), other_share(system, rest)
        if rest.empty or during is None or before is None or during[0] - before[0] < limit:
            continue
        speed = float(windows.loc[span, "images"].sum() / (windows.loc[span, "end"] - windows.loc[span, "start"]).sum())
        base = float(rest["rate"].median())
        return Finding(
            id="other_processes",
            severity="warning",
            title=(
                f"Other processes slowed training: {_epochs(span)} ran at {speed / base:.1f}x the other epochs' "
                f"rate while other processes used {during[0]:.0f} % of the CPUs"
            ),
            measured=(
                f"{_epochs(span)}: {speed:.1f} img/s against {base:.1f} img/s (the median of the other epochs); "
                f"other processes used {during[0]:.0f} % of the machine's CPUs then and {before[0]:.0f} % in the other "
                f"epochs, this run's own processes {during[1]:.0f} % and {before[1]:.0f} % (system.csv: the machine's "
                "busy CPU less the run's own processes')"
            ),
            threshold=(
                f"an epoch below report.slow_epoch_ratio = {ratio:g} x the median epoch's img/s while other "
                f"processes used report.other_cpu_percent = {limit:g} percentage points more of the CPUs than in the "
                "other epochs"
            ),
            fix=(
                "Something else ran on this machine while those epochs trained (`top` or `htop` names it while it "
                "runs): train with the machine to itself, or run the other program at a lower priority (`nice -n 19`); "
                "training's loader workers and the model share the CPUs with it."
            ),
        )
    return None
