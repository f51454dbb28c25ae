"""Failures on purpose, for the tests: each hook is an environment variable naming where to fail, so
a test can check what a real failure of that kind does to the job.  Unset - always, outside the
tests - they do nothing."""

from __future__ import annotations

import logging
import os
import signal
import time

import torch

from rectrain import watchdog

log = logging.getLogger(__name__)

# Why: a crash right after a checkpoint must resume at the next epoch (kill-and-resume test).
KILL_AFTER_EPOCH_ENV = "RECTRAIN_KILL_AFTER_EPOCH"
# Why: a rank hung in data loading (a hung filesystem) must be ended by the watchdog, named (watchdog test).
STALL_RANK_ENV = "RECTRAIN_STALL_RANK"
# Why: a rank dying while its peers wait in an all-reduce must end the job, naming it (crash test).
FAIL_RANK_ENV = "RECTRAIN_FAIL_RANK"


def _chosen(env: str, value: int) -> bool:
    return os.environ.get(env) == str(value)


def epoch_batches(batches, rank: int, epoch: int, first: int):
    """An epoch's batches (the first is step `first`) through every fault hook the environment names: the
    one place the epoch loop lets the tests in (each hook passes the batches on untouched when unset)."""
    batches = record_labels(batches, rank, epoch, first)
    batches = record_shapes(batches, rank, epoch, first)
    batches = nonfinite_from(batches, epoch, first)
    return stall_loader(batches, rank)


def stall_loader(batches, rank: int):
    """The batches; with RECTRAIN_STALL_RANK=rank the loader sleeps for an hour before its second."""
    for i, batch in enumerate(batches):
        if i == 1 and _chosen(STALL_RANK_ENV, rank):
            log.info("%s=%d: this rank's loader stalls now, as on a hung filesystem", STALL_RANK_ENV, rank)
            time.sleep(3600)
        yield batch


def fail_rank(rank: int) -> None:
    """With RECTRAIN_FAIL_RANK=rank: raise as the epoch starts, while the peers go on to their all-reduce."""
    if _chosen(FAIL_RANK_ENV, rank):
        raise RuntimeError(f"injected failure ({FAIL_RANK_ENV}={rank})")


def kill_after_checkpoint(epoch: int) -> None:
    """With RECTRAIN_KILL_AFTER_EPOCH=epoch: `kill -9` this process once the epoch's checkpoint is written."""
    if _chosen(KILL_AFTER_EPOCH_ENV, epoch):
        log.info("%s=%d: killing this process as a crash would", KILL_AFTER_EPOCH_ENV, epoch)
        os.kill(os.getpid(), signal.SIGKILL)


# Why: a stop signal mid-epoch must checkpoint at the step the ranks agree on and resume after it,
# even when only one rank got it (preemption tests).  "<rank>:<epoch>:<step>[:<signal>]"; a step equal to
# the epoch's step count: at its end, after its checkpoint (a stop at the boundary).
SIGNAL_AT_ENV = "RECTRAIN_SIGNAL_AT"
# Why: a resumed epoch must feed each rank exactly the samples of the uninterrupted epoch; the tests
# read them from this folder (labels_rank<r>.csv: epoch, step, the batch's labels space-separated).
RECORD_LABELS_ENV = "RECTRAIN_RECORD_LABELS"
# Why: every rank must train each epoch at train.progressive's resolution, a resumed epoch too; the
# tests read it from this folder (shapes_rank<r>.csv: epoch, step, the batch's height and width).
RECORD_SHAPES_ENV = "RECTRAIN_RECORD_SHAPES"


# Why: a run whose loss turns non-finite must stop within train.nonfinite_steps, write no non-finite
# checkpoint and resume from the last good one (divergence tests).  "<epoch>:<step>": from that step
# on, every rank's images are infinite, so the loss is NaN (and the weights after the update).
NONFINITE_AT_ENV = "RECTRAIN_NONFINITE_AT"


def nonfinite_from(batches, epoch: int, first: int):
    """The batches; with RECTRAIN_NONFINITE_AT=epoch:step, those from that step on hold infinite images."""
    parts = os.environ.get(NONFINITE_AT_ENV, "").split(":")
    if len(parts) != 2:
        yield from batches
        return
    at_epoch, at_step = (int(p) for p in parts)
    for step, (x, y) in enumerate(batches, start=first):
        if (epoch, step) >= (at_epoch, at_step):
            x = torch.full_like(x, float("inf")) if x.is_floating_point() else x
        yield x, y


