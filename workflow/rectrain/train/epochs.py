"""The epoch loop: train an epoch (rectrain.train.step.run_steps), validate it with the evaluate
stage's tally (rectrain.metrics), and on rank 0 write its epochs.csv row, the checkpoint and its log
line; the ranks meet at a barrier after each epoch, so none runs ahead of the checkpoint."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rectrain import watchdog
from rectrain.distributed import all_gather, all_reduce_sum, barrier
from rectrain.loaders import Loader
from rectrain.log import CONSOLE_LINE
from rectrain.metrics import all_reduce as all_reduce_tally
from rectrain.metrics import tally
from rectrain.progress import Progress, RunProgress
from rectrain.stepclock import StepClock
from rectrain.storage import device_info, human_bytes
from rectrain.train import calibrate, curves, early_warning
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import divergence, faults
from rectrain.train.lifecycle.checkpoint import CheckpointSaver
from rectrain.train.lifecycle.midepoch import MidEpoch, Position, run_state, stop_at_epoch_end
from rectrain.train.lifecycle.stop import Agreement
from rectrain.train.run import Run
from rectrain.train.step import Step, run_steps
from rectrain.train.telemetry import EMA_VAL_COLUMNS, CsvLog

log = logging.getLogger(__name__)

# epochs.csv's val columns stay empty for a dataset without a val split.
NO_VAL = {"val_single_view_loss": None, "val_single_view_top1": None, "val_single_view_top5": None, "val_images": 0}


@dataclass(frozen=True)
class Books:
    """Where the epochs are written down: this rank's step rows, rank 0's epoch rows (else None), the
    calibration each epoch's img/s is held against (its input efficiency), and rank 0's TensorBoard
    curves (rectrain.train.curves; None: another rank, or train.tensorboard false)."""

    steps: CsvLog
    epochs: CsvLog | None
    calibration: dict | None
    curves: curves.Curves | None = None


def train_epochs(run: Run, start: Position, books: Books, agreement: Agreement) -> None:
    """Train, validate, checkpoint (rank 0) each epoch from `start` until train.epochs; rank 0 logs
    progress lines every train.progress_s; the ranks checkpoint mid-epoch and stop as `agreement` decides
    (rectrain.train.lifecycle.midepoch)."""
    d, epochs = run.d, run.settings.optim.epochs
    progress = RunProgress(run.settings.telemetry.progress_s, d.world_size, epochs) if d.master else None
    watch = divergence.watch_of(run)
    for epoch in range(start.epoch, epochs):
        faults.fail_rank(d.rank)
        if progress:
            progress.begin_epoch(epoch, run.train_loader.batches_per_epoch)
        if books.curves:
            books.curves.begin_epoch(run.train_loader.spec.crop_at(epoch))
        first, saved = start.rank_part(epoch, d.rank)
        wall_before = saved.get("wall_s", 0.0)
        control = MidEpoch(run, agreement, epoch, books.steps, wall_before, watch)
        stats = train_one_epoch(
            run.step,
            run.train_loader,
            epoch,
            books.steps,
            progress=progress,
            resumed=(first, saved),
            control=control,
            curves=books.curves,
        )
        # before the validation (wasted on a diverged model) and the checkpoint (never a non-finite one)
        divergence.guard(watch, agreement, f"the end of epoch {epoch}")
        after_steps = time.monotonic()
        val = validate_epoch(run, epoch, progress)
        rngs = all_gather(ckpt.rng_state(), d)
        if d.master:
            end_epoch(run, epoch, stats, val, rngs, books)
        else:
            watchdog.beat(f"epoch {epoch}: waiting for rank 0's checkpoint")
        barrier(d)
        if progress:
            progress.between_s = time.monotonic() - after_steps
        faults.kill_after_checkpoint(epoch)
        stop_at_epoch_end(run, agreement, epoch)


def train_one_epoch(
    step: Step,
    loader: Loader,
    epoch: int,
    steps_log,
    progress: Progress | None = None,
    *,
    resumed: tuple[int, dict] = (0, {}),
    control: MidEpoch | None = None,
    curves: curves.Curves | None = None,
) -> dict:
    """One epoch's steps; `resumed`: (the first step, this rank's entry of the mid-epoch checkpoint)."""
    n_batches = loader.batches_per_epoch
    first, saved = resumed
    began = time.time()
    clock = StepClock(torch.device("cpu"))
    start = clock.mark()
    if step.augment_batch is not None:  # train.mixup.off_epoch
        step.augment_batch.begin_epoch(epoch)
    batches = faults.epoch_batches(loader.epoch(epoch, first, saved.get("loader")), step.dist.rank, epoch, first)
    batches = watchdog.watched(batches, f"epoch {epoch}")
    t = run_steps(
        step,
        epoch,
        batches,
        steps_log,
        n_batches,
        progress=progress,
        first=first,
        totals=saved.get("totals"),
        control=control,
        curves=curves,
    )
    wall = saved.get("wall_s", 0.0) + clock.seconds(start, clock.mark())
    if t["steps"] != n_batches:
        raise RuntimeError(
            f"rank {step.dist.rank}: the {loader.kind} loader yielded {t['steps']} batches in epoch {epoch}, "
            f"expected {n_batches} on every rank (the other ranks would wait forever)"
        )
    # This rank's steady img/s, summed over ranks as report/efficiency.py sums them.
    rate = t["steady_images"] / t["steady_wall_s"] if t["steady_wall_s"] > 0 else 0.0
    loss_sum, correct, seen, rates = all_reduce_sum([t["loss_sum"], t["correct"], t["seen"], rate], step.dist)
    waits = all_gather(t["data_wait_s"] / t["step_wall_s"] if t["step_wall_s"] > 0 else None, step.dist)
    return {
        "train_loss": loss_sum / seen,
        "train_acc": correct / seen,
        "images": seen,
        "wall_s": wall,
        "steady": rates,
        "data_wait_shares": waits,  # each rank's share of its step time spent waiting for data
        "began": began,  # unix time this process started the epoch: its system samples (curves)
    }


def validate_epoch(run: Run, epoch: int, progress: Progress | None) -> dict:
    """The epoch's validation, or NO_VAL without a val split; with train.ema the EMA's beside the raw
    weights' (its keys prefixed ema_)."""
    if not run.val_loader:
        return NO_VAL
    models = {"": run.model}
    if run.step.ema is not None:
        models["ema_"] = run.step.ema.module
    val = {}
    for prefix, model in models.items():
        if progress:
            what = "the EMA's validation" if prefix else "validation"
            progress.begin(
                f"epoch {epoch} (of {run.settings.optim.epochs}) {what} batch", run.val_loader.batches_per_epoch
            )
        scores = validate(model, run.val_loader, len(run.classes), run.step, progress=progress)
        val.update({prefix + k: v for k, v in scores.items()})
    return val


