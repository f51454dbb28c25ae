"""A run that diverges stops, and nothing non-finite is ever saved.

`Detector` (one per rank) reads every training step's loss and, under fp16, the GradScaler's loss
scale, as rectrain.train.step resolves them (one step late: no host sync per step).  A step is bad when
its loss is not finite or the scale is below LOSS_SCALE_FLOOR; train.nonfinite_steps bad steps in a row
trip it.  fp16's ordinary overflow skips do not count: the forward pass's loss stays finite (the
overflow is in the gradients) and the scaler only halves a scale far above the floor.

The ranks stop together: the detector's state joins the stop agreement after every optimizer step
(rectrain.train.lifecycle.stop), and `guard` - called by every rank before any checkpoint (epoch end, periodic,
signalled) replaces the one on disk - all-reduces whether rank 0's model, optimizer or scaler state
holds a non-finite tensor.  Either way every rank logs one line (the epoch, step, LR and loss scale,
and what to change) and raises Diverged: exit status 1, with checkpoints/last.pt still the last good
checkpoint and checkpoints/diverged.json saying where it went wrong (the next run.json and the report
carry it)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from rectrain import atomic
from rectrain.distributed import Dist, barrier
from rectrain.log import PROGRESS_LOGGER, utc_now
from rectrain.train.lifecycle.checkpoint import DIVERGED
from rectrain.train.lifecycle.stop import Agreed

log = logging.getLogger(__name__)

# Below a scale of 1 the GradScaler shrinks the loss: the gradients overflow fp16 even unscaled, which
# no number of skipped steps cures (the scale starts at 2**16 and an ordinary overflow halves it once).
LOSS_SCALE_FLOOR = 1.0
# Names of non-finite tensors quoted in the line (a diverged model has hundreds).
NAMES_SHOWN = 3
EXIT_DIVERGED = 1  # a failure: Snakemake must not take the run for finished or cleanly stopped


class Diverged(Agreed):
    """Raised on every rank once the ranks agree the run diverged (see the module doc)."""


@dataclass
class Detector:
    """Consecutive bad steps of this rank (see the module doc); `limit`: train.nonfinite_steps."""

    limit: int
    bad: int = 0
    last: dict = field(default_factory=dict)  # the last step read: epoch, step, loss, lr, scale

    def observe(self, epoch: int, step: int, loss: float, lr: float, scale: float | None) -> None:
        self.last = {"epoch": epoch, "step": step, "loss": loss, "lr": lr, "scale": scale}
        low_scale = scale is not None and scale < LOSS_SCALE_FLOOR
        self.bad = self.bad + 1 if not math.isfinite(loss) or low_scale else 0

    @property
    def tripped(self) -> bool:
        return self.bad >= self.limit

    def cause(self) -> str:
        scale = self.last.get("scale")
        if scale is not None and scale < LOSS_SCALE_FLOOR and math.isfinite(self.last.get("loss", 0.0)):
            what = f"the fp16 loss scale stayed below {LOSS_SCALE_FLOOR:g}"
        else:
            what = "the training loss was not finite"
        return f"{what} for {self.bad} consecutive steps (train.nonfinite_steps: {self.limit})"


def nonfinite_names(states: dict[str, dict]) -> list[str]:
    """The names ("model.fc.weight", "optimizer.state.3.momentum_buffer", "scaler.scale") of the floating
    point tensors and numbers in `states` (name -> a state dict) holding a NaN or an infinity.  One device
    sync for all tensors (a ResNet-50 with momentum: ~500 tensors, well under a millisecond on a GPU)."""
    names, flags, numbers = [], [], []
    for name, value in _leaves(states, ""):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            names.append(name)
            flags.append(torch.isfinite(value).all())
        elif isinstance(value, float) and not math.isfinite(value):
            numbers.append(name)
    if not flags:
        return numbers
    ok = torch.stack([f.to(flags[0].device) for f in flags]).tolist()
    return [n for n, good in zip(names, ok, strict=True) if not good] + numbers


def _leaves(obj, prefix: str):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for k, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}.{k}")
    else:
        yield prefix, obj


def run_states(model: torch.nn.Module, step) -> dict[str, dict]:
    """What a checkpoint saves that training changes: the model (parameters and buffers), the
    optimizer (its momentum) and the scaler (of the rectrain.train.step.Step `step`)."""
    return {"model": model.state_dict(), "optimizer": step.optimizer.state_dict(), "scaler": step.scaler.state_dict()}


@dataclass(frozen=True)
class Watch:
    """What the stop on divergence needs of a run: this rank, the checkpoints folder, train.precision,
    the rank's detector and the states a checkpoint would save (`run_states`)."""

    d: Dist
    ck_dir: Path
    precision: str
    detector: Detector
    states: Callable[[], dict[str, dict]]