# Why: a run whose loss explodes while it stays finite must stop on its loss band, naming a last good
# checkpoint from before (divergence tests).  "<epoch>:<step>:<factor>": after that step the schedule's
# peak LR is multiplied by factor (every rank: each polls after the same step).
LR_TIMES_AT_ENV = "RECTRAIN_LR_TIMES_AT"


def lr_times_at(scheduler, epoch: int, step: int) -> None:
    """With RECTRAIN_LR_TIMES_AT=epoch:step:factor: the LR schedule's base LRs times factor after that step."""
    parts = os.environ.get(LR_TIMES_AT_ENV, "").split(":")
    if len(parts) != 3 or [int(p) for p in parts[:2]] != [epoch, step]:
        return
    scheduler.base_lrs = [lr * float(parts[2]) for lr in scheduler.base_lrs]
    log.info("%s: the peak LR times %s after epoch %d step %d", LR_TIMES_AT_ENV, parts[2], epoch, step)


def signal_at(rank: int, epoch: int, step: int) -> None:
    """With RECTRAIN_SIGNAL_AT=rank:epoch:step[:SIGNAL]: this rank sends itself SIGNAL (SIGTERM) after that step."""
    parts = os.environ.get(SIGNAL_AT_ENV, "").split(":")
    if len(parts) < 3 or [int(p) for p in parts[:3]] != [rank, epoch, step]:
        return
    sig = signal.Signals[parts[3]] if len(parts) > 3 else signal.SIGTERM
    log.info("%s: rank %d sends itself %s after epoch %d step %d", SIGNAL_AT_ENV, rank, sig.name, epoch, step)
    os.kill(os.getpid(), sig)


# Why: a test that waits for an outside stop (SLURM's time-limit warning) needs the run still inside an
# epoch when it comes, however slow the box, without training many epochs to make sure of it.
# "<rank>:<epoch>:<step>:<gate file>": that rank waits after that step until the gate file exists or a
# stop signal has arrived (its peers wait for it in their next all-reduce).
PAUSE_AT_ENV = "RECTRAIN_PAUSE_AT"


def pause_at(rank: int, epoch: int, step: int, stopping) -> None:
    """With RECTRAIN_PAUSE_AT=rank:epoch:step:gate: wait after that step until `gate` exists or `stopping()`."""
    parts = os.environ.get(PAUSE_AT_ENV, "").split(":", 3)
    if len(parts) < 4 or [int(p) for p in parts[:3]] != [rank, epoch, step]:
        return
    log.info(
        "%s: rank %d pauses after epoch %d step %d until %s exists or a stop signal",
        PAUSE_AT_ENV,
        rank,
        epoch,
        step,
        parts[3],
    )
    while not (os.path.exists(parts[3]) or stopping()):
        watchdog.beat(f"{PAUSE_AT_ENV}: paused after epoch {epoch} step {step}")
        time.sleep(0.2)


def _recorded(batches, first: int, folder: str | None, path: str, row):
    """The batches (the first is step `first`); with `folder` set, each batch's `row(step, images,
    labels)` is appended to folder/path."""
    if not folder:
        yield from batches
        return
    with open(os.path.join(folder, path), "a", buffering=1) as f:
        for step, (x, y) in enumerate(batches, start=first):
            f.write(row(step, x, y) + "\n")
            yield x, y


def record_labels(batches, rank: int, epoch: int, first: int):
    """The batches; with RECTRAIN_RECORD_LABELS=<dir> each batch's labels are appended to <dir>/labels_rank<rank>.csv."""
    row = lambda step, x, y: f"{epoch},{step},{' '.join(str(int(v)) for v in y.tolist())}"  # noqa: E731
    return _recorded(batches, first, os.environ.get(RECORD_LABELS_ENV), f"labels_rank{rank}.csv", row)


def record_shapes(batches, rank: int, epoch: int, first: int):
    """The batches; with RECTRAIN_RECORD_SHAPES=<dir> each batch's image height and width are appended
    to <dir>/shapes_rank<rank>.csv."""
    row = lambda step, x, y: f"{epoch},{step},{x.shape[-2]},{x.shape[-1]}"  # noqa: E731
    return _recorded(batches, first, os.environ.get(RECORD_SHAPES_ENV), f"shapes_rank{rank}.csv", row)
