"""Synthetic stage outputs in the CONTRACTS formats (telemetry CSVs, run.json, pack manifests,
eval outputs, Snakemake benchmark TSVs) for the diagnosis and report tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from rectrain import settings
from rectrain.config import stage_block

# Explicit values (the tests quote them), checked and completed by the schema like a stage's block.
REPORT_CFG = stage_block(
    "report",
    json.dumps(
        {
            "title": "rectrain report",
            "data_wait_share": 0.2,
            "imbalance_ratio": 3.0,
            "iowait_percent": 20,
            "gpu_mem_high": 0.92,
            "gpu_mem_low": 0.5,
            "gpu_util_low": 70,
            "input_efficiency": 0.9,
            "cpu_busy_percent": 90,
            "classes_shown": 10,
        }
    ),
)

# The same values as the report block's view, as the report's entry point hands it to the diagnosis.
REPORT = settings.view("report", REPORT_CFG)

BENCH_COLUMNS = ["s", "h:m:s", "max_rss", "max_vms", "max_uss", "max_pss", "io_in", "io_out", "mean_load", "cpu_time"]


def make_steps(
    wait_share: dict[int, float],
    epochs: int = 2,
    steps: int = 20,
    step_s: float = 0.5,
    images: int = 32,
    t0: float = 1_700_000_000.0,
) -> pd.DataFrame:
    """steps.csv rows where rank r spends wait_share[r] of every step waiting for data.  Built with
    arrays: a full ImageNet run (90 epochs x 5005 steps x 2 ranks) is 900,900 rows."""
    n = epochs * steps
    k = np.arange(n)
    # the time a loop adding step_s to t0 reaches, bit for bit
    t = np.cumsum(np.concatenate([[t0], np.full(n, step_s)]))[1:]
    frames = [
        pd.DataFrame(
            {
                "rank": rank,
                "epoch": k // steps,
                "step": k % steps,
                "time": t,
                "wall_s": step_s,
                "data_wait_s": step_s * share,
                "compute_s": step_s * (1 - share),
                "images": images,
                "loss": 2.3 * np.exp(-0.05 * k),
                "lr": 0.1,
            }
        )
        for rank, share in wait_share.items()
    ]
    return pd.concat(frames, ignore_index=True)


def make_system(
    n: int = 40,
    iowait: float = 2.0,
    gpus: dict[int, tuple[float, float, float]] | None = None,
    t0: float = 1_700_000_000.0,
    cpu: float = 50.0,
    cpu_jitter: float = 5.0,
) -> pd.DataFrame:
    """system.csv; gpus maps index -> (util %, mem used MB, mem total MB); None = CPU-only (no GPU columns).
    CPU busy is `cpu` +- `cpu_jitter` % (within 0..100)."""
    rng = np.random.default_rng(0)
    df = pd.DataFrame(
        {
            "time": t0 + np.arange(n, dtype=float),
            "cpu_percent": np.clip(cpu + rng.uniform(-cpu_jitter, cpu_jitter, n), 0, 100),
            "iowait_percent": np.full(n, float(iowait)),
            "disk_read_mb_s": 80 + rng.uniform(-10, 10, n),
            "rss_mb": 2000 + rng.uniform(0, 50, n),
        }
    )
    for i, (util, used, total) in (gpus or {}).items():
        df[f"gpu{i}_util"] = np.full(n, float(util))
        df[f"gpu{i}_mem_used_mb"] = np.full(n, float(used))
        df[f"gpu{i}_mem_total_mb"] = np.full(n, float(total))
    return df


def make_calibration(images_per_s: dict[int, float] | None = None, skipped: str | None = None) -> dict:
    """run.json's calibration: synthetic-data img/s per rank (keys are strings, as JSON has them)."""
    rates = {str(r): float(v) for r, v in (images_per_s or {}).items()}
    return {
        "images_per_s": rates if skipped is None else {},
        "steps": 20,
        "warmup_steps": 5,
        "seconds": 3.5,
        "batch_size": 128,
        "skipped": skipped,
    }


def make_run(world_size: int = 2, gpus: int = 2, rotational: bool | None = False, **overrides) -> dict:
    run = {
        "world_size": world_size,
        "nodes": 1,
        "devices": [f"cuda:{i}" for i in range(gpus)] if gpus else ["cpu"] * world_size,
        "backend": "nccl" if gpus else "gloo",
        "loader": "dali",
        "model": "resnet18",
        "precision": "bf16",
        "channels_last": True,
        "compile": False,
        "batch_size": 128,
        "grad_accum": 1,
        "global_batch": 128 * world_size,
        "epochs": 2,
        "image_size": 64,
        "rec_device": {"path": "results/fast_storage/demo/train.rec", "device": "/dev/sdb", "rotational": rotational},
        "gpus": [
            {"index": i, "name": "NVIDIA GeForce RTX 2080 Ti", "memory_total_mb": 11264, "driver": "535.54.03"}
            for i in range(gpus)
        ],
        "cuda": "12.1" if gpus else None,
        "torch": "2.14.1",
        "dali": "1.34.0",
        "padding_per_epoch": 0,
        "started": "2026-11-29T10:00:00+00:00",
        "finished": "2026-11-29T10:20:00+00:00",
        "preflight": {},
        "cores": 16,
    }
    run.update(overrides)
    return run