def guard(watch: Watch, agreement, where: str) -> None:
    """Every rank, before a checkpoint replaces the one on disk: when rank 0's state holds a non-finite
    tensor, or any rank's detector tripped, every rank stops (`stop`); else nothing."""
    bad = nonfinite_names(watch.states()) if watch.d.master else []
    tripped, count = agreement.any_of(int(watch.detector.tripped), len(bad))
    if tripped or count:
        stop(watch, where, bad, count)


def stop(watch: Watch, where: str, bad: list[str] = (), count: int = 0) -> None:
    """Every rank: log the one line (see `line`), rank 0 writes diverged.json, then raise Diverged."""
    text = line(watch, where, bad, count)
    if watch.d.master:
        atomic.write_json(
            watch.ck_dir / DIVERGED, {"time": utc_now(), "where": where, **_last(watch.detector), "line": text}
        )
    barrier(watch.d)  # the marker is on disk before a first rank's exit makes torchrun end the others
    # rank 0's line also reaches the terminal the run was started from (rectrain.log), not only its log
    (logging.getLogger(PROGRESS_LOGGER) if watch.d.master else log).error("%s", text)
    raise Diverged(text)


def _last(detector: Detector) -> dict:
    last = dict(detector.last)
    # JSON has no NaN: the loss as text
    return {**last, "loss": str(last["loss"])} if "loss" in last else last


def line(watch: Watch, where: str, bad: list[str], count: int) -> str:
    """The rank's one line: where and why it stopped, the last good checkpoint, what to change."""
    detector = watch.detector
    last = detector.last
    at = f"epoch {last['epoch']} step {last['step']}" if last else where
    scale = last.get("scale")
    lr = f"lr {last['lr']:.4g}" if last else "lr unknown"
    numbers = f"{lr}, loss scale {scale:g}" if scale is not None else f"{lr}, no loss scale ({watch.precision})"
    if detector.tripped:
        cause = detector.cause()
    elif bad:
        more = ", ..." if len(bad) > NAMES_SHOWN else ""
        cause = (
            f"{len(bad)} non-finite tensor(s) in the model or optimizer state ({', '.join(bad[:NAMES_SHOWN])}{more})"
        )
    else:
        cause = "another rank's loss was not finite" if not count else f"rank 0 holds {count} non-finite tensor(s)"
    return (
        f"rank {watch.d.rank}: training diverged at {at} ({numbers}): {cause}; stopped at {where}, nothing of it "
        f"saved: {last_good(watch.ck_dir)}. To go on: lower train.lr (the peak) or lengthen train.warmup_epochs, use "
        f"train.precision: bf16 where the GPU has it, or set train.clip_grad_norm (e.g. 1.0); then rerun with "
        f"train.resume: always (exit status {EXIT_DIVERGED})"
    )


def last_good(ck_dir: Path) -> str:
    """Which checkpoint a rerun goes on from, in words."""
    last = Path(ck_dir) / "last.pt"
    if not last.exists():
        return "no checkpoint was written yet, a rerun starts over"
    try:
        state = torch.load(last, map_location="cpu", weights_only=True, mmap=True)
        at = f"epoch {state['epoch']}" + (f" step {state['step']}" if state.get("step") is not None else " (its end)")
    except (OSError, RuntimeError, KeyError):
        at = "unreadable"
    return f"{last} ({at}) is the last good checkpoint"


def diverged_before(ck_dir: Path) -> dict | None:
    """diverged.json of the checkpoints this run continues (it stopped on divergence before), or None;
    run.json's `diverged_before`, which the report shows."""
    path = Path(ck_dir) / DIVERGED
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
