"""Failures on purpose, for the tests: each hook is an environment variable naming where to fail (unset, as
always outside the tests, it does nothing).  The epoch loop lets them in at three places: `epoch_batches`
(the batches), `after_step` (each optimizer step) and the epoch's start and checkpoint."""

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
# Why: a stop signal mid-epoch must checkpoint at the step the ranks agree on and resume after it, even when
# only one rank got it (preemption tests); a step equal to the epoch's step count: after its checkpoint.
SIGNAL_AT_ENV = "RECTRAIN_SIGNAL_AT"
# Why: a resumed epoch must feed each rank exactly the samples of the uninterrupted epoch.
RECORD_LABELS_ENV = "RECTRAIN_RECORD_LABELS"
# Why: every rank must train each epoch at train.progressive's resolution, a resumed epoch too.
RECORD_SHAPES_ENV = "RECTRAIN_RECORD_SHAPES"
# Why: a run whose loss turns non-finite must stop within train.nonfinite_steps, write no non-finite
# checkpoint and resume from the last good one (divergence tests): infinite images make the loss NaN.
NONFINITE_AT_ENV = "RECTRAIN_NONFINITE_AT"
# Why: a run whose loss explodes while it stays finite must stop on its loss band, naming a last good
# checkpoint from before (divergence tests).
LR_TIMES_AT_ENV = "RECTRAIN_LR_TIMES_AT"
# Why: a test that waits for an outside stop (SLURM's time-limit warning) needs the run still inside an
# epoch when it comes, however slow the box (its peers wait for the paused rank in their next all-reduce).
PAUSE_AT_ENV = "RECTRAIN_PAUSE_AT"


def _at(env: str, *where: int, cut: int = -1) -> list[str] | None:
    """The rest of `env`'s "<where...>:<rest>" value when it starts with `where`, else None."""
    parts = os.environ.get(env, "").split(":", cut)
    return parts[len(where) :] if len(parts) >= len(where) and parts[: len(where)] == [str(w) for w in where] else None


def _record(env: str, name: str, rank: int):
    folder = os.environ.get(env)
    return open(os.path.join(folder, f"{name}_rank{rank}.csv"), "a", buffering=1) if folder else None


def epoch_batches(batches, rank: int, epoch: int, first: int):
    """An epoch's batches (the first is step `first`): with RECTRAIN_RECORD_LABELS or _SHAPES=<dir> each
    batch's labels or height and width are appended to <dir>/labels_rank<r>.csv or shapes_rank<r>.csv;
    with RECTRAIN_NONFINITE_AT=epoch:step those from that step on hold infinite images; with
    RECTRAIN_STALL_RANK=rank the loader stalls before its second batch."""
    parts = os.environ.get(NONFINITE_AT_ENV, "").split(":")
    nonfinite = tuple(int(p) for p in parts) if len(parts) == 2 else None
    labels, shapes = _record(RECORD_LABELS_ENV, "labels", rank), _record(RECORD_SHAPES_ENV, "shapes", rank)
    try:
        for step, (x, y) in enumerate(batches, start=first):
            if labels:
                labels.write(f"{epoch},{step},{' '.join(str(int(v)) for v in y.tolist())}\n")
            if shapes:
                shapes.write(f"{epoch},{step},{x.shape[-2]},{x.shape[-1]}\n")
            if nonfinite and (epoch, step) >= nonfinite and x.is_floating_point():
                x = torch.full_like(x, float("inf"))
            if step == first + 1 and _at(STALL_RANK_ENV, rank) == []:
                stall_loader(rank)
            yield x, y
    finally:
        for f in (labels, shapes):
            if f:
                f.close()


def stall_loader(rank: int) -> None:
    """Sleep for an hour, as a loader on a hung filesystem (the watchdog names this function)."""
    log.info("%s=%d: this rank's loader stalls now, as on a hung filesystem", STALL_RANK_ENV, rank)
    time.sleep(3600)


def fail_rank(rank: int) -> None:
    """With RECTRAIN_FAIL_RANK=rank: raise as the epoch starts, while the peers go on to their all-reduce."""
    if _at(FAIL_RANK_ENV, rank) == []:
        raise RuntimeError(f"injected failure ({FAIL_RANK_ENV}={rank})")


def kill_after_checkpoint(epoch: int) -> None:
    """With RECTRAIN_KILL_AFTER_EPOCH=epoch: `kill -9` this process once the epoch's checkpoint is written."""
    if _at(KILL_AFTER_EPOCH_ENV, epoch) == []:
        log.info("%s=%d: killing this process as a crash would", KILL_AFTER_EPOCH_ENV, epoch)
        os.kill(os.getpid(), signal.SIGKILL)


def after_step(rank: int, epoch: int, step: int, scheduler, stopping) -> None:
    """After each optimizer step: signal_at; with RECTRAIN_LR_TIMES_AT=epoch:step:factor the schedule's base
    LRs times factor; with RECTRAIN_PAUSE_AT=rank:epoch:step:gate a wait until `gate` exists or `stopping()`."""
    signal_at(rank, epoch, step)
    factor = _at(LR_TIMES_AT_ENV, epoch, step)
    if factor:
        scheduler.base_lrs = [lr * float(factor[0]) for lr in scheduler.base_lrs]
        log.info("%s: the peak LR times %s after epoch %d step %d", LR_TIMES_AT_ENV, factor[0], epoch, step)
    gate = _at(PAUSE_AT_ENV, rank, epoch, step, cut=3)
    if gate:
        where = f"rank {rank} pauses after epoch {epoch} step {step}"
        log.info("%s: %s until %s exists or a stop signal", PAUSE_AT_ENV, where, gate[0])
        while not (os.path.exists(gate[0]) or stopping()):
            watchdog.beat(f"{PAUSE_AT_ENV}: paused after epoch {epoch} step {step}")
            time.sleep(0.2)


def signal_at(rank: int, epoch: int, step: int) -> None:
    """With RECTRAIN_SIGNAL_AT=rank:epoch:step[:SIGNAL]: this rank sends itself SIGNAL (SIGTERM) after that step."""
    rest = _at(SIGNAL_AT_ENV, rank, epoch, step)
    if rest is None:
        return
    sig = signal.Signals[rest[0]] if rest else signal.SIGTERM
    log.info("%s: rank %d sends itself %s after epoch %d step %d", SIGNAL_AT_ENV, rank, sig.name, epoch, step)
    os.kill(os.getpid(), sig)
