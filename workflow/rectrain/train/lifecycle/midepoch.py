"""Checkpoints within an epoch (after a stop signal, every train.checkpoint_interval_min) into last.pt, at
the step every rank agreed on (rectrain.train.lifecycle.stop).  `run_state` is what a checkpoint holds
(with each rank's loader state, running totals and seconds for a mid-epoch one), `Position.of` where it
resumes.  A write that fails (a full disk) leaves the previous last.pt intact: a periodic one is logged
and training goes on; a stop then fails the job.  docs/architecture.md, "Stopping and mid-epoch checkpoints"."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass

from rectrain import watchdog
from rectrain.distributed import all_gather, barrier
from rectrain.storage import human_bytes
from rectrain.train import ema as emas
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import divergence, faults, supervise
from rectrain.train.lifecycle.status import EXIT_STOPPED
from rectrain.train.lifecycle.stop import Agreement, Decision, Stopped
from rectrain.train.run import Run

log = logging.getLogger(__name__)

CONTINUE = "to continue, run the same command again (through Snakemake: the same snakemake command)"


def run_state(run: Run, epoch: int, rngs: list, step: int | None = None, ranks: list | None = None) -> dict:
    """The checkpoint of `run` in `epoch` after `step` steps (None: the epoch done); see the module doc."""
    return {
        "model": run.model.state_dict(),
        "optimizer": run.step.optimizer.state_dict(),
        "scheduler": run.step.scheduler.state_dict(),
        "scaler": run.step.scaler.state_dict(),
        "ema": emas.state(run.step.ema),  # train.ema's averaged weights (None without one)
        "epoch": epoch,
        "step": step,
        "ranks": ranks,
        "rng": rngs,
        "config": run.settings.as_dict(),
        "num_classes": len(run.classes),
        "model_name": run.settings.network.model,
        "blurpool": run.settings.network.blurpool,  # the network's structure: evaluation builds the same one
        "image_size": run.settings.resolution.image_size,
        **run.identity.stamp(),
        "world_sizes": list(run.world_sizes),
    }


@dataclass(frozen=True)
class Position:
    """Where a run (re)starts: `epoch`, after `step` of its steps, with each rank's saved `ranks` entry."""

    epoch: int = 0
    step: int = 0
    ranks: list | None = None

    @classmethod
    def of(cls, state: dict) -> Position:
        """The position after checkpoint `state`: the next step of its epoch, or the next epoch."""
        if state.get("step") is None:
            return cls(state["epoch"] + 1)
        return cls(state["epoch"], state["step"], state["ranks"])

    def rank_part(self, epoch: int, rank: int) -> tuple[int, dict]:
        """(first step, the rank's saved entry) for `epoch`: (0, {}) unless it is the resumed epoch."""
        if epoch != self.epoch or not self.step:
            return 0, {}
        return self.step, self.ranks[rank]


class MidEpoch:
    """One epoch's control for run_steps: asked after every optimizer step, it checkpoints and stops as the
    ranks agreed; `watch.detector` (divergence.watch_of) reads the steps' losses."""

    def __init__(self, run: Run, agreement: Agreement, epoch: int, steps_log, wall_before: float, watch):
        self.run, self.agreement, self.epoch, self.loader = run, agreement, epoch, run.train_loader
        self.steps_log, self.wall_before, self.started = steps_log, wall_before, time.monotonic()
        self.watch, self.detector = watch, watch.detector

    def poll(self, step: int) -> Decision:
        stopping = lambda: self.agreement.request.signum != 0  # noqa: E731
        faults.after_step(self.run.d.rank, self.epoch, step, self.run.step.scheduler, stopping)
        return self.agreement.poll(self.detector.tripped)

    def act(self, decision: Decision, steps_done: int, totals: dict) -> None:
        """Checkpoint after `steps_done` steps; on a stop, end the rank (Stopped) once it is written; on
        divergence (or a non-finite state to save) end it (divergence.Diverged) with nothing written."""
        run, d = self.run, self.run.d
        where = f"epoch {self.epoch} step {steps_done - 1} of {self.loader.batches_per_epoch}"
        if decision.diverged:
            self.steps_log.sync()
            divergence.stop(self.watch, where)
        divergence.guard(self.watch, self.agreement, f"the mid-epoch checkpoint after {where}")
        why = f"stop signal {decision.signal_name}" if decision.stop else "train.checkpoint_interval_min"
        watchdog.beat(f"epoch {self.epoch}: writing the mid-epoch checkpoint ({why})")
        self.steps_log.sync()  # the rows up to this step outlive a power cut as the checkpoint does
        mine = {"rng": ckpt.rng_state(), "loader": self.loader.state(), "totals": dict(totals)}
        gathered = all_gather({**mine, "wall_s": self.wall_before + time.monotonic() - self.started}, d)
        error = write(run, self.epoch, steps_done, gathered) if d.master else None
        written = self.agreement.all_true(error is None)
        self.agreement.checkpointed()
        if decision.stop:
            stop(run, decision, where, written, resumes_at=f"epoch {self.epoch} step {steps_done}")
        elif d.master and written:
            log.info("mid-epoch checkpoint after %s (%s): %s", where, why, run.ck_dir / "last.pt")


