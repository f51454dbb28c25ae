"""Out-of-memory preflight: find out before training whether the batch fits, and say what does.

On an 11 GB card a too-large batch can surface as `CUDA error: an illegal memory access` deep inside
training.  Each GPU rank therefore runs one forward/backward at the configured batch first; if it does
not fit, a binary search finds the largest batch that does, and the run stops with a message naming
the GPU, its memory, the failing batch, what fits, and the two fixes.  `batch_size: auto` uses the
same search (with headroom); the batch plan (rectrain.train.batchplan) then sets gradient accumulation
to keep the global batch.

The trial is a whole training step (forward, backward, an optimizer step: momentum is real memory),
with cuDNN's autotuner off, and its peak is judged against a Budget: the device's free memory
(torch.cuda.mem_get_info, so the CUDA context and other processes are already out) plus torch's own
cache, less what will sit beside the step - the loaders' decoders (DALI's mixed decoder reserves
dali_device_memory_padding per decode thread, plus prefetched batches) and DDP's gradient buckets.
The loaders' share is estimated from their settings: DALI allocates it only when its pipeline first
runs, after the batch must be chosen.  The search takes any `try_step(batch)` callable and the budget
an injectable mem_get_info, so all of it is unit-tested on CPU with fakes.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch

from rectrain import model as models
from rectrain.loaders import LoaderChoice, LoaderSpec, image_itemsize

# `batch_size: auto` keeps peak memory at or under this share of the card.
HEADROOM = 0.90
# A CUDA error while reserved memory was above this share of the card is treated as a probable OOM.
NEAR_LIMIT = 0.85
MB = 2**20
_OOM_TEXT = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "cuda_error_out_of_memory")


def usable_bytes(device: torch.device) -> int:
    """Memory this process may allocate on the card: its total x the per-process fraction
    (torch.cuda.set_per_process_memory_fraction, or PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:f)."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    return int(total * (fraction(device) if fraction else 1.0))


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_mb: float  # what this process may use
    card_mb: float | None = None  # the whole card, when a per-process cap makes it differ

    @classmethod
    def of(cls, device: torch.device) -> "GpuInfo":
        p = torch.cuda.get_device_properties(device)
        usable, card = usable_bytes(device) / 2**20, p.total_memory / 2**20
        return cls(device.index or 0, p.name, usable, card if usable < 0.99 * card else None)

    def label(self) -> str:
        cap = f" of the card's {self.card_mb / 1024:.1f} GB, capped for this process" if self.card_mb else ""
        return f"GPU {self.index} ({self.name}, {self.total_mb / 1024:.1f} GB{cap})"


class BatchDoesNotFit(RuntimeError):
    """The configured batch does not fit; the message says what does and how to fix the config."""


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def largest_fitting_batch(try_step: Callable[[int], object], failed: int) -> int:
    """Largest b < failed for which try_step(b) does not raise an OOM (0 if even 1 does not fit).

    try_step must free its memory before returning or raising.  Binary search: ~log2(failed) tries.
    """
    return _search(try_step, failed)[0]


def _search(try_step: Callable[[int], object], failed: int) -> tuple[int, object]:
    """(largest fitting batch, what try_step returned for it)."""
    lo, hi, lo_result = 0, failed, None  # invariant: lo fits (0 trivially), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            result = try_step(mid)
            lo, lo_result = mid, result
        except Exception as exc:  # noqa: BLE001 - only OOMs are expected; anything else propagates
            if not is_oom(exc):
                raise
            hi = mid
    return lo, lo_result


def split_batch(per_device: int, fits: int) -> tuple[int, int]:
    """(batch, grad_accum) for `per_device` samples per optimizer step when at most `fits` fit at once:
    the fewest micro-batches, each as even as can be.  The one home of this arithmetic: the batch plan
    (rectrain.train.batchplan) and every fix this module suggests use it."""
    accum = math.ceil(per_device / fits)
    return math.ceil(per_device / accum), accum


