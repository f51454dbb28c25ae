"""Time projection: what the measured throughput means for the configured run and for full ImageNet.

The number a user with two GPUs and a deadline wants first.  Computed from measured numbers only:
  training   the report's one headline throughput (`wall_clock_rate`, HEADLINE): the finished epochs'
             images over their wall clock (epochs.csv) - a slow stretch of the run counts as it took -,
             over the images one epoch trains (steps.csv, padding included); before an epoch has
             finished (the live report), the steady img/s of the steps so far, and the page says so
  validation the evaluate stage's img/s (metrics.json) over the val images, once per epoch
and, for an ImageNet-like dataset only (classes named by WordNet ids: ImageNet, or a subset of its
classes or images), the same rates over 1,281,167 train images and 50,000 val images, for the configured
epochs (the loaders' padding to full batches, under ranks x batch images, is left out).  Checkpoint writing is not in it; the run's measured wall time stands beside it as a check.
Per training resolution (epochs.csv's `resolution`, else train.image_size): the wall-clock img/s of the
epochs trained there (steady img/s without a finished one) and their time per epoch, and for a run of a preset (config/recipes/, the config's `recipe` block) the source's
published top-1 beside full ImageNet's time on this hardware, each epoch at its resolution's measured rate.
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
from rectrain.settings import RecipeSettings

# The definition the page prints beside the headline throughput (`wall_clock_rate`).
HEADLINE = (
    "images trained per second of the finished epochs' wall clock: all ranks, each epoch from its start to its "
    "last step (loader start-up included; the validation and checkpoint after it left out)"
)
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


def wall_clock_rate(epochs_csv: pd.DataFrame) -> float | None:
    """The report's headline throughput (HEADLINE): the finished epochs' images (epochs.csv: images_per_s
    x wall_s, all ranks) over their wall time; None before an epoch has finished."""
    if epochs_csv.empty or not {"images_per_s", "wall_s"} <= set(epochs_csv):
        return None
    rate = pd.to_numeric(epochs_csv["images_per_s"], errors="coerce")
    wall = pd.to_numeric(epochs_csv["wall_s"], errors="coerce")
    ok = rate.notna() & wall.notna() & (wall > 0)
    return float((rate[ok] * wall[ok]).sum() / wall[ok].sum()) if ok.any() else None


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
    train_img_s: float  # the finished epochs' wall clock (HEADLINE), else steady: `wall_clock`
    val_img_s: float | None  # the evaluate stage's
    ranks: int
    run: Plan  # this run as configured
    imagenet: Plan | None  # full ImageNet at the configured epochs; None when this run is that size or larger,
    # or the dataset is not ImageNet-like
    measured_run_s: float | None  # run.json started -> finished
    measured_train_s: float | None  # epochs.csv: mean training wall per epoch (validation excluded)
    wall_clock: bool = True  # train_img_s is the finished epochs' wall-clock rate (else no epoch had finished)


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
    measured = wall_clock_rate(epochs_csv)
    train_rate = measured or sum(rates.values())
    val_rate = metrics.get("images_per_s") or None
    epochs = int(train_setting(run, "epochs") or steps["epoch"].nunique())
    ranks = int(run.get("world_size") or len(rates))
    this = plan(images_per_epoch(steps), int(metrics.get("images") or 0), (train_rate, val_rate), epochs)
    full = None
    if like_imagenet and this.train_images < IMAGENET_TRAIN:
        full = plan(IMAGENET_TRAIN, IMAGENET_VAL, (train_rate, val_rate), epochs)
    wall = epochs_csv["wall_s"].mean() if "wall_s" in epochs_csv and not epochs_csv.empty else None
    return Projection(train_rate, val_rate, ranks, this, full, _run_seconds(run), wall, measured is not None)


# --- time to accuracy: per-resolution rates, and a preset's published top-1 beside its projected time ---------


def epoch_resolutions(epochs_csv: pd.DataFrame, run: Mapping, epochs) -> dict[int, int]:
    """The training crop (px) of each of `epochs`: epochs.csv's `resolution` column where it has one
    (progressive resizing records it), else train.image_size; {} when neither says."""
    recorded: dict[int, int] = {}
    if "resolution" in epochs_csv and not epochs_csv.empty:
        pairs = zip(epochs_csv["epoch"], pd.to_numeric(epochs_csv["resolution"], errors="coerce"), strict=True)
        recorded = {int(e): int(r) for e, r in pairs if pd.notna(r)}
    size = train_setting(run, "image_size")
    found = {int(e): recorded.get(int(e), size) for e in epochs}
    return {e: int(r) for e, r in found.items() if r is not None}


@dataclass(frozen=True)
class ResolutionRow:
    """The epochs trained at one resolution: measured rate and time, and the full-ImageNet epoch at that rate."""

    resolution: int
    epochs: int
    train_img_s: float  # measured: the wall-clock rate of its finished epochs (else steady), all ranks
    epoch_s: float | None  # measured: mean training wall per epoch there (epochs.csv wall_s)
    imagenet_epoch_s: float | None  # projected: full ImageNet's train images at train_img_s; None if not ImageNet-like


def per_resolution(
    steps: pd.DataFrame, epochs_csv: pd.DataFrame, run: Mapping, *, like_imagenet: bool = True
) -> list[ResolutionRow]:
    """One ResolutionRow per training resolution the run used, smallest first; [] without steps."""
    if steps.empty:
        return []
    res_of = epoch_resolutions(epochs_csv, run, sorted(steps["epoch"].unique()))
    rows = []
    for res in sorted(set(res_of.values())):
        epochs = [e for e, r in res_of.items() if r == res]
        rates = steady_rates(steps[steps["epoch"].isin(epochs)])
        if not rates:
            continue
        wall, finished = None, epochs_csv
        if "wall_s" in epochs_csv and not epochs_csv.empty:
            finished = epochs_csv[epochs_csv["epoch"].isin(epochs)]
            wall = finished["wall_s"].mean()
        rate = wall_clock_rate(finished) or sum(rates.values())
        full = IMAGENET_TRAIN / rate if like_imagenet else None
        rows.append(ResolutionRow(res, len(epochs), rate, None if pd.isna(wall) else float(wall), full))
    return rows


@dataclass(frozen=True)
class TimeToAccuracy:
    """A preset's published top-1 (config's recipe block) beside this hardware's projected time for full
    ImageNet on this run's schedule of resolutions."""

    recipe: RecipeSettings  # name, published_top1, epochs, source, reference_hardware, reference_minutes
    run_epochs: int
    schedule: tuple[tuple[int, int], ...]  # (resolution, epochs at it), in order of first use
    train_s: float | None  # projected: full ImageNet training, each epoch at its resolution's measured rate
    val_s: float | None  # projected: validating 50,000 images once per epoch at the evaluate stage's rate
    note: str | None  # why there is no projection
    global_batch: int | None = None  # what ran (run.json)
    recipe_global_batch: int | None = None  # what the config asked for (run.json; None: not recorded or none)

    @property
    def batch_differs(self) -> bool:
        """This run averaged another global batch per step than the recipe's: another recipe (its LR scaled)."""
        return (
            None not in (self.global_batch, self.recipe_global_batch) and self.global_batch != self.recipe_global_batch
        )

    @property
    def total_s(self) -> float | None:
        return None if self.train_s is None else self.train_s + (self.val_s or 0.0)

    @property
    def published_pct(self) -> float | None:
        top1 = self.recipe.published_top1
        return None if top1 is None else 100 * top1

    @property
    def shortened(self) -> bool:
        """This run trained another epoch count than the one the top-1 was published for."""
        return bool(self.recipe.epochs) and self.recipe.epochs != self.run_epochs


