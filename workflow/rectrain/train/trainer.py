"""Train a torchvision model with DistributedDataParallel from the packed .rec.

    python -m rectrain.train.launch --config-json '<train block>' --rec train.rec --idx train.idx \\
        --val-rec val.rec --val-idx val.idx --classes classes.tsv --out results/<ds>/train

(launch execs torchrun, which starts one `python -m rectrain.train` per device with RANK, LOCAL_RANK
and WORLD_SIZE set).  Started without a launcher - plain `python -m rectrain.train ...`, an IDE's
Run button - this module relaunches itself through torchrun when the config asks for more than one
process, or runs as a single process, and says which; it never dies on a missing RANK.  A partial
--config-json block is completed from config/schema.yaml.

A run, in order (`train`): set up the rank, build the model, check the batch fits beside what the
loaders will hold (preflight), build the loaders and the optimizer, resume a checkpoint of the same
run (rectrain.train.checkpoint.RunIdentity) or clear the one it replaces, calibrate (img/s on
synthetic data, rectrain.train.calibrate), then per epoch train (rectrain.train.step.run_steps),
validate (rectrain.metrics' tally, as the evaluate stage counts) and checkpoint; finally publish the outputs.  A watchdog
(rectrain.watchdog, train.watchdog_s) ends a rank that stops making progress.

Outputs in --out: checkpoints/epoch_<k>.pt + last.pt (every epoch, atomic), telemetry/ (live CSVs),
and once finished steps.csv, epochs.csv, system.csv, run.json and model.pt (written last), then
checkpoints/finished.json (a later start of the job is a forced rerun: it retrains).
See docs/architecture.md for the formats.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from rectrain import distributed, driver_check, sources, watchdog
from rectrain import model as models
from rectrain.atomic import write_json
from rectrain.config import ConfigError, stage_block
from rectrain.distributed import Dist, all_gather, all_reduce_sum, barrier
from rectrain.loaders import DaliOptions, LoaderSpec, build_loader, resolve_loader, resolve_workers
from rectrain.log import setup as setup_logging
from rectrain.metrics import all_reduce as all_reduce_tally
from rectrain.metrics import tally
from rectrain.progress import Progress, RunProgress
from rectrain.tables import read_classes
from rectrain.train import calibrate, memory, telemetry
from rectrain.train import checkpoint as ckpt
from rectrain.train.step import Step, run_steps
from rectrain.train.stepclock import StepClock

__all__ = ["Step", "run_steps", "main"]  # the step lives in rectrain.train.step; the bench imports it from here

log = logging.getLogger(__name__)

# Test hook: simulate `kill -9` right after the checkpoint of this epoch (kill-and-resume test).
KILL_AFTER_EPOCH_ENV = "RECTRAIN_KILL_AFTER_EPOCH"
# Test hook: this rank's loader sleeps for an hour before its second batch (watchdog test).
STALL_RANK_ENV = "RECTRAIN_STALL_RANK"
# Test hook: this rank raises as training starts while its peers wait in an all-reduce (crash test).
FAIL_RANK_ENV = "RECTRAIN_FAIL_RANK"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True, help="the train block of the config, as JSON (partial is fine)")
    ap.add_argument("--rec", required=True)
    ap.add_argument("--idx", required=True)
    ap.add_argument("--val-rec", help="the val .rec; without it (no val split) no epoch is validated")
    ap.add_argument("--val-idx")
    ap.add_argument("--classes", required=True, help="classes.tsv (label, wnid, name)")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--manifest",
        default=None,
        help="the pack manifest of --rec (results/<ds>/pack/train.manifest.json): resume fingerprint",
    )
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for the whole job (default: all)")
    ap.add_argument(
        "--single-process",
        action="store_true",
        help="without a launcher, run one process instead of relaunching through torchrun",
    )
    return ap.parse_args(argv)


# --- launcher-proof start ------------------------------------------------------------------------


def relaunch_or_single(cfg: dict, argv: list[str], single: bool) -> None:
    """Called when RANK/WORLD_SIZE/LOCAL_RANK are missing: exec the same command under torchrun when
    the config asks for several processes, else set this process up as rank 0 of 1."""
    gpu_count = distributed.visible_gpu_count()
    driver_check.stop_on_mismatch(cfg["devices"], gpu_count > 0, "train")
    plan = distributed.plan_processes(cfg, gpu_count)
    missing = ", ".join(v for v in distributed.LAUNCH_VARS if v not in os.environ)
    if plan.nproc > 1 and cfg["nodes"] == 1 and not single:
        log.info(
            "started without a launcher (%s not set): relaunching through torchrun with %d processes because %s",
            missing,
            plan.nproc,
            plan.reason,
        )
        cmd, env = distributed.torchrun_command(plan, "rectrain.train", argv)
        os.execvpe(cmd[0], cmd, env)
    if single:
        why = "--single-process was given"
    elif cfg["nodes"] > 1:
        why = "multi-node runs must be started by the launcher"
    else:
        why = plan.reason
    log.info(
        "started without a launcher (%s not set): running as a single process (rank 0 of 1) because %s", missing, why
    )
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


# --- pieces of the run ---------------------------------------------------------------------------


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to 1, then cosine to 0, per optimizer step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def preflight_inputs(cfg: dict, model, loss_fn, d: Dist, num_classes: int, spec: LoaderSpec | None):
    """(the trial step, what will be held beside it) for choose_batch."""
    spec = spec or loader_spec(cfg, d, "", "", resolve_workers(cfg["workers"], d.local_world_size))
    choice = resolve_loader(cfg["loader"], spec)
    held = (
        memory.loader_reservation(choice, spec, "training"),
        memory.loader_reservation(choice, spec, "validation"),  # its pipeline stays built for the whole run
        memory.ddp_reservation(model, d.world_size),
    )
    trial = memory.Trial(
        model,
        loss_fn,
        cfg["image_size"],
        num_classes,
        d.device,
        cfg["precision"],
        cfg["channels_last"],
        make_optimizer=lambda: make_optimizer(cfg, model, 256, 1)[0],
    )
    return trial, held


def choose_batch(cfg: dict, model, loss_fn, d: Dist, num_classes: int, spec: LoaderSpec | None = None):
    """(per-device batch, grad_accum, preflight report).  On a GPU, one training step (forward, backward,
    optimizer step) proves the batch fits beside what the loader and DDP will hold - or the run stops
    here with what does fit (rectrain.train.memory).  `spec`: the train loader's (batch not yet
    chosen); by default the one this config builds."""
    auto = cfg["batch_size"] == "auto"
    global_batch = cfg["global_batch"] or (memory.DEFAULT_AUTO_GLOBAL_BATCH if auto else None)
    if d.device.type != "cuda":
        if auto:
            return (
                math.ceil(global_batch / d.world_size),
                1,
                {"skipped": "no GPU: batch_size auto uses global_batch / world_size"},
            )
        return int(cfg["batch_size"]), int(cfg["grad_accum"]), {"skipped": "no GPU memory to check on CPU"}
    trial, held = preflight_inputs(cfg, model, loss_fn, d, num_classes, spec)
    gpu = memory.GpuInfo.of(d.device)
    state = ckpt.host_copy(model.state_dict())  # the trial steps move weights and BatchNorm statistics
    try:
        budget = memory.device_budget(d.device, held, memory.HEADROOM if auto else 1.0)
        batch, accum, report = memory.preflight(
            memory.cuda_try_step(trial, budget),
            cfg["batch_size"],
            int(cfg["grad_accum"]),
            global_batch,
            d.world_size,
            gpu,
        )
        if auto:  # every rank must use the same batch: the smallest GPU decides
            batch = int(min(all_gather(batch, d)))
            accum = report["grad_accum"] = math.ceil(global_batch / (batch * d.world_size))
            report.update(batch=batch, global_batch=global_batch)
        with memory.autotune_off():
            need_mb = memory.cuda_try_step(trial, memory.device_budget(d.device, held))(batch)
    finally:
        model.load_state_dict(state)
    total_mb = budget.available_bytes / memory.MB
    report.update(
        gpu=gpu.label(),
        need_mb=round(need_mb, 1),
        free_mb=round(total_mb, 1),
        share=round(need_mb / total_mb, 3),
        held={r.what.split(" (")[0]: round(r.bytes(batch) / memory.MB, 1) for r in budget.held},
    )
    return batch, accum, report


def code_fingerprint() -> dict:
    """sha256 of each training source file (the train rule's code input, rectrain.sources): a checkpoint
    written by other code is another run, so an edit followed by a Snakemake rerun really retrains."""
    return sources.fingerprint("train")


def set_backend_flags(cfg: dict, device: torch.device) -> None:
    # Fixed training shapes: cuDNN's autotuner picks the fastest kernels once, for every later step.
    torch.backends.cudnn.benchmark = device.type == "cuda" and bool(cfg["cudnn_benchmark"])


def make_model(cfg: dict, num_classes: int, device: torch.device):
    """(model on device, in channels_last when asked; the loss)."""
    model = models.build(cfg["model"], num_classes, cfg["channels_last"]).to(device)
    return model, torch.nn.CrossEntropyLoss(label_smoothing=cfg["label_smoothing"])


def make_optimizer(cfg: dict, model, global_batch: int, opt_steps_per_epoch: int):
    """(SGD with nesterov, warmup + cosine schedule, GradScaler for fp16) for the global batch."""
    peak_lr = cfg["lr"] * global_batch / 256
    total_steps = cfg["epochs"] * opt_steps_per_epoch
    warmup_steps = round(cfg["warmup_epochs"] * opt_steps_per_epoch)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=peak_lr,
        momentum=cfg["momentum"],
        nesterov=cfg["nesterov"] and cfg["momentum"] > 0,
        weight_decay=cfg["weight_decay"],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps))
    scaler = torch.amp.GradScaler(next(model.parameters()).device.type, enabled=cfg["precision"] == "fp16")
    return optimizer, scheduler, scaler


def train_batches(loader, epoch: int, rank: int):
    """The loader's batches of one epoch (with the stalled-loader test hook)."""
    for i, batch in enumerate(loader.epoch(epoch)):
        if i == 1 and os.environ.get(STALL_RANK_ENV) == str(rank):
            log.info("%s=%d: this rank's loader stalls now, as on a hung filesystem", STALL_RANK_ENV, rank)
            time.sleep(3600)
        yield batch


def train_one_epoch(step: Step, loader, epoch: int, steps_log, progress: Progress | None = None) -> dict:
    n_batches = loader.batches_per_epoch
    clock = StepClock(torch.device("cpu"))
    start = clock.mark()
    batches = watchdog.watched(train_batches(loader, epoch, step.dist.rank), f"epoch {epoch}")
    t = run_steps(step, epoch, batches, steps_log, n_batches=n_batches, progress=progress)
    wall = clock.seconds(start, clock.mark())
    if t["steps"] != n_batches:
        raise RuntimeError(
            f"rank {step.dist.rank}: the {loader.kind} loader yielded {t['steps']} batches in epoch {epoch}, "
            f"expected {n_batches} on every rank (the other ranks would wait forever)"
        )
    # This rank's steady img/s, summed over ranks as report/efficiency.py sums them.
    rate = t["steady_images"] / t["steady_wall_s"] if t["steady_wall_s"] > 0 else 0.0
    loss_sum, correct, seen, rates = all_reduce_sum([t["loss_sum"], t["correct"], t["seen"], rate], step.dist)
    return {"train_loss": loss_sum / seen, "train_acc": correct / seen, "images": seen, "wall_s": wall, "steady": rates}


def validate(model: torch.nn.Module, loader, num_classes: int, step: Step, progress: Progress | None = None) -> dict:
    """Loss, top-1, top-5 over the whole val .rec with the evaluate stage's tally (rectrain.metrics) (each rank its
    shard, summed across ranks), so epochs.csv and metrics.json count the same way."""
    # Each rank's BatchNorm statistics drifted on its own shard since the last forward; validate the
    # weights that get checkpointed (rank 0's), or epochs.csv disagrees with the evaluate stage.
    if step.dist.world_size > 1:
        for buf in model.buffers():
            dist.broadcast(buf, src=0)
    model.eval()
    batches = watchdog.watched(loader.epoch(0), "validation")
    t = tally(
        model,
        batches,
        num_classes,
        step.dist.device,
        step.precision,
        channels_last=step.channels_last,
        progress=progress,
    )
    t = all_reduce_tally(t, step.dist.device)
    n = max(t.images, 1)
    top1 = float(t.confusion.diagonal().sum()) / n
    return {"val_loss": t.loss_sum / n, "val_top1": top1, "val_top5": t.top5_hits / n, "val_images": t.images}


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Run:
    """One rank's training run: its inputs, what preflight chose, and the pieces built from them."""

    args: argparse.Namespace
    cfg: dict
    d: Dist
    classes: list[dict]
    model: torch.nn.Module  # unwrapped: what is checkpointed and validated
    step: Step
    train_loader: object
    val_loader: object
    batch: int
    preflight: dict
    workers: int
    out: Path
    cores: int = 1  # CPU cores the job may use (--threads, else this process's affinity)
    calibration: dict | None = None
    identity: ckpt.RunIdentity | None = None
    info: dict = field(default_factory=dict)

    @property
    def ck_dir(self) -> Path:
        return self.out / "checkpoints"

    @property
    def global_batch(self) -> int:
        return self.batch * self.step.accum * self.d.world_size


def loader_spec(cfg: dict, d: Dist, rec: str, idx: str, workers: int) -> LoaderSpec:
    """This rank's train loader as the config asks for it; batch_size 0 until the preflight chose it."""
    return LoaderSpec(
        rec,
        idx,
        batch_size=0,
        image_size=cfg["image_size"],
        train=True,
        rank=d.rank,
        world_size=d.world_size,
        workers=workers,
        device=str(d.device),
        gpu_decode=cfg["gpu_decode"],
        seed=cfg["seed"],
        dali=DaliOptions.from_config(cfg),
    )


def prepare(args: argparse.Namespace, cfg: dict, d: Dist) -> Run:
    """Model, preflight batch, loaders and optimizer for this rank."""
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, threads // d.local_world_size))
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank (DDP also broadcasts rank 0's)
    classes = read_classes(args.classes)
    set_backend_flags(cfg, d.device)
    model, loss_fn = make_model(cfg, len(classes), d.device)
    workers = resolve_workers(cfg["workers"], d.local_world_size, threads)
    log.info("rank %d: %d loader workers (train.workers: %s)", d.rank, workers, cfg["workers"])
    spec = loader_spec(cfg, d, args.rec, args.idx, workers)
    batch, accum, preflight = choose_batch(cfg, model, loss_fn, d, len(classes), spec)
    train_loader = build_loader(cfg["loader"], dataclasses.replace(spec, batch_size=batch))
    val_loader = None
    if args.val_rec:
        val_spec = dataclasses.replace(spec, rec=args.val_rec, idx=args.val_idx, batch_size=batch, train=False)
        val_loader = build_loader(cfg["loader"], val_spec)
    else:
        log.info("no val split (--val-rec not given, index.absent_splits): epochs are not validated")
    opt_steps = math.ceil(train_loader.batches_per_epoch / accum)
    optimizer, scheduler, scaler = make_optimizer(cfg, model, batch * accum * d.world_size, opt_steps)
    step = Step(model, loss_fn, optimizer, scheduler, scaler, accum, cfg["precision"], cfg["channels_last"], d)
    run = Run(args, cfg, d, classes, model, step, train_loader, val_loader, batch, preflight, workers, Path(args.out))
    run.cores = threads
    data = ckpt.data_fingerprint(args.rec, args.idx, args.classes, args.manifest)
    run.identity = ckpt.RunIdentity(ckpt.maths_config(cfg), batch, accum, d.world_size, data, code_fingerprint())
    return run


def resume(run: Run) -> tuple[int, list | None]:
    """(first epoch to train, per-rank RNG states) from checkpoints/last.pt when it continues this run;
    otherwise the checkpoints of the run it replaces are removed (rank 0, once every rank has decided)."""
    start_epoch, rng_states, why_not = 0, None, None
    last = run.ck_dir / "last.pt"
    if last.exists():
        state = ckpt.load(last)
        why_not = ckpt.resumable(state, run.identity)
        if not why_not and ckpt.finished_marker(run.ck_dir).exists():
            why_not = (
                "that run finished and published model.pt, and this job was started again (snakemake --forcerun, "
                "or its outputs deleted): a new run"
            )
        if not why_not:
            restore(run, state)
            start_epoch, rng_states = state["epoch"] + 1, state["rng"]
            if run.d.master:
                log.info(
                    "resuming from %s: epoch %d of %d done by the same run (config, batch %d x accum %d, records, "
                    "%d processes and code all match); continuing at epoch %d",
                    last,
                    state["epoch"],
                    run.cfg["epochs"],
                    run.batch,
                    run.step.accum,
                    run.d.world_size,
                    start_epoch,
                )
        del state
    starts = all_gather(start_epoch, run.d)  # also: nobody writes checkpoints before every rank has read last.pt
    if len(set(starts)) > 1:
        raise RuntimeError(
            f"ranks disagree on the epoch to resume from ({starts}): {run.ck_dir} must be on a "
            "filesystem every node sees (shared --out)"
        )
    if run.d.master and not start_epoch:  # whatever checkpoints are here belong to another run
        gone = ckpt.clear(run.ck_dir)
        if gone:
            why_not = why_not or f"{last.name} is missing"
            log.info(
                "not resuming from %s: %s; removed its checkpoints (%s); starting from epoch 0",
                last,
                why_not,
                ", ".join(gone),
            )
    return start_epoch, rng_states


def restore(run: Run, state: dict) -> None:
    run.model.load_state_dict(state["model"])
    run.step.optimizer.load_state_dict(state["optimizer"])
    run.step.scheduler.load_state_dict(state["scheduler"])
    run.step.scaler.load_state_dict(state["scaler"])


def wrap(run: Run) -> None:
    """DDP across ranks, then torch.compile when asked: the network the steps run."""
    d = run.d
    net = run.model
    if d.world_size > 1:
        net = DDP(run.model, device_ids=[d.device.index] if d.device.type == "cuda" else None)
    run.step.net = torch.compile(net) if run.cfg["compile"] else net


def run_info(run: Run, start_epoch: int) -> dict:
    """run.json: what ran where, with which batch and loader, and why (the report's provenance)."""
    from rectrain.storage import device_info

    try:
        import nvidia.dali as dali

        dali_version = dali.__version__
    except ImportError:
        dali_version = None
    d, cfg, loader = run.d, run.cfg, run.train_loader
    return {
        "world_size": d.world_size,
        "nodes": cfg["nodes"],
        "devices": local_devices(d),
        "backend": d.backend,
        "loader": loader.kind,
        "model": cfg["model"],
        "precision": cfg["precision"],
        "batch_size": run.batch,
        "grad_accum": run.step.accum,
        "global_batch": run.global_batch,
        "epochs": cfg["epochs"],
        "image_size": cfg["image_size"],
        "rec_device": device_info(run.args.rec),
        "gpus": telemetry.gpu_inventory(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "dali": dali_version,
        "padding_per_epoch": loader.padding_per_epoch,
        "started": _now(),
        "finished": None,
        "preflight": run.preflight,
        "config": cfg,
        "resumed_from_epoch": start_epoch or None,
        # What decoded the JPEGs, and why it is not what train.loader asked for (DALI missing) when it is not.
        "loader_requested": cfg["loader"],
        "decode": loader.choice.decode,
        "loader_note": loader.choice.note,
        "workers": run.workers,  # the count 'auto' became, which the diagnosis quotes
        "cores": run.cores,
        "calibration": run.calibration,
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def telemetry_logs(run: Run, start_epoch: int):
    """(steps log, epochs log on rank 0 else None) in out/telemetry/, with the node's system sampler."""
    live = run.out / "telemetry"
    live.mkdir(parents=True, exist_ok=True)
    steps_log = telemetry.step_log(live, run.d.rank, start_epoch)
    epochs_log = telemetry.epoch_log(live, start_epoch) if run.d.master else None
    sampler = None
    if run.d.local_rank == 0:
        from rectrain.storage import block_device_for

        node = int(os.environ.get("GROUP_RANK", 0))  # torchrun's node rank
        sampler = telemetry.SystemSampler(
            live / f"system_node{node}.csv",
            run.cfg["sample_interval_s"],
            block_device_for(run.args.rec),
            telemetry.job_processes(),
            append=start_epoch > 0,
        )
        sampler.start()
    try:
        yield steps_log, epochs_log
    finally:
        steps_log.close()
        if sampler is not None:
            sampler.stop()


def calibrate_run(run: Run) -> dict:
    """run.json's `calibration`: every rank's img/s on synthetic data with this run's step (rectrain.train.calibrate)."""
    cfg = run.cfg
    shape = calibrate.Shape(run.batch, cfg["image_size"], len(run.classes))
    cal = calibrate.calibrate(run.step, run.model, shape, cfg["calibration_steps"], cfg["calibration_warmup_steps"])
    if run.d.master:
        if cal["skipped"]:
            log.info("calibration skipped: %s (no input efficiency for this run)", cal["skipped"])
        else:
            log.info(
                "calibration: %.1f img/s on synthetic data on the device (%s), %d steps after %d warm-up, %.1f s",
                calibrate.total_rate(cal),
                ", ".join(f"rank {r}: {v:.1f}" for r, v in cal["images_per_s"].items()),
                cal["steps"],
                cal["warmup_steps"],
                cal["seconds"],
            )
    return cal


def efficiency_note(stats: dict, calibration: dict | None) -> str:
    """The epoch log line's input efficiency: the epoch's steady img/s against the calibration's."""
    ceiling = calibrate.total_rate(calibration)
    if not ceiling or not stats["steady"]:
        return ""
    return (
        f", input efficiency {stats['steady'] / ceiling:.2f} ({stats['steady']:.1f} img/s steady against "
        f"{ceiling:.1f} calibrated)"
    )


def train_epochs(run: Run, start_epoch: int, steps_log, epochs_log) -> None:
    """The epoch loop: train, validate, checkpoint (rank 0), until train.epochs; rank 0 logs progress
    lines every train.progress_s."""
    d = run.d
    progress = RunProgress(run.cfg["progress_s"], d.world_size, run.cfg["epochs"]) if d.master else None
    for epoch in range(start_epoch, run.cfg["epochs"]):
        if os.environ.get(FAIL_RANK_ENV) == str(d.rank):
            raise RuntimeError(f"injected failure ({FAIL_RANK_ENV}={d.rank})")
        if progress:
            progress.begin_epoch(epoch, run.train_loader.batches_per_epoch)
        stats = train_one_epoch(run.step, run.train_loader, epoch, steps_log, progress=progress)
        after_steps = time.monotonic()
        val = NO_VAL
        if run.val_loader:
            if progress:
                what = f"epoch {epoch} (of {run.cfg['epochs']}) validation batch"
                progress.begin(what, run.val_loader.batches_per_epoch)
            val = validate(run.model, run.val_loader, len(run.classes), run.step, progress=progress)
        rngs = all_gather(ckpt.rng_state(), d)
        if d.master:
            end_epoch(run, epoch, stats, val, (rngs, epochs_log))
        else:
            watchdog.beat(f"epoch {epoch}: waiting for rank 0's checkpoint")
        barrier(d)
        if progress:
            progress.between_s = time.monotonic() - after_steps
        if os.environ.get(KILL_AFTER_EPOCH_ENV) == str(epoch):
            log.info("%s=%d: killing this process as a crash would", KILL_AFTER_EPOCH_ENV, epoch)
            os.kill(os.getpid(), signal.SIGKILL)


def end_epoch(run: Run, epoch: int, stats: dict, val: dict, saved: tuple) -> None:
    """Rank 0 after an epoch: its epochs.csv row, the checkpoint (with every rank's RNG state), the epoch line."""
    rngs, epochs_log = saved
    epochs_log.write(
        epoch=epoch,
        train_loss=stats["train_loss"],
        train_acc=stats["train_acc"],
        val_loss=val["val_loss"],
        val_top1=val["val_top1"],
        val_top5=val["val_top5"],
        images_per_s=stats["images"] / stats["wall_s"],
        wall_s=stats["wall_s"],
    )
    watchdog.beat(f"epoch {epoch}: writing the checkpoint")
    save_checkpoint(run, epoch, rngs)
    log.info(
        "epoch %d: train loss %.3f acc %.3f, %s, %.0f img/s, %.1f s%s",
        epoch,
        stats["train_loss"],
        stats["train_acc"],
        val_text(val),
        stats["images"] / stats["wall_s"],
        stats["wall_s"],
        efficiency_note(stats, run.calibration),
    )


# epochs.csv's val columns stay empty for a dataset without a val split.
NO_VAL = {"val_loss": None, "val_top1": None, "val_top5": None, "val_images": 0}


def val_text(val: dict) -> str:
    if val["val_loss"] is None:
        return "no val split"
    return f"val loss {val['val_loss']:.3f} top-1 {val['val_top1']:.3f} top-5 {val['val_top5']:.3f}"


def save_checkpoint(run: Run, epoch: int, rngs: list) -> None:
    """epoch_<k>.pt and last.pt: everything a resume needs, and what makes it the same run."""
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.step.optimizer.state_dict(),
        "scheduler": run.step.scheduler.state_dict(),
        "scaler": run.step.scaler.state_dict(),
        "epoch": epoch,
        "rng": rngs,
        "config": run.cfg,
        "num_classes": len(run.classes),
        "model_name": run.cfg["model"],
        "image_size": run.cfg["image_size"],
        **run.identity.stamp(),
    }
    ckpt.save_atomic(state, run.ck_dir / f"epoch_{epoch}.pt")
    ckpt.save_atomic(state, run.ck_dir / "last.pt")


def finish(run: Run) -> None:
    """Publish the outputs on rank 0: merged telemetry, run.json, and model.pt last (the rule's marker
    of a finished run)."""
    live, out = run.out / "telemetry", run.out
    telemetry.merge_steps(live, out / "steps.csv", run.d.world_size)
    shutil.copyfile(live / "epochs.csv", out / "epochs.csv")
    shutil.copyfile(live / "system_node0.csv", out / "system.csv")  # other nodes: telemetry/system_node<k>.csv
    run.info["finished"] = _now()
    write_json(out / "run.json", run.info)
    ckpt.save_atomic(ckpt.load(run.ck_dir / "last.pt"), out / "model.pt")
    ckpt.mark_finished(run.ck_dir, out / "model.pt")
    log.info("done: %s", out / "model.pt")


def local_devices(d: Dist) -> list[str]:
    """The device of each rank on this node (ranks may share a GPU)."""
    if d.device.type == "cpu":
        return [str(d.device)]
    gpus = torch.cuda.device_count()
    return [f"cuda:{distributed.rank_device(r, d.local_world_size, gpus)[0]}" for r in range(d.local_world_size)]


def log_start(run: Run) -> None:
    d, cfg = run.d, run.cfg
    log.info(
        "%d process(es), %s, %s loader, %s @%dpx, batch %d x accum %d x %d = %d, %d train images "
        "(%d padded per epoch), preflight: %s",
        d.world_size,
        run.info["backend"],
        run.train_loader.kind,
        cfg["model"],
        cfg["image_size"],
        run.batch,
        run.step.accum,
        d.world_size,
        run.global_batch,
        run.train_loader.size,
        run.train_loader.padding_per_epoch,
        run.preflight,
    )


def train(args: argparse.Namespace, cfg: dict) -> None:
    d = distributed.setup(cfg["devices"] != "cpu", cfg["collective_timeout_s"])
    if d.master:
        (Path(args.out) / "checkpoints").mkdir(parents=True, exist_ok=True)
    with watchdog.Watchdog(cfg["watchdog_s"], d.rank, d.world_size, Path(args.out) / "telemetry"):
        watchdog.beat("preparing: model, memory preflight, loaders")
        run = prepare(args, cfg, d)
        watchdog.beat("reading checkpoints/last.pt")
        start_epoch, rng_states = resume(run)
        wrap(run)
        run.calibration = calibrate_run(run)
        run.info = run_info(run, start_epoch)
        if d.master:
            write_json(run.out / "run.json", run.info)
            log_start(run)
        if rng_states is not None:
            ckpt.set_rng_state(rng_states[d.rank])
        with telemetry_logs(run, start_epoch) as (steps_log, epochs_log):
            train_epochs(run, start_epoch, steps_log, epochs_log)
        watchdog.beat("publishing the outputs")
        barrier(d)
        if d.master:
            epochs_log.close()
            finish(run)
        barrier(d)


def _explain_failure(exc: BaseException, cfg: dict) -> str:
    """The error line a failing rank leaves in the log, with what an out-of-memory really means."""
    rank = os.environ.get("RANK", "?")
    batch = cfg.get("batch_size") if isinstance(cfg, dict) else None
    on_gpu = torch.cuda.is_available() and isinstance(cfg, dict) and cfg.get("devices") != "cpu"
    # setup() chose the rank's GPU (ranks may share one); before it ran, this is GPU 0.
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", 1))
    hint = memory.explain_cuda_error(exc, device, batch if isinstance(batch, int) else 0, world)
    return f"rank {rank} failed: {type(exc).__name__}: {exc}" + (f"\n{hint}" if hint else "")


@record
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    setup_logging("train", elapsed=True)
    try:
        cfg = stage_block("train", args.config_json)
    except ConfigError as err:
        raise SystemExit(f"[train] {err}") from None
    if not distributed.launched():
        relaunch_or_single(cfg, argv, args.single_process)
    try:
        train(args, cfg)
    except Exception as exc:
        log.exception(_explain_failure(exc, cfg))
        raise
    finally:
        distributed.teardown()


if __name__ == "__main__":
    main()
