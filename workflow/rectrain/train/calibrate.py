"""Calibration: the img/s this run's own training step reaches when data costs nothing.

Before the first epoch every rank runs a short burst of steps (rectrain.train.step.run_steps, the step
the epochs run) on one synthetic batch already on the device: same network (DDP- and compile-wrapped),
batch, gradient accumulation, precision, memory format and optimizer step.  Its steady-state img/s
(warm-up steps dropped) is the ceiling the input pipeline is measured against: real img/s over it is
the run's input efficiency (report/efficiency.py, and each epoch's log line).  bench/gpu_efficiency.py
measures its synthetic ceiling with the same `measure`, so the bench and the pipeline agree.

The trained result does not change: the steps run on the real network, between a snapshot and a
restore of everything they touch - weights and BatchNorm statistics, optimizer state (momentum),
LR schedule position, GradScaler state and every RNG (torch, CUDA, numpy, python).  Calibrating on
the real network rather than a deep copy costs no second model in device memory, keeps the DDP
buckets and the compiled graph the epochs use (a copy would need its own DDP wrapper, and compile
would compile twice), and warms cuDNN's autotuner for the first epoch.  Under DDP the steps
all-reduce synthetic gradients among the ranks, which all run the same number of steps; every
optimizer step ends with zero_grad(set_to_none), and the restore drops the gradients, so nothing of
them reaches a real step.

Compiled (train.compile): the calibration runs the network the epochs run, so it is compiled once, with
the same mode, and the ceiling is the compiled step's.  The synthetic batch has the loader's dtype and
memory format (rectrain.loaders.image_dtype, channels_last), so the graph compiled here is the one
the epochs' real batches run (a dtype or stride the graph was not traced for would compile another).
Compilation happens in the first step: a compiled run warms up for at least one step, and the
graphs compiled during the measured steps are counted (`compiles`): none, or the ceiling is low.
The time cap (train.calibration_max_s) counts from the end of that compiling step.

Bounded (a calibration once took 135 s, longer than the 1-step-per-epoch run it measured, silent all
along): its steps (warm-up included) are at most CALIBRATION_SHARE of the steps the whole run trains
(shortened, or skipped when not even one measured step after a warm-up one fits), it stops measuring
once train.calibration_max_s have passed, and rank 0 logs a progress line every train.progress_s.
The measured steps run in chunks of whole optimizer steps; after each chunk the ranks gather their
elapsed time, so every rank takes the same decision to go on and runs the same number of steps.

Under train.progressive the run trains at several resolutions, and a step's img/s depends on its
crop: each distinct resolution is calibrated on its own (bounded by the steps the run trains at it,
train.calibration_max_s shared equally), each epoch's input efficiency is held against its own
resolution's rate, and the run's against the epochs' combined ceiling (combine_resolutions).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rectrain import watchdog
from rectrain.atomic import write_json
from rectrain.distributed import Dist, all_gather
from rectrain.log import CONSOLE_LINE
from rectrain.progress import Progress
from rectrain.train import resolution, telemetry
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.step import Step, compiled_graphs, is_compiled, run_steps

if TYPE_CHECKING:
    from rectrain.train.run import Run

log = logging.getLogger(__name__)

# The epoch number calibration steps carry in their step rows (kept in memory, never in steps.csv).
CALIBRATION_EPOCH = -1
# The calibration's steps (warm-up included) are at most this share of the steps the run trains.
CALIBRATION_SHARE = 0.5


@dataclass(frozen=True)
class Bounds:
    """What limits a calibration: the steps the whole run trains (None: unbounded), its time cap in
    seconds (train.calibration_max_s), rank 0's progress interval (train.progress_s), the micro-steps
    of one optimizer step (chunks end on whole optimizer steps)."""

    run_steps: int | None = None
    max_s: float = float("inf")
    progress_s: float = float("inf")
    accum: int = 1

    def fit(self, steps: int, warmup: int) -> tuple[int, int, str | None]:
        """(measured steps, warm-up steps, why they were cut or None) within CALIBRATION_SHARE of the run;
        0 measured steps when none fits."""
        if self.run_steps is None or steps <= 0:
            return steps, warmup, None
        allowed = int(CALIBRATION_SHARE * self.run_steps)
        if warmup + steps <= allowed:
            return steps, warmup, None
        why = (
            f"the run trains only {self.run_steps} steps: {warmup} warm-up + {steps} calibration steps would be more "
            f"than {CALIBRATION_SHARE:.0%} of it"
        )
        if allowed < 2:
            return 0, 0, why
        cut_warmup = min(warmup, allowed // 2)
        return allowed - cut_warmup, cut_warmup, why + f", so at most {cut_warmup} + {allowed - cut_warmup}"


class StepRows:
    """A steps_log for run_steps that keeps its rows in memory."""

    def __init__(self):
        self.rows: list[dict] = []

    def write(self, **row) -> None:
        self.rows.append(row)


def steady(rows: list[dict], warmup: int) -> dict:
    """img/s, data-wait share, step count and the (start, end) unix times over the steps after `warmup`
    (all when fewer ran)."""
    kept = [r for r in rows if r["step"] >= warmup] or rows
    wall = sum(r["wall_s"] for r in kept)
    return {
        "img_s": sum(r["images"] for r in kept) / wall,
        "data_wait_share": sum(r["data_wait_s"] for r in kept) / wall,
        "steps": len(kept),
        "window": (kept[0]["time"] - kept[0]["wall_s"], kept[-1]["time"]),  # unix times of the kept steps
    }


@dataclass(frozen=True)
class Shape:
    """What a synthetic batch looks like: per-device batch, square image side, classes, and the real
    batches' dtype and memory format (the loader's image_dtype; NHWC when channels_last)."""

    batch: int
    image_size: int
    num_classes: int
    dtype: torch.dtype = torch.float32
    channels_last: bool = False


def synthetic_batches(shape: Shape, device: torch.device, n: int, seed: int = 0):
    """One random batch, made once (own generator: the global RNGs are not drawn) and moved to the
    device, yielded n times: the input pipeline's cost is zero, the ceiling no loader can beat."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape.batch, 3, shape.image_size, shape.image_size, generator=g)
    layout = torch.channels_last if shape.channels_last else torch.contiguous_format
    x = x.to(device, shape.dtype, memory_format=layout)
    y = torch.randint(0, shape.num_classes, (shape.batch,), generator=g).to(device)
    return ((x, y) for _ in range(n))