def write(run: Run, epoch: int, steps_done: int, gathered: list[dict]) -> str | None:
    """Rank 0: write last.pt; None when written, else what failed (logged; the previous last.pt is intact)."""
    ranks = [{k: g[k] for k in ("loader", "totals", "wall_s")} for g in gathered]
    state = run_state(run, epoch, [g["rng"] for g in gathered], step=steps_done, ranks=ranks)
    started = time.monotonic()
    try:
        ckpt.save_atomic(state, run.ck_dir / "last.pt")
    # torch.save reports a full disk as RuntimeError ("unexpected pos ...", its zip writer), open() as OSError.
    except (OSError, RuntimeError) as exc:
        # Text only from here: the exception's frames hold torch.save's writer, whose open temporary
        # file (unlinked) keeps its space on the full disk until they are freed.
        error = f"{type(exc).__name__}: {exc}"
    else:
        log.debug("mid-epoch checkpoint written in %.2f s", time.monotonic() - started)
        return None
    free = human_bytes(shutil.disk_usage(run.ck_dir).free)
    said = f"could not write the mid-epoch checkpoint {run.ck_dir / 'last.pt'} ({free} free on that disk): {error}"
    then = "training goes on and tries again in train.checkpoint_interval_min (free space on that disk)"
    log.warning("%s; the previous checkpoint there is intact and a rerun resumes from it; %s", said, then)
    return error


def stop(run: Run, decision: Decision, where: str, written: bool, resumes_at: str) -> None:
    """Every rank: say what was saved and how to continue, then end (Stopped), or fail when nothing was."""
    d, last = run.d, run.ck_dir / "last.pt"
    if d.master and written:  # before the barrier: a peer exiting first makes torchrun signal this rank
        supervise.mark_stopped(run.ck_dir, decision.signal_name, where, resumes_at)
    barrier(d)
    if not written:
        raise RuntimeError(
            f"rank {d.rank}: stopped by {decision.signal_name} after {where}, but the checkpoint could not be "
            f"written (see the warning above): nothing of this epoch's steps since the last checkpoint is saved; "
            f"{CONTINUE}: it resumes from {last} as it was before"
        )
    kept = f"{last} holds the model, optimizer, LR schedule, scaler, every rank's RNG and loader position"
    said = f"exit status {EXIT_STOPPED}; {CONTINUE}: it resumes at {resumes_at}"
    log.info("rank %d: stopped by %s after %s: %s; %s", d.rank, decision.signal_name, where, kept, said)
    raise Stopped(f"stopped by {decision.signal_name} after {where}")


def stop_at_epoch_end(run: Run, agreement: Agreement, epoch: int) -> None:
    """After an epoch's checkpoint: a stop signal that came during its last step or its validation ends
    the ranks here, with nothing to add to that checkpoint."""
    faults.signal_at(run.d.rank, epoch, run.train_loader.batches_per_epoch)
    decision = agreement.poll()
    agreement.checkpointed()  # the epoch's checkpoint restarts the periodic clock
    if decision.stop:
        stop(run, decision, f"the end of epoch {epoch}", True, resumes_at=f"epoch {epoch + 1}")