def fix_hint(batch: int, fits: int, world_size: int, accum: int = 1, auto: bool = False) -> str:
    """The config change that makes `batch` x `accum` per device fit when only `fits` does, keeping the
    global batch (`auto`: the run had batch_size auto, so the fix pins what auto could not foresee)."""
    if fits <= 0:
        return (
            "not even batch 1 fits: use a smaller train.model or train.image_size (train.progressive's max_res), "
            "or train.precision: bf16/fp16 to halve activation memory"
        )
    global_batch = batch * accum * world_size
    per_device, steps = split_batch(batch * accum, fits)
    keep = f"train.batch_size: {per_device} and train.grad_accum: {steps}"
    if auto:
        return f"fix: keep the global batch of {global_batch} with {keep} in place of train.batch_size: auto"
    return (
        f"fix: set train.batch_size: {fits} (or lower), or keep the global batch of {global_batch} with "
        f"{keep} (or train.batch_size: auto)"
    )


def oom_message(
    gpu: GpuInfo, batch: int, fits: int, world_size: int, need_mb: float | None = None, *, accum: int = 1
) -> str:
    need = f" (needs ~{need_mb / 1024:.1f} GB)" if need_mb else ""
    largest = f"the largest batch that fits is {fits}" if fits else "no batch fits"
    return (
        f"out of GPU memory: batch {batch} per device{need} does not fit on {gpu.label()}; "
        f"{largest}. {fix_hint(batch, fits, world_size, accum)}"
    )


def check_batch(try_step: Callable[[int], object], batch: int, gpu: GpuInfo, world_size: int, accum: int = 1) -> dict:
    """Preflight for a fixed batch: returns a report, or raises BatchDoesNotFit with the explanation
    (and, when the budget refused it, what else holds the device's memory)."""
    try:
        try_step(batch)
        return {"batch": batch, "fits": True}
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        why = str(exc) if isinstance(exc, HeadroomExceeded) else None
    fits, peak_mb = _search(try_step, batch)
    # Activation memory grows about linearly with the batch: extrapolate from what fitted.
    need_mb = peak_mb * batch / fits if fits and isinstance(peak_mb, (int, float)) else None
    message = oom_message(gpu, batch, fits, world_size, None if why else need_mb, accum=accum)
    raise BatchDoesNotFit(f"{message}\n{why}" if why else message)


def auto_fit(try_step: Callable[[int], object], want: int) -> tuple[int, str | None]:
    """(largest batch up to `want` that fits, why `want` was refused or None) for `batch_size: auto`;
    the batch plan turns it into batch and grad_accum.  try_step must raise an OOM when the batch does
    not fit its budget (see budgeted(..., headroom))."""
    try:
        try_step(want)
        return want, None
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        why = str(exc)
    fits = largest_fitting_batch(try_step, want)
    if fits == 0:
        raise BatchDoesNotFit(
            f"batch_size: auto found no batch that fits with {HEADROOM:.0%} headroom; {why}. "
            + fix_hint(want, 0, 1)  # nothing fits: no batch or world size to name
        )
    return fits, why


@contextlib.contextmanager
def autotune_off():
    """cuDNN's autotuner off for the search: it would time every kernel anew for each trial batch (seconds
    each, and workspace memory that is not the step's); the setting comes back afterwards."""
    was = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = was


def preflight(
    try_step: Callable[[int], object], want: int, *, auto: bool, gpu: GpuInfo, world_size: int, accum: int = 1
):
    """(the largest batch up to `want` that fits, the report) with cuDNN autotune off while the trial
    steps run.  auto: searched below `want` when it does not fit; otherwise `want` (train.batch_size)
    is checked, and BatchDoesNotFit says what does."""
    with autotune_off():
        if auto:
            fits, why = auto_fit(try_step, want)
            return fits, {"auto": True, "why_lower": why}
        return want, check_batch(try_step, want, gpu, world_size, accum)