def measure(step: Step, batches, steps: int, warmup: int) -> dict:
    """Run warmup + steps training steps on `batches` with the project's step; steady-state numbers."""
    rows = StepRows()
    n = warmup + steps
    run_steps(step, CALIBRATION_EPOCH, batches, rows, n_batches=n, max_steps=n)
    return steady(rows.rows, warmup)


@contextlib.contextmanager
def restored(step: Step, model: torch.nn.Module):
    """Run the body, then put back every state a training step changes (see the module doc)."""
    saved = {
        "model": ckpt.host_copy(model.state_dict()),
        "optimizer": ckpt.host_copy(step.optimizer.state_dict()),
        "scheduler": ckpt.host_copy(step.scheduler.state_dict()),
        "scaler": ckpt.host_copy(step.scaler.state_dict()),
        "ema": ckpt.host_copy(step.ema.module.state_dict()) if step.ema is not None else None,
        "rng": ckpt.rng_state(),
    }
    try:
        yield
    finally:
        model.load_state_dict(saved["model"])  # copies in place: DDP and the compiled graph keep their tensors
        step.optimizer.load_state_dict(saved["optimizer"])  # replaces the state: no momentum from synthetic data
        step.scheduler.load_state_dict(saved["scheduler"])
        if saved["scaler"]:
            step.scaler.load_state_dict(saved["scaler"])
        if saved["ema"] is not None:  # the calibration's synthetic steps moved the average too
            step.ema.module.load_state_dict(saved["ema"])
        model.zero_grad(set_to_none=True)
        ckpt.set_rng_state(saved["rng"])


def skipped(why: str, shape: Shape) -> dict:
    return {
        "images_per_s": {},
        "steps": 0,
        "warmup_steps": 0,
        "seconds": 0.0,
        "batch_size": shape.batch,
        "skipped": why,
    }


