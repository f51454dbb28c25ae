"""Out-of-memory preflight: find out before training whether the batch fits, and say what does.

On an 11 GB card a too-large batch can surface as `CUDA error: an illegal memory access` deep inside
training.  Each GPU rank therefore runs one forward/backward at the configured batch first; if it does
not fit, a binary search finds the largest batch that does, and the run stops with a message naming
the GPU, its memory, the failing batch, what fits, and the two fixes.  `batch_size: auto` uses the
same search (with headroom) and sets gradient accumulation to keep the global batch.
The search takes any `try_step(batch)` callable, so it is unit-tested on CPU with a fake allocator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from rectrain import model as models

# `batch_size: auto` keeps peak memory at or under this share of the card.
HEADROOM = 0.90
# A CUDA error while reserved memory was above this share of the card is treated as a probable OOM.
NEAR_LIMIT = 0.85
DEFAULT_AUTO_GLOBAL_BATCH = 256
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


def fix_hint(batch: int, fits: int, world_size: int) -> str:
    global_batch = batch * world_size
    if fits <= 0:
        return (
            "not even batch 1 fits: use a smaller train.model or train.image_size, "
            "or train.precision: bf16/fp16 to halve activation memory"
        )
    accum = math.ceil(batch / fits)
    per_device = math.ceil(batch / accum)
    return (
        f"fix: set train.batch_size: {fits} (or lower), or keep the global batch of {global_batch} with "
        f"train.batch_size: {per_device} and train.grad_accum: {accum} (or train.batch_size: auto)"
    )


def oom_message(gpu: GpuInfo, batch: int, fits: int, world_size: int, need_mb: float | None = None) -> str:
    need = f" (needs ~{need_mb / 1024:.1f} GB)" if need_mb else ""
    largest = f"the largest batch that fits is {fits}" if fits else "no batch fits"
    return (
        f"out of GPU memory: batch {batch} per device{need} does not fit on {gpu.label()}; "
        f"{largest}. {fix_hint(batch, fits, world_size)}"
    )


def check_batch(try_step: Callable[[int], object], batch: int, gpu: GpuInfo, world_size: int) -> dict:
    """Preflight for a fixed batch: returns a report, or raises BatchDoesNotFit with the explanation."""
    try:
        try_step(batch)
        return {"batch": batch, "fits": True}
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
    fits, peak_mb = _search(try_step, batch)
    # Activation memory grows about linearly with the batch: extrapolate from what fitted.
    need_mb = peak_mb * batch / fits if fits and isinstance(peak_mb, (int, float)) else None
    raise BatchDoesNotFit(oom_message(gpu, batch, fits, world_size, need_mb))


def auto_batch(try_step: Callable[[int], object], global_batch: int, world_size: int) -> tuple[int, int]:
    """(per-device batch, grad_accum) for `batch_size: auto`: largest fitting batch with headroom,
    accumulation so that batch x accum x world ~= global_batch.  try_step must raise an OOM when peak
    memory would exceed HEADROOM of the card (see cuda_try_step(headroom=...))."""
    want = max(1, math.ceil(global_batch / world_size))
    try:
        try_step(want)
        return want, 1
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
    fits = largest_fitting_batch(try_step, want)
    if fits == 0:
        raise BatchDoesNotFit(
            f"batch_size: auto found no batch that fits with {HEADROOM:.0%} headroom; " + fix_hint(want, 0, world_size)
        )
    accum = math.ceil(want / fits)
    return math.ceil(want / accum), accum


class HeadroomExceeded(torch.cuda.OutOfMemoryError):
    """Raised by cuda_try_step when a step fit but left less than the wanted headroom."""


def cuda_try_step(
    model: torch.nn.Module,
    loss_fn,
    image_size: int,
    num_classes: int,
    device: torch.device,
    precision: str,
    channels_last: bool,
    headroom: float | None = None,
) -> Callable[[int], float]:
    """A try_step(batch) -> peak MB that runs one forward/backward on random data on `device`."""
    total = usable_bytes(device)

    def try_step(batch: int) -> float:
        x = y = loss = None
        try:
            torch.cuda.reset_peak_memory_stats(device)
            x = torch.randn(batch, 3, image_size, image_size, device=device)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            y = torch.randint(0, num_classes, (batch,), device=device)
            with models.autocast(device, precision):
                loss = loss_fn(model(x), y)
            loss.backward()
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        finally:
            del x, y, loss
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        if headroom is not None and peak > headroom * total:
            raise HeadroomExceeded(
                f"batch {batch} peaks at {peak / 2**20:.0f} MB, over {headroom:.0%} of {total / 2**20:.0f} MB"
            )
        return peak / 2**20

    return try_step


def explain_cuda_error(exc: BaseException, device: torch.device, batch: int, world_size: int) -> str | None:
    """A hint for a CUDA error raised during training when memory was near the card's limit, else None.

    'illegal memory access' and friends after the allocator ran near full are usually an OOM in
    disguise (the seed user's 2080 Ti at batch 128)."""
    if device.type != "cuda" or not isinstance(exc, RuntimeError) or "cuda" not in str(exc).lower():
        return None
    try:
        gpu = GpuInfo.of(device)
        peak_mb = torch.cuda.max_memory_reserved(device) / 2**20
    except Exception:  # noqa: BLE001 - the context may be unusable after a sticky CUDA error
        return None
    if not is_oom(exc) and peak_mb < NEAR_LIMIT * gpu.total_mb:
        return None
    return (
        f"this CUDA error happened with {peak_mb / 1024:.1f} of {gpu.total_mb / 1024:.1f} GB reserved on "
        f"{gpu.label()} at batch {batch} per device: most likely out of memory. "
        + fix_hint(batch, max(1, int(batch * NEAR_LIMIT * gpu.total_mb / max(peak_mb, 1))), world_size)
    )