class HeadroomExceeded(torch.cuda.OutOfMemoryError):
    """Raised by a budgeted try_step when the step and what else holds the device do not fit its budget."""


# --- what the device holds besides the step -------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / MB:.0f} MB" if n < 2**30 else f"{n / 2**30:.2f} GB"


@dataclass(frozen=True)
class Reservation:
    """Device memory something beside the training step holds: fixed, plus per sample of the batch."""

    what: str  # in words, with the settings that size it
    fixed_bytes: int = 0
    per_sample_bytes: int = 0

    def bytes(self, batch: int) -> int:
        return self.fixed_bytes + self.per_sample_bytes * batch

    def describe(self, batch: int) -> str:
        return f"{_mb(self.bytes(batch))} {self.what.format(batch_mb=_mb(self.per_sample_bytes * batch))}"


def loader_reservation(choice: LoaderChoice, spec: LoaderSpec, role: str = "training") -> Reservation | None:
    """What a loader (`role`: training, validation) holds on the device, estimated from its settings
    (None off the GPU); the estimate is what the preflight can know before the first batch.

    DALI's mixed decoder reserves dali_device_memory_padding for nvJPEG in EACH of its decode threads
    (train.workers), keeps dali_prefetch_queue_depth decoded batches ahead plus the one the step holds,
    and with dali_preallocate (on a GPU with hardware JPEG decoders, the only place it acts) a
    full-size image buffer per sample.  The torch loader's GPU decode keeps
    a batch decoding ahead of the one in the step."""
    if not spec.on_gpu:
        return None
    sample = 3 * spec.largest_crop**2 * image_itemsize(choice.kind, spec.dtype)  # at the run's largest crop
    if choice.kind == "dali" and choice.decode.startswith("gpu"):
        threads, depth, pad = max(1, spec.workers), spec.dali.prefetch_queue_depth, spec.dali.device_memory_padding
        width, height = spec.dali.preallocate if spec.jpeg_engine else (0, 0)  # the hints act only there
        what = (
            f"held by the {role} loader's DALI mixed decoder (dali_device_memory_padding {_mb(pad)} per decode thread x {threads} "
            f"threads = {_mb(pad * threads)}, plus {depth} prefetched batches and the one in the step: "
            "{batch_mb}" + (f", with dali_preallocate {width}x{height} buffers" if width and height else "") + ")"
        )
        return Reservation(what, pad * threads, (depth + 1) * sample + 3 * width * height)
    if choice.decode.startswith("gpu"):
        what = f"held by the {role} loader's GPU decode (TorchCodec; a batch ahead and one in use: {{batch_mb}})"
    else:
        what = f"held by the {role} loader's batches on the device (one ahead and one in use: {{batch_mb}})"
    return Reservation(what, 0, 2 * sample)


def ema_reservation(model: torch.nn.Module, ema: dict) -> Reservation | None:
    """train.ema's averaged copy of the weights and buffers, fp32 on the device (rectrain.train.ema)."""
    if not ema["decay"]:
        return None
    size = sum(t.numel() * 4 for t in model.state_dict().values() if t.is_floating_point())
    return Reservation("of the weights' EMA (train.ema, fp32)", size, 0)


def ddp_reservation(model: torch.nn.Module, world_size: int) -> Reservation | None:
    """DDP's gradient buckets: a second copy of the gradients, allocated at the first backward."""
    if world_size <= 1:
        return None
    size = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return Reservation(f"of DDP gradient buckets ({world_size} processes)", size, 0)


