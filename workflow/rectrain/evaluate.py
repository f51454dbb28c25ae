"""Evaluate the final checkpoint on the val .rec: metrics.json and per_class.csv.

python -m rectrain.evaluate --config-json '<evaluate block>' --checkpoint results/<ds>/train/model.pt \
    --rec <fast>/<ds>/val.rec --idx <fast>/<ds>/val.idx --classes results/<ds>/index/classes.tsv \
    --out results/<ds>/eval

Devices: the same plan as training (rectrain.train.launch.plan_processes on the checkpoint's train config).
With several GPUs the command re-executes itself under torchrun, one process per GPU, each reading a
contiguous shard of the .rec with padding dropped (the loaders' eval mode), and the per-rank tallies
(confusion matrix, top-5 hits, loss sum) are summed with all_reduce - so the result equals one pass
over every record exactly once. On CPU it runs as one process: a second process on the same cores
adds start-up and gains nothing over torch's intra-op threads. It also runs correctly when started
under torchrun by hand (gloo on CPU).

Model shape (architecture, classes, image size) comes from the checkpoint, so the rule's params need
only the evaluate block; the checkpoint is loaded with weights_only=True (no pickled code runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from rectrain.atomic import write_json
from rectrain.loaders import EVAL_CROP_FRACTION, LoaderSpec, build_loader, resolve_workers
from rectrain.train.checkpoint import load as load_checkpoint
from rectrain.train.launch import plan_processes, torchrun_args, visible_gpu_count


@dataclass(frozen=True)
class EvalSpec(LoaderSpec):
    """LoaderSpec whose shorter-side resize can be set (evaluate.resize) instead of image_size/0.875."""

    resize: int | None = None

    @property
    def eval_resize(self) -> int:
        return self.resize or int(round(self.image_size / EVAL_CROP_FRACTION))


@dataclass
class Tally:
    """Sums over evaluated images; additive across ranks and batches."""

    confusion: torch.Tensor  # [C, C] int64, row = true label, column = predicted
    top5_hits: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def images(self) -> int:
        return int(self.confusion.sum())


# ---------------------------------------------------------------------------------------------
# Checkpoint -> model


def build_model(name: str, num_classes: int) -> torch.nn.Module:
    """The architecture training used (torchvision's model registry, like rectrain.train)."""
    import torchvision

    try:
        return torchvision.models.get_model(name, num_classes=num_classes)
    except ValueError as err:
        raise ValueError(f"checkpoint model_name {name!r} is not a torchvision model: {err}") from None


def model_from_checkpoint(ckpt: dict) -> torch.nn.Module:
    missing = [k for k in ("model", "model_name", "num_classes", "image_size") if k not in ckpt]
    if missing:
        raise KeyError(f"checkpoint lacks {missing}: it was not written by rectrain.train; rerun the train rule")
    model = build_model(ckpt["model_name"], int(ckpt["num_classes"]))
    model.load_state_dict(ckpt["model"])
    return model.eval()


def loader_kind(cfg: dict, ckpt: dict) -> str:
    return cfg.get("loader") or (ckpt.get("config") or {}).get("loader") or "dali"


def eval_spec(cfg: dict, ckpt: dict, rec: str, idx: str, rank: int, world: int, device: str) -> EvalSpec:
    train_cfg = ckpt.get("config") or {}
    crop = int(cfg.get("crop") or ckpt["image_size"])
    workers = resolve_workers(cfg.get("workers", 2), int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return EvalSpec(
        rec=rec,
        idx=idx,
        batch_size=int(cfg.get("batch_size", 64)),
        image_size=crop,
        train=False,
        rank=rank,
        world_size=world,
        workers=workers,
        device=device,
        gpu_decode=bool(train_cfg.get("gpu_decode", True)),
        resize=cfg.get("resize"),
    )


# ---------------------------------------------------------------------------------------------
# The pass over the data


def _autocast(device: torch.device, precision: str):
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        return torch.autocast("cuda", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    return torch.autocast(device.type, enabled=False)


@torch.inference_mode()
def tally(model: torch.nn.Module, batches, num_classes: int, device: torch.device, precision: str = "fp32") -> Tally:
    """Confusion matrix, top-5 hits and summed cross-entropy over (images, labels) batches."""
    t = Tally(confusion=torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device))
    k = min(5, num_classes)
    hits = torch.zeros((), dtype=torch.int64, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    start = time.perf_counter()
    for images, labels in batches:
        images, labels = images.to(device), labels.to(device)
        if device.type == "cuda":
            images = images.contiguous(memory_format=torch.channels_last)
        with _autocast(device, precision):
            logits = model(images)
        logits = logits.float()
        loss += F.cross_entropy(logits, labels, reduction="sum").double()
        topk = logits.topk(k, dim=1).indices
        hits += (topk == labels[:, None]).any(dim=1).sum()
        t.confusion += torch.bincount(labels * num_classes + topk[:, 0], minlength=num_classes * num_classes).view(
            num_classes, num_classes
        )
    t.top5_hits, t.loss_sum = int(hits), float(loss)
    t.seconds = time.perf_counter() - start
    return t


def all_reduce(t: Tally, device: torch.device) -> Tally:
    """Sum the tallies of every rank (no-op without a process group). Time = the slowest rank's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return t
    conf = t.confusion.to(device)
    sums = torch.tensor([t.top5_hits, t.loss_sum], dtype=torch.float64, device=device)
    secs = torch.tensor([t.seconds], dtype=torch.float64, device=device)
    dist.all_reduce(conf)
    dist.all_reduce(sums)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    return Tally(confusion=conf, top5_hits=int(round(sums[0].item())), loss_sum=float(sums[1]), seconds=float(secs))


# ---------------------------------------------------------------------------------------------
# Outputs


def metrics(t: Tally, loader: str, checkpoint: str) -> dict:
    n = t.images
    if n == 0:
        raise ValueError("the val .rec produced no images: check the pack stage's val manifest")
    return {
        "top1": float(t.confusion.diagonal().sum()) / n,
        "top5": t.top5_hits / n,
        "loss": t.loss_sum / n,
        "images": n,
        "images_per_s": n / t.seconds if t.seconds > 0 else None,
        "loader": loader,
        "checkpoint": str(checkpoint),
    }


def per_class(confusion: torch.Tensor, classes: pd.DataFrame) -> pd.DataFrame:
    """One row per class: accuracy and the class its images were most often mistaken for."""
    conf = confusion.cpu().long()
    n = conf.shape[0]
    wnids = dict(zip(classes["label"].astype(int), classes["wnid"].astype(str), strict=True))
    names = dict(zip(classes["label"].astype(int), classes["name"].astype(str), strict=True))
    off = conf.clone()
    off.fill_diagonal_(-1)  # never "confused with itself"
    rows = []
    for label in range(n):
        images, correct = int(conf[label].sum()), int(conf[label, label])
        worst = int(off[label].argmax())
        count = int(off[label, worst])
        rows.append(
            {
                "label": label,
                "wnid": wnids.get(label, ""),
                "name": names.get(label, ""),
                "images": images,
                "correct": correct,
                "accuracy": correct / images if images else float("nan"),
                "most_confused_label": worst if count > 0 else "",
                "most_confused_wnid": wnids.get(worst, "") if count > 0 else "",
                "most_confused_count": max(count, 0),
            }
        )
    return pd.DataFrame(rows)


def read_classes(path: str | os.PathLike, num_classes: int) -> pd.DataFrame:
    classes = pd.read_csv(path, sep="\t", keep_default_na=False, dtype={"wnid": str, "name": str})
    if len(classes) != num_classes:
        raise ValueError(
            f"{path} lists {len(classes)} classes but the checkpoint's model has {num_classes}: "
            "the index changed after training; rerun train (snakemake reruns it when the index changes)"
        )
    return classes


def write_outputs(out: Path, m: dict, table: pd.DataFrame) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "per_class.csv", index=False)
    write_json(out / "metrics.json", m)  # last: its presence means the outputs are complete


# ---------------------------------------------------------------------------------------------
# Processes


def distributed_env() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    return None


def relaunch_command(ckpt: dict, argv: list[str], gpu_count: int) -> tuple[list[str], dict] | None:
    """(torchrun argv, env) that run this evaluation on every training GPU, or None to run in-process."""
    plan = plan_processes(ckpt.get("config") or {}, gpu_count)
    if plan.kind != "gpu" or plan.nproc < 2:
        return None
    env = dict(os.environ)
    if plan.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(plan), "-m", "rectrain.evaluate", *argv]
    return cmd, env


def run(cfg: dict, checkpoint: str, rec: str, idx: str, classes_path: str, out: str) -> dict | None:
    """Evaluate in this process (one rank of torchrun, or alone). Returns the metrics on rank 0."""
    import torch.distributed as dist

    ckpt = load_checkpoint(checkpoint)
    dist_env = distributed_env()
    rank, local_rank, world = dist_env or (0, 0, 1)
    use_cuda = torch.cuda.is_available() and (ckpt.get("config") or {}).get("devices") != "cpu"
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if dist_env and world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        num_classes = int(ckpt["num_classes"])
        classes = read_classes(classes_path, num_classes)
        model = model_from_checkpoint(ckpt).to(device)
        if device.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        kind = loader_kind(cfg, ckpt)
        spec = eval_spec(cfg, ckpt, rec, idx, rank, world, str(device))
        print(
            f"[evaluate] rank {rank}/{world} on {device}: {kind} loader, resize {spec.eval_resize} "
            f"+ centre crop {spec.image_size}, batch {spec.batch_size}",
            file=sys.stderr,
            flush=True,
        )
        loader = build_loader(kind, spec)
        precision = (ckpt.get("config") or {}).get("precision", "fp32")
        t = all_reduce(tally(model, loader.epoch(0), num_classes, device, precision), device)
        if rank != 0:
            return None
        m = metrics(t, kind, checkpoint)
        write_outputs(Path(out), m, per_class(t.confusion, classes))
        print(
            f"[evaluate] top-1 {100 * m['top1']:.2f} %, top-5 {100 * m['top5']:.2f} %, loss {m['loss']:.4f} "
            f"on {m['images']} images ({m['images_per_s'] or 0:.0f} img/s)",
            file=sys.stderr,
        )
        return m
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m rectrain.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config-json", required=True, help="the evaluate config block")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--rec", required=True)
    ap.add_argument("--idx", required=True)
    ap.add_argument("--classes", required=True, help="classes.tsv of the index (label, wnid, name)")
    ap.add_argument("--out", required=True, help="folder for metrics.json and per_class.csv")
    ap.add_argument("--single-process", action="store_true", help="never relaunch under torchrun")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if distributed_env() is None and not args.single_process:
        relaunch = relaunch_command(load_checkpoint(args.checkpoint), argv, visible_gpu_count())
        if relaunch:
            cmd, env = relaunch
            print("[evaluate] one process per training GPU: " + " ".join(cmd), file=sys.stderr, flush=True)
            os.execve(cmd[0], cmd, env)
    run(json.loads(args.config_json), args.checkpoint, args.rec, args.idx, args.classes, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
