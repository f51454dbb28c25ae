"""The batch: the per-device batch, gradient accumulation and world size a run trains with, and the
memory preflight that proves it fits.  `plan_batch` is the one entry: a rank calls it once, before its
loaders are built, with the train block's batch, optim and network parts, the rank's parts (RankParts,
from run.prepare_rank) and the checkpoint's plan; from then on the BatchPlan is only read: the learning rate scales with its global batch, the
checkpoint's run identity records it, run.json and the start line report it, and the failure line
(rectrain.train.lifecycle.failure) names it when a CUDA error looks like an out-of-memory in disguise.
`plan` is the arithmetic that turns (the train block's `batch` part, what fits, world size) into it.

The preflight.  On an 11 GB card a too-large batch can surface as `CUDA error: an illegal memory access`
deep inside training.  Each GPU rank therefore runs one training step (forward, backward, an optimizer
step: momentum is real memory) at the configured batch first, with cuDNN's autotuner off; if it does
not fit, a binary search finds the largest batch that does, and the run stops with a message naming
the GPU, its memory, the failing batch, what fits, and the two fixes.  `batch_size: auto` uses the same
search (with headroom) and accumulates gradients to keep the global batch; the ranks agree on the
smallest GPU's batch.  The step's peak is judged against a Budget: the device's free memory
(torch.cuda.mem_get_info, so the CUDA context and other processes are already out) plus torch's own
cache, less what will sit beside the step - the loaders' decoders (DALI's mixed decoder reserves
dali_device_memory_padding per decode thread, plus prefetched batches), DDP's gradient buckets and the
EMA.  The loaders' share is estimated from their settings: DALI allocates it only when its pipeline
first runs, after the batch must be chosen.  The search takes any `try_step(batch)` callable and the
budget an injectable mem_get_info, so all of it is unit-tested on CPU with fakes.  On CPU nothing is
measured.

Resuming with `batch_size: auto`: the checkpoint's plan (rectrain.train.lifecycle.resume.previous_plan) is
preferred when it is a split of this config's global batch over the same world size and it still
fits (on a GPU the preflight's largest fitting batch proves it; on CPU it is reused as is).  Otherwise
a restart with less free memory would plan another micro-batch and the checkpoint would be another
run's; when it no longer fits, the reason says so, naming both plans.

A small dataset caps 'auto': a global batch of 256 over 150 images is one optimizer step per epoch,
and a run of a few such steps learns nothing (it has: val top-1 at chance, one class predicted for
every image).  With batch_size auto the per-device batch is cut so an epoch has at least
MIN_STEPS_PER_EPOCH optimizer steps; the plan's global batch is then the smaller one, so train.lr
scales with what each step really averages, and the reason names the numbers.  A number in
train.batch_size is never changed: the report's few-steps finding says what it costs.

Resuming on another world size (2 GPUs -> 1, 1 -> 2, another node count): the checkpoint's global batch
is kept (`regroup`), with 'auto' and a numeric train.batch_size alike: the per-device batch and
grad_accum are recomputed so batch x accum x world size is the checkpoint's, and the LR (scaled by the
global batch) and its schedule (counting optimizer steps) go on unchanged.

A number in train.batch_size with train.global_batch set is the per-device micro-batch, and
grad_accum is derived to keep the global batch (rectrain.train.globalbatch: torch-free, so the
Snakefile's parse-time checks use it too), as a preset asks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from rectrain import model as models
from rectrain.distributed import Dist, all_gather
from rectrain.loaders import LoaderChoice, LoaderSpec, image_itemsize
from rectrain.recordio import idx_arrays
from rectrain.train import globalbatch
from rectrain.train.lifecycle.checkpoint import host_copy
from rectrain.train.optim import make_optimizer

if TYPE_CHECKING:
    from rectrain.settings import TrainBatch, TrainNetwork, TrainOptim
    from rectrain.train.batchaug import BatchAugment

log = logging.getLogger(__name__)

# train.global_batch null with batch_size auto: the batch the reference LR (train.lr) is given for.
DEFAULT_AUTO_GLOBAL_BATCH = 256
# batch_size auto: the fewest optimizer steps per epoch the plan allows (see the module doc; the
# report's report.min_steps_per_epoch defaults to the same number).
MIN_STEPS_PER_EPOCH = 4
# `batch_size: auto` keeps peak memory at or under this share of the card.
HEADROOM = 0.90
# A CUDA error while reserved memory was above this share of the card is treated as a probable OOM.
NEAR_LIMIT = 0.85
MB = 2**20
_OOM_TEXT = ("out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed", "cuda_error_out_of_memory")


@dataclass(frozen=True)
class RankParts:
    """What a rank has before its batch is planned (rectrain.train.run.prepare_rank builds it): all the
    preflight needs, and what the run is then built from."""

    d: Dist
    classes: list[dict]
    model: torch.nn.Module
    loss_fn: torch.nn.Module
    cores: int  # CPU cores the job may use (--threads, else this process's affinity)
    workers: int  # the loader workers train.workers became
    spec: LoaderSpec  # the train loader's, batch_size 0 until planned
    loader: LoaderChoice  # the loader train.loader runs as on this machine (rectrain.loaders.resolve_loader)
    applied: dict  # what each model-dependent mechanic and init_weights changed (rectrain.model.construct)
    # random erasing and Mixup/CutMix on the device batch (rectrain.train.batchaug), None when off
    augment_batch: BatchAugment | None = None
    val_spec: LoaderSpec | None = None  # the per-epoch validation loader's; None without a val split


@dataclass(frozen=True)
class BatchPlan:
    batch: int  # per device and micro-step: what the loaders yield
    grad_accum: int
    world_size: int
    preflight: dict = field(default_factory=dict, compare=False)  # run.json's `preflight` report
    reason: str = ""  # where the batch came from, in words (the failure line)
    auto: bool = False  # train.batch_size was 'auto'
    capped: str = ""  # why the dataset capped an 'auto' batch, in words; "" when it did not

    @property
    def global_batch(self) -> int:
        return self.batch * self.grad_accum * self.world_size

    def from_epoch(self, epoch: int) -> dict:
        """This plan as an entry of the world-size record (checkpoints' and run.json's `world_sizes`)."""
        return {"epoch": epoch, "world_size": self.world_size, "batch_size": self.batch, "grad_accum": self.grad_accum}


# --- the entry: a rank's plan, once ----------------------------------------------------------------


def plan_batch(
    batch: TrainBatch,
    d: Dist,
    parts: RankParts | None = None,
    *,
    optim: TrainOptim | None = None,
    network: TrainNetwork | None = None,
    previous: BatchPlan | None = None,
) -> BatchPlan:
    """This rank's batch plan for the train block's `batch` part.  On a GPU, one training step proves the
    batch fits beside what the loaders, DDP and the EMA will hold - or the run stops here with what does
    fit (BatchDoesNotFit): `parts` are the rank's model, loss and loaders to try, `optim` and `network`
    (the block's parts) the optimizer and numerics the run will have.  On CPU nothing is measured, and
    only `parts.spec` is read: the train images may cap an 'auto' batch.  `previous`: the checkpoint's
    plan, preferred with batch_size auto (module doc)."""
    auto = batch.batch_size == "auto"
    images = train_images(parts.spec if parts else None) if auto else None
    if d.device.type != "cuda":
        skipped = "no GPU: batch_size auto uses global_batch / world_size" if auto else None
        preflight = {"skipped": skipped or "no GPU memory to check on CPU"}
        chosen = plan(batch, d.world_size, preflight=preflight, previous=previous, train_images=images)
    else:
        if parts is None or optim is None or network is None:
            raise ValueError("plan_batch on a GPU needs the rank's parts (run.prepare_rank), optim and network")
        trial, held = preflight_inputs(d, parts, optim, network)
        state = host_copy(parts.model.state_dict())  # the trial steps move weights and BatchNorm statistics
        try:
            chosen = _measured_plan(batch, trial, held, d, previous, images)
        finally:
            parts.model.load_state_dict(state)
    regrouped = previous is not None and previous.world_size != d.world_size
    if (regrouped or ((previous or chosen.capped) and chosen.auto)) and d.master:
        log.info("batch plan: %s", chosen.reason)
    return chosen


def _measured_plan(
    batch, trial: Trial, held: tuple, d: Dist, previous: BatchPlan | None, images: int | None
) -> BatchPlan:
    """The plan from trial steps on this rank's GPU, with the preflight report run.json keeps
    (`batch`: the train block's part; `images`: the train images, which may cap an 'auto' batch)."""
    auto = batch.batch_size == "auto"
    gpu = GpuInfo.of(d.device)
    budget = device_budget(d.device, held, HEADROOM if auto else 1.0)
    accum = int(batch.grad_accum) if auto else fixed_accum(batch, d.world_size)
    want = dataset_cap(batch, d.world_size, images)[0] or wanted(batch, d.world_size)
    fits, found = preflight(
        cuda_try_step(trial, budget), want, auto=auto, gpu=gpu, world_size=d.world_size, accum=accum
    )
    if auto:  # every rank must use the same batch: the smallest GPU decides
        fits = int(min(all_gather(fits, d)))
    draft = plan(batch, d.world_size, fits, previous=previous, train_images=images)
    with autotune_off():
        need_mb = cuda_try_step(trial, device_budget(d.device, held))(draft.batch)
    if auto:
        found = {"auto": True, "batch": draft.batch, "grad_accum": draft.grad_accum, **found}
        found["global_batch"] = auto_global_batch(batch)
    total_mb = budget.available_bytes / MB
    report = {
        **found,
        "gpu": gpu.label(),
        "need_mb": round(need_mb, 1),
        "free_mb": round(total_mb, 1),
        "share": round(need_mb / total_mb, 3),
        "held": {r.what.split(" (")[0]: round(r.bytes(draft.batch) / MB, 1) for r in budget.held},
    }
    return dataclasses.replace(draft, preflight=report)


def preflight_inputs(d: Dist, parts: RankParts, optim: TrainOptim, network: TrainNetwork):
    """(the trial step, what will be held beside it) for plan_batch, at the run's largest training crop
    (train.progressive, the spec's largest_crop): a batch that fits there fits every epoch.  Without a
    val split (`parts.val_spec` None) no validation loader is reserved for (its DALI decoder alone is GBs)."""
    spec, model = parts.spec, parts.model
    held = (
        loader_reservation(parts.loader, spec, "training"),
        # dropped between passes (rectrain.loaders.dali), but DALI's memory pool keeps what it took
        loader_reservation(parts.loader, parts.val_spec, "validation") if parts.val_spec else None,
        ddp_reservation(model, d.world_size),
        ema_reservation(model, optim.ema),
    )

    def new_optimizer():  # of the run's kind, at any LR: its state is what takes memory
        return make_optimizer(optim, model, 256, 1, family=network.model, precision=network.precision)[0]

    trial = Trial(
        model,
        parts.loss_fn,
        spec.largest_crop,
        len(parts.classes),
        d.device,
        network.precision,
        network.channels_last,
        make_optimizer=new_optimizer,
        augment_batch=parts.augment_batch,
    )
    return trial, held


# --- the plan: arithmetic, nothing measured ---------------------------------------------------------


def auto_global_batch(batch) -> int:
    """The global batch 'auto' keeps, from the train block's `batch` part (rectrain.settings)."""
    return batch.global_batch or DEFAULT_AUTO_GLOBAL_BATCH


def fixed_accum(batch, world_size: int) -> int:
    """A numeric train.batch_size's gradient accumulation: derived to keep train.global_batch when it is
    set (rectrain.train.globalbatch; raises ConfigError when it cannot be kept), else train.grad_accum."""
    if globalbatch.numeric_with_global(batch.batch_size, batch.global_batch):
        return globalbatch.derived_accum(batch.global_batch, int(batch.batch_size), world_size, int(batch.grad_accum))
    return int(batch.grad_accum)


def recipe_global_batch(batch) -> int | None:
    """The global batch the config asks for (run.json's recipe_global_batch, beside the one that ran):
    train.global_batch, 256 under batch_size auto without it, None for a number without it."""
    return auto_global_batch(batch) if batch.batch_size == "auto" else batch.global_batch


def wanted(batch, world_size: int) -> int:
    """The per-device batch the `batch` part asks for: train.batch_size, or with 'auto' its share of the
    global batch (before anything was measured)."""
    if batch.batch_size == "auto":
        return max(1, math.ceil(auto_global_batch(batch) / world_size))
    return int(batch.batch_size)


def dataset_cap(batch, world_size: int, train_images: int | None) -> tuple[int | None, str]:
    """(the largest per-device batch that gives MIN_STEPS_PER_EPOCH optimizer steps per epoch on
    `train_images` images, why in words) when 'auto's share of the global batch is larger; (None, "")
    when it is not, or the image count is unknown."""
    want = wanted(batch, world_size)
    if not train_images:
        return None, ""
    cap = max(1, train_images // (world_size * MIN_STEPS_PER_EPOCH))
    if want <= cap:
        return None, ""
    gb = auto_global_batch(batch)
    why = (
        f"capped to {cap} per device (global batch {cap * world_size}, not {gb}): the dataset's {train_images} "
        f"train images fill a global batch of {gb} {train_images / gb:.2f} time(s) per epoch, and an epoch needs "
        f"at least {MIN_STEPS_PER_EPOCH} optimizer steps (batchplan.MIN_STEPS_PER_EPOCH) to learn; train.lr "
        f"scales to the smaller global batch (set train.batch_size to a number to override)"
    )
    return cap, why


def plan(
    batch,
    world_size: int,
    fits: int | None = None,
    preflight: dict | None = None,
    *,
    previous: BatchPlan | None = None,
    train_images: int | None = None,
) -> BatchPlan:
    """The plan for the train block's `batch` part on `world_size` processes when at most `fits` samples fit on a device
    (None: not measured).  A number in train.batch_size is used as given - the preflight has stopped
    the run already if it does not fit; 'auto' takes its share of the global batch, cut to what
    `train_images` can fill (module doc), and, when that does not fit, accumulates gradients over
    smaller batches so the global batch stays - or reuses the checkpoint's plan `previous`."""
    if previous and previous.world_size != world_size:
        regrouped = regroup(previous, world_size, batch, fits, preflight)
        if regrouped:
            return regrouped
    if batch.batch_size != "auto":
        fixed, accum = int(batch.batch_size), fixed_accum(batch, world_size)
        reason = f"train.batch_size: {fixed}"
        if globalbatch.numeric_with_global(batch.batch_size, batch.global_batch):
            reason += (
                f" per device x grad_accum {accum} (derived) x {world_size} = train.global_batch {batch.global_batch}"
            )
        return BatchPlan(fixed, accum, world_size, preflight or {}, reason)
    cap, capped = dataset_cap(batch, world_size, train_images)
    want = cap or wanted(batch, world_size)
    reason = f"batch_size auto: global batch {auto_global_batch(batch)} over {world_size} process(es)"
    reason += f", {capped}" if capped else ""
    not_reused = previous and why_not_reused(previous, want, world_size, fits)
    if previous and not not_reused:
        reason += f", the checkpoint's plan {previous.batch} x accum {previous.grad_accum} reused (it still fits)"
        return BatchPlan(
            previous.batch, previous.grad_accum, world_size, preflight or {}, reason, auto=True, capped=capped
        )
    micro, accum = split_batch(want, min(want, fits or want))
    if accum > 1:
        reason += f", {want} per device did not fit, {fits} did"
    if not_reused:
        reason += (
            f"; the checkpoint's plan {previous.batch} x accum {previous.grad_accum} is not reused ({not_reused}), "
            f"this run plans {micro} x accum {accum}"
        )
    return BatchPlan(micro, accum, world_size, preflight or {}, reason, auto=True, capped=capped)


def split_batch(per_device: int, fits: int) -> tuple[int, int]:
    """(batch, grad_accum) for `per_device` samples per optimizer step when at most `fits` fit at once:
    the fewest micro-batches, each as even as can be.  The one home of this arithmetic: the plan and
    every fix this module suggests use it."""
    accum = math.ceil(per_device / fits)
    return math.ceil(per_device / accum), accum


def exact_split(per_device: int, most: int) -> tuple[int, int]:
    """(batch, grad_accum) with batch x grad_accum == per_device exactly and batch <= most: the fewest
    micro-batches that do (split_batch may round up; a regrouped plan must not)."""
    for accum in range(max(1, math.ceil(per_device / max(1, most))), per_device + 1):
        if per_device % accum == 0:
            return per_device // accum, accum
    return 1, per_device


def regroup(previous: BatchPlan, world_size: int, batch, fits: int | None, preflight: dict | None) -> BatchPlan | None:
    """The checkpoint's plan `previous` moved to another `world_size` with its global batch kept - so the LR
    (scaled by the global batch) and the schedule (counting optimizer steps) are the checkpoint's - or None
    when `world_size` does not divide that global batch (rectrain.train.lifecycle.resume then refuses, naming both
    plans).  The micro-batch is at most train.batch_size (a number: what the user says fits), else at most
    what the preflight measured, else the checkpoint's (on CPU nothing is measured): 2 -> 1 processes
    doubles grad_accum."""
    total = previous.global_batch
    if total % world_size:
        return None
    per_device = total // world_size
    auto = batch.batch_size == "auto"
    most = (fits or previous.batch) if auto else int(batch.batch_size)
    micro, accum = exact_split(per_device, min(per_device, most))
    reason = (
        f"the checkpoint's global batch {total} ({previous.batch} x accum {previous.grad_accum} x {previous.world_size} "
        f"processes) kept over {world_size} process(es): {micro} x accum {accum}"
    )
    return BatchPlan(micro, accum, world_size, preflight or {}, reason, auto=auto)


def train_images(spec: LoaderSpec | None) -> int | None:
    """Records in the train .idx the loader will read; None when there is none to count (a preflight
    without data)."""
    if spec is None or not spec.idx or not Path(spec.idx).is_file():
        return None
    return len(idx_arrays(spec.idx)[0])


def why_not_reused(previous: BatchPlan, want: int, world_size: int, fits: int | None) -> str | None:
    """Why the checkpoint's plan cannot be this run's (`want` per device over `world_size` processes,
    at most `fits` fitting, None: not measured), or None when it can."""
    if previous.world_size != world_size:
        return f"it was planned for {previous.world_size} processes, this run has {world_size}"
    if split_batch(want, previous.batch) != (previous.batch, previous.grad_accum):
        return f"it does not split {want} samples per device and step"
    if fits is not None and previous.batch > fits:
        return f"it no longer fits: at most {fits} per device fit now"
    return None


# --- the search: the largest batch a try_step takes, and what to say when it is too small --------------


def process_fraction(device: torch.device) -> float:
    """The share of the card this process may allocate (torch.cuda.set_per_process_memory_fraction, or
    PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:f); 1.0 without CUDA or before torch 2.6."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.6
    return getter(device) if getter and torch.cuda.is_available() else 1.0


def usable_bytes(device: torch.device) -> int:
    """Memory this process may allocate on the card: its total x the per-process fraction."""
    return int(torch.cuda.get_device_properties(device).total_memory * process_fraction(device))


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


class HeadroomExceeded(torch.cuda.OutOfMemoryError):
    """Raised by a budgeted try_step when the step and what else holds the device do not fit its budget."""


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
    the plan turns it into batch and grad_accum.  try_step must raise an OOM when the batch does
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


# --- the budget: what the device holds besides the step ----------------------------------------------


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
    cap = total * process_fraction(device)
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


# --- the trial step: one real training step on random data ------------------------------------------


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
