"""One training step, shared by the epoch loop (rectrain.train.epochs), the calibration
(rectrain.train.calibrate) and bench/gpu_efficiency.py, so all three time the same work.

`train_step` is the whole step, on one screen, phase by phase.  `run_steps` feeds it a pass's batches
and hands what each step leaves (a `StepOut`, still on the device) to the `Bookkeeper`, which reads it one
step late - telemetry row, totals, progress line, curves, the divergence detector - and asks the epoch's
control (rectrain.train.lifecycle.midepoch) after every optimizer step whether the ranks checkpoint or
stop there.  No host sync per step: the host queues step k+1 (and fetches its batch) while the GPU still
computes step k.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from rectrain import model as models
from rectrain.distributed import Dist
from rectrain.progress import Progress
from rectrain.stepclock import StepClock
from rectrain.train.batchaug import hard_labels


@dataclass
class Step:
    """What one training step needs: the network (DDP- and compile-wrapped as configured), its loss,
    optimizer, schedule and scaler, gradient accumulation, numerics, the rank it runs on, and the
    optional phases: the batch's device-side augmentation and the weights' EMA."""

    net: torch.nn.Module
    loss_fn: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    accum: int
    precision: str
    channels_last: bool
    dist: Dist
    clip_grad_norm: float | None = None  # train.clip_grad_norm
    # (images, labels) -> (images, targets) on the device: random erasing, Mixup/CutMix (rectrain.train.batchaug);
    # None = as loaded
    augment_batch: Callable | None = None
    # an EMA of the weights with update(model, step=k), after every optimizer step (rectrain.train.ema)
    ema: object | None = None


@dataclass(frozen=True)
class StepOut:
    """What a step leaves for its bookkeeping: its numbers, still on the device, read one step late."""

    index: int  # the step within its epoch
    loss: torch.Tensor
    hits: torch.Tensor  # top-1 hits against the hard labels (under Mixup each image's larger share: batchaug)
    images: int
    lr: float  # the LR the step ran at (the largest group's: the head's under train.layer_decay)
    scale: torch.Tensor | None  # the fp16 loss scale after it (loss_scale)
    stepped: bool  # the optimizer stepped (the last micro-batch of its accumulation)


def train_step(step: Step, i: int, x: torch.Tensor, y: torch.Tensor, *, last_micro: bool) -> StepOut:
    """Micro-batch `i` (x, y already on the device), each phase in order: the batch's device-side
    augmentation, the forward pass under autocast, the loss, the backward pass (scaled for fp16, divided
    over the accumulated micro-batches, DDP's all-reduce only on the last: no_sync before it); then, on
    the last micro-batch, gradient clipping (on the true gradients), the optimizer step (skipped by the
    scaler on an fp16 overflow), the LR schedule and the EMA; last what the bookkeeping reads."""
    lr = max(group["lr"] for group in step.optimizer.param_groups)  # the head's, under train.layer_decay
    if step.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    inputs, targets = step.augment_batch(x, y) if step.augment_batch else (x, y)
    sync = contextlib.nullcontext() if last_micro or step.dist.world_size == 1 else step.net.no_sync()
    with sync:
        with models.autocast(step.dist.device, step.precision):
            out = step.net(inputs)
            loss = step.loss_fn(out, targets)
        step.scaler.scale(loss / step.accum).backward()
    if last_micro:
        if step.clip_grad_norm:
            step.scaler.unscale_(step.optimizer)
            torch.nn.utils.clip_grad_norm_(step.net.parameters(), step.clip_grad_norm)
        step.scaler.step(step.optimizer)
        step.scaler.update()
        step.optimizer.zero_grad(set_to_none=True)
        step.scheduler.step()
        if step.ema is not None:
            step.ema.update(unwrapped(step.net), step=step.scheduler.last_epoch)
    hits = (out.detach().argmax(1) == hard_labels(targets)).sum()
    return StepOut(i, loss.detach(), hits, len(y), lr, loss_scale(step.scaler), last_micro)


def unwrapped(net: torch.nn.Module) -> torch.nn.Module:
    """The network under torch.compile's and DDP's wrappers: what the EMA averages."""
    net = getattr(net, "_orig_mod", net)
    return getattr(net, "module", net)


def is_compiled(net: torch.nn.Module) -> bool:
    """The network is torch.compile's wrapper (train.compile)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(net, OptimizedModule)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's own count, recompiles included)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_steps(
    step: Step,
    epoch: int,
    batches,
    steps_log,
    n_batches: int | None = None,
    max_steps: int | None = None,
    *,
    progress: Progress | None = None,
    first: int = 0,
    totals: dict | None = None,
    control=None,
    curves=None,
):
    """Train on `batches` (at most max_steps of them) and return the pass's totals (Bookkeeper.totals).
    A resumed epoch starts at step `first` with the `totals` of its steps before; `control` is asked
    after every optimizer step whether the ranks checkpoint or stop there; `steps_log`, `progress` and
    `curves` get each step's row, times and numbers (Bookkeeper)."""
    step.net.train()
    n_batches = n_batches or max_steps
    clock = StepClock(step.dist.device)
    book = Bookkeeper(
        clock,
        steps_log,
        rank=step.dist.rank,
        epoch=epoch,
        totals=totals,
        progress=progress,
        control=control,
        curves=curves,
    )
    for i, (x, y) in enumerate(batches, start=first):
        book.data_ready()
        last_micro = (i + 1) % step.accum == 0 or i + 1 == n_batches
        book.after(train_step(step, i, x, y, last_micro=last_micro), last_of_pass=i + 1 == n_batches)
        if max_steps is not None and i + 1 >= max_steps:
            break
    book.flush()
    return book.totals