def schedule_of(res_of: Mapping[int, int]) -> tuple[tuple[int, int], ...]:
    counts: dict[int, int] = {}
    for epoch in sorted(res_of):
        counts[res_of[epoch]] = counts.get(res_of[epoch], 0) + 1
    return tuple(counts.items())


def time_to_accuracy(
    recipe: RecipeSettings,
    rows: list[ResolutionRow],
    epochs_csv: pd.DataFrame,
    run: Mapping,
    metrics: Mapping,
    *,
    like_imagenet: bool,
) -> TimeToAccuracy | None:
    """None for a run without a preset (recipe: the recipe block's view; recipe.name null); else the
    panel, its projection only for an ImageNet-like dataset with a steady rate measured at every
    resolution of the schedule."""
    if not recipe.name:
        return None
    epochs = int(train_setting(run, "epochs") or len(epochs_csv))
    res_of = epoch_resolutions(epochs_csv, run, range(epochs))
    rate = {r.resolution: r.train_img_s for r in rows}
    missing = sorted({r for r in res_of.values() if r not in rate})
    note = None
    if not like_imagenet:
        note = (
            "this dataset is not ImageNet-like (its classes are not WordNet ids): ImageNet's time says nothing about it"
        )
    elif not res_of or missing:
        note = f"no steady training rate measured at {', '.join(f'{r} px' for r in missing) or 'any resolution'}"
    train_s = val_s = None
    if note is None:
        train_s = sum(IMAGENET_TRAIN / rate[r] for r in res_of.values())
        val_rate = metrics.get("images_per_s")
        val_s = epochs * IMAGENET_VAL / val_rate if val_rate else None
    batches = (run.get("global_batch"), run.get("recipe_global_batch"))
    return TimeToAccuracy(recipe, epochs, schedule_of(res_of), train_s, val_s, note, *batches)
