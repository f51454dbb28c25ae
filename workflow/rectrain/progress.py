"""Progress lines: `<what> k/K (p %): img/s, ETA` every interval, for every long pass of every stage.

On ImageNet one epoch is 20-60 minutes and a pack hours; without these lines the log says nothing for
that long.  One format for all of them:

    epoch 1 (of 90) step 2100/5005 (42.0 %): 1890.3 img/s (all 8 rank(s), last 310 step(s)), data wait 2 %, ETA 6 min 21 s, run ETA ...
    pack train: read 640000/1281167 images (50.0 %): 2210.4 img/s, ETA 4 min 50 s, 310.2 MB/s, skipped 0, repaired 3

Timed steps (training, validation, evaluation): rank 0 logs one line every `interval_s`
(train.progress_s, evaluate.progress_s) from times the step already has: training's steps are
resolved one step late through the StepClock (rectrain.train.step), evaluation's tally reads its clock
marks once per line - no synchronisation of its own.  The numbers cover the steps since the previous
line (a recent window, without the pass's first step, which holds the loader's start-up), on rank 0's
timeline:
  img/s      rank 0's images / step wall time x ranks (DDP steps the ranks in lockstep; evaluation
             shards are equal), so the job's rate without a collective
  data wait  share of the step wall time rank 0 waited for its next batch
  ETA        remaining steps x the window's mean step time; the run's ETA adds the remaining epochs at
             that pace plus the validation and checkpoint time per epoch, once one has been measured

Counted passes (the pack's read, assemble and verify steps, pack.progress_s): the caller only says how
many images are done (`count`); img/s is over the pass so far and the ETA the rest at that rate.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from rectrain.log import duration

log = logging.getLogger(__name__)


def epoch_eta_s(done: int, total: int, step_s: float) -> float:
    """Seconds left in a pass of `total` steps after `done` of them, at step_s per step."""
    return max(0, total - done) * step_s


def run_eta_s(done: int, total: int, step_s: float, epoch: int, epochs: int, between_s: float | None) -> float:
    """Seconds left in the run: this epoch's remaining steps, then (epochs - epoch - 1) more epochs of
    `total` steps at step_s each; `between_s` (validation + checkpoint, measured after an epoch) is
    added once per epoch still to finish, this one included; None until measured counts as 0."""
    between = between_s or 0.0
    later = max(0, epochs - epoch - 1)
    return epoch_eta_s(done, total, step_s) + between + later * (total * step_s + between)


@dataclass
class Window:
    """Sums over the steps since the last line."""

    steps: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    images: int = 0


class Progress:
    """Rank 0's progress lines for one pass at a time (an epoch, a validation, an evaluation, a pack step).

    begin() starts a pass.  Timed steps: add() takes each resolved step; when due() the caller calls
    line(done).  Counted images: count(done) after each batch (it logs when a line is due)."""

    def __init__(self, interval_s: float, world_size: int = 1, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.world_size, self.clock = interval_s, world_size, clock
        self.label, self.total, self.unit = "", 0, ""
        self.tail: Callable[[int, float], str] | None = None
        self.window = Window()
        self._due = math.inf
        self._began = 0.0

    def begin(self, label: str, total: int, tail: Callable[[int, float], str] | None = None, unit: str = "") -> None:
        """A new pass of `total` steps (or `unit`s: "images"); `tail(done, seconds_per_step)` adds to
        each line (the run's ETA, the pack's MB/s)."""
        self.label, self.total, self.tail, self.unit = label, total, tail, unit
        self.window = Window()
        self._began = self.clock()
        self._due = self._began + self.interval_s

    def add(self, index: int, wall_s: float, wait_s: float, images: int) -> None:
        """Step `index` (0-based) of the pass took wall_s, of which wait_s waiting for its batch."""
        if index == 0:
            return  # the loader's start-up, not the pace of the pass
        w = self.window
        w.steps, w.wall_s, w.wait_s, w.images = w.steps + 1, w.wall_s + wall_s, w.wait_s + wait_s, w.images + images

    def due(self) -> bool:
        return self.clock() >= self._due

    def line(self, done: int) -> str | None:
        """Log the line for `done` steps of the pass and start a new window; None (and nothing logged)
        while the window holds no steady step yet."""
        w = self.window
        if not w.steps or w.wall_s <= 0:
            return None
        step_s = w.wall_s / w.steps
        window = (
            f" (all {self.world_size} rank(s), last {w.steps} step(s)), data wait {100 * w.wait_s / w.wall_s:.0f} %"
        )
        text = self._write(
            done, w.images * self.world_size / w.wall_s, window, epoch_eta_s(done, self.total, step_s), step_s
        )
        self.window = Window()
        return text

    def count(self, done: int, force: bool = False) -> str | None:
        """`done` images of the pass are finished: log the line when one is due, or now with `force`
        (the pass's end); img/s over the pass so far."""
        if not force and not self.due():
            return None
        rate = done / max(self.clock() - self._began, 1e-9)
        per_image = 1 / rate if rate > 0 else math.inf  # nothing done yet: ETA unknown
        eta_s = epoch_eta_s(done, self.total, per_image) if done < self.total else 0.0
        return self._write(done, rate, "", eta_s, per_image)

    def _write(self, done: int, rate: float, window: str, eta_s: float, step_s: float) -> str:
        unit = f" {self.unit}" if self.unit else ""
        text = (
            f"{self.label} {done}/{self.total}{unit} ({100 * done / max(self.total, 1):.1f} %): {rate:.1f} img/s"
            f"{window}, ETA {duration(eta_s)}"
        )
        if self.tail is not None:
            text += self.tail(done, step_s)
        log.info("%s", text)
        self._due = self.clock() + self.interval_s
        return text


class RunProgress(Progress):
    """Training's progress: epoch passes whose lines add the run's ETA, validation passes without it."""

    def __init__(self, interval_s: float, world_size: int, epochs: int, clock: Callable[[], float] = time.monotonic):
        super().__init__(interval_s, world_size, clock)
        self.epochs = epochs
        self.between_s: float | None = None  # validation + checkpoint of the last finished epoch

    def begin_epoch(self, epoch: int, total: int) -> None:
        self.begin(
            f"epoch {epoch} (of {self.epochs}) step", total, lambda done, step_s: self._run_eta(epoch, done, step_s)
        )

    def _run_eta(self, epoch: int, done: int, step_s: float) -> str:
        eta = run_eta_s(done, self.total, step_s, epoch, self.epochs, self.between_s)
        left = self.epochs - epoch - 1
        if self.between_s is None:
            return (
                f", run ETA {duration(eta)} + validation ({left} epoch(s) after this one; validation not measured yet)"
            )
        return (
            f", run ETA {duration(eta)} ({left} epoch(s) after this one; validation and checkpoint "
            f"{duration(self.between_s)} per epoch)"
        )


class Marks:
    """A pass's StepClock marks, read once per progress line: one wait for the device per line (every
    interval_s), not per step.  For loops that keep no per-step times of their own (evaluation's tally)."""

    def __init__(self, progress: Progress, clock):
        self.progress, self.clock = progress, clock
        self.pending: list[tuple] = []
        self.prev = clock.mark()
        self._data = self.prev

    def data(self) -> None:
        """The step's batch is here."""
        self._data = self.clock.mark()

    def end(self, index: int, images: int) -> None:
        """Step `index` is queued; when a line is due, wait for it and read every pending step."""
        end = self.clock.mark()
        self.pending.append((index, self.prev, self._data, end, images))
        self.prev = end
        if not self.progress.due() and index + 1 != self.progress.total:  # the last batch always gets its line
            return
        self.clock.wait(end)
        for i, start, data, stop, n in self.pending:
            self.progress.add(i, self.clock.seconds(start, stop), self.clock.seconds(start, data), n)
        self.pending = []
        self.progress.line(index + 1)
