"""Resume: continue from checkpoints/last.pt when it was written by this same run
(rectrain.train.checkpoint.RunIdentity: config, batch plan, records, world size, code), else clear the
checkpoints of the run this one replaces and start at epoch 0."""

from __future__ import annotations

import logging

from rectrain.distributed import all_gather
from rectrain.train import checkpoint as ckpt
from rectrain.train.run import Run

log = logging.getLogger(__name__)


def resume(run: Run) -> tuple[int, list | None]:
    """(first epoch to train, per-rank RNG states) from checkpoints/last.pt when it continues this run;
    otherwise the checkpoints of the run it replaces are removed (rank 0, once every rank has decided)."""
    last = run.ck_dir / "last.pt"
    start_epoch, rng_states, why_not = _continue(run) if last.exists() else (0, None, None)
    starts = all_gather(start_epoch, run.d)  # also: nobody writes checkpoints before every rank has read last.pt
    if len(set(starts)) > 1:
        raise RuntimeError(
            f"ranks disagree on the epoch to resume from ({starts}): {run.ck_dir} must be on a "
            "filesystem every node sees (shared --out)"
        )
    if run.d.master and not start_epoch:  # whatever checkpoints are here belong to another run
        gone = ckpt.clear(run.ck_dir)
        if gone:
            why_not = why_not or f"{last.name} is missing"
            log.info(
                "not resuming from %s: %s; removed its checkpoints (%s); starting from epoch 0",
                last,
                why_not,
                ", ".join(gone),
            )
    return start_epoch, rng_states


def _continue(run: Run) -> tuple[int, list | None, str | None]:
    """(first epoch, RNG states, None) with last.pt's state restored when it continues this run,
    else (0, None, why not)."""
    last = run.ck_dir / "last.pt"
    state = ckpt.load(last)
    why_not = ckpt.resumable(state, run.identity)
    if not why_not and ckpt.finished_marker(run.ck_dir).exists():
        why_not = (
            "that run finished and published model.pt, and this job was started again (snakemake --forcerun, "
            "or its outputs deleted): a new run"
        )
    if why_not:
        return 0, None, why_not
    restore(run, state)
    if run.d.master:
        log.info(
            "resuming from %s: epoch %d of %d done by the same run (config, batch %d x accum %d, records, "
            "%d processes and code all match); continuing at epoch %d",
            last,
            state["epoch"],
            run.cfg["epochs"],
            run.plan.batch,
            run.plan.grad_accum,
            run.d.world_size,
            state["epoch"] + 1,
        )
    return state["epoch"] + 1, state["rng"], None


def restore(run: Run, state: dict) -> None:
    run.model.load_state_dict(state["model"])
    run.step.optimizer.load_state_dict(state["optimizer"])
    run.step.scheduler.load_state_dict(state["scheduler"])
    run.step.scaler.load_state_dict(state["scaler"])