def make_manifest(
    split: str = "train",
    rotational: bool | None = False,
    skipped: list[dict] | None = None,
    repaired: list[dict] | None = None,
    packed: int = 600,
) -> dict:
    skipped, repaired = skipped or [], repaired or []
    return {
        "split": split,
        "rec": f"results/fast_storage/demo/{split}.rec",
        "idx": f"results/fast_storage/demo/{split}.idx",
        "discovered": packed + len(skipped),
        "packed": packed,
        "skipped": len(skipped),
        "repaired": repaired,
        "skipped_files": skipped,
        "bytes_written": packed * 4096,
        "wall_s": 3.0,
        "images_per_s": packed / 3.0,
        "mb_per_s": packed * 4096 / 3.0 / 1e6,
        "resize": 0,
        "quality": 90,
        "storage": {
            "path": "results/fast_storage/demo",
            "device": "/dev/sdb",
            "rotational": rotational,
            "free_bytes": 10**11,
            "needed_bytes": packed * 4096,
            "warning": "rotational disk" if rotational else None,
        },
    }


def make_epochs(epochs: int = 2) -> pd.DataFrame:
    """epochs.csv; two epochs keep the values the tests quote, longer runs follow a learning curve."""
    e = np.arange(epochs, dtype=float)
    if epochs <= 2:
        train_acc, val_single_view_top1 = 0.3 + 0.2 * e, 0.25 + 0.2 * e
    else:
        train_acc, val_single_view_top1 = 0.75 * (1 - np.exp(-e / 15)), 0.72 * (1 - np.exp(-e / 15))
    return pd.DataFrame(
        {
            "epoch": e.astype(int),
            "train_loss": 2.0 - 0.5 * e if epochs <= 2 else 6.9 * np.exp(-e / 20) + 0.9,
            "train_acc": train_acc,
            "val_single_view_loss": 2.1 - 0.4 * e if epochs <= 2 else 6.9 * np.exp(-e / 22) + 1.1,
            "val_single_view_top1": val_single_view_top1,
            "val_single_view_top5": np.minimum(0.7 + 0.1 * e, 0.93),
            "images_per_s": 500 + 10 * e,
            "wall_s": 30.0,
        }
    )


def make_classes(n: int = 4, evil: bool = True) -> pd.DataFrame:
    names = [f"class {i}" for i in range(n)]
    if evil:
        names[1] = "<script>alert(1)</script>"
    return pd.DataFrame({"label": range(n), "wnid": [f"n{1440764 + i:08d}" for i in range(n)], "name": names})


def make_per_class(classes: pd.DataFrame) -> pd.DataFrame:
    """per_class.csv. Four classes of 10 images keep the values the tests quote; more get 50 images
    each (ImageNet's val set), seeded accuracies and a seeded most-confused class."""
    n = len(classes)
    images = 10 if n == 4 else 50
    if n == 4:
        correct, confused, count = [9, 2, 7, 5], [1, 0, 1, 2], [1, 6, 2, 3]
    else:
        rng = np.random.default_rng(1)
        correct = np.clip(rng.normal(0.7 * images, 0.15 * images, n).round(), 0, images).astype(int).tolist()
        confused = [(i + int(rng.integers(1, n))) % n for i in range(n)]
        count = [int(rng.integers(0, images - c + 1)) for c in correct]
    return classes.assign(
        images=images,
        correct=correct,
        accuracy=[c / images for c in correct],
        most_confused_label=confused,
        most_confused_wnid=[classes.wnid[j] for j in confused],
        most_confused_count=count,
    )


