"""The run's curves, live, for TensorBoard: rank 0 writes event files to <out>/tensorboard/ (train.tensorboard)
through torch.utils.tensorboard, flushed at every progress line, so `tensorboard --logdir results`
shows a run of days while it trains.

One x axis for every tag: the training step of the run, epoch x steps per epoch + the steps done in
it; an epoch's values sit at its last step.  A resumed run (mid-epoch too) opens a new event file
with TensorBoard's purge_step at the first step it trains: whatever the previous process wrote from
there on (a SIGKILL after the last checkpoint) is dropped by every reader, so no step is written twice.
A run that starts over moves the curves aside with its checkpoints (rectrain.train.lifecycle.checkpoint.move_aside).

Tags (docs/watching.md says what each is):
  per progress line   train/loss (rank 0's steps since the last line), train/lr, train/images_per_s (all
                      ranks), train/data_wait_share/rank0, train/loss_scale (fp16), train/resolution_px
  per epoch           epoch/train_loss, epoch/val_single_view_top1, epoch/val_single_view_top5, epoch/seconds, epoch/input_efficiency,
                      epoch/data_wait_share/rank<r>, epoch/gpu_util_percent/gpu<i>,
                      epoch/gpu_mem_used_mb/gpu<i>, epoch/cpu_busy_percent, epoch/iowait_percent (node 0's
                      system samples during the epoch)
  evaluate stage      evaluate/top1 and evaluate/top5 in <out>/tensorboard/evaluate/ (a run of its own:
                      its x axis is the test resolution in px); a rerun replaces the previous one
"""

from __future__ import annotations

import contextlib
import csv
import logging
from pathlib import Path

from rectrain.train.lifecycle.checkpoint import CURVES

log = logging.getLogger(__name__)

FOLDER = CURVES


def writer(folder: Path, purge_step: int | None = None):
    """torch's SummaryWriter on `folder` (imported here: tensorboard is needed only when writing)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(folder), purge_step=purge_step)


class Curves:
    """Rank 0's writer for one training process (see the module doc)."""

    def __init__(self, out: Path, steps_per_epoch: int, steps_done: int):
        self.steps_per_epoch = steps_per_epoch
        # the points up to the checkpoint's step stay; a later one is the killed process's, written again
        self.w = writer(Path(out) / FOLDER, purge_step=steps_done + 1)
        self.loss_sum, self.loss_n = 0.0, 0
        self.resolution = None

    def step_of(self, epoch: int, done: int) -> int:
        return epoch * self.steps_per_epoch + done

    def begin_epoch(self, resolution: int) -> None:
        self.resolution = resolution

    def add_loss(self, loss: float) -> None:
        self.loss_sum, self.loss_n = self.loss_sum + loss, self.loss_n + 1

    def interval(self, epoch: int, done: int, window, world_size: int, lr: float, scale: float | None) -> None:
        """At a progress line after `done` steps of `epoch`: the window's numbers (rectrain.progress.Window)."""
        step = self.step_of(epoch, done)
        if self.loss_n:
            self.w.add_scalar("train/loss", self.loss_sum / self.loss_n, step)
        self.loss_sum, self.loss_n = 0.0, 0
        self.w.add_scalar("train/lr", lr, step)
        if window.wall_s > 0:
            self.w.add_scalar("train/images_per_s", window.images * world_size / window.wall_s, step)
            self.w.add_scalar("train/data_wait_share/rank0", window.wait_s / window.wall_s, step)
        if scale is not None:
            self.w.add_scalar("train/loss_scale", scale, step)
        if self.resolution:
            self.w.add_scalar("train/resolution_px", self.resolution, step)
        self.w.flush()

    def epoch(self, epoch: int, values: dict, system: dict) -> None:
        """After `epoch`'s checkpoint: its values (None: not measured) and node 0's system means."""
        step = self.step_of(epoch + 1, 0)
        for tag, value in {**values, **system}.items():
            if value is not None:
                self.w.add_scalar(f"epoch/{tag}", value, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


@contextlib.contextmanager
def opened(on: bool, out: Path, steps_per_epoch: int, start_epoch: int, start_step: int):
    """`on` (rank 0 with train.tensorboard): the Curves of the run in `out` resumed at (start_epoch,
    start_step), closed (flushed) at the end; else None."""
    if not on:
        yield None
        return
    curves = Curves(out, steps_per_epoch, start_epoch * steps_per_epoch + start_step)
    try:
        yield curves
    finally:
        curves.close()


def epoch_values(stats: dict, val: dict, efficiency: float | None) -> dict:
    """An epoch's tags (without the epoch/ prefix) from train_one_epoch's stats and the validation."""
    values = {
        "train_loss": stats["train_loss"],
        # one centre crop, no flip TTA: not the final evaluation's protocol, and named so (as in epochs.csv)
        "val_single_view_top1": val["val_single_view_top1"],
        "val_single_view_top5": val["val_single_view_top5"],
        "seconds": stats["wall_s"],
        "input_efficiency": efficiency,
    }
    for rank, share in enumerate(stats.get("data_wait_shares") or []):
        values[f"data_wait_share/rank{rank}"] = share
    return values


def system_means(path: Path, start: float, end: float) -> dict:
    """Mean CPU busy and iowait, and per GPU utilisation and memory used, over the rows of the live
    system CSV (rectrain.train.telemetry.SystemSampler) between unix times start and end."""
    sums: dict[str, list[float]] = {}
    names = {"cpu_percent": "cpu_busy_percent", "iowait_percent": "iowait_percent"}
    try:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    t = float(row["time"])
                except (TypeError, ValueError):
                    continue  # a torn last line
                if not start <= t <= end:
                    continue
                for col, value in row.items():
                    tag = names.get(col) or _gpu_tag(col)
                    if tag and value not in ("", None):
                        sums.setdefault(tag, []).append(float(value))
    except OSError:
        return {}
    return {tag: sum(v) / len(v) for tag, v in sums.items()}


def _gpu_tag(col: str) -> str | None:
    """gpu<i>_util -> gpu_util_percent/gpu<i>, gpu<i>_mem_used_mb -> gpu_mem_used_mb/gpu<i>."""
    head, _, field = col.partition("_")
    if not head.startswith("gpu") or not head[3:].isdigit():
        return None
    return {"util": f"gpu_util_percent/{head}", "mem_used_mb": f"gpu_mem_used_mb/{head}"}.get(field)


def evaluation(train_out: Path, rows: list[dict]) -> None:
    """The evaluate stage's top-1 and top-5 per test resolution (metrics.json's rows), at the crop in px
    as the step; purge_step 0 drops an earlier evaluation's points."""
    w = writer(Path(train_out) / FOLDER / "evaluate", purge_step=0)
    for r in sorted(rows, key=lambda r: r["crop"]):  # steps in order, as readers draw a line
        w.add_scalar("evaluate/top1", r["top1"], r["crop"])
        w.add_scalar("evaluate/top5", r["top5"], r["crop"])
    w.close()
