"""One training step, shared by the epoch loop (rectrain.train.epochs), the calibration
(rectrain.train.calibrate) and bench/gpu_efficiency.py, so all three time the same work."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from rectrain import model as models
from rectrain.distributed import Dist
from rectrain.progress import Progress
from rectrain.train.stepclock import StepClock


@dataclass
class Step:
    """What one training step needs: the network (DDP- and compile-wrapped as configured), its loss,
    optimizer, schedule and scaler, gradient accumulation, numerics, and the rank it runs on."""

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
    """Train on `batches` (at most max_steps of them), one telemetry row per step in steps_log, and
    the resolved times into `progress` (rank 0's progress lines, rectrain.progress).  A resumed epoch
    starts at step `first` with the `totals` of its steps before; `control` (rectrain.train.lifecycle.midepoch)
    is asked after every optimizer step whether the ranks checkpoint or stop there, and its divergence
    detector (rectrain.train.lifecycle.divergence) reads every step's loss and loss scale; `curves` (rank 0's,
    rectrain.train.curves) gets the numbers of every progress line.

    No host sync per step: times come from a StepClock read one step late, loss and hits stay on the
    device until then, so the host queues step k+1 (and fetches its batch) while the GPU still computes
    step k.  Totals: loss, hits, images, steps, and `steady_images` / `steady_wall_s` without the first
    step (pipeline start-up), the report's steady state (rectrain.report.stats.steady_steps)."""
    step.net.train()
    n_batches = n_batches or max_steps
    clock = StepClock(step.dist.device)
    detector = control.detector if control is not None else None
    book = _Book(clock, steps_log, step.dist.rank, epoch, progress, totals, detector=detector, curves=curves)
    pending = None
    m_prev = clock.mark()
    for i, (x, y) in enumerate(batches, start=first):
        m_data = clock.mark()
        lr = step.optimizer.param_groups[0]["lr"]
        last_micro = (i + 1) % step.accum == 0 or i + 1 == n_batches
        out, loss = _forward_backward(step, x, y, last_micro=last_micro)
        hits = (out.argmax(1) == y).sum()
        m_end = clock.mark()
        if pending:
            book.resolve(pending)
        pending = (i, m_prev, m_data, m_end, loss.detach(), hits, len(y), lr, loss_scale(step.scaler))
        m_prev = m_end
        if control is not None and last_micro and i + 1 < n_batches:
            decision = control.poll(i)
            if decision.checkpoint or decision.diverged:  # its row and totals first: the checkpoint carries them
                book.resolve(pending)
                pending = None
                control.act(decision, i + 1, book.totals)
                m_prev = clock.mark()  # the checkpoint's time is no step's
        if max_steps is not None and i + 1 >= max_steps:
            break
    if pending:
        book.resolve(pending)
    return book.totals


class _Book:
    """A step's bookkeeping once its times can be read (one step late): its telemetry row, the
    epoch's totals, the progress lines."""

    def __init__(
        self,
        clock: StepClock,
        steps_log,
        rank: int,
        epoch: int,
        progress: Progress | None,
        totals=None,
        *,
        detector=None,
        curves=None,
    ):
        self.clock, self.steps_log, self.rank, self.epoch, self.progress = clock, steps_log, rank, epoch, progress
        zero = {"loss_sum": 0.0, "correct": 0.0, "seen": 0, "steps": 0, "steady_images": 0, "steady_wall_s": 0.0}
        zero.update(data_wait_s=0.0, step_wall_s=0.0)  # the epoch's data-wait share (rectrain.train.curves)
        self.totals = {**zero, **(totals or {})}
        self.detector, self.curves = detector, curves

    def resolve(self, pending: tuple) -> None:
        i, m_prev, m_data, m_end, loss, hits, n, lr, scale = pending
        clock, totals = self.clock, self.totals
        clock.wait(m_end)
        wall, wait = clock.seconds(m_prev, m_end), clock.seconds(m_prev, m_data)
        loss_v = loss.item()
        scale_v = scale.item() if scale is not None else None
        if self.detector is not None:
            self.detector.observe(self.epoch, i, loss_v, lr, scale_v)
        # Step wall time runs from the end of the previous step, so data wait + compute = wall.
        self.steps_log.write(
            rank=self.rank,
            epoch=self.epoch,
            step=i,
            time=clock.unix_time(m_end),
            wall_s=wall,
            data_wait_s=wait,
            compute_s=wall - wait,
            images=n,
            loss=loss_v,
            lr=lr,
        )
        totals["loss_sum"] += loss_v * n
        totals["correct"] += hits.item()
        totals["seen"] += n
        totals["steps"] += 1
        totals["data_wait_s"] += wait
        totals["step_wall_s"] += wall
        if i > 0:
            totals["steady_images"] += n
            totals["steady_wall_s"] += wall
        if self.progress is not None:
            self.progress.add(i, wall, wait, n)
            if self.curves is not None:
                self.curves.add_loss(loss_v)
            # The pass's last step always gets its line: the log then ends each pass on its own numbers,
            # whatever the machine's speed (resolved one step late, it comes right after the one before).
            if self.progress.due() or i + 1 == self.progress.total:
                window = self.progress.window
                if self.progress.line(i + 1) and self.curves is not None:
                    self.curves.interval(self.epoch, i + 1, window, self.progress.world_size, lr, scale_v)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The fp16 loss scale after this step's update, as a device tensor read one step late with the loss
    (GradScaler.get_scale() would sync the host each step); None when the scaler is off (bf16, fp32).
    update() changes the scale in place, hence the copy."""
    if not scaler.is_enabled() or scaler._scale is None:  # torch keeps it private; read-only here
        return None
    return scaler._scale.detach().clone()


def _forward_backward(step: Step, x, y, last_micro: bool):
    """One micro-batch; the optimizer steps (and DDP all-reduces) on the last micro-batch only."""
    if step.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    sync = contextlib.nullcontext() if last_micro or step.dist.world_size == 1 else step.net.no_sync()
    with sync:
        with models.autocast(step.dist.device, step.precision):
            out = step.net(x)
            loss = step.loss_fn(out, y)
        step.scaler.scale(loss / step.accum).backward()
    if last_micro:
        if step.clip_grad_norm:
            step.scaler.unscale_(step.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(step.net.parameters(), step.clip_grad_norm)
        step.scaler.step(step.optimizer)
        step.scaler.update()
        step.optimizer.zero_grad(set_to_none=True)
        step.scheduler.step()
    return out, loss
