"""A run that diverges stops, and nothing non-finite or out of its loss band is ever saved.

`Detector` (one per rank) reads every training step's loss and, under fp16, the GradScaler's loss
scale, as rectrain.train.step resolves them (one step late: no host sync per step).  A step is bad when
its loss is not finite, when it is above the run's loss band, or when the scale is below
LOSS_SCALE_FLOOR; train.nonfinite_steps bad steps in a row trip it.  fp16's ordinary overflow skips do
not count: the forward pass's loss stays finite (the overflow is in the gradients) and the scaler only
halves a scale far above the floor.

The loss band, from the run's own history and ln K (K classes: ln K is an untrained network's loss, its
output uniform): the level is the median of this rank's last BAND_WINDOW losses that were inside the
band (the launch's first loss until there are more); a step is above the band when its loss exceeds
    max(ln K, min(BAND_JUMP x level, BAND_CEILING x max(ln K, the launch's first loss)))
- a jump to four times the recent level, or a slow climb to ten times where the launch began, and
never merely above a level far below ln K (a trained model's rare hard batch).  A healthy run's loss
falls from about ln K: bench/RESULTS.md ("Divergence beyond NaN") measured how far below the band the
suite's and the small-set bench's runs stayed.

The parameters (rank 0's: DDP keeps every rank's equal) are measured where it costs nothing per step:
every NORM_EVERY_STEPS steps and before every checkpoint, one host sync each.  They have exploded when
their global L2 norm is NORM_GROWTH times the one this launch started from, or when SGD's last update
(lr x the momentum buffer's norm, what SGD adds to the weights each step) is UPDATE_SHARE of their norm
or more; either trips the detector at once.  (AdamW keeps no single step direction: its parameter norm
alone is watched.)

The ranks stop together: the detector's state joins the stop agreement after every optimizer step
(rectrain.train.lifecycle.stop), and `guard` - called by every rank before any checkpoint (epoch end, periodic,
signalled) replaces the one on disk - all-reduces whether rank 0's model, optimizer or scaler state
holds a non-finite tensor, whether its parameters exploded and whether any rank's last loss is above
its band (a checkpoint written after the loss left its band would be no good one).  Either way every
rank logs one line (the epoch, step, LR, loss and its band, and what to change in this run's settings)
and raises Diverged: exit status 1, with checkpoints/last.pt still the last good checkpoint - good by
the same test - and checkpoints/diverged.json saying where it went wrong (the next run.json and the
report carry it)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from rectrain import atomic
from rectrain.distributed import Dist, barrier
from rectrain.log import PROGRESS_LOGGER, utc_now
from rectrain.train.lifecycle.checkpoint import DIVERGED
from rectrain.train.lifecycle.stop import Agreed

if TYPE_CHECKING:
    from rectrain.train.run import Run

log = logging.getLogger(__name__)

# Below a scale of 1 the GradScaler shrinks the loss: the gradients overflow fp16 even unscaled, which
# no number of skipped steps cures (the scale starts at 2**16 and an ordinary overflow halves it once).
LOSS_SCALE_FLOOR = 1.0
# The loss band (see the module doc).
BAND_WINDOW = 100
BAND_JUMP = 4.0
BAND_CEILING = 10.0
# The parameters' norm (see the module doc): sampled every this many steps, and before a checkpoint.
NORM_EVERY_STEPS = 50
NORM_GROWTH = 100.0
UPDATE_SHARE = 1.0
# Names of non-finite tensors quoted in the line (a diverged model has hundreds).
NAMES_SHOWN = 3
EXIT_DIVERGED = 1  # a failure: Snakemake must not take the run for finished or cleanly stopped

NOT_FINITE, ABOVE_BAND, LOW_SCALE = "not finite", "above its band", "low scale"
# telemetry/divergence.json: how close the run came to the thresholds (`keep_margins`)
MARGINS = "divergence.json"


class Diverged(Agreed):
    """Raised on every rank once the ranks agree the run diverged (see the module doc)."""


@dataclass(frozen=True)
class Norms:
    """The parameters' global L2 norm and the last update's (None: the optimizer keeps no step direction)."""

    params: float
    update: float | None


@dataclass
class Detector:
    """Consecutive bad steps of this rank and its parameters' norms (see the module doc); `limit`:
    train.nonfinite_steps, `classes`: K (0: unknown, the band then has no ln K floor), `norms`: how to
    measure the parameters (rank 0's; None on the other ranks)."""

    limit: int
    classes: int = 0
    norms: Callable[[], Norms] | None = None
    bad: int = 0
    kind: str = ""  # the last bad step's kind: NOT_FINITE, ABOVE_BAND or LOW_SCALE
    last: dict = field(default_factory=dict)  # the last step read: epoch, step, loss, lr, scale
    first_loss: float | None = None
    history: deque = field(default_factory=lambda: deque(maxlen=BAND_WINDOW))
    start_norm: float | None = None  # the parameters' norm as this launch started
    exploded: str | None = None  # why the parameters count as exploded, in words
    steps: int = 0
    # how close this launch came to each threshold (telemetry/divergence.json: `margins`)
    peaks: dict = field(default_factory=lambda: {"loss_over_band": 0.0, "norm_growth": 0.0, "update_share": 0.0})

    def __post_init__(self) -> None:
        self.start_norm = self.norms().params if self.norms is not None else None

    @property
    def untrained(self) -> float:
        return math.log(self.classes) if self.classes > 1 else 0.0

    def upper(self) -> float:
        """The band's top for the next step (infinite before the first finite loss)."""
        if self.first_loss is None:
            return math.inf
        level = statistics.median(self.history)
        return max(self.untrained, min(BAND_JUMP * level, BAND_CEILING * max(self.untrained, self.first_loss)))

    def observe(self, epoch: int, step: int, loss: float, lr: float, scale: float | None) -> None:
        upper = self.upper()
        self.last = {"epoch": epoch, "step": step, "loss": loss, "lr": lr, "scale": scale, "upper": upper}
        kind = ""
        if not math.isfinite(loss):
            kind = NOT_FINITE
        elif loss > upper:
            kind = ABOVE_BAND
        elif scale is not None and scale < LOSS_SCALE_FLOOR:
            kind = LOW_SCALE
        if math.isfinite(loss) and kind != ABOVE_BAND:
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.history.append(loss)
            if math.isfinite(upper):
                self.peaks["loss_over_band"] = max(self.peaks["loss_over_band"], loss / upper)
        self.bad, self.kind = (self.bad + 1, kind) if kind else (0, "")
        self.steps += 1
        if self.norms is not None and self.steps % NORM_EVERY_STEPS == 0:
            self.check_norms()

    @property
    def above_band(self) -> bool:
        """The last step's loss was above the band (a checkpoint now would be no good one)."""
        return self.bad > 0 and self.kind == ABOVE_BAND

    def check_norms(self) -> None:
        """Measure the parameters (rank 0); past NORM_GROWTH or UPDATE_SHARE they have exploded."""
        if self.norms is None or self.exploded:
            return
        n = self.norms()
        if not math.isfinite(n.params):
            return  # the non-finite check names the tensors
        if self.start_norm:
            self.peaks["norm_growth"] = max(self.peaks["norm_growth"], n.params / self.start_norm)
        if n.update is not None and n.params > 0:
            self.peaks["update_share"] = max(self.peaks["update_share"], n.update / n.params)
        if self.start_norm and n.params >= NORM_GROWTH * self.start_norm:
            self.exploded = (
                f"the parameters' norm grew from {self.start_norm:.4g} at this launch's start to {n.params:.4g} "
                f"({n.params / self.start_norm:.3g} x; limit {NORM_GROWTH:g} x)"
            )
        elif n.update is not None and n.params > 0 and n.update >= UPDATE_SHARE * n.params:
            self.exploded = (
                f"one SGD update moved the parameters by {n.update:.4g}, {n.update / n.params:.3g} x their norm "
                f"{n.params:.4g} (limit {UPDATE_SHARE:g} x)"
            )

    @property
    def tripped(self) -> bool:
        return self.bad >= self.limit or self.exploded is not None

    def band_text(self) -> str:
        """The band of the last step, in numbers."""
        upper = self.last.get("upper", math.inf)
        if not math.isfinite(upper):
            return "no band yet"
        level = statistics.median(self.history) if self.history else float("nan")
        floor = f"ln {self.classes} = {self.untrained:.3g}" if self.classes > 1 else "no class count"
        return (
            f"the loss band's top {upper:.4g} = max({floor}, min({BAND_JUMP:g} x the recent level {level:.4g}, "
            f"{BAND_CEILING:g} x max(ln K, the first loss {self.first_loss:.4g})))"
        )

    def cause(self) -> str:
        if self.exploded:
            return self.exploded
        count = f"for {self.bad} consecutive steps (train.nonfinite_steps: {self.limit})"
        if self.kind == LOW_SCALE:
            return f"the fp16 loss scale stayed below {LOSS_SCALE_FLOOR:g} {count}"
        if self.kind == ABOVE_BAND:
            return f"the training loss stayed above its band {count}, last {self.last['loss']:.4g} ({self.band_text()})"
        return f"the training loss was not finite {count}"


def parameter_norms(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], Norms]:
    """How to measure `model`'s parameters and `optimizer`'s last update (one device sync per call)."""

    def measure() -> Norms:
        with torch.no_grad():
            params = [p for p in model.parameters() if p.requires_grad]
            total = torch.nn.utils.get_total_norm(params)
            update = None
            if isinstance(optimizer, torch.optim.SGD):
                group = optimizer.param_groups[0]
                buffers = [
                    optimizer.state[p]["momentum_buffer"] for p in params if "momentum_buffer" in optimizer.state[p]
                ]
                if buffers and group["momentum"]:
                    update = group["lr"] * torch.nn.utils.get_total_norm(buffers)
            return Norms(float(total), None if update is None else float(update))

    return measure


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


