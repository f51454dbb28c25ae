"""The run's curves, live, for TensorBoard: rank 0 writes event files to <out>/tensorboard/ (train.tensorboard)
through torch.utils.tensorboard, flushed at every progress line, so `tensorboard --logdir results`
shows a run of days while it trains.

One x axis for every tag: the training step of the run, epoch x steps per epoch + the steps done in
it; an epoch's values sit at its last step.  A resumed run (mid-epoch too) opens a new event file
with TensorBoard's purge_step at the first step it trains: whatever the previous process wrote from
there on (a SIGKILL after the last checkpoint) is dropped by every reader, so no step is written twice.
A run that starts over moves the curves aside with its checkpoints (rectrain.train.lifecycle.checkpoint.CheckpointSaver.move_aside).

Tags (docs/watching.md says what each is):
  per progress line   train/loss (rank 0's steps since the last line), train/lr, train/images_per_s (all
                      ranks), train/data_wait_share/rank<r> (rank 0's window; every other rank's steps
                      since the last line, read from the step log it writes live), train/loss_scale
                      (fp16), train/resolution_px
  per epoch           epoch/train_loss, epoch/val_single_view_top1, epoch/val_single_view_top5, epoch/seconds, epoch/input_efficiency,
                      epoch/data_wait_share/rank<r>, epoch/gpu_util_percent/gpu<i>,
                      epoch/gpu_mem_used_mb/gpu<i>, epoch/cpu_busy_percent, epoch/iowait_percent (node 0's
                      system samples during the epoch; another node k's with /node<k>: node_means)
  evaluate stage      evaluate/top1 and evaluate/top5 in <out>/tensorboard/evaluate/ (a run of its own:
                      its x axis is the test resolution in px); a rerun replaces the previous one
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
from pathlib import Path

from rectrain.train.lifecycle.checkpoint import CURVES
from rectrain.train.telemetry import STEP_COLUMNS

log = logging.getLogger(__name__)

FOLDER = CURVES


def writer(folder: Path, purge_step: int | None = None):
    """torch's SummaryWriter on `folder` (imported here: tensorboard is needed only when writing)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(folder), purge_step=purge_step)


class Curves:
    """Rank 0's writer for one training process (see the module doc)."""

    def __init__(self, out: Path, steps_per_epoch: int, steps_done: int):
        self.out, self.steps_per_epoch, self.steps_done = Path(out), steps_per_epoch, steps_done
        # the points up to the checkpoint's step stay; a later one is the killed process's, written again
        self.w = writer(self.out / FOLDER, purge_step=steps_done + 1)
        self.loss_sum, self.loss_n = 0.0, 0
        self.resolution = None
        self.peers: PeerWaits | None = None  # made at the first line, when every rank has cut its step log

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
        if self.peers is None:
            self.peers = PeerWaits(self.out / "telemetry", world_size, self.steps_per_epoch, self.steps_done)
        for rank, share in self.peers.shares().items():
            self.w.add_scalar(f"train/data_wait_share/rank{rank}", share, step)
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


_EPOCH, _STEP, _WALL, _WAIT = (STEP_COLUMNS.index(c) for c in ("epoch", "step", "wall_s", "data_wait_s"))


class PeerWaits:
    """The data-wait share of every rank but 0 over the steps it logged since the last progress line,
    read from the step log it writes live (rectrain.train.telemetry, line-buffered): rank 0 learns it with
    no collective in the training loop.  Only complete lines are read, from where the last read ended.
    A rank with no new step yet (it logs a step late, as rank 0 does) gets no point at this line; one
    whose log this node cannot see (another node's local disk) gets none at all."""

    def __init__(self, telemetry: Path, world_size: int, steps_per_epoch: int, steps_done: int):
        self.steps_per_epoch = steps_per_epoch
        self.paths = {r: telemetry / f"steps_rank{r}.csv" for r in range(1, world_size)}
        self.offsets = dict.fromkeys(self.paths, 0)
        self.last = dict.fromkeys(self.paths, steps_done)  # steps up to the resume's are an earlier launch's

    def shares(self) -> dict[int, float]:
        out = {}
        for rank, path in self.paths.items():
            wall = wait = 0.0
            for fields in self._new_lines(rank, path):
                try:
                    step = int(fields[_EPOCH]) * self.steps_per_epoch + int(fields[_STEP]) + 1
                    if step <= self.last[rank]:
                        continue
                    wall, wait, self.last[rank] = wall + float(fields[_WALL]), wait + float(fields[_WAIT]), step
                except (ValueError, IndexError):
                    continue  # the header
            if wall > 0:
                out[rank] = wait / wall
        return out

    def _new_lines(self, rank: int, path: Path) -> list[list[bytes]]:
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self.offsets[rank]:
                    self.offsets[rank] = 0  # cut since (a resume): read it again, the steps filter it
                f.seek(self.offsets[rank])
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offsets[rank] += len(complete)
        return [line.split(b",") for line in complete.splitlines()]


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
        # train.ema's validation beside the raw weights' (None without one: no point)
        "ema_val_single_view_top1": val.get("ema_val_single_view_top1"),
        "ema_val_single_view_top5": val.get("ema_val_single_view_top5"),
        "seconds": stats["wall_s"],
        "input_efficiency": efficiency,
    }
    for rank, share in enumerate(stats.get("data_wait_shares") or []):
        values[f"data_wait_share/rank{rank}"] = share
    return values


def node_means(telemetry: Path, start: float, end: float) -> dict:
    """system_means of every node's system CSV in `telemetry` (system_node<k>.csv, written by each node's
    local rank 0 where the run's folder is shared): node 0's tags as they are, node k's with /node<k>
    after the measure (cpu_busy_percent/node1, gpu_util_percent/node1_gpu0).  A node of an earlier
    launch has no samples in the window, so no tags."""
    means = {}
    for path in sorted(Path(telemetry).glob("system_node*.csv")):
        node = path.stem.removeprefix("system_node")
        if not node.isdigit():
            continue
        for tag, value in system_means(path, start, end).items():
            measure, _, gpu = tag.partition("/")
            where = f"node{node}_{gpu}" if gpu else f"node{node}"
            means[tag if node == "0" else f"{measure}/{where}"] = value
    return means


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
