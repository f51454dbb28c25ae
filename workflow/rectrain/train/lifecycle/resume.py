"""Resume: continue checkpoints/last.pt when train.resume allows it (`resume`), or start over without
deleting anything, or republish a finished run; docs/architecture.md, "Rerun semantics" (Resume, A
finished run survives).  `check_position` refuses a damaged or crafted checkpoint in one line."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rectrain import atomic
from rectrain.distributed import all_gather
from rectrain.log import CONSOLE_LINE
from rectrain.train import ema as emas
from rectrain.train.batchplan import BatchPlan
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.lifecycle import identity
from rectrain.train.lifecycle.checkpoint import CheckpointSaver
from rectrain.train.lifecycle.midepoch import Position
from rectrain.train.lifecycle.status import FINISHED, forced
from rectrain.train.optim import keep_configured_lr
from rectrain.train.run import Run

log = logging.getLogger(__name__)

# Identity items train.resume: always does not resume across on the same world size; on another world size
# the global batch decides instead of REGROUPED (batchplan.regroup).
REFUSED, REGROUPED = ("batch",), ("world_size", "batch")
FORCED = (
    "a forced rerun: that run finished and published model.pt, and Snakemake forced this job (snakemake --forcerun "
    "train, -F or -f): a new run"
)
NOT_KEPT = "that run finished but its published outputs are not all kept in checkpoints/finished/: a new run"


@dataclass(frozen=True)
class Resumed:
    """What resume decided: the first epoch to train, every rank's RNG state to restore (None when
    starting over), and the differences train.resume: always resumed across."""

    start_epoch: int
    rng_states: list | None = None
    despite: tuple[str, ...] = ()
    restored: bool = False  # the finished run's outputs are published again: nothing to train
    start_step: int = 0  # a mid-epoch checkpoint: the steps of start_epoch already done
    ranks: list | None = None  # ... and each rank's loader state and running totals (rectrain.train.lifecycle.midepoch)
    world_sizes: tuple[dict, ...] = ()  # every change of world size, with its epoch (checkpoint.world_sizes)
    regrouped: bool = False  # on another world size: every rank's RNG is seeded afresh (reseed)
    parent: dict | None = None  # a branch (train.resume_from): the checkpoint it started from (run.json's parent)

    @property
    def continues(self) -> bool:
        return bool(self.start_epoch or self.start_step)

    @property
    def position(self) -> Position:
        return Position(self.start_epoch, self.start_step, self.ranks)


class ResumeRefused(RuntimeError):
    """train.resume: always, but the checkpoint differs in an item no resume can cross."""


def previous_plan(ck_dir: Path, resume: str, maths: dict | None = None) -> BatchPlan | None:
    """The batch plan checkpoints/last.pt was written with, for `batch_size: auto` to reuse and for a run on
    another world size to keep its global batch (batchplan.regroup); None when this run will not continue it
    (no checkpoint, a finished run, train.resume: never, or under auto another `maths` config: identity.maths_config)."""
    last = Path(ck_dir) / "last.pt"
    if resume == "never" or not last.exists():
        return None
    if (Path(ck_dir) / FINISHED).exists() and not (CheckpointSaver(ck_dir).complete() and not forced()):
        return None
    stamp = identity.stamp_of(last)
    if not all(isinstance(stamp[k], int) for k in ("batch_size", "grad_accum", "world_size")):
        return None
    if resume == "auto" and maths is not None:
        same = identity.RunIdentity(maths, 0, 0, 0, stamp["data"], stamp["code"])
        if any(d.item == "config" for d in identity.differences(stamp, same)):
            return None  # a new run: it plans from its own train.batch_size and grad_accum
    return BatchPlan(stamp["batch_size"], stamp["grad_accum"], stamp["world_size"], reason="the checkpoint's")


def resume(run: Run) -> Resumed:
    """Continue checkpoints/last.pt when train.resume allows it; otherwise (rank 0, once every rank has
    decided) move the checkpoints of the run this one replaces aside."""
    last = run.ck_dir / "last.pt"
    if run.d.master:  # a checkpoint's temporary of a process killed while writing it (SIGKILL, a power cut)
        for folder in (run.ck_dir, run.out):
            atomic.remove_dead_temporaries(folder)
    if run.settings.stops.resume == "never":
        decided, why_not = Resumed(0), "train.resume is never"
    elif not last.exists():
        decided, why_not = Resumed(0), f"{last.name} is missing"
    else:
        decided, why_not = _continue(run)
    kept = None if decided.continues else kept_finished_run(run)
    fresh = not decided.continues  # whatever checkpoints are here belong to another run
    if kept is not None:
        decided = Resumed(run.settings.optim.epochs, restored=True)
    elif not decided.continues and run.settings.stops.resume_from is not None:
        decided = branch(run, Path(run.settings.stops.resume_from))
    # also: nobody writes checkpoints before every rank read last.pt
    starts = all_gather((decided.start_epoch, decided.start_step), run.d)
    if len(set(starts)) > 1:
        raise RuntimeError(
            f"ranks disagree on the epoch to resume from ({starts}): {run.ck_dir} must be on a "
            "filesystem every node sees (shared --out)"
        )
    saver = CheckpointSaver.of(run)
    if run.d.master and (fresh or kept is not None):
        saver.start_over(why_not, bring_back=kept)
    if run.d.master and decided.restored:
        saver.restore_finished(run.out)
    return decided


def parent_run(checkpoint: Path) -> str | None:
    """The run a checkpoint belongs to: <run> in results/<dataset>/<run>/train/checkpoints/<file>
    (also from a run moved aside in checkpoints/replaced/<folder>/), else None."""
    parts = Path(checkpoint).parts
    if "checkpoints" not in parts:
        return None
    at = parts.index("checkpoints")
    return parts[at - 2] if at >= 2 and parts[at - 1] == "train" else None


def branch(run: Run, checkpoint: Path) -> Resumed:
    """train.resume_from: this new run starts from another run's checkpoint's states at the epoch after it (a
    mid-epoch last.pt: at its epoch again), every rank's RNG seeded afresh; its own checkpoints stay here."""
    if not checkpoint.is_file():
        raise ResumeRefused(
            f"train.resume_from: {checkpoint} is no file; name an epoch_<k>.pt or last.pt of another run "
            "(results/<dataset>/<run>/train/checkpoints/)"
        )
    state = ckpt.load(checkpoint)
    at = Position.of(state)
    if at.epoch >= run.settings.optim.epochs:
        raise ResumeRefused(
            f"train.resume_from: {checkpoint} ends at epoch {at.epoch} and this run's train.epochs is "
            f"{run.settings.optim.epochs}: nothing would be trained; raise train.epochs above {at.epoch}"
        )
    restore(run, state, (f"a branch from {checkpoint}",))
    epochs = run.settings.optim.epochs
    parent = {"run": parent_run(checkpoint), "checkpoint": str(checkpoint), "epoch": int(state["epoch"])}
    parent.update(step=state.get("step"), sha256=identity.sha256(checkpoint))
    if run.d.master:
        log.info(
            "branching from %s (run %s, epoch %d): its weights, optimizer and LR schedule; training epochs %d-%d here",
            *(checkpoint, parent["run"], parent["epoch"], at.epoch, epochs - 1),
            extra=CONSOLE_LINE,
        )
    return Resumed(at.epoch, regrouped=True, parent=parent)


