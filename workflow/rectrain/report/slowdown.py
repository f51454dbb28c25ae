"""Epochs that ran slower than the run's others, and whether other processes used the CPUs then.

A run whose epochs 5-6 went from ~100 to ~20 img/s while another program kept the CPUs busy got a
diagnosis that named only the disk.  The sampler writes the machine's busy CPU (system.csv's
cpu_percent) and the job's own processes' (job_cpu_percent, on the same scale: 100 = every CPU of the
machine), so what other processes used is their difference.  The rule, from measured numbers only:

- each epoch's rate: the images all ranks trained in it over the wall clock from its second step's
  start to its last step's end (steps.csv; the first step's loader start-up, validation and
  checkpoints between epochs left out);
- slow: below report.slow_epoch_ratio x the median epoch's rate; consecutive slow epochs are one span,
  held against the median rate of the epochs that were not slow;
- other processes' share: the mean of cpu_percent - job_cpu_percent over the system samples taken
  within the span's epochs, against the same over the other epochs;
- named when other processes used at least report.other_cpu_percent % of the machine's CPUs during the
  span, and RISE_POINTS percentage points more than in the other epochs: their load coincides with the
  slowdown (on a machine others keep busy throughout, the rise is what a newcomer adds).

Pure functions over parsed telemetry, like diagnosis.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from rectrain.report.diagnosis import Finding
from rectrain.report.stats import steady_steps
from rectrain.settings import ReportSettings

# How much more of the CPUs other processes must use in the slow epochs than in the others (the
# samples' noise on an otherwise steady machine is a few points).
RISE_POINTS = 5.0


def epoch_windows(steps: pd.DataFrame) -> pd.DataFrame:
    """Per epoch (index): start, end (unix seconds), images and the rate of all ranks (img/s), each
    epoch's first step left out (its loader start-up: stats.steady_steps)."""
    steps = steady_steps(steps)
    if steps.empty:
        return pd.DataFrame(columns=["start", "end", "images", "rate"])
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


@dataclass(frozen=True)
class Slowed:
    """A span of slow epochs other processes' load coincided with (see the module doc)."""

    span: list[int]
    speed: float  # its img/s
    base: float  # the median img/s of the other epochs
    during: tuple[float, float]  # (other processes' CPU %, the run's own) in the span
    before: tuple[float, float]  # the same in the other epochs

    def text(self) -> str:
        return (
            f"{_epochs(self.span)}: {self.speed:.1f} img/s against {self.base:.1f} img/s (the median of the other "
            f"epochs); other processes used {self.during[0]:.0f} % of the machine's CPUs then and {self.before[0]:.0f} % "
            f"in the other epochs, this run's own processes {self.during[1]:.0f} % and {self.before[1]:.0f} %"
        )


def slowed_spans(windows: pd.DataFrame, system: pd.DataFrame, ratio: float, limit: float) -> list[Slowed]:
    """Every span of slow epochs during which other processes used the CPUs (see the module doc)."""
    found = []
    for span in slow_spans(windows["rate"], ratio):
        rest = windows.drop(index=span)
        during, before = other_share(system, windows.loc[span]), other_share(system, rest)
        if rest.empty or during is None or before is None or during[0] < limit or during[0] - before[0] < RISE_POINTS:
            continue
        seconds = float((windows.loc[span, "end"] - windows.loc[span, "start"]).sum())
        found.append(
            Slowed(
                span, float(windows.loc[span, "images"].sum()) / seconds, float(rest["rate"].median()), during, before
            )
        )
    return found


def other_processes(steps: pd.DataFrame, system: pd.DataFrame, report: ReportSettings) -> Finding | None:
    """The finding for the spans of slow epochs during which other processes used the CPUs, titled by the
    one where their share rose most (see the module doc); None when no span qualifies or the telemetry
    lacks the job's own CPU."""
    if system.empty or "job_cpu_percent" not in system or system["job_cpu_percent"].dropna().empty:
        return None
    windows = epoch_windows(steps)
    ratio, limit = float(report.slow_epoch_ratio), float(report.other_cpu_percent)
    found = slowed_spans(windows, system, ratio, limit) if len(windows) >= 2 else []
    if not found:
        return None
    top = max(found, key=lambda s: s.during[0] - s.before[0])
    return Finding(
        id="other_processes",
        severity="warning",
        title=(
            f"Other processes slowed training: {_epochs(top.span)} ran at {top.speed / top.base:.1f}x the other "
            f"epochs' rate while other processes used {top.during[0]:.0f} % of the CPUs"
        ),
        measured="; ".join(s.text() for s in found)
        + " (system.csv: the machine's busy CPU less the run's own processes')",
        threshold=(
            f"an epoch below report.slow_epoch_ratio = {ratio:g} x the median epoch's img/s while other "
            f"processes used at least report.other_cpu_percent = {limit:g} % of the CPUs, {RISE_POINTS:g} "
            "points more than in the other epochs"
        ),
        fix=(
            "Something else ran on this machine while those epochs trained (`top` or `htop` names it while it "
            "runs): train with the machine to itself, or run the other program at a lower priority (`nice -n 19`); "
            "training's loader workers and the model share the CPUs with it."
        ),
    )