def advice(optim, precision: str) -> str:
    """What to change, for this run's optimizer part of the train block (rectrain.settings' TrainOptim)
    and train.precision: its own values named, and only the cures it does not use already (no bf16 to
    a bf16 run)."""
    cures = [f"lower train.lr (now {optim.lr:g}, the peak for a global batch of 256)"]
    if optim.lr_schedule == "linear":
        cures.append(f"move train.lr_peak_epoch later (now {optim.lr_peak_epoch:g})")
    else:
        cures.append(f"lengthen train.warmup_epochs (now {optim.warmup_epochs:g})")
    if precision == "fp16":
        cures.append("use train.precision: bf16 where the GPU has it (fp16 overflows where bf16 does not)")
    if optim.clip_grad_norm is None:
        cures.append("set train.clip_grad_norm (e.g. 1.0)")
    else:
        cures.append(f"lower train.clip_grad_norm (now {optim.clip_grad_norm:g})")
    return f"To go on: {', or '.join(cures)}; then rerun with train.resume: always"


@dataclass(frozen=True)
class Watch:
    """What the stop on divergence needs of a run: this rank, the checkpoints folder, train.precision,
    the rank's detector, the states a checkpoint would save (`run_states`) and what to change (`advice`)."""

    d: Dist
    ck_dir: Path
    precision: str
    detector: Detector
    states: Callable[[], dict[str, dict]]
    advice: str


