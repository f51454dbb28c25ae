"""The batch plan: the per-device batch, gradient accumulation and world size a run trains with.

It is decided once per rank, before the loaders are built (on a GPU after the memory preflight,
rectrain.train.memory, has measured what fits and the ranks have agreed on it), and from then on
only read: the learning rate scales with its global batch, the checkpoint's run identity records
it, run.json and the start line report it, and the failure line names it when a CUDA error looks
like an out-of-memory in disguise.  `plan` is the one function that turns (the train block's `batch`
part, what fits, world size) into it.

Resuming with `batch_size: auto`: the checkpoint's plan (rectrain.train.lifecycle.resume.previous_plan) is
preferred when it is a split of this config's global batch over the same world size and it still
fits (on a GPU the preflight's largest fitting batch proves it; on CPU nothing is measured and it is
reused as is).  Otherwise a restart with less free memory would plan another micro-batch and the
checkpoint would be another run's; when it no longer fits, the reason says so, naming both plans.

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
grad_accum is derived to keep the global batch (rectrain.train.globalbatch), as a preset asks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rectrain import model as models
from rectrain.distributed import Dist, all_gather
from rectrain.loaders import DaliOptions, LoaderSpec, image_dtype, resolve_loader
from rectrain.loaders.augment import NONE, parse_policy
from rectrain.recordio import idx_arrays
from rectrain.train import globalbatch, memory
from rectrain.train.lifecycle import checkpoint as ckpt
from rectrain.train.optim import make_optimizer
from rectrain.train.resolution import largest, resolutions

log = logging.getLogger(__name__)

# train.global_batch null with batch_size auto: the batch the reference LR (train.lr) is given for.
DEFAULT_AUTO_GLOBAL_BATCH = 256
# batch_size auto: the fewest optimizer steps per epoch the plan allows (see the module doc; the
# report's report.min_steps_per_epoch defaults to the same number).
MIN_STEPS_PER_EPOCH = 4


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
    micro, accum = memory.split_batch(want, min(want, fits or want))
    if accum > 1:
        reason += f", {want} per device did not fit, {fits} did"
    if not_reused:
        reason += (
            f"; the checkpoint's plan {previous.batch} x accum {previous.grad_accum} is not reused ({not_reused}), "
            f"this run plans {micro} x accum {accum}"
        )
    return BatchPlan(micro, accum, world_size, preflight or {}, reason, auto=True, capped=capped)


def exact_split(per_device: int, most: int) -> tuple[int, int]:
    """(batch, grad_accum) with batch x grad_accum == per_device exactly and batch <= most: the fewest
    micro-batches that do (memory.split_batch may round up; a regrouped plan must not)."""
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
    if memory.split_batch(want, previous.batch) != (previous.batch, previous.grad_accum):
        return f"it does not split {want} samples per device and step"
    if fits is not None and previous.batch > fits:
        return f"it no longer fits: at most {fits} per device fit now"
    return None


def loader_spec(
    loaders, resolution, network, d: Dist, rec: str, idx: str, *, workers: int, seed: int, epochs: int
) -> LoaderSpec:
    """This rank's train loader as the train block asks for it; batch_size 0 until the plan sets it.
    `loaders`, `resolution`, `network`: the block's loaders, resolution and model parts (the images'
    precision and layout); `seed`: train.seed; `epochs`: train.epochs (a progressive schedule's length).
    train.augment.policy is parsed here, once (a policy timm's grammar lacks fails naming the key)."""
    return LoaderSpec(
        rec,
        idx,
        batch_size=0,
        image_size=resolution.image_size,
        train=True,
        rank=d.rank,
        world_size=d.world_size,
        workers=workers,
        device=str(d.device),
        gpu_decode=loaders.gpu_decode,
        seed=seed,
        dali=DaliOptions.from_config(loaders),
        crops=tuple(resolutions(resolution.image_size, resolution.progressive, epochs))
        if resolution.progressive
        else (),
        decode=loaders.decode,
        order=loaders.order,
        dtype=image_dtype(models.resolve_precision(network.precision, d.device)),
        channels_last=network.channels_last,
        augment=parse_policy(loaders.augment["policy"]),
        repeated_aug=loaders.repeated_aug,
    )


def val_loader_spec(val_resolution: int | None, spec: LoaderSpec, rec: str, idx: str) -> LoaderSpec:
    """The per-epoch validation loader's, from the train loader's `spec`: every record once, a centre
    crop of train.val_resolution (null = image_size) from a shorter side of it / 0.875, not augmented."""
    size = val_resolution or spec.image_size
    return dataclasses.replace(spec, rec=rec, idx=idx, train=False, image_size=size, crops=(), augment=NONE)


@dataclass(frozen=True)
class Preflight:
    """What a GPU rank's memory preflight builds its trial step and the loaders' reservations from."""

    model: Any  # torch.nn.Module, on this rank's device
    loss_fn: Any
    num_classes: int
    spec: LoaderSpec  # the train loader's, batch not yet chosen
    loader: str  # train.loader
    resolution: Any  # the train block's resolution, optim and model parts (rectrain.settings)
    optim: Any
    network: Any
    validated: bool = True  # False without a val split: no validation loader will hold anything
    augment_batch: Any = None  # the run's device-side batch augmentation (rectrain.train.batchaug), or None


def preflight_inputs(p: Preflight, d: Dist):
    """(the trial step, what will be held beside it) for choose_batch, at the run's largest training
    crop (train.progressive): a batch that fits there fits every epoch.  Without a val split
    (`p.validated` False) no validation loader is reserved for (its DALI decoder alone is GBs)."""
    spec, res, network = p.spec, p.resolution, p.network
    choice = resolve_loader(p.loader, spec)
    val_spec = val_loader_spec(res.val_resolution, spec, spec.rec, spec.idx)
    held = (
        memory.loader_reservation(choice, spec, "training"),
        # dropped between passes (rectrain.loaders.dali), but DALI's memory pool keeps what it took
        memory.loader_reservation(choice, val_spec, "validation") if p.validated else None,
        memory.ddp_reservation(p.model, d.world_size),
        memory.ema_reservation(p.model, p.optim.ema),
    )
    trial = memory.Trial(
        p.model,
        p.loss_fn,
        largest(res.image_size, res.progressive, p.optim.epochs),
        p.num_classes,
        d.device,
        network.precision,
        network.channels_last,
        make_optimizer=lambda: make_optimizer(
            p.optim, p.model, 256, 1, family=network.model, precision=network.precision
        )[0],
        augment_batch=p.augment_batch,
    )
    return trial, held


def choose_batch(batch, d: Dist, preflight: Preflight | None = None, *, previous: BatchPlan | None = None) -> BatchPlan:
    """This rank's batch plan for the train block's `batch` part.  On a GPU, one training step (forward,
    backward, optimizer step) proves the batch fits beside what the loaders and DDP will hold - or the
    run stops here with what does fit (rectrain.train.memory); `preflight` says what to build them from
    (on CPU only its spec is read: the train images may cap an 'auto' batch).  `previous`: the
    checkpoint's plan, preferred with batch_size auto (module doc)."""
    auto = batch.batch_size == "auto"
    images = train_images(preflight.spec if preflight else None) if auto else None
    if d.device.type != "cuda":
        skipped = "no GPU: batch_size auto uses global_batch / world_size" if auto else None
        chosen = plan(
            batch,
            d.world_size,
            preflight={"skipped": skipped or "no GPU memory to check on CPU"},
            previous=previous,
            train_images=images,
        )
    else:
        if preflight is None:
            raise ValueError("choose_batch on a GPU needs the preflight's inputs (batchplan.Preflight)")
        trial, held = preflight_inputs(preflight, d)
        state = ckpt.host_copy(preflight.model.state_dict())  # the trial steps move weights and BatchNorm statistics
        try:
            chosen = _measured_plan(batch, trial, held, d, previous, images)
        finally:
            preflight.model.load_state_dict(state)
    regrouped = previous is not None and previous.world_size != d.world_size
    if (regrouped or ((previous or chosen.capped) and chosen.auto)) and d.master:
        log.info("batch plan: %s", chosen.reason)
    return chosen


def _measured_plan(
    batch, trial: memory.Trial, held: tuple, d: Dist, previous: BatchPlan | None, images: int | None
) -> BatchPlan:
    """The plan from trial steps on this rank's GPU, with the preflight report run.json keeps
    (`batch`: the train block's part; `images`: the train images, which may cap an 'auto' batch)."""
    auto = batch.batch_size == "auto"
    gpu = memory.GpuInfo.of(d.device)
    budget = memory.device_budget(d.device, held, memory.HEADROOM if auto else 1.0)
    try_step = memory.cuda_try_step(trial, budget)
    want = dataset_cap(batch, d.world_size, images)[0] or wanted(batch, d.world_size)
    fits, found = memory.preflight(
        try_step,
        want,
        auto=auto,
        gpu=gpu,
        world_size=d.world_size,
        accum=int(batch.grad_accum) if auto else fixed_accum(batch, d.world_size),
    )
    if auto:  # every rank must use the same batch: the smallest GPU decides
        fits = int(min(all_gather(fits, d)))
    draft = plan(batch, d.world_size, fits, previous=previous, train_images=images)
    with memory.autotune_off():
        need_mb = memory.cuda_try_step(trial, memory.device_budget(d.device, held))(draft.batch)
    if auto:
        found = {"auto": True, "batch": draft.batch, "grad_accum": draft.grad_accum, **found}
        found["global_batch"] = auto_global_batch(batch)
    total_mb = budget.available_bytes / memory.MB
    report = {
        **found,
        "gpu": gpu.label(),
        "need_mb": round(need_mb, 1),
        "free_mb": round(total_mb, 1),
        "share": round(need_mb / total_mb, 3),
        "held": {r.what.split(" (")[0]: round(r.bytes(draft.batch) / memory.MB, 1) for r in budget.held},
    }
    return dataclasses.replace(draft, preflight=report)