def validate(
    model: torch.nn.Module, loader: Loader, num_classes: int, step: Step, progress: Progress | None = None
) -> dict:
    """Loss, top-1, top-5 over the whole val .rec with the evaluate stage's tally (rectrain.metrics) (each rank its
    shard, summed across ranks), so epochs.csv and metrics.json count the same way."""
    # Each rank's BatchNorm statistics drifted on its own shard since the last forward; validate the
    # weights that get checkpointed (rank 0's), or epochs.csv disagrees with the evaluate stage.
    if step.dist.world_size > 1:
        for buf in model.buffers():
            dist.broadcast(buf, src=0)
    model.eval()
    batches = watchdog.watched(loader.epoch(0), "validation")
    t = tally(
        model,
        batches,
        num_classes,
        step.dist.device,
        step.precision,
        channels_last=step.channels_last,
        progress=progress,
    )
    t = all_reduce_tally(t, step.dist.device)
    n = max(t.images, 1)
    top1 = float(t.confusion.diagonal().sum()) / n
    return {
        "val_single_view_loss": t.loss_sum / n,
        "val_single_view_top1": top1,
        "val_single_view_top5": t.top5_hits / n,
        "val_images": t.images,
    }


def end_epoch(run: Run, epoch: int, stats: dict, val: dict, rngs: list, books: Books) -> None:
    """Rank 0 after an epoch: its epochs.csv row, the checkpoint (with every rank's RNG state), the epoch line."""
    crop = run.train_loader.spec.crop_at(epoch)
    books.epochs.write(
        epoch=epoch,
        train_loss=stats["train_loss"],
        train_acc=stats["train_acc"],
        val_single_view_loss=val["val_single_view_loss"],
        val_single_view_top1=val["val_single_view_top1"],
        val_single_view_top5=val["val_single_view_top5"],
        images_per_s=stats["images"] / stats["wall_s"],
        wall_s=stats["wall_s"],
        resolution=crop,
        **{column: val.get(column) for column in EMA_VAL_COLUMNS},
    )
    watchdog.beat(f"epoch {epoch}: writing the checkpoint")
    saved = checkpoint_note(run, epoch, CheckpointSaver.of(run).save_epoch(run_state(run, epoch, rngs), epoch))
    log.info(
        "epoch %d%s: train loss %.3f acc %.3f, %s, %.0f img/s, %.1f s%s; %s",
        epoch,
        f" ({crop} px)" if run.settings.resolution.progressive else "",
        stats["train_loss"],
        stats["train_acc"],
        val_text(val),
        stats["images"] / stats["wall_s"],
        stats["wall_s"],
        efficiency_note(stats, books.calibration, crop),
        saved,
        extra=CONSOLE_LINE,
    )
    opt_steps = -(-run.train_loader.batches_per_epoch // run.plan.grad_accum)
    early_warning.warn(epoch, stats["train_loss"], val["val_single_view_top1"], len(run.classes), opt_steps)
    if books.curves:
        ceiling = calibrate.rate_at(books.calibration, crop)
        efficiency = stats["steady"] / ceiling if ceiling and stats["steady"] else None
        system = curves.node_means(run.out / "telemetry", stats["began"], time.time())
        books.curves.epoch(epoch, curves.epoch_values(stats, val, efficiency), system)


def val_text(val: dict) -> str:
    if val["val_single_view_loss"] is None:
        return "no val split"
    text = (
        f"val (single view, no flip TTA) loss {val['val_single_view_loss']:.3f} "
        f"top-1 {val['val_single_view_top1']:.3f} top-5 {val['val_single_view_top5']:.3f}"
    )
    if val.get("ema_val_single_view_loss") is not None:
        text += (
            f", EMA's loss {val['ema_val_single_view_loss']:.3f} top-1 {val['ema_val_single_view_top1']:.3f} "
            f"top-5 {val['ema_val_single_view_top5']:.3f}"
        )
    return text


def efficiency_note(stats: dict, calibration: dict | None, resolution: int) -> str:
    """The epoch log line's input efficiency: the epoch's steady img/s against the calibration's at the
    epoch's training resolution."""
    ceiling = calibrate.rate_at(calibration, resolution)
    if not ceiling or not stats["steady"]:
        return ""
    return (
        f", input efficiency {stats['steady'] / ceiling:.2f} ({stats['steady']:.1f} img/s steady against "
        f"{ceiling:.1f} calibrated)"
    )


def names_of_one_file(ck_dir: Path, epoch: int) -> str:
    """How last.pt stands to epoch_<k>.pt on disk, for the epoch line."""
    same = os.path.samefile(ck_dir / f"epoch_{epoch}.pt", ck_dir / "last.pt")
    return ", last.pt a hard link to it" if same else " and last.pt"


def checkpoint_note(run: Run, epoch: int, pruned: list[str]) -> str:
    """The epoch line's checkpoint part: its size, the folder and disk it is on, what was pruned - what
    a user sizing the disk (train.keep_checkpoints) needs."""
    size = (run.ck_dir / f"epoch_{epoch}.pt").stat().st_size
    where = device_info(run.ck_dir)
    kept = run.settings.stops.keep_checkpoints
    note = (
        f"checkpoint {human_bytes(size)} (epoch_{epoch}.pt{names_of_one_file(run.ck_dir, epoch)}) in {where['path']} on disk "
        f"{where['device'] or 'unknown'}, keeping the last {kept} epoch checkpoint(s)"
    )
    return note + (f", deleted {', '.join(pruned)}" if pruned else "")
