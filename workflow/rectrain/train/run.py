"""Building one rank's training run, in two steps around the batch plan (rectrain.train.batchplan):
first what the preflight needs (`prepare_rank`: threads, classes, the model and its loss, the loader
spec, `loader_spec`), then, once the plan exists, everything sized by it (`build_run`: loaders, optimizer, the
network the steps run, the identity a checkpoint must match).  A Run is complete when built and never
changes; what is learnt later (the calibration, run.json) are separate values."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from rectrain import model as models
from rectrain import sources
from rectrain.distributed import Dist
from rectrain.loaders import (
    DaliOptions,
    Loader,
    LoaderSpec,
    build_loader,
    image_dtype,
    order,
    resolve_loader,
    resolve_workers,
)
from rectrain.loaders.augment import parse_policy
from rectrain.settings import TrainSettings
from rectrain.tables import read_classes
from rectrain.train import batchaug, init_weights, losses
from rectrain.train import ema as emas
from rectrain.train.batchplan import BatchPlan, RankParts
from rectrain.train.lifecycle.identity import RunIdentity, data_fingerprint, maths_config
from rectrain.train.optim import make_optimizer, recorded
from rectrain.train.resolution import resolutions
from rectrain.train.step import Step

log = logging.getLogger(__name__)


def code_fingerprint(model: str) -> dict:
    """sha256 of each training source file (the train rule's code input, rectrain.sources) and of the
    files defining train.model's network when it is your own, as this process imported them
    (rectrain.model.source_digests: the bytes hashed are the bytes run, so an edit while the run is
    going changes neither; evaluate refuses a file edited since): a checkpoint written by other code is
    another run, so an edit followed by a Snakemake rerun really retrains."""
    return {**sources.fingerprint("train"), **models.source_digests(model)}


def set_backend_flags(cudnn_benchmark: bool, device: torch.device) -> None:
    # Fixed training shapes: cuDNN's autotuner picks the fastest kernels once, for every later step.
    torch.backends.cudnn.benchmark = device.type == "cuda" and bool(cudnn_benchmark)


def make_model(network, num_classes: int, device: torch.device, master: bool = True, *, mixed: bool = False):
    """(model on device, in channels_last when asked, from train.init_weights when set; the training loss
    (rectrain.train.losses: soft targets when `mixed`, train.mixup on); what the model-dependent mechanics
    and init_weights did to it), from the train block's `network` part."""
    model, applied = models.construct(
        network.model,
        num_classes,
        network.channels_last,
        zero_init_residual=network.zero_init_residual,
        blurpool=network.blurpool,
        model_args=network.model_args,
    )
    if master:
        log.info("%s", models.mechanics_line(network.model, applied))
    if network.init_weights:
        applied["init_weights"] = init_weights.apply(
            model, network.init_weights, master, strict=network.init_weights_strict
        )
    model = model.to(device)
    return model, losses.train_loss(network, mixed), applied


def prepare_rank(
    args: argparse.Namespace, d: Dist, network, loaders, resolution, *, seed: int, epochs: int
) -> RankParts:
    """The network, the classes and the loaders' specs of this rank (the validation one None without a val
    split); `network`, `loaders`, `resolution`: the train block's model, loaders and resolution parts;
    `seed`: train.seed; `epochs`: train.epochs."""
    cores = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // d.local_world_size))
    torch.manual_seed(seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    classes = read_classes(args.classes)
    set_backend_flags(network.cudnn_benchmark, d.device)
    mixed = batchaug.mixup_on(loaders.mixup)
    model, loss_fn, applied = make_model(network, len(classes), d.device, d.master, mixed=mixed)
    augment_batch = batchaug.build(loaders, network.label_smoothing, len(classes), d.device)
    workers = resolve_workers(loaders.workers, d.local_world_size, cores)
    log.info("rank %d: %d loader workers (train.workers: %s)", d.rank, workers, loaders.workers)
    spec = loader_spec(loaders, resolution, network, d, args.rec, args.idx, workers=workers, seed=seed, epochs=epochs)
    val_spec = spec.validation(args.val_rec, args.val_idx, resolution.val_resolution) if args.val_rec else None
    choice = resolve_loader(loaders.loader, spec)
    return RankParts(d, classes, model, loss_fn, cores, workers, spec, choice, applied, augment_batch, val_spec)


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


@dataclass(frozen=True)
class Run:
    """One rank's training run: its inputs, its batch plan, and the pieces built from them."""

    args: argparse.Namespace
    settings: TrainSettings  # the train block, read once
    d: Dist
    classes: list[dict]
    model: torch.nn.Module  # unwrapped: what is checkpointed and validated
    step: Step  # its net: the model under DDP and torch.compile, as configured
    train_loader: Loader
    val_loader: Loader | None  # None without a val split
    plan: BatchPlan
    workers: int
    cores: int
    identity: RunIdentity
    # the recipe as it ran: what each mechanic changed, the optimizer's groups (run.json, weights.json)
    resolved: dict
    # every change of world size, with its epoch (rectrain.train.lifecycle.resume.world_sizes); a resume replaces it
    world_sizes: tuple[dict, ...] = ()

    @property
    def out(self) -> Path:
        return Path(self.args.out)

    @property
    def ck_dir(self) -> Path:
        return self.out / "checkpoints"


def build_run(args: argparse.Namespace, s: TrainSettings, parts: RankParts, plan: BatchPlan) -> Run:
    """Loaders, optimizer and the wrapped network for the plan's batch; the Run keeps the block `s`,
    whose whole is the checkpoint's identity."""
    d, model, network = parts.d, parts.model, s.network
    for problem in batchaug.config_problems(s.loaders, plan.batch):  # batch_size auto's plan: known only now
        raise ValueError(problem)
    train_loader, val_loader = make_loaders(s.loaders.loader, parts.spec, parts.val_spec, plan.batch, plan.grad_accum)
    opt_steps = math.ceil(train_loader.batches_per_epoch / plan.grad_accum)
    optimizer, scheduler, scaler = make_optimizer(
        s.optim, model, plan.global_batch, opt_steps, family=network.model, precision=network.precision
    )
    net = wrap(model, d, s.launch, network, plan.grad_accum)
    step = Step(
        net,
        parts.loss_fn,
        optimizer,
        scheduler,
        scaler,
        plan.grad_accum,
        network.precision,
        network.channels_last,
        d,
        clip_grad_norm=s.optim.clip_grad_norm,
        augment_batch=parts.augment_batch,
        ema=emas.build(s.optim.ema, model),  # of the unwrapped model, before DDP and torch.compile
    )
    data = data_fingerprint(args.rec, args.idx, args.classes, args.manifest)
    identity = RunIdentity(
        maths_config(s.as_dict()),
        plan.batch,
        plan.grad_accum,
        d.world_size,
        data,
        code_fingerprint(s.network.model),
    )
    return Run(
        args=args,
        settings=s,
        d=d,
        classes=parts.classes,
        model=model,
        step=step,
        train_loader=train_loader,
        val_loader=val_loader,
        plan=plan,
        workers=parts.workers,
        cores=parts.cores,
        identity=identity,
        resolved=recipe_as_run(
            s.loaders,
            network,
            s.optim.ema,
            parts.applied,
            recorded(optimizer, model, s.optim, plan.global_batch),
            order.repeats_words(s.loaders.repeated_aug, train_loader.size, d.world_size, plan.batch, plan.grad_accum),
        ),
        world_sizes=(plan.from_epoch(0),),
    )


def recipe_as_run(loaders, network, ema: dict, applied: dict, optimizer: dict, repeated: str | None) -> dict:
    """run.json's and weights.json's `recipe_as_run`: what each model mechanic changed (`applied`), the
    optimizer's groups (`optimizer`: optim.recorded), and in words what the batch augmentation (the train
    block's `loaders` part), the loss (its `network` part), the EMA (train.ema) and the repeated
    augmentation (`repeated`: order.repeats_words, None when off) did."""
    return {
        "mechanics": applied,
        "optimizer": optimizer,
        "batch_augment": batchaug.words(loaders),
        "loss": losses.words(network, batchaug.mixup_on(loaders.mixup)),
        "ema": emas.words(ema),
        "repeated_aug": repeated,
    }


def make_loaders(
    kind: str, spec: LoaderSpec, val_spec: LoaderSpec | None, batch: int, grad_accum: int = 1
) -> tuple[Loader, Loader | None]:
    """(train loader, val loader or None without a val split: `val_spec` None) at the planned batch, the
    training epoch in whole optimizer steps of `grad_accum` micro-batches; `kind`: train.loader."""
    train_loader = build_loader(kind, dataclasses.replace(spec, batch_size=batch, grad_accum=grad_accum))
    if val_spec is None:
        log.info("no val split (--val-rec not given, index.absent_splits): epochs are not validated")
        return train_loader, None
    return train_loader, build_loader(kind, dataclasses.replace(val_spec, batch_size=batch))


def wrap(model: torch.nn.Module, d: Dist, launch, network, grad_accum: int = 1) -> torch.nn.Module:
    """DDP across ranks (the train block's `launch` part: train.ddp_*), then torch.compile when its `network`
    part asks (train.compile_mode): the network the steps run, the calibration included."""
    net = ddp(model, d, launch, grad_accum) if d.world_size > 1 else model
    if not network.compile:
        return net
    return torch.compile(net, mode=None if network.compile_mode == "default" else network.compile_mode)


# DDP's compression hooks by train.ddp_comm_hook: gradients travel as fp16/bf16 (half the bytes of
# an all-reduce) and are decompressed into the fp32 buckets.
COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}


def ddp(model: torch.nn.Module, d: Dist, launch, grad_accum: int) -> DDP:
    """The model under DDP with train.ddp_* (the train block's `launch` part): gradients as views into the all-reduce buckets (no copy
    in and out, one gradient-sized buffer less), a static graph (every parameter used every step, as in
    the torchvision classifiers: DDP can skip its per-step unused-parameter bookkeeping), and the
    optional compression hook.  A static graph is only valid without gradient accumulation: torch 2.14's
    reducer fails an internal assert (expect_autograd_hooks_) when the first backward runs under
    no_sync, which every accumulating micro-batch does."""
    static = bool(launch.ddp_static_graph) and grad_accum == 1
    if launch.ddp_static_graph and not static and d.master:
        log.info("DDP static_graph off: grad_accum %d runs micro-batches under no_sync, which it cannot", grad_accum)
    net = DDP(
        model,
        device_ids=[d.device.index] if d.device.type == "cuda" else None,
        gradient_as_bucket_view=launch.ddp_bucket_view,
        static_graph=static,
    )
    hook = launch.ddp_comm_hook
    if hook != "none":
        net.register_comm_hook(None, COMM_HOOKS[hook])
    return net
