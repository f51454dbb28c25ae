"""Where a run that has not published its outputs stands: how far it got, whether it still trains,
and how long the rest takes at the pace it measured - the live report's banner (rectrain.report.live).

Read from what the run writes as it goes (rectrain.train.outputs): the live telemetry under
train/telemetry/, run.json (written as each launch starts, `finished` filled in at the end), and the
lifecycle's markers in train/checkpoints/: stopped.json (a clean stop, rectrain.train.lifecycle.supervise)
and diverged.json (rectrain.train.lifecycle.divergence). A marker counts only when it is no older than
run.json's `started`: an older one belongs to an earlier launch of the same run. A run killed outright
(SIGKILL, out of memory, a lost machine) leaves no marker: it is told from one that still trains by
its processes, when it ran on this host, else by how long ago its telemetry was last written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd
import psutil

from rectrain.log import duration
from rectrain.progress import run_eta_s
from rectrain.report.inputs import RunData
from rectrain.train.lifecycle.status import DIVERGED, STOPPED

TRAINING, STOPPED_STATE, KILLED, DIVERGED_STATE, FINISHED = "training", "stopped", "killed", "diverged", "finished"
# The pace is the mean of rank 0's last steps (as a progress line's window is its last steps), each
# epoch's first step left out: it holds the loader's start-up.
PACE_STEPS = 200
# A run on another host is taken for gone when nothing under telemetry/ was written for this long and
# for this many system-sampler intervals (the sampler writes a row every train.sample_interval_s, also
# while the run validates or writes a checkpoint).
STALE_S = 300.0
STALE_SAMPLES = 10
# The entry points a training process runs (the launcher, python -m rectrain.train and its ranks).
TRAIN_MODULES = ("rectrain.train",)


@dataclass(frozen=True)
class Position:
    """How far the run got: `done` of `epochs` epochs, and `step` steps (rank 0) of epoch `epoch`
    (0-based, as epochs.csv and the progress lines count) out of `steps_per_epoch` (None: not known)."""

    epochs: int
    done: int
    epoch: int
    step: int
    steps_per_epoch: int | None


@dataclass(frozen=True)
class Pace:
    """Rank 0's mean step time over its last steps, and the time between two epochs (validation and
    checkpoint: the median gap between one epoch's last step and the next one's first); None: not measured."""

    step_s: float | None
    between_s: float | None


@dataclass(frozen=True)
class Status:
    state: str  # TRAINING, STOPPED_STATE, KILLED, DIVERGED_STATE or FINISHED
    why: str  # how that is known, in words
    position: Position
    pace: Pace
    left_s: float | None  # training still to do at the measured pace (None: not measurable)
    last_write_s: float | None  # seconds since the telemetry was last written
    marker: dict | None = None  # stopped.json or diverged.json, when one says how it ended


def rank0(steps: pd.DataFrame) -> pd.DataFrame:
    if steps.empty:
        return steps
    return steps[steps["rank"] == steps["rank"].min()].sort_values(["epoch", "step"])


def steps_per_epoch(steps0: pd.DataFrame, done: int, run: dict, manifest: dict | None) -> int | None:
    """Steps of one epoch: counted in a finished epoch's rows, else run.json's batches_per_epoch (the
    loader's count: train.repeated_aug's epoch is not the records'), else, from a run.json without it, the
    train images (with the padding that fills the last batch) over the batch of every process; None when
    none is known."""
    finished = steps0[steps0["epoch"] < done] if not steps0.empty else steps0
    if not finished.empty:
        return int(finished.groupby("epoch")["step"].max().max()) + 1
    if run.get("batches_per_epoch"):
        return int(run["batches_per_epoch"])
    packed = (manifest or {}).get("packed")
    per_step = int(run.get("batch_size") or 0) * int(run.get("world_size") or 0)
    if not packed or not per_step:
        return None
    return -(-(int(packed) + int(run.get("padding_per_epoch") or 0)) // per_step)


def position(steps: pd.DataFrame, epochs: pd.DataFrame, run: dict, manifest: dict | None) -> Position:
    total = int(run.get("epochs") or 0)
    done = int(epochs["epoch"].max()) + 1 if not epochs.empty else 0
    steps0 = rank0(steps)
    current = steps0[steps0["epoch"] == done] if not steps0.empty else steps0
    step = int(current["step"].max()) + 1 if not current.empty else 0
    return Position(total, done, min(done, total), step, steps_per_epoch(steps0, done, run, manifest))


def pace(steps: pd.DataFrame) -> Pace:
    steps0 = rank0(steps)
    if steps0.empty:
        return Pace(None, None)
    steady = steps0[steps0["step"] > 0].tail(PACE_STEPS)
    step_s = float(steady["wall_s"].mean()) if not steady.empty else None
    by_epoch = steps0.groupby("epoch")
    first_start = (steps0["time"] - steps0["wall_s"]).groupby(steps0["epoch"]).min()
    last_end = by_epoch["time"].max()
    gaps = [first_start[e + 1] - last_end[e] for e in last_end.index if e + 1 in first_start.index]
    return Pace(step_s, float(pd.Series(gaps).median()) if gaps else None)


def time_left_s(pos: Position, p: Pace) -> float | None:
    """Training still to do: this epoch's remaining steps and the epochs after it at the measured step
    time, each with the measured time between epochs (rectrain.progress.run_eta_s, as the progress
    line's run ETA); None before a step time or the epoch's length is known."""
    if pos.done >= pos.epochs:
        return 0.0
    if p.step_s is None or pos.steps_per_epoch is None:
        return None
    return run_eta_s(pos.step, pos.steps_per_epoch, p.step_s, pos.epoch, pos.epochs, p.between_s)


def _time(text) -> dt.datetime | None:
    with contextlib.suppress(TypeError, ValueError):
        return dt.datetime.fromisoformat(str(text))
    return None


def marker_since(path: Path, started) -> dict | None:
    """The JSON marker at `path` when it was written at or after `started` (run.json's: this launch), else None."""
    with contextlib.suppress(OSError, ValueError):
        info = json.loads(Path(path).read_text())
        at, since = _time(info.get("time")), _time(started)
        if isinstance(info, dict) and at is not None and (since is None or at >= since):
            return info
    return None


def _out_dir(proc: psutil.Process) -> Path | None:
    """The --out folder of a training process, resolved against its working directory; None for others."""
    cmd = proc.info.get("cmdline") or []
    if not any(word in TRAIN_MODULES for word in cmd) or "--out" not in cmd[:-1]:
        return None
    out = Path(cmd[cmd.index("--out") + 1])
    return out if out.is_absolute() else Path(proc.cwd()) / out


def training_here(train_dir: Path, procs: Callable[[], Iterable] | None = None) -> bool:
    """Whether a process on this host trains into `train_dir` (only this user's processes can be read)."""
    target = Path(train_dir).resolve()
    listed = procs() if procs else psutil.process_iter(["cmdline"])
    for proc in listed:
        with contextlib.suppress(psutil.Error, OSError):
            out = _out_dir(proc)
            if out is not None and out.resolve() == target:
                return True
    return False


def last_write_s(telemetry: Path, now: float) -> float | None:
    """Seconds since any file under telemetry/ was last written; None when there is none."""
    times = [p.stat().st_mtime for p in Path(telemetry).glob("*.csv")]
    return now - max(times) if times else None


def stale_after_s(run: dict) -> float:
    interval = float((run.get("config") or {}).get("sample_interval_s") or 1.0)
    return max(STALE_S, STALE_SAMPLES * interval)


def state(
    train_dir: Path, run: dict, written_s: float | None, here: Callable[[Path], bool] = training_here
) -> tuple[str, str, dict | None]:
    """(state, how that is known, the marker that says how it ended) of the run in `train_dir`."""
    ck_dir = Path(train_dir) / "checkpoints"
    if run.get("finished"):
        return FINISHED, f"finished at {run['finished']}", None
    diverged = marker_since(ck_dir / DIVERGED, run.get("started"))
    if diverged:
        return DIVERGED_STATE, f"stopped on divergence at {diverged.get('time')} ({ck_dir / DIVERGED})", diverged
    stopped = marker_since(ck_dir / STOPPED, run.get("started"))
    if stopped:
        how = f"{stopped.get('signal')} at {stopped.get('time')}, after {stopped.get('after')}"
        return STOPPED_STATE, f"stopped cleanly ({how}), its stop checkpoint written", stopped
    host = run.get("host")
    if host == socket.gethostname():
        if here(Path(train_dir)):
            return TRAINING, f"a process on this host ({host}) trains into {train_dir}", None
        return KILLED, f"no process on this host ({host}) trains into {train_dir}, and no stop was recorded", None
    limit = stale_after_s(run)
    if written_s is not None and written_s < limit:
        return TRAINING, f"its telemetry was written {written_s:.0f} s ago (on {host or 'another host'})", None
    ago = "never" if written_s is None else f"{written_s:.0f} s ago"
    return KILLED, f"its telemetry was last written {ago} (over {limit:.0f} s), and no stop was recorded", None


def status(
    train_dir: Path, data: RunData, *, now: float | None = None, here: Callable[[Path], bool] = training_here
) -> Status:
    """Where the run in `train_dir` stands, from `data` as rectrain.report.live loads it."""
    now = time.time() if now is None else now
    written = last_write_s(Path(train_dir) / "telemetry", now)
    kind, why, marker = state(Path(train_dir), data.run, written, here)
    pos = position(data.steps, data.epochs, data.run, data.manifests.get("train"))
    p = pace(data.steps)
    return Status(kind, why, pos, p, time_left_s(pos, p), written, marker)


def end_time(left: float | None, now: float | None = None) -> str | None:
    """When a run training now ends at that pace, in UTC to the minute."""
    if left is None:
        return None
    at = dt.datetime.fromtimestamp((time.time() if now is None else now) + left, dt.timezone.utc)
    return at.strftime("%Y-%m-%d %H:%M UTC")


def _at(pos: Position) -> str:
    """'epoch 1 (of 3) step 2/5', as the progress lines say it."""
    of = f"/{pos.steps_per_epoch}" if pos.steps_per_epoch else ""
    return f"epoch {pos.epoch} (of {pos.epochs}) step {pos.step}{of}"


def _pace_words(p: Pace) -> str:
    between = f", {duration(p.between_s)} between epochs (validation, checkpoint)" if p.between_s is not None else ""
    return f"{1000 * p.step_s:.0f} ms a step{between}" if p.step_s is not None else "no step measured yet"


def banner(s: Status, now: float | None = None) -> dict:
    """The live report's banner: state, headline and the sentences under it."""
    pos, done = s.position, f"{s.position.done} of {s.position.epochs} epoch(s) done"
    left = "not known yet (no step time measured)" if s.left_s is None else duration(s.left_s)
    if s.state == FINISHED:
        head, lines = f"Finished: all {pos.epochs} epochs", [s.why]
    elif s.state == DIVERGED_STATE:
        head = f"Diverged: stopped at {s.marker.get('where')}"
        lines = [done, s.marker.get("line") or s.why]
    elif s.state == TRAINING and pos.done >= pos.epochs:
        head, lines = f"In progress: all {pos.epochs} epochs trained, publishing the outputs", [s.why]
    elif s.state == TRAINING:
        end = end_time(s.left_s, now)
        head = f"In progress: {_at(pos)}"
        lines = [f"{done}; training ends in {left}" + (f", about {end}" if end else ""), s.why]
    else:  # stopped or killed: what is left, should it go on
        head = f"{s.state.capitalize()} at {_at(pos)}"
        lines = [f"{done}; {left} of training left when it goes on", s.why]
    return {"state": s.state, "headline": head, "lines": lines, "pace": _pace_words(s.pace), "status": s}