def kept_finished_run(run: Run) -> Path | None:
    """The newest finished run under replaced/ that is this run and kept whole (a config edited and edited back,
    a new run that failed after it started over); None under train.resume: never, or when forced."""
    if run.settings.stops.resume == "never" or forced():
        return None
    for folder in reversed(CheckpointSaver.of(run).replaced_runs()):
        last = folder / "last.pt"
        if not (last.is_file() and (folder / FINISHED).is_file() and CheckpointSaver(folder).complete()):
            continue
        if not identity.differences(identity.stamp_of(last), run.identity):
            return folder
    return None


def _finished_run(run: Run, found: list[identity.Difference]) -> tuple[Resumed, str | None]:
    """A finished run started again: republished when it is this run, kept and not forced; else a new run."""
    if forced():
        return Resumed(0), FORCED
    if found:
        return Resumed(0), "; ".join(d.text for d in found)
    if not CheckpointSaver.of(run).complete():
        return Resumed(0), NOT_KEPT
    return Resumed(run.settings.optim.epochs, restored=True), None


def _continue(run: Run) -> tuple[Resumed, str | None]:
    """(what to resume, None) with last.pt's state restored when train.resume allows it, else
    (a start at epoch 0, why not)."""
    last, mode = run.ck_dir / "last.pt", run.settings.stops.resume
    state = ckpt.load(last)
    found = identity.differences(state, run.identity)
    if (run.ck_dir / FINISHED).exists():
        return _finished_run(run, found)
    moved = any(d.item == "world_size" for d in found)
    if moved:  # the batch differs with it: judged by the global batch instead (batchplan.regroup)
        found = [d for d in found if d.item not in REGROUPED]
    if found and mode == "auto":
        return Resumed(0), "; ".join(d.text for d in found)
    check_position(state, last, run, moved)
    refused = [d.text for d in found if d.item in REFUSED]
    if refused:
        raise ResumeRefused(
            f"train.resume: always cannot continue {last}: {'; '.join(refused)}. Every rank's RNG state and "
            "shard of the records belong to the processes and batch that wrote it, so no rank would continue "
            "where it stopped. Train with the same devices and batch, or set train.resume: auto to start over "
            "(the checkpoints are moved aside, not deleted)"
        )
    despite = tuple(d.text for d in found)
    if moved:
        return _on_another_world_size(run, last, state, despite)
    restore(run, state, despite)
    at = Position.of(state)
    if run.d.master:
        _say_resuming(run, last, state, despite)
    history = tuple(world_sizes(state))
    return Resumed(at.epoch, state["rng"], despite, start_step=at.step, ranks=at.ranks, world_sizes=history), None


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


