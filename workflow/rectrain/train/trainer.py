"""Train a torchvision model with DistributedDataParallel from the packed .rec.

    python -m rectrain.train.launch --config-json '<train block>' --rec train.rec --idx train.idx \
        --val-rec val.rec --val-idx val.idx --classes classes.tsv --out results/<ds>/train

(launch execs torchrun, which starts one `python -m rectrain.train` per device with RANK, LOCAL_RANK
and WORLD_SIZE set).  Started without a launcher - plain `python -m rectrain.train ...`, an IDE's
Run button - this module relaunches itself through torchrun when the config asks for more than one
process, or runs as a single process, and says which; it never dies on a missing RANK.

Outputs in --out: checkpoints/epoch_<k>.pt + last.pt (every epoch, atomic), telemetry/ (live CSVs),
and once finished steps.csv, epochs.csv, system.csv, run.json and model.pt (written last).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torchvision
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from rectrain import sources
from rectrain.atomic import write_json
from rectrain.loaders import DaliOptions, LoaderSpec, build_loader, resolve_workers
from rectrain.tables import read_classes
from rectrain.train import checkpoint as ckpt
from rectrain.train import memory, telemetry
from rectrain.train.launch import plan_processes, torchrun_args, visible_gpu_count
from rectrain.train.stepclock import StepClock

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# Config keys that do not change the maths of a run: a checkpoint written under other values of these
# may still be resumed.  Anything else differing means the checkpoint belongs to another run.
RESUME_INDEPENDENT_KEYS = {"sample_interval_s", "workers", "collective_timeout_s", "compile"}
# Test hook: simulate `kill -9` right after the checkpoint of this epoch (kill-and-resume test).
KILL_AFTER_EPOCH_ENV = "RECTRAIN_KILL_AFTER_EPOCH"
# Test hook: this rank raises as training starts while its peers wait in an all-reduce (crash test).
FAIL_RANK_ENV = "RECTRAIN_FAIL_RANK"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True, help="the train block of the config, as JSON")
    ap.add_argument("--rec", required=True)
    ap.add_argument("--idx", required=True)
    ap.add_argument("--val-rec", required=True)
    ap.add_argument("--val-idx", required=True)
    ap.add_argument("--classes", required=True, help="classes.tsv (label, wnid, name)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for the whole job (default: all)")
    ap.add_argument(
        "--single-process",
        action="store_true",
        help="without a launcher, run one process instead of relaunching through torchrun",
    )
    return ap.parse_args(argv)


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[train {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# --- launcher-proof start ------------------------------------------------------------------------


def launched() -> bool:
    return all(v in os.environ for v in LAUNCH_VARS)


def relaunch_or_single(cfg: dict, argv: list[str], single: bool) -> bool:
    """Called when RANK/WORLD_SIZE/LOCAL_RANK are missing.  Returns True if this process should train
    as the only rank, False if the job already ran under a relaunched torchrun."""
    plan = plan_processes(cfg, visible_gpu_count())
    missing = ", ".join(v for v in LAUNCH_VARS if v not in os.environ)
    if plan.nproc > 1 and int(cfg.get("nodes", 1)) == 1 and not single:
        log(
            f"started without a launcher ({missing} not set): relaunching through torchrun with "
            f"{plan.nproc} processes because {plan.reason}"
        )
        if plan.cuda_visible_devices is not None:  # "" for devices: cpu hides the GPUs from NVML too
            os.environ["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        from torch.distributed.run import main as torchrun_main

        torchrun_main([*torchrun_args(plan), "-m", "rectrain.train", *argv])
        return False
    why = (
        "--single-process was given"
        if single
        else ("multi-node runs must be started by the launcher" if int(cfg.get("nodes", 1)) > 1 else plan.reason)
    )
    log(f"started without a launcher ({missing} not set): running as a single process (rank 0 of 1) because {why}")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return True


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_distributed(cfg: dict) -> Dist:
    """nanoGPT-style: device = LOCAL_RANK (never the global rank), NCCL on GPUs, gloo on CPU."""
    rank, world, local = (int(os.environ[v]) for v in LAUNCH_VARS)
    use_gpu = cfg.get("devices", "auto") != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", local) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    if world > 1:
        timeout = datetime.timedelta(seconds=float(cfg.get("collective_timeout_s", 600)))
        dist.init_process_group(
            "nccl" if use_gpu else "gloo", timeout=timeout, **({"device_id": device} if use_gpu else {})
        )
    return Dist(rank, world, local, int(os.environ.get("LOCAL_WORLD_SIZE", world)), device)


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    if d.world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_gather(obj, d: Dist) -> list:
    if d.world_size == 1:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(d: Dist) -> None:
    if d.world_size > 1:
        dist.barrier()


# --- pieces of the run ---------------------------------------------------------------------------


def amp_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup to 1, then cosine to 0, per optimizer step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def choose_batch(cfg: dict, model, loss_fn, d: Dist, num_classes: int) -> tuple[int, int, dict]:
    """(per-device batch, grad_accum, preflight report).  On a GPU, one forward/backward proves the
    batch fits - or the run stops here with what does fit (rectrain.train.memory)."""
    auto = cfg["batch_size"] == "auto"
    global_batch = cfg.get("global_batch") or (memory.DEFAULT_AUTO_GLOBAL_BATCH if auto else None)
    if d.device.type != "cuda":
        if auto:
            return (
                math.ceil(global_batch / d.world_size),
                1,
                {"skipped": "no GPU: batch_size auto uses global_batch / world_size"},
            )
        return int(cfg["batch_size"]), int(cfg["grad_accum"]), {"skipped": "no GPU memory to check on CPU"}
    gpu = memory.GpuInfo.of(d.device)
    state = copy.deepcopy(model.state_dict())  # the probe steps must not touch BatchNorm statistics
    args = (model, loss_fn, cfg["image_size"], num_classes, d.device, amp_dtype(cfg["precision"]), cfg["channels_last"])
    try:
        if auto:
            batch, accum = memory.auto_batch(
                memory.cuda_try_step(*args, headroom=memory.HEADROOM), global_batch, d.world_size
            )
            # Every rank must use the same batch: the smallest GPU decides.
            batch = int(min(all_gather(batch, d)))
            accum = math.ceil(global_batch / (batch * d.world_size))
            report = {"auto": True, "batch": batch, "grad_accum": accum, "global_batch": global_batch}
        else:
            batch, accum = int(cfg["batch_size"]), int(cfg["grad_accum"])
            report = memory.check_batch(memory.cuda_try_step(*args), batch, gpu, d.world_size)
        peak = memory.cuda_try_step(*args)(batch)
    finally:
        model.load_state_dict(state)
    report.update(
        {
            "gpu": gpu.label(),
            "peak_mb": round(peak, 1),
            "total_mb": round(gpu.total_mb, 1),
            "share": round(peak / gpu.total_mb, 3),
        }
    )
    return batch, accum, report


def data_fingerprint(rec: str, idx: str) -> dict:
    return {"rec_bytes": os.path.getsize(rec), "idx_bytes": os.path.getsize(idx)}


def code_fingerprint() -> dict:
    """sha256 of each training source file (the train rule's code input, rectrain.sources): a checkpoint
    written by other code is another run, so an edit followed by a Snakemake rerun really retrains."""
    return sources.fingerprint("train")


def resumable(state: dict, cfg: dict, fingerprint: dict, world_size: int, code: dict | None = None) -> str | None:
    """None if the checkpoint continues this run, else why not."""

    def strip(c):
        return {k: v for k, v in c.items() if k not in RESUME_INDEPENDENT_KEYS}

    if strip(state.get("config", {})) != strip(cfg):
        changed = sorted(
            k
            for k in set(cfg) | set(state.get("config", {}))
            if k not in RESUME_INDEPENDENT_KEYS and cfg.get(k) != state["config"].get(k)
        )
        return f"the train config changed ({', '.join(changed)})"
    if state.get("data") != fingerprint:
        return "the training .rec/.idx changed"
    if code is not None and state.get("code") != code:
        changed = sorted(
            f for f in set(code) | set(state.get("code") or {}) if code.get(f) != (state.get("code") or {}).get(f)
        )
        return f"the training code changed ({', '.join(changed)})"
    if state.get("world_size") != world_size:
        return f"it was written by {state.get('world_size')} processes, this run has {world_size}"
    return None


def set_backend_flags(cfg: dict, device: torch.device) -> None:
    # Fixed training shapes: cuDNN's autotuner picks the fastest kernels once, for every later step.
    torch.backends.cudnn.benchmark = device.type == "cuda" and bool(cfg.get("cudnn_benchmark", True))


def make_model(cfg: dict, num_classes: int, device: torch.device):
    """(model on device, in channels_last when asked; the loss)."""
    model = torchvision.models.get_model(cfg["model"], num_classes=num_classes).to(device)
    if cfg["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    return model, torch.nn.CrossEntropyLoss(label_smoothing=cfg["label_smoothing"])


def make_optimizer(cfg: dict, model, global_batch: int, opt_steps_per_epoch: int):
    """(SGD with nesterov, warmup + cosine schedule, GradScaler for fp16) for the global batch."""
    peak_lr = cfg["lr"] * global_batch / 256
    total_steps, warmup_steps = cfg["epochs"] * opt_steps_per_epoch, round(cfg["warmup_epochs"] * opt_steps_per_epoch)
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


# --- the loop ------------------------------------------------------------------------------------


def run_steps(
    epoch,
    model,
    batches,
    loss_fn,
    optimizer,
    scheduler,
    scaler,
    cfg,
    accum,
    d,
    steps_log,
    n_batches: int | None = None,
    max_steps: int | None = None,
) -> dict:
    """Train on `batches` (at most max_steps of them), one telemetry row per step in steps_log.

    The training step itself: the epoch loop and bench/gpu_efficiency.py both run it.  No host sync per
    step: times come from a StepClock read one step late, loss and hits stay on the device until then,
    so the host queues step k+1 (and fetches its batch) while the GPU still computes step k."""
    model.train()
    dtype = amp_dtype(cfg["precision"])
    n_batches = n_batches or max_steps
    clock = StepClock(d.device)
    totals = {"loss_sum": 0.0, "correct": 0.0, "seen": 0, "steps": 0}

    def resolve(step, m_prev, m_data, m_end, loss, hits, n, lr):
        clock.wait(m_end)
        wall, wait = clock.seconds(m_prev, m_end), clock.seconds(m_prev, m_data)
        loss_v = loss.item()
        # Step wall time runs from the end of the previous step, so data wait + compute = wall.
        steps_log.write(
            rank=d.rank,
            epoch=epoch,
            step=step,
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

    pending = None
    m_prev = clock.mark()
    for step, (x, y) in enumerate(batches):
        m_data = clock.mark()
        if cfg["channels_last"]:
            x = x.contiguous(memory_format=torch.channels_last)
        last_micro = (step + 1) % accum == 0 or step + 1 == n_batches
        lr = optimizer.param_groups[0]["lr"]
        sync = contextlib.nullcontext() if last_micro or d.world_size == 1 else model.no_sync()
        with sync:
            with torch.autocast(d.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                out = model(x)
                loss = loss_fn(out, y)
            scaler.scale(loss / accum).backward()
        if last_micro:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        hits = (out.argmax(1) == y).sum()
        m_end = clock.mark()
        if pending:
            resolve(*pending)
        pending = (step, m_prev, m_data, m_end, loss.detach(), hits, len(y), lr)
        m_prev = m_end
        if max_steps is not None and step + 1 >= max_steps:
            break
    if pending:
        resolve(*pending)
    return totals


def train_one_epoch(epoch, model, loader, loss_fn, optimizer, scheduler, scaler, cfg, accum, d, steps_log):
    n_batches = loader.batches_per_epoch
    t_epoch = time.perf_counter()
    t = run_steps(
        epoch,
        model,
        loader.epoch(epoch),
        loss_fn,
        optimizer,
        scheduler,
        scaler,
        cfg,
        accum,
        d,
        steps_log,
        n_batches=n_batches,
    )
    wall = time.perf_counter() - t_epoch
    if t["steps"] != n_batches:
        raise RuntimeError(
            f"rank {d.rank}: the {loader.kind} loader yielded {t['steps']} batches in epoch {epoch}, "
            f"expected {n_batches} on every rank (the other ranks would wait forever)"
        )
    loss_sum, correct, seen = all_reduce_sum([t["loss_sum"], t["correct"], t["seen"]], d)
    return {"train_loss": loss_sum / seen, "train_acc": correct / seen, "images": seen, "wall_s": wall}


@torch.no_grad()
def evaluate(model, loader, loss_fn, cfg, d, num_classes) -> dict:
    """Loss, top-1, top-5 over the whole val .rec (each rank its shard, summed across ranks)."""
    # Each rank's BatchNorm statistics drifted on its own shard since the last forward; validate the
    # weights that get checkpointed (rank 0's), or epochs.csv disagrees with the evaluate stage.
    if d.world_size > 1:
        for buf in ckpt.unwrap(model).buffers():
            dist.broadcast(buf, src=0)
    model.eval()
    dtype = amp_dtype(cfg["precision"])
    k = min(5, num_classes)
    loss_sum = top1 = top5 = n = 0.0
    for x, y in loader.epoch(0):
        if cfg["channels_last"]:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(d.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
        loss_sum += torch.nn.functional.cross_entropy(out.float(), y, reduction="sum").item()
        hits = out.topk(k, dim=1).indices == y[:, None]
        top1 += hits[:, 0].sum().item()
        top5 += hits.any(dim=1).sum().item()
        n += len(y)
    loss_sum, top1, top5, n = all_reduce_sum([loss_sum, top1, top5, n], d)
    return {
        "val_loss": loss_sum / max(n, 1),
        "val_top1": top1 / max(n, 1),
        "val_top5": top5 / max(n, 1),
        "val_images": int(n),
    }


def run_info(cfg, d, loader_kind, batch, accum, epochs, rec, padding, preflight, started) -> dict:
    from rectrain.storage import device_info

    try:
        import nvidia.dali as dali

        dali_version = dali.__version__
    except ImportError:
        dali_version = None
    return {
        "world_size": d.world_size,
        "nodes": int(cfg.get("nodes", 1)),
        "devices": [str(d.device)] if d.device.type == "cpu" else [f"cuda:{i}" for i in range(d.local_world_size)],
        "backend": "nccl" if d.device.type == "cuda" else "gloo",
        "loader": loader_kind,
        "model": cfg["model"],
        "precision": cfg["precision"],
        "batch_size": batch,
        "grad_accum": accum,
        "global_batch": batch * accum * d.world_size,
        "epochs": epochs,
        "image_size": cfg["image_size"],
        "rec_device": device_info(rec),
        "gpus": telemetry.gpu_inventory(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "dali": dali_version,
        "padding_per_epoch": padding,
        "started": started,
        "finished": None,
        "preflight": preflight,
        "config": cfg,
    }


def train(args: argparse.Namespace, cfg: dict) -> None:
    d = setup_distributed(cfg)
    out = Path(args.out)
    ck_dir = out / "checkpoints"
    if d.master:
        ck_dir.mkdir(parents=True, exist_ok=True)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, threads // d.local_world_size))
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank (DDP also broadcasts rank 0's)

    classes = read_classes(args.classes)
    set_backend_flags(cfg, d.device)
    model, loss_fn = make_model(cfg, len(classes), d.device)
    batch, accum, preflight = choose_batch(cfg, model, loss_fn, d, len(classes))

    workers = resolve_workers(cfg["workers"], d.local_world_size, threads)
    log(f"rank {d.rank}: {workers} loader workers (train.workers: {cfg['workers']})")
    common = dict(
        image_size=cfg["image_size"],
        rank=d.rank,
        world_size=d.world_size,
        workers=workers,
        device=str(d.device),
        gpu_decode=cfg["gpu_decode"],
        seed=cfg["seed"],
        dali=DaliOptions.from_config(cfg),
    )
    train_loader = build_loader(cfg["loader"], LoaderSpec(args.rec, args.idx, batch_size=batch, train=True, **common))
    val_loader = build_loader(
        cfg["loader"], LoaderSpec(args.val_rec, args.val_idx, batch_size=batch, train=False, **common)
    )
    global_batch = batch * accum * d.world_size
    optimizer, scheduler, scaler = make_optimizer(
        cfg, model, global_batch, math.ceil(train_loader.batches_per_epoch / accum)
    )

    start_epoch, rng_states = 0, None
    fingerprint, code = data_fingerprint(args.rec, args.idx), code_fingerprint()
    last = ck_dir / "last.pt"
    if last.exists():
        state = ckpt.load(last)
        why_not = resumable(state, cfg, fingerprint, d.world_size, code)
        if why_not:
            log(f"not resuming from {last}: {why_not}; starting from epoch 0")
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            start_epoch, rng_states = state["epoch"] + 1, state["rng"]
            log(f"resuming from {last}: epoch {state['epoch']} done, continuing at epoch {start_epoch}")
        del state
    starts = all_gather(start_epoch, d)  # also: nobody writes checkpoints before every rank has read last.pt
    if len(set(starts)) > 1:
        raise RuntimeError(
            f"ranks disagree on the epoch to resume from ({starts}): {ck_dir} must be on a "
            "filesystem every node sees (shared --out)"
        )

    ddp = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None) if d.world_size > 1 else model
    net = torch.compile(ddp) if cfg["compile"] else ddp

    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    info = run_info(
        cfg,
        d,
        train_loader.kind,
        batch,
        accum,
        cfg["epochs"],
        args.rec,
        train_loader.padding_per_epoch,
        preflight,
        started,
    )
    info["resumed_from_epoch"] = start_epoch if start_epoch else None
    # What decoded the JPEGs, and why it is not what train.loader asked for (DALI missing) when it is not.
    info.update(
        loader_requested=cfg["loader"],
        decode=train_loader.choice.decode,
        loader_note=train_loader.choice.note,
        workers=workers,
    )  # the count 'auto' became, which the diagnosis quotes
    if d.master:
        write_json(out / "run.json", info)
        log(
            f"{d.world_size} process(es), {info['backend']}, {train_loader.kind} loader, {cfg['model']} "
            f"@{cfg['image_size']}px, batch {batch} x accum {accum} x {d.world_size} = {global_batch}, "
            f"{train_loader.size} train images ({train_loader.padding_per_epoch} padded per epoch), "
            f"preflight: {preflight}"
        )
    live = out / "telemetry"
    live.mkdir(parents=True, exist_ok=True)
    steps_log = telemetry.step_log(live, d.rank, start_epoch)
    epochs_log = telemetry.epoch_log(live, start_epoch) if d.master else None
    sampler = None
    node = int(os.environ.get("GROUP_RANK", 0))  # torchrun's node rank
    if d.local_rank == 0:
        from rectrain.storage import block_device_for

        sampler = telemetry.SystemSampler(
            live / f"system_node{node}.csv",
            cfg["sample_interval_s"],
            block_device_for(args.rec),
            telemetry.job_processes(),
            append=start_epoch > 0,
        )
        sampler.start()

    try:
        if rng_states is not None:
            ckpt.set_rng_state(rng_states[d.rank])
        for epoch in range(start_epoch, cfg["epochs"]):
            if os.environ.get(FAIL_RANK_ENV) == str(d.rank):
                raise RuntimeError(f"injected failure ({FAIL_RANK_ENV}={d.rank})")
            stats = train_one_epoch(
                epoch, net, train_loader, loss_fn, optimizer, scheduler, scaler, cfg, accum, d, steps_log
            )
            val = evaluate(model, val_loader, loss_fn, cfg, d, len(classes))
            rngs = all_gather(ckpt.rng_state(), d)
            if d.master:
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
                state = {
                    "model": ckpt.unwrap(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict(),
                    "epoch": epoch,
                    "rng": rngs,
                    "config": cfg,
                    "num_classes": len(classes),
                    "model_name": cfg["model"],
                    "image_size": cfg["image_size"],
                    "batch_size": batch,
                    "grad_accum": accum,
                    "world_size": d.world_size,
                    "data": fingerprint,
                    "code": code,
                }
                ckpt.save_atomic(state, ck_dir / f"epoch_{epoch}.pt")
                ckpt.save_atomic(state, last)
                log(
                    f"epoch {epoch}: train loss {stats['train_loss']:.3f} acc {stats['train_acc']:.3f}, "
                    f"val loss {val['val_loss']:.3f} top-1 {val['val_top1']:.3f} top-5 {val['val_top5']:.3f}, "
                    f"{stats['images'] / stats['wall_s']:.0f} img/s, {stats['wall_s']:.1f} s"
                )
            barrier(d)
            if os.environ.get(KILL_AFTER_EPOCH_ENV) == str(epoch):
                log(f"{KILL_AFTER_EPOCH_ENV}={epoch}: killing this process as a crash would")
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        steps_log.close()
        if sampler is not None:
            sampler.stop()
    barrier(d)
    if d.master:
        epochs_log.close()
        telemetry.merge_steps(live, out / "steps.csv", d.world_size)
        shutil.copyfile(live / "epochs.csv", out / "epochs.csv")
        shutil.copyfile(live / "system_node0.csv", out / "system.csv")  # other nodes: telemetry/system_node<k>.csv
        info["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        write_json(out / "run.json", info)
        ckpt.save_atomic(ckpt.load(last), out / "model.pt")  # last: the rule's output marks a finished run
        log(f"done: {out / 'model.pt'}")
    barrier(d)


@record
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg = json.loads(args.config_json)
    if not launched() and not relaunch_or_single(cfg, argv, args.single_process):
        return
    rank = os.environ.get("RANK", "?")
    try:
        train(args, cfg)
    except Exception as exc:
        batch = cfg.get("batch_size")
        device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            if torch.cuda.is_available() and cfg.get("devices") != "cpu"
            else torch.device("cpu")
        )
        hint = memory.explain_cuda_error(
            exc, device, batch if isinstance(batch, int) else 0, int(os.environ.get("WORLD_SIZE", 1))
        )
        print(
            f"rank {rank} failed: {type(exc).__name__}: {exc}" + (f"\n{hint}" if hint else ""),
            file=sys.stderr,
            flush=True,
        )
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