@dataclass
class Chunks:
    """How far a bounded calibration got: steps done (warm-up included), the warm-up's length (cut
    short when the time cap comes first), the measured rows, why it stopped early."""

    warmup: int
    done: int = 0
    rows: list = field(default_factory=list)
    stopped: str = ""
    compiles: int = 0  # torch.compile graphs compiled during the measured steps (0 when not compiled)
    compiled: bool = False  # the network is torch.compile's: its first chunk compiles


def bounded_steps(step: Step, batches, steps: int, bounds: Bounds, progress: Progress | None, chunks: Chunks) -> None:
    """`chunks.warmup` warm-up steps then up to `steps` measured ones, in chunks of whole optimizer steps
    about one progress interval long (a progress line after each when due), until
    train.calibration_max_s have passed: the warm-up is cut short then, and at least one step is
    measured.  Elapsed time is gathered from every rank, so all take the same decisions.  A compiled
    network's first chunk compiles it: the time cap and the step-time estimate count from its end, so
    a minute of compiling neither uses up the cap nor passes for the step time."""
    d, t0, base = step.dist, time.perf_counter(), 0
    total, chunk = chunks.warmup + steps, bounds.accum
    while chunks.done < total:
        limit = chunks.warmup if chunks.done < chunks.warmup else total  # the warm-up ends on a chunk's end
        n = min(chunk, limit - chunks.done)
        part, graphs = StepRows(), compiled_graphs()
        run_steps(step, CALIBRATION_EPOCH, batches, part, n_batches=n, max_steps=n)
        if chunks.done >= chunks.warmup:
            chunks.rows += part.rows
            chunks.compiles += compiled_graphs() - graphs
        chunks.done += n
        if progress is not None:
            progress.count(chunks.done * (part.rows[-1]["images"] if part.rows else 0) * d.world_size)
        if chunks.compiled and not base:
            t0, base = time.perf_counter(), chunks.done  # every rank, after the same chunk
            continue
        elapsed = max(all_gather(time.perf_counter() - t0, d))
        per_step = elapsed / (chunks.done - base)
        if chunks.done < total and elapsed + per_step > bounds.max_s:
            if chunks.rows:
                chunks.stopped = (
                    f"train.calibration_max_s = {bounds.max_s:g} s: {len(chunks.rows)} of {steps} steps measured"
                )
                return
            chunks.warmup = min(chunks.warmup, chunks.done)  # the warm-up ends here: one optimizer step measured
            chunks.stopped = (
                f"train.calibration_max_s = {bounds.max_s:g} s: {chunks.warmup} warm-up step(s), then one optimizer "
                f"step of {steps} measured"
            )
            total = chunks.done + bounds.accum
        ahead = min(total - chunks.done, min(bounds.progress_s, bounds.max_s - elapsed) / per_step)
        chunk = max(bounds.accum, int(ahead) // bounds.accum * bounds.accum)


def calibrate(
    step: Step, model: torch.nn.Module, shape: Shape, steps: int, warmup: int, *, bounds: Bounds = Bounds()
) -> dict:
    """Every rank calibrates; returns run.json's `calibration` (every rank's img/s, gathered) on all
    ranks.  `model` is the unwrapped network under step.net, whose state is restored afterwards;
    `bounds`: what limits it (module doc)."""
    d: Dist = step.dist
    if steps <= 0:
        return skipped("train.calibration_steps is 0", shape)
    compiled = is_compiled(step.net)
    warmup = max(warmup, 1) if compiled else warmup  # the first step compiles: never measured
    steps, warmup, cut = bounds.fit(steps, warmup)
    if steps <= 0:
        return skipped(cut, shape)
    t0 = time.perf_counter()
    progress = Progress(bounds.progress_s, d.world_size) if d.master else None
    if progress is not None:
        progress.begin("calibration", (warmup + steps) * shape.batch * d.world_size, unit="images")
    chunks, graphs = Chunks(warmup, compiled=compiled), compiled_graphs()
    with restored(step, model):
        batches = watchdog.watched(synthetic_batches(shape, d.device, warmup + steps), "calibration")
        bounded_steps(step, batches, steps, bounds, progress, chunks)
        result = steady(chunks.rows, 0)
    seconds = time.perf_counter() - t0
    rates = all_gather(result["img_s"], d)
    seconds = max(all_gather(seconds, d))
    return {
        "images_per_s": {str(r): float(v) for r, v in enumerate(rates)},
        "steps": result["steps"],
        "warmup_steps": chunks.warmup,
        "seconds": round(seconds, 3),
        "batch_size": shape.batch,
        "skipped": None,
        "shortened": "; ".join(w for w in (cut, chunks.stopped) if w) or None,
        "compiled": compiled,
        # graphs torch.compile made in the warm-up and (should be none) in the measured steps
        "compiles": {"warmup": compiled_graphs() - graphs - chunks.compiles, "measured": chunks.compiles},
    }


def total_rate(calibration: dict | None) -> float | None:
    """Summed calibration img/s of all ranks (None when skipped): what the epochs' real img/s,
    summed the same way, is compared with."""
    rates = (calibration or {}).get("images_per_s") or {}
    return sum(rates.values()) if rates else None


def rate_at(calibration: dict | None, size: int) -> float | None:
    """total_rate at the training resolution `size` (px): its own calibration under train.progressive,
    else the run's."""
    by = (calibration or {}).get("by_resolution")
    return total_rate(by.get(str(size)) if by else calibration)


def compiled_note(cal: dict) -> str:
    """The calibration log line's tail for a compiled run: what the warm-up compiled, and a warning
    when compilation fell into the measured steps (their img/s then includes it)."""
    if not cal.get("compiled"):
        return ""
    graphs = cal["compiles"]
    note = f", compiled (torch.compile: {graphs['warmup']} graph(s) in the warm-up)"
    if graphs["measured"]:
        note += (
            f"; {graphs['measured']} graph(s) compiled during the measured steps, so the ceiling is too low: "
            "raise train.calibration_warmup_steps"
        )
    return note


def setup_key(run: Run) -> dict:
    """What a calibration's img/s depends on: the devices (GPU models and memory, CPU cores), the
    processes, the model and its numerics, the batch plan, the resolutions and the calibration's own
    bounds.  run.json and telemetry/calibration.json (KEPT) record it (`calibration_setup`): a resume
    with the same one reuses the measurement."""
    s, res = run.settings, run.settings.resolution
    tel = s.telemetry
    return {
        "gpus": [[g.get("name"), g.get("memory_total_mb")] for g in telemetry.gpu_inventory()],
        "cpu_cores": os.cpu_count(),
        "devices": s.launch.devices,
        "world_size": run.d.world_size,
        "model": s.network.model,
        "precision": s.network.precision,
        "channels_last": s.network.channels_last,
        "compile": [s.network.compile, s.network.compile_mode],
        "batch": [run.plan.batch, run.plan.grad_accum],
        "resolutions": resolution.resolutions(res.image_size, res.progressive, s.optim.epochs),
        "image_dtype": str(run.train_loader.image_dtype),
        "bounds": [tel.calibration_steps, tel.calibration_warmup_steps, tel.calibration_max_s],
    }


# The run's calibration and what it was measured on, in the live telemetry folder of its --out: run.json
# has them too, but it is an output Snakemake removes when the job stops, so a resume through Snakemake
# reads them from here.
KEPT = Path("telemetry") / "calibration.json"


def keep(path: Path, info: dict) -> None:
    """Rank 0: run.json's `calibration` and `calibration_setup` (from `info`) to `path` (KEPT)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {key: info[key] for key in ("calibration", "calibration_setup")})


def reused_or_measured(run: Run, previous_run_json: Path, resumed: bool) -> dict:
    """On a resume whose previous run (its run.json, or telemetry/calibration.json: KEPT) measured the same
    `setup_key`: that calibration, said so
    (24-40 s of a short run saved); else calibrate_run.  Rank 0 decides for every rank (each must run
    the calibration's steps, or none)."""
    key = setup_key(run)
    found = _previous(previous_run_json, key) if resumed and run.d.master else None
    found = all_gather(found, run.d)[0]
    if found is None:
        return calibrate_run(run)
    if run.d.master:
        log.info(
            "calibration reused from %s (%.1f img/s): the same devices, processes, model, batch plan and "
            "resolutions as the run this one resumes",
            previous_run_json,
            total_rate(found),
            extra=CONSOLE_LINE,
        )
    return found


def _previous(path: Path, key: dict) -> dict | None:
    try:
        before = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    same = isinstance(before, dict) and before.get("calibration_setup") == json.loads(json.dumps(key))
    found = before.get("calibration") if same else None
    return found if found and not found.get("skipped") else None  # a skipped one costs nothing to skip again


def calibrate_run(run: Run) -> dict:
    """run.json's `calibration` for a training run, logged on rank 0: every rank's img/s on synthetic
    data with the run's own step and planned batch - under train.progressive at each resolution the
    run trains (combine_resolutions), train.calibration_max_s shared equally among them."""
    res, epochs, max_s = run.settings.resolution, run.settings.optim.epochs, run.settings.telemetry.calibration_max_s
    per_epoch = resolution.resolutions(res.image_size, res.progressive, epochs)
    if not res.progressive:
        return _calibrate_at(run, per_epoch[0], epochs, max_s)
    sizes = sorted(set(per_epoch))
    share = max_s / len(sizes)
    by = {str(r): _calibrate_at(run, r, per_epoch.count(r), share, f" at {r} px") for r in sizes}
    return combine_resolutions(by, per_epoch)


def _calibrate_at(run: Run, size: int, epochs: int, max_s: float, where: str = "") -> dict:
    """One calibration at crops of `size` px, bounded by the `epochs` of the run trained at that size
    (CALIBRATION_SHARE of their steps) and `max_s`; logged on rank 0 (`where`: the resolution, in words)."""
    tel = run.settings.telemetry
    shape = Shape(
        run.plan.batch, size, len(run.classes), run.train_loader.image_dtype, run.settings.network.channels_last
    )
    bounds = Bounds(
        run_steps=epochs * run.train_loader.batches_per_epoch,
        max_s=max_s,
        progress_s=tel.progress_s,
        accum=run.plan.grad_accum,
    )
    cal = calibrate(run.step, run.model, shape, tel.calibration_steps, tel.calibration_warmup_steps, bounds=bounds)
    if run.d.master:
        _log_calibration(cal, where)
    return cal


def _log_calibration(cal: dict, where: str) -> None:
    if cal["skipped"]:
        log.info("calibration%s skipped: %s (no input efficiency for this run)", where, cal["skipped"])
    else:
        log.info(
            "calibration%s: %.1f img/s on synthetic data on the device (%s), %d steps after %d warm-up, %.1f s%s",
            where,
            total_rate(cal),
            ", ".join(f"rank {r}: {v:.1f}" for r, v in cal["images_per_s"].items()),
            cal["steps"],
            cal["warmup_steps"],
            cal["seconds"],
            compiled_note(cal),
        )
    if cal.get("shortened"):
        log.info("calibration%s shortened: %s", where, cal["shortened"])


def combine_resolutions(by: dict[str, dict], per_epoch: list[int]) -> dict:
    """The calibration of a run with several training resolutions (`by`: one calibration per
    resolution, keyed by its px as a string; `per_epoch`: each epoch's resolution).  Its images_per_s is
    each rank's ceiling for the whole run: every epoch trains the same number of images, so the run's
    synthetic time is the sum of the epochs' and its rate the epochs' harmonic mean - what the report
    compares the run's real img/s with.  The epoch log lines use their resolution's own (rate_at)."""
    parts = list(by.values())
    skipped = next((f"at {r} px: {c['skipped']}" for r, c in by.items() if c["skipped"]), None)
    rates = {}
    if not skipped:
        for rank in parts[0]["images_per_s"]:
            rates[rank] = len(per_epoch) / sum(1 / by[str(r)]["images_per_s"][rank] for r in per_epoch)
    shortened = "; ".join(f"at {r} px: {c['shortened']}" for r, c in by.items() if c.get("shortened"))
    return {
        "images_per_s": rates,
        "steps": sum(c["steps"] for c in parts),
        "warmup_steps": sum(c["warmup_steps"] for c in parts),
        "seconds": round(sum(c["seconds"] for c in parts), 3),
        "batch_size": parts[0]["batch_size"],
        "skipped": skipped,
        "shortened": shortened or None,
        "compiled": any(c.get("compiled") for c in parts),
        "compiles": {k: sum(c["compiles"][k] for c in parts if c.get("compiles")) for k in ("warmup", "measured")},
        "resolutions": per_epoch,  # each epoch's, so a reader finds the epoch's own rate in by_resolution
        "by_resolution": by,
    }