class Bookkeeper:
    """A pass's bookkeeping, off the host-sync path: each step's StepOut is resolved one step late (its
    telemetry row, the epoch's totals, the progress lines and curves, the divergence detector), and after
    every optimizer step the epoch's control is polled (a mid-epoch checkpoint or stop).  Step wall time
    runs from the end of the previous step, so data wait + compute = wall."""

    def __init__(self, clock: StepClock, steps_log, *, rank: int, epoch: int, totals, progress, control, curves):
        self.clock, self.steps_log, self.rank, self.epoch, self.progress = clock, steps_log, rank, epoch, progress
        zero = {"loss_sum": 0.0, "correct": 0.0, "seen": 0, "steps": 0, "steady_images": 0, "steady_wall_s": 0.0}
        zero.update(data_wait_s=0.0, step_wall_s=0.0)  # the epoch's data-wait share (rectrain.train.curves)
        self.totals = {**zero, **(totals or {})}
        self.control, self.curves = control, curves
        self.detector = control.detector if control is not None else None
        self.pending: tuple | None = None  # (StepOut, its start, data and end marks) until resolved
        self.start = self.data = clock.mark()

    def data_ready(self) -> None:
        self.data = self.clock.mark()

    def after(self, out: StepOut, *, last_of_pass: bool) -> None:
        """Step `out` is queued: resolve the one before, keep this one; after an optimizer step that is not
        the pass's last, the control decides, and its checkpoint carries this step's row and totals."""
        end = self.clock.mark()
        self.flush()
        self.pending, self.start = (out, self.start, self.data, end), end
        if self.control is not None and out.stepped and not last_of_pass:
            decision = self.control.poll(out.index)
            if decision.checkpoint or decision.diverged:
                self.flush()
                self.control.act(decision, out.index + 1, self.totals)
                self.start = self.clock.mark()  # the checkpoint's time is no step's

    def flush(self) -> None:
        """Resolve the pending step, if any."""
        if self.pending is not None:
            self.resolve(*self.pending)
            self.pending = None

    def resolve(self, out: StepOut, start, data, end) -> None:
        clock, totals = self.clock, self.totals
        clock.wait(end)
        wall, wait = clock.seconds(start, end), clock.seconds(start, data)
        loss = out.loss.item()
        scale = out.scale.item() if out.scale is not None else None
        if self.detector is not None:
            self.detector.observe(self.epoch, out.index, loss, out.lr, scale)
        self.steps_log.write(
            rank=self.rank,
            epoch=self.epoch,
            step=out.index,
            time=clock.unix_time(end),
            wall_s=wall,
            data_wait_s=wait,
            compute_s=wall - wait,
            images=out.images,
            loss=loss,
            lr=out.lr,
        )
        totals["loss_sum"] += loss * out.images
        totals["correct"] += out.hits.item()
        totals["seen"] += out.images
        totals["steps"] += 1
        totals["data_wait_s"] += wait
        totals["step_wall_s"] += wall
        if out.index > 0:
            totals["steady_images"] += out.images
            totals["steady_wall_s"] += wall
        self.report(out, wall, wait, loss, scale)

    def report(self, out: StepOut, wall: float, wait: float, loss: float, scale: float | None) -> None:
        """Rank 0's progress line and curves; the pass's last step always gets its line, so the log ends
        each pass on its own numbers whatever the machine's speed."""
        if self.progress is None:
            return
        self.progress.add(out.index, wall, wait, out.images)
        if self.curves is not None:
            self.curves.add_loss(loss)
        if self.progress.due() or out.index + 1 == self.progress.total:
            window = self.progress.window
            if self.progress.line(out.index + 1) and self.curves is not None:
                self.curves.interval(self.epoch, out.index + 1, window, self.progress.world_size, out.lr, scale)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The fp16 loss scale after this step's update, as a device tensor read one step late with the loss
    (GradScaler.get_scale() would sync the host each step); None when the scaler is off (bf16, fp32).
    update() changes the scale in place, hence the copy."""
    if not scaler.is_enabled() or scaler._scale is None:  # torch keeps it private; read-only here
        return None
    return scaler._scale.detach().clone()