RNG_KEYS = ("torch", "cuda", "numpy", "python")


def check_position(state: dict, last: Path, run: Run, moved: bool) -> None:
    """ResumeRefused, naming the file and the fix, unless the checkpoint's position fits its own run and this
    one: its epoch within its train.epochs and not past this run's, a mid-epoch step that is a step, and (on
    the same number of processes) one RNG state and loader position per rank."""
    epoch, step = state.get("epoch"), state.get("step")
    own_epochs = (state.get("config") or {}).get("epochs")
    damaged = "move it aside (or set train.resume: never: it is moved to checkpoints/replaced/) and train again"
    if not (_whole(epoch) and _whole(own_epochs) and 0 <= epoch < own_epochs):
        raise ResumeRefused(
            f"{last} is damaged: epoch {epoch!r} is not an epoch of its run ({own_epochs!r} epochs); {damaged}"
        )
    if step is not None and not (_whole(step) and 0 < step):
        raise ResumeRefused(f"{last} is damaged: step {step!r} is not a step count; {damaged}")
    at, epochs = Position.of(state), run.settings.optim.epochs
    if at.epoch > epochs or (at.step and at.epoch >= epochs):
        done = f"{at.epoch} epochs done" if not at.step else f"epoch {at.epoch} started"
        raise ResumeRefused(
            f"train.resume: {run.settings.stops.resume} cannot continue {last}: it holds {done}, beyond train.epochs = "
            f"{epochs}, so nothing would be trained and the outputs would not be this run's. Set train.epochs >= "
            f"{at.epoch + (1 if at.step else 0)} to continue it, or train.resume: auto to start over (the checkpoints are "
            "moved aside, not deleted)"
        )
    if moved:
        return  # another world size: the ranks are reseeded, and a mid-epoch position restarts its epoch
    world, rngs, ranks = run.d.world_size, state.get("rng"), state.get("ranks")
    one_each = isinstance(rngs, list) and len(rngs) == world
    if not (one_each and all(isinstance(r, dict) and set(RNG_KEYS) <= set(r) for r in rngs)):
        shown = f"{len(rngs)} entries" if isinstance(rngs, list) else type(rngs).__name__
        raise ResumeRefused(
            f"{last} is damaged: its RNG states ({shown}) are not one per each of its {world} processes; {damaged}"
        )
    if step is not None and not (isinstance(ranks, list) and len(ranks) == world):
        raise ResumeRefused(
            f"{last} is damaged: its mid-epoch loader positions are not one per each of its {world} processes; {damaged}"
        )


def plan_words(plan: BatchPlan) -> str:
    return f"{plan.batch} x accum {plan.grad_accum} x {plan.world_size} process(es) = global batch {plan.global_batch}"


def world_sizes(state: dict) -> list[dict]:
    """The checkpoint's record of its world sizes: [{epoch, world_size, batch_size, grad_accum}, ...], one
    entry per change, the first at epoch 0 (a checkpoint written before this record: its own plan)."""
    plan = BatchPlan(state["batch_size"], state["grad_accum"], state["world_size"])
    return list(state.get("world_sizes") or [plan.from_epoch(0)])


