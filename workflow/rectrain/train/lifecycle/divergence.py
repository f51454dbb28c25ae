"""A run that diverges stops, and nothing non-finite or out of its loss band is ever saved: docs/watching.md,
"A run that diverges stops".  The detector (rectrain.train.lossband, one per rank) joins the stop agreement
(rectrain.train.lifecycle.stop) so the ranks stop together; `guard` runs before every checkpoint; `stop`
logs the line, writes diverged.json and raises Diverged (exit status 1)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from rectrain import atomic
from rectrain.distributed import Dist, barrier
from rectrain.log import PROGRESS_LOGGER, utc_now
from rectrain.train.lifecycle.status import DIVERGED
from rectrain.train.lifecycle.stop import Agreed
from rectrain.train.lossband import NORM_GROWTH, UPDATE_SHARE, Detector, parameter_norms

if TYPE_CHECKING:
    from rectrain.train.run import Run

log = logging.getLogger(__name__)

# Names of non-finite tensors quoted in the line (a diverged model has hundreds).
NAMES_SHOWN = 3
EXIT_DIVERGED = 1  # a failure: Snakemake must not take the run for finished or cleanly stopped
# telemetry/divergence.json: how close the run came to the thresholds (`keep_margins`)
MARGINS = "divergence.json"


class Diverged(Agreed):
    """Raised on every rank once the ranks agree the run diverged (see the module doc)."""


def nonfinite_names(states: dict[str, dict]) -> list[str]:
    """The names ("model.fc.weight", "scaler.scale") of the tensors and numbers in `states` holding a NaN or an
    infinity.  One device sync for all (a ResNet-50 with momentum: ~500 tensors, well under a millisecond)."""
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
    """What a checkpoint saves that training changes: the model, the optimizer and the scaler of `step`."""
    return {"model": model.state_dict(), "optimizer": step.optimizer.state_dict(), "scaler": step.scaler.state_dict()}


def advice(optim, precision: str) -> str:
    """What to change, for the run's optimizer settings and train.precision: its own values named, and only
    the cures it does not use already (no bf16 to a bf16 run)."""
    cures = [f"lower train.lr (now {optim.lr:g}, the peak for a global batch of 256)"]
    if optim.lr_schedule == "linear":
        cures.append(f"move train.lr_peak_epoch later (now {optim.lr_peak_epoch:g})")
    else:
        cures.append(f"lengthen train.warmup_epochs (now {optim.warmup_epochs:g})")
    if precision == "fp16":
        cures.append("use train.precision: bf16 where the GPU has it (fp16 overflows where bf16 does not)")
    clip = optim.clip_grad_norm
    cures.append(f"lower train.clip_grad_norm (now {clip:g})" if clip else "set train.clip_grad_norm (e.g. 1.0)")
    return f"To go on: {', or '.join(cures)}; then rerun with train.resume: always"


@dataclass(frozen=True)
class Watch:
    """What the stop on divergence needs of a run (`watch_of`)."""

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
    """Every rank, before a checkpoint replaces the one on disk: every rank stops (`stop`) when rank 0's state
    holds a non-finite tensor or its parameters exploded, or any rank tripped or its last loss is above the band."""
    watch.detector.check_norms()
    bad = nonfinite_names(watch.states()) if watch.d.master else []
    tripped, count, above = agreement.any_of(int(watch.detector.tripped), len(bad), int(watch.detector.above_band))
    if tripped or count or above:
        stop(watch, where, bad, count)
    if watch.d.master:
        keep_margins(watch, where)


def keep_margins(watch: Watch, where: str) -> None:
    """Rank 0, at each checkpoint that passed the guard: how close this launch came to each threshold
    (rectrain.train.lossband.Detector.peaks), in telemetry/divergence.json - bench/divergence_fp.py reads it."""
    thresholds = {"loss_over_band": 1.0, "norm_growth": NORM_GROWTH, "update_share": UPDATE_SHARE}
    info = {"where": where, "steps": watch.detector.steps, "margins": watch.detector.peaks, "thresholds": thresholds}
    with contextlib.suppress(OSError):
        atomic.write_json(Path(watch.ck_dir).parent / "telemetry" / MARGINS, info)


def stop(watch: Watch, where: str, bad: list[str] = (), count: int = 0) -> None:
    """Every rank: log the one line (see `line`), rank 0 writes diverged.json, then raise Diverged."""
    text = line(watch, where, bad, count)
    if watch.d.master:
        info = {"time": utc_now(), "where": where, **_last(watch.detector), "line": text}
        atomic.write_json(watch.ck_dir / DIVERGED, info)
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
    with contextlib.suppress(OSError, ValueError):
        return json.loads((Path(ck_dir) / DIVERGED).read_text())
    return None