@dataclass(frozen=True)
class Budget:
    """What the training step may use: the device's free memory plus what torch already holds (the model
    and its cache), times the headroom, less what the loader and DDP will hold."""

    available_bytes: int
    held: tuple[Reservation, ...] = ()
    headroom: float = 1.0

    def held_bytes(self, batch: int) -> int:
        return sum(r.bytes(batch) for r in self.held)

    def refusal(self, batch: int, step_bytes: int) -> str:
        parts = [f"{_mb(step_bytes)} for the training step (model, activations, optimizer state)"]
        parts += [r.describe(batch) for r in self.held]
        need = step_bytes + self.held_bytes(batch)
        share = f"{self.headroom:.0%} of " if self.headroom < 1 else ""
        return (
            f"batch {batch} needs {_mb(need)}: " + " + ".join(parts) + f"; over {share}the {_mb(self.available_bytes)} "
            "free on the device"
        )


def device_budget(device: torch.device, held, headroom: float = 1.0, mem_get_info=None) -> Budget:
    """The Budget on `device` now: torch.cuda.mem_get_info's free bytes (the CUDA context, other
    processes and other libraries already taken out) plus torch's own cache, capped by the per-process
    fraction.  `mem_get_info` is injectable for tests."""
    free, total = (mem_get_info or torch.cuda.mem_get_info)(device)
    torch_held = torch.cuda.memory_reserved(device) if torch.cuda.is_available() else 0
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    cap = total * (fraction(device) if fraction and torch.cuda.is_available() else 1.0)
    return Budget(int(min(free + torch_held, cap)), tuple(r for r in held if r is not None), headroom)


def budgeted(step_bytes: Callable[[int], int], budget: Budget | None) -> Callable[[int], float]:
    """try_step(batch) -> MB the batch needs: the step's measured peak plus what the budget says is held
    beside it; raises HeadroomExceeded, naming each share, when that is over the budget."""

    def try_step(batch: int) -> float:
        peak = step_bytes(batch)
        if budget is None:
            return peak / MB
        need = peak + budget.held_bytes(batch)
        if need > budget.headroom * budget.available_bytes:
            raise HeadroomExceeded(budget.refusal(batch, peak))
        return need / MB

    return try_step


@dataclass
class Trial:
    """What a preflight step runs: the model and its loss on random data of the training shape, with
    the training numerics and a fresh optimizer of the run's kind (its state is real memory)."""

    model: torch.nn.Module
    loss_fn: torch.nn.Module
    image_size: int
    num_classes: int
    device: torch.device
    precision: str
    channels_last: bool
    make_optimizer: Callable[[], torch.optim.Optimizer] | None = None
    # the run's device-side batch augmentation: Mixup's soft targets are what the loss takes
    augment_batch: Callable | None = None


def trial_batch(trial: Trial, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch of the training shape on the trial's device, through the run's batch augmentation
    (random erasing, Mixup/CutMix) when it has one, so the loss gets the targets it trains on."""
    x = torch.randn(batch, 3, trial.image_size, trial.image_size, device=trial.device)
    if trial.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, trial.num_classes, (batch,), device=trial.device)
    return trial.augment_batch(x, y) if trial.augment_batch is not None else (x, y)


def cuda_step_bytes(trial: Trial) -> Callable[[int], int]:
    """step_bytes(batch): peak device memory torch reserves for one forward, backward and optimizer step.
    The caller restores the weights (the optimizer step moves them)."""
    device = trial.device

    def step_bytes(batch: int) -> int:
        x = y = loss = optimizer = None
        try:
            torch.cuda.reset_peak_memory_stats(device)
            x, y = trial_batch(trial, batch)
            optimizer = trial.make_optimizer() if trial.make_optimizer else None
            with models.autocast(device, trial.precision):
                loss = trial.loss_fn(trial.model(x), y)
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_reserved(device)
        finally:
            del x, y, loss, optimizer
            trial.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    return step_bytes


def cuda_try_step(trial: Trial, budget: Budget | None = None) -> Callable[[int], float]:
    """A try_step(batch) -> MB needed that runs one real training step on random data on the GPU."""
    return budgeted(cuda_step_bytes(trial), budget)