def _on_another_world_size(run: Run, last: Path, state: dict, despite: tuple[str, ...]) -> tuple[Resumed, str | None]:
    """Continue a checkpoint written by another number of processes, its global batch kept (batchplan.regroup),
    from its epoch's start when it was written mid-epoch; refused when the global batch changed."""
    old, new = BatchPlan(state["batch_size"], state["grad_accum"], state["world_size"]), run.plan
    if old.global_batch != new.global_batch:
        raise ResumeRefused(
            f"train.resume: {run.settings.stops.resume} cannot continue {last} on {new.world_size} process(es): it was "
            f"trained with {plan_words(old)}, this run plans {plan_words(new)}, and the LR and its schedule belong "
            f"to the global batch. {keeping_hint(old.global_batch, new.world_size)}"
        )
    at, restarted = Position.of(state), ""
    if at.step:
        start = run.ck_dir / f"epoch_{at.epoch - 1}.pt"
        if at.epoch == 0 or not start.exists():
            none = "it is the first epoch" if at.epoch == 0 else f"{start.name} is missing"
            why = (
                f"it stopped in epoch {at.epoch} after {at.step} steps on {old.world_size} process(es), and its ranks' "
                f"loader positions cannot be re-split over {new.world_size}: epoch {at.epoch} restarts from its start, "
                f"and no checkpoint holds that start ({none}), so the run starts from epoch 0 (repeating "
                f"{at.step} steps)"
            )
            return Resumed(0), why
        restarted = (
            f"; {last.name} was written mid-epoch {at.epoch} after {at.step} steps, whose ranks' loader "
            f"positions cannot be re-split over {new.world_size} process(es): epoch {at.epoch} restarts "
            f"from its start (epoch_{at.epoch - 1}.pt), repeating those {at.step} steps"
        )
        state = {**ckpt.load(start), "world_sizes": world_sizes(state)}
    restore(run, state, despite)
    at = Position.of(state)
    if run.d.master:
        done, continuing = _done_text(state, run.settings.optim.epochs)
        log.info(
            "resuming from %s on another number of processes: it was trained with %s, this run keeps its global "
            "batch with %s (the LR and its schedule, counted in optimizer steps, unchanged)%s; %s; %s",
            *(last, plan_words(old), plan_words(new), restarted, done, continuing),
            extra=CONSOLE_LINE,
        )
    history = (*world_sizes(state), new.from_epoch(at.epoch))
    return Resumed(at.epoch, None, despite, world_sizes=history, regrouped=True), None


def keeping_hint(global_batch: int, world_size: int) -> str:
    """The setting that keeps `global_batch` on another number of processes."""
    divisors = [n for n in range(1, min(global_batch, 64) + 1) if global_batch % n == 0]
    return (
        f"{world_size} process(es) cannot split a global batch of {global_batch}: train on a number of processes "
        f"that divides it ({', '.join(map(str, divisors))}: train.devices, train.cpu_processes, train.nodes), or "
        "set train.resume: never to start a new run with this plan (the checkpoints are moved aside, not deleted)"
    )


def _done_text(state: dict, epochs: int) -> tuple[str, str]:
    """What a checkpoint holds, and where the run continues: 'epoch 3 of 90 done; continuing at epoch 4'
    or, mid-epoch, 'epoch 3 step 1200 of 90 epochs done ...; continuing at epoch 3 step 1201'."""
    at = Position.of(state)
    if not at.step:
        return f"epoch {state['epoch']} of {epochs} done", f"continuing at epoch {at.epoch}"
    return (
        f"epoch {at.epoch} up to step {at.step - 1} of {epochs} epochs done (a mid-epoch checkpoint)",
        f"continuing at epoch {at.epoch} step {at.step}",
    )


def _say_resuming(run: Run, last: Path, state: dict, despite: tuple[str, ...]) -> None:
    done, continuing = _done_text(state, run.settings.optim.epochs)
    if despite:
        why = f" despite {'; '.join(despite)} (train.resume: always; recorded in run.json's resumed_despite): {done}"
    else:
        plan = f"batch {run.plan.batch} x accum {run.plan.grad_accum}, records, {run.d.world_size} processes"
        why = f": {done} by the same run (config, {plan} and code all match)"
    log.info("resuming from %s%s; %s", last, why, continuing, extra=CONSOLE_LINE)


def restore(run: Run, state: dict, despite: tuple[str, ...] = ()) -> None:
    """Load the checkpoint's model, optimizer, scheduler, scaler and EMA states into the run (at this run's
    configured peak LR: optim.keep_configured_lr)."""
    base_lrs = list(run.step.scheduler.base_lrs)
    try:
        run.model.load_state_dict(state["model"])
        run.step.optimizer.load_state_dict(state["optimizer"])
        run.step.scheduler.load_state_dict(state["scheduler"])
        run.step.scaler.load_state_dict(state["scaler"])
        emas.load(run.step.ema, state.get("ema"))
        keep_configured_lr(run.step.scheduler, base_lrs)
    except (RuntimeError, KeyError, ValueError) as exc:
        if not despite:
            raise
        raise ResumeRefused(
            f"train.resume: always could not restore {run.ck_dir / 'last.pt'} into this run "
            f"({'; '.join(despite)}): {exc}. Set train.resume: auto to start over (the checkpoints are moved "
            "aside, not deleted)"
        ) from exc
