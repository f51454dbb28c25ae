"""Time projection: what the measured throughput means for the configured run and for full ImageNet.

The number a user with two GPUs and a deadline wants first.  Computed from measured numbers only:
  training   steady img/s of all ranks (steps.csv without each epoch's first step, the input
             efficiency's real rate) over the images one epoch trains (steps.csv, padding included)
  validation the evaluate stage's img/s (metrics.json) over the val images, once per epoch
and, for an ImageNet-like dataset only (classes named by WordNet ids: ImageNet, or a subset of its
classes or images), the same rates over 1,281,167 train images and 50,000 val images, for the configured
epochs (the loaders' padding to full batches, under ranks x batch images, is left out).  Loader start-up (each epoch's first
step) and checkpoint writing are not in it; the run's measured wall time stands beside it as a check.
Pure functions over parsed telemetry, like diagnosis.py.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Mapping

import pandas as pd

from rectrain.report.efficiency import steady_rates
from rectrain.report.stats import train_setting

IMAGENET_TRAIN = 1_281_167
IMAGENET_VAL = 50_000
IMAGENET_CLASSES = 1000
WNID = re.compile(r"^n\d{8}$")


def imagenet_like(classes: pd.DataFrame) -> bool:
    """Every class a WordNet id (n01440764): ImageNet's 1000 classes or a subset of them (the demo,
    ImageNet-100), whose per-image cost carries over to full ImageNet; a 5-class dataset of one's own
    (classes named cat, dog, ...) is no basis for a full-ImageNet time."""
    if classes.empty or "wnid" not in classes or len(classes) > IMAGENET_CLASSES:
        return False
    return bool(classes["wnid"].astype(str).str.match(WNID).all())


@dataclass(frozen=True)
class Plan:
    """One epoch's work and its time at the measured rates, and the run's at `epochs` of them."""

    train_images: int
    val_images: int
    train_s: float
    val_s: float | None  # None: no evaluation rate measured
    epochs: int

    @property
    def epoch_s(self) -> float:
        return self.train_s + (self.val_s or 0.0)

    @property
    def run_s(self) -> float:
        return self.epochs * self.epoch_s


@dataclass(frozen=True)
class Projection:
    train_img_s: float  # steady, all ranks
    val_img_s: float | None  # the evaluate stage's
    ranks: int
    run: Plan  # this run as configured
    imagenet: Plan | None  # full ImageNet at the configured epochs; None when this run is that size or larger,
    # or the dataset is not ImageNet-like
    measured_run_s: float | None  # run.json started -> finished
    measured_train_s: float | None  # epochs.csv: mean training wall per epoch (validation excluded)


def plan(train_images: int, val_images: int, rates: tuple[float, float | None], epochs: int) -> Plan:
    train_rate, val_rate = rates
    val_s = val_images / val_rate if val_rate else None
    return Plan(train_images, val_images, train_images / train_rate, val_s, epochs)


def images_per_epoch(steps: pd.DataFrame) -> int:
    """Images one epoch trained, all ranks (the most over the epochs: a resumed run's are equal)."""
    return int(steps.groupby("epoch")["images"].sum().max())


def _run_seconds(run: Mapping) -> float | None:
    try:
        start = datetime.datetime.fromisoformat(run["started"])
        end = datetime.datetime.fromisoformat(run["finished"])
    except (KeyError, TypeError, ValueError):
        return None
    return (end - start).total_seconds()


def project(
    steps: pd.DataFrame, epochs_csv: pd.DataFrame, run: Mapping, metrics: Mapping, *, like_imagenet: bool = True
) -> Projection | None:
    """None without steady training steps (nothing measured to project from); `like_imagenet`
    (imagenet_like of classes.tsv) allows the full-ImageNet projection."""
    rates = steady_rates(steps)
    if not rates:
        return None
    train_rate = sum(rates.values())
    val_rate = metrics.get("images_per_s") or None
    epochs = int(train_setting(run, "epochs") or steps["epoch"].nunique())
    ranks = int(run.get("world_size") or len(rates))
    this = plan(images_per_epoch(steps), int(metrics.get("images") or 0), (train_rate, val_rate), epochs)
    full = None
    if like_imagenet and this.train_images < IMAGENET_TRAIN:
        full = plan(IMAGENET_TRAIN, IMAGENET_VAL, (train_rate, val_rate), epochs)
    wall = epochs_csv["wall_s"].mean() if "wall_s" in epochs_csv and not epochs_csv.empty else None
    return Projection(train_rate, val_rate, ranks, this, full, _run_seconds(run), wall)
