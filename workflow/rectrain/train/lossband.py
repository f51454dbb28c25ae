"""The divergence detector, the step's bookkeeping (rectrain.train.step.Bookkeeper feeds it each step's loss
and fp16 loss scale, one step late): a loss that is not finite or above the run's loss band, a scale that
collapses, parameters that explode.  docs/watching.md, "A run that diverges stops"; the stop itself is
rectrain.train.lifecycle.divergence."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

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
NOT_FINITE, ABOVE_BAND, LOW_SCALE = "not finite", "above its band", "low scale"


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