def consistent_epochs(epochs: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """epochs.csv's wall_s and images_per_s as training writes them for these steps: each epoch's step
    time (rank 0's) and all ranks' images over it."""
    first = steps[steps["rank"] == steps["rank"].min()]
    wall = first.groupby("epoch")["wall_s"].sum()
    images = steps.groupby("epoch")["images"].sum()
    return epochs.assign(wall_s=epochs["epoch"].map(wall), images_per_s=epochs["epoch"].map(images / wall))


def write_run(
    root: Path,
    *,
    wait_share=None,
    iowait=2.0,
    gpus=None,
    run_overrides=None,
    rotational=False,
    skipped=None,
    repaired=None,
    evil=True,
    stages=("index_raw", "pack/train", "pack/val", "train", "evaluate"),
    ds: str = "demo",
    cpu: float = 50.0,
    epochs: int = 2,
    steps: int = 20,
    classes: int = 4,
    samples: int = 40,
) -> dict:
    """Write every stage output of a finished run under root; return the paths (report CLI args).
    `samples`: system.csv rows (one a second, as train.sample_interval_s's default)."""
    wait_share = wait_share or {0: 0.02, 1: 0.03}
    train = root / "results" / ds / "main" / "train"
    ev = root / "results" / ds / "main" / "eval"
    pack = root / "results" / ds / "pack"
    index = root / "results" / ds / "index"
    bench = root / "benchmarks"
    for d in (train, ev, pack, index, bench):
        d.mkdir(parents=True, exist_ok=True)
    step_rows = make_steps(wait_share, epochs=epochs, steps=steps)
    step_rows.to_csv(train / "steps.csv", index=False)
    make_system(samples, gpus=gpus, iowait=iowait, cpu=cpu).to_csv(train / "system.csv", index=False)
    consistent_epochs(make_epochs(epochs), step_rows).to_csv(train / "epochs.csv", index=False)
    n_gpus = len(gpus or {})
    run = make_run(world_size=len(wait_share), gpus=n_gpus, rotational=rotational, **(run_overrides or {}))
    (train / "run.json").write_text(json.dumps(run))
    for split in ("train", "val"):
        man = make_manifest(
            split,
            rotational=rotational,
            skipped=skipped if split == "train" else None,
            repaired=repaired if split == "train" else None,
        )
        (pack / f"{split}.manifest.json").write_text(json.dumps(man))
    names = make_classes(classes, evil=evil)
    names.to_csv(index / "classes.tsv", sep="\t", index=False)
    per_class = make_per_class(names)
    per_class.to_csv(ev / "per_class.csv", index=False)
    (ev / "metrics.json").write_text(
        json.dumps(
            {
                "top1": 0.575,
                "top5": 0.95,
                "loss": 1.1,
                "images": 40,
                "images_per_s": 400.0,
                "loader": "dali",
                "checkpoint": str(train / "model.pt"),
            }
        )
    )
    for i, stage in enumerate(stages):  # "rule" -> rule/<ds>.tsv, "rule/part" -> rule/<ds>_<part>.tsv
        rule, _, part = stage.partition("/")
        (bench / rule).mkdir(exist_ok=True)
        row = [10.0 * (i + 1), f"0:00:{10 * (i + 1):02d}", 500.0 + i, 900.0, 450.0, 470.0, 12.5, 3.25, 95.0, 8.0]
        name = f"{ds}_{part}.tsv" if part else f"{ds}.tsv"
        pd.DataFrame([row], columns=BENCH_COLUMNS).to_csv(bench / rule / name, sep="\t", index=False)
    return {"train": train, "eval": ev, "pack": pack, "index": index, "benchmarks": bench, "run": run}


CUSTOM_CLASSES = ["cat", "dog", "fish", "frog", "owl"]


def write_small_custom_run(root: Path, **run_overrides) -> dict:
    """The issue-27 run: a 5-class custom dataset (folder names, no wnids, no names) of 150 train and
    50 val images trained with batch_size auto and global_batch 256 on 2 CPU processes: one step per
    epoch, val top-1 at chance with every image predicted as one class, top-5 of 5 classes, an input
    efficiency above 1, a real .png repaired, resumed at epoch 2."""
    paths = write_run(root, wait_share={0: 0.02, 1: 0.02}, epochs=4, steps=1, classes=5, evil=False)
    train, ev, index, pack = paths["train"], paths["eval"], paths["index"], paths["pack"]
    steps = make_steps({0: 0.02, 1: 0.02}, epochs=4, steps=1, images=128)
    # a step per epoch: the first of each epoch is its only one, so the steady rate is every step's
    steps.to_csv(train / "steps.csv", index=False)
    classes = pd.DataFrame({"label": range(5), "wnid": CUSTOM_CLASSES, "name": [""] * 5})
    classes.to_csv(index / "classes.tsv", sep="\t", index=False)
    per_class = classes.assign(
        images=10,
        correct=[10, 0, 0, 0, 0],
        accuracy=[1.0, 0, 0, 0, 0],
        most_confused_label=["", 0, 0, 0, 0],
        most_confused_wnid=["", "cat", "cat", "cat", "cat"],
        most_confused_count=[0, 10, 10, 10, 10],
        predicted=[50, 0, 0, 0, 0],
    )
    per_class.to_csv(ev / "per_class.csv", index=False)
    metrics = {"top1": 0.2, "top5": 1.0, "num_classes": 5, "loss": 1.61, "images": 50, "images_per_s": 90.0}
    (ev / "metrics.json").write_text(json.dumps({**metrics, "loader": "dali", "checkpoint": str(train / "model.pt")}))
    # steady 512 img/s (2 ranks x 128 images / 0.5 s) against 388 calibrated: 1.32
    run = make_run(world_size=2, gpus=0, batch_size=128, global_batch=256, padding_per_epoch=106, epochs=4)
    run.update(calibration=make_calibration({0: 194.0, 1: 194.0}), resumed_from_epoch=2, resumed_despite=[])
    run.update(run_overrides)
    (train / "run.json").write_text(json.dumps(run))
    for split, n in (("train", 150), ("val", 50)):
        man = make_manifest(split, packed=n)
        if split == "train":
            man["repaired"] = [
                {"id": 3, "source": "train/owl/photo.png", "reason": "PNG content named as JPEG re-encoded as JPEG"}
            ]
        (pack / f"{split}.manifest.json").write_text(json.dumps(man))
    return {**paths, "run": run}