def watch_of(run: Run) -> Watch:
    """The run's Watch: a detector for its classes, with rank 0 measuring the parameters."""
    norms = parameter_norms(run.model, run.step.optimizer) if run.d.master else None
    detector = Detector(run.settings.stops.nonfinite_steps, len(run.classes), norms)
    states = lambda: run_states(run.model, run.step)  # noqa: E731
    precision = run.settings.network.precision
    return Watch(run.d, run.ck_dir, precision, detector, states, advice(run.settings.optim, precision))


def guard(watch: Watch, agreement, where: str) -> None:
    """Every rank, before a checkpoint replaces the one on disk: when rank 0's state holds a non-finite
    tensor or its parameters exploded, or any rank's detector tripped or its last loss is above the
    band, every rank stops (`stop`); else nothing."""
    watch.detector.check_norms()
    bad = nonfinite_names(watch.states()) if watch.d.master else []
    tripped, count, above = agreement.any_of(int(watch.detector.tripped), len(bad), int(watch.detector.above_band))
    if tripped or count or above:
        stop(watch, where, bad, count)
    if watch.d.master:
        keep_margins(watch, where)


def keep_margins(watch: Watch, where: str) -> None:
    """Rank 0, at each checkpoint that passed the guard: how close this launch came to each threshold so
    far, in telemetry/divergence.json (`margins`: its loss's highest share of the band's top, its
    parameters' norm's highest growth, SGD's longest update as a share of the weights; `thresholds`:
    the shares that stop a run) - bench/divergence_fp.py reads it."""
    thresholds = {"loss_over_band": 1.0, "norm_growth": NORM_GROWTH, "update_share": UPDATE_SHARE}
    info = {"where": where, "steps": watch.detector.steps, "margins": watch.detector.peaks, "thresholds": thresholds}
    with contextlib.suppress(OSError):
        atomic.write_json(Path(watch.ck_dir).parent / "telemetry" / MARGINS, info)


