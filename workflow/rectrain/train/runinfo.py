"""What ran where, with which batch and loader, and why: run.json (the report's provenance) and the
line rank 0 logs as training starts."""

from __future__ import annotations

import logging
import socket

import torch

from rectrain import distributed
from rectrain.distributed import Dist
from rectrain.loaders import augment
from rectrain.log import utc_now
from rectrain.storage import device_info
from rectrain.train import batchplan, telemetry
from rectrain.train.resolution import resolutions
from rectrain.train.run import Run

log = logging.getLogger(__name__)


def dali_version() -> str | None:
    try:
        import nvidia.dali as dali
    except ImportError:
        return None
    return dali.__version__


def reading(run: Run) -> dict:
    """Where and how training reads its .rec: the disk (rectrain.storage: rotational?) and train.order as
    it runs, and why (rectrain.loaders.order; the reads it caused are added at the finish: trainer)."""
    order = run.train_loader.order
    return {"rec_device": device_info(run.args.rec), "order": order.choice.as_dict() if order else None}


def batching(run: Run) -> dict:
    """The batch plan as it runs: per device, accumulated, global (beside the config's), and the epoch's
    length per rank."""
    plan, loader = run.plan, run.train_loader
    return {
        "batch_size": plan.batch,
        "grad_accum": plan.grad_accum,
        "global_batch": plan.global_batch,  # what ran
        "recipe_global_batch": batchplan.recipe_global_batch(run.settings.batch),  # what the config asked for
        "padding_per_epoch": loader.padding_per_epoch,
        # per rank: the epoch's batches (under train.repeated_aug timm's epoch length, not the records')
        "batches_per_epoch": loader.batches_per_epoch,
    }


def run_info(
    run: Run,
    start_epoch: int,
    calibration: dict,
    *,
    resumed_despite: tuple[str, ...] = (),
    start_step: int = 0,
    diverged_before: dict | None = None,
) -> dict:
    """run.json as the run starts (`finished` is filled in when it is published); `resumed_despite`: the
    identity differences train.resume: always resumed across; `start_step`: a mid-epoch resume's step;
    `diverged_before`: where the checkpoints' run stopped on divergence (rectrain.train.lifecycle.divergence)."""
    d, s, loader, plan = run.d, run.settings, run.train_loader, run.plan
    res = s.resolution
    return {
        "world_size": d.world_size,
        "nodes": s.launch.nodes,
        # rank 0's host: the live report looks there for the run's processes (rectrain.report.inprogress)
        "host": socket.gethostname(),
        "devices": local_devices(d),
        "backend": d.backend,
        "loader": loader.kind,
        "model": s.network.model,
        "precision": s.network.precision,
        **batching(run),  # batch_size, grad_accum, global_batch, recipe_global_batch, padding, batches per epoch
        "epochs": s.optim.epochs,
        "image_size": res.image_size,
        "progressive": res.progressive,  # the schedule of every epoch's training crop (null: image_size throughout)
        "resolutions": resolutions(res.image_size, res.progressive, s.optim.epochs),
        **reading(run),  # rec_device, order
        "gpus": telemetry.gpu_inventory(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "dali": dali_version(),
        "started": utc_now(),
        "finished": None,
        "preflight": plan.preflight,
        "config": s.as_dict(),  # the whole block, flat, as configured
        "recipe_as_run": run.resolved,  # each mechanic's changes, each parameter group's LR and decay
        "resumed_from_epoch": start_epoch if start_epoch or start_step else None,
        "resumed_from_step": start_step or None,  # a mid-epoch checkpoint: the first step trained
        "resumed_despite": list(resumed_despite),
        # every change of world size with its epoch (a run moved from 2 GPUs to 1 and back)
        "world_sizes": list(run.world_sizes),
        "diverged_before": diverged_before,
        # What decoded the JPEGs, and why it is not what train.loader asked for (DALI missing) when it is not.
        "loader_requested": s.loaders.loader,
        "decode": loader.choice.decode,
        "decode_path": loader.choice.decode_path,  # train.decode as it ran (DALI only; None for torch)
        "compiled": bool(s.network.compile),  # torch.compile: the epochs and the calibration alike
        "augment": augment.ran_as(loader.spec.augment, loader.kind, loader.choice.decode),  # train.augment.policy
        "loader_note": loader.choice.note,
        "workers": run.workers,  # the count 'auto' became, which the diagnosis quotes
        "cores": run.cores,
        "calibration": calibration,
    }


def local_devices(d: Dist) -> list[str]:
    """The device of each rank on this node (ranks may share a GPU)."""
    if d.device.type == "cpu":
        return [str(d.device)]
    gpus = torch.cuda.device_count()
    return [f"cuda:{distributed.rank_device(r, d.local_world_size, gpus)[0]}" for r in range(d.local_world_size)]


def log_start(run: Run) -> None:
    d, plan = run.d, run.plan
    log.info(
        "%d process(es), %s, %s loader, %s @%s, batch %d x accum %d x %d = %d, %d train images "
        "(%d padded per epoch), preflight: %s",
        d.world_size,
        d.backend,
        run.train_loader.kind,
        run.settings.network.model,
        resolution_words(run.settings.resolution),
        plan.batch,
        plan.grad_accum,
        d.world_size,
        plan.global_batch,
        run.train_loader.size,
        run.train_loader.padding_per_epoch,
        plan.preflight,
    )
    if run.train_loader.order is not None:
        choice = run.train_loader.order.choice
        log.info("training order: %s (%s)", choice.used, choice.reason)


def resolution_words(res) -> str:
    """The training resolution (the train block's `resolution` part) for the start line: '64px', or under
    train.progressive '32->64px (ramp epochs 0-2)'."""
    ramp = res.progressive
    if not ramp:
        return f"{res.image_size}px"
    return f"{ramp['min_res']}->{ramp['max_res']}px (ramp epochs {ramp['start_ramp']}-{ramp['end_ramp']})"