def stop(watch: Watch, where: str, bad: list[str] = (), count: int = 0) -> None:
    """Every rank: log the one line (see `line`), rank 0 writes diverged.json, then raise Diverged."""
    text = line(watch, where, bad, count)
    if watch.d.master:
        atomic.write_json(
            watch.ck_dir / DIVERGED, {"time": utc_now(), "where": where, **_last(watch.detector), "line": text}
        )
    barrier(watch.d)  # the marker is on disk before a first rank's exit makes torchrun end the others
    # rank 0's line also reaches the terminal the run was started from (rectrain.log), not only its log,
    # and it is the run's cause (an error record: rectrain.snakefile.causes repeats it last on the console)
    if watch.d.master:
        logging.getLogger(PROGRESS_LOGGER).error("%s", text)
    else:
        log.warning("%s", text)
    raise Diverged(text)


def _last(detector: Detector) -> dict:
    # JSON has no NaN or infinity: the numbers that may be either as text
    last = {k: v for k, v in detector.last.items() if k != "upper"}
    return {**last, "loss": str(last["loss"])} if "loss" in last else last


def _cause(watch: Watch, bad: list[str], count: int) -> str:
    detector = watch.detector
    if detector.tripped:
        return detector.cause()
    if bad:
        more = ", ..." if len(bad) > NAMES_SHOWN else ""
        return f"{len(bad)} non-finite tensor(s) in the model or optimizer state ({', '.join(bad[:NAMES_SHOWN])}{more})"
    if detector.above_band:
        return f"the training loss {detector.last['loss']:.4g} was above its band at this checkpoint ({detector.band_text()})"
    if count:
        return f"rank 0 holds {count} non-finite tensor(s)"
    return "another rank's loss left its band, was not finite or its parameters exploded (rank 0's line says which)"


def line(watch: Watch, where: str, bad: list[str], count: int) -> str:
    """The rank's one line: where and why it stopped, the last good checkpoint, what to change."""
    last = watch.detector.last
    at = f"epoch {last['epoch']} step {last['step']}" if last else where
    scale = last.get("scale")
    lr = f"lr {last['lr']:.4g}" if last else "lr unknown"
    numbers = f"{lr}, loss scale {scale:g}" if scale is not None else f"{lr}, no loss scale ({watch.precision})"
    loss = f", loss {last['loss']:.4g}" if last else ""
    return (
        f"rank {watch.d.rank}: training diverged at {at} ({numbers}{loss}): {_cause(watch, bad, count)}; stopped at "
        f"{where}, nothing of it saved: {last_good(watch.ck_dir)}. {watch.advice} (exit status {EXIT_DIVERGED})"
    )


def last_good(ck_dir: Path) -> str:
    """Which checkpoint a rerun goes on from, in words (every checkpoint written passed `guard`)."""
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
