"""Findings on whether the run learned at all: too few optimizer steps per epoch, validation accuracy
at chance, one class predicted for most images.

A small custom dataset with the reference config (batch_size auto, global_batch 256, 150 images)
trained one step per epoch, ended at chance with every image predicted as one class, and the report
said nothing of it.  Pure functions over the parsed outputs, like diagnosis.py; thresholds come from
the `report` block.
"""

from __future__ import annotations

from typing import Mapping

import pandas as pd

from rectrain import chance
from rectrain.advice import MORE_STEPS_FIX
from rectrain.report.diagnosis import Finding
from rectrain.report.inputs import RunData
from rectrain.report.stats import train_setting
from rectrain.settings import ReportSettings


def optimizer_steps_per_epoch(steps: pd.DataFrame, run: Mapping) -> int | None:
    """Optimizer steps one epoch took on rank 0 (micro-steps over train.grad_accum, the most over the
    epochs: a resumed epoch may be partial); None without step telemetry."""
    if steps.empty:
        return None
    rank0 = steps[steps["rank"] == steps["rank"].min()]
    micro = int(rank0.groupby("epoch")["step"].count().max())
    return -(-micro // int(run.get("grad_accum") or 1))


def train_images(data: RunData) -> int | None:
    packed = (data.manifests.get("train") or {}).get("packed")
    return int(packed) if packed else None


def suggested_batch(images: int | None, world_size: int, min_steps: int) -> int | None:
    """The per-device batch that gives `min_steps` optimizer steps per epoch on `images` images."""
    return max(1, images // (world_size * min_steps)) if images else None


def few_steps(data: RunData, report: ReportSettings) -> Finding | None:
    run = data.run
    n = optimizer_steps_per_epoch(data.steps, run)
    limit = int(report.min_steps_per_epoch)
    if n is None or n >= limit:
        return None
    world, images = int(run.get("world_size") or 1), train_images(data)
    batch = suggested_batch(images, world, limit)
    plan = (
        f"batch {run.get('batch_size')} per device x grad_accum {run.get('grad_accum')} x {world} process(es) = "
        f"global batch {run.get('global_batch')}"
    )
    over = f" over {images} train images" if images else ""
    padded = run.get("padding_per_epoch")
    padded = f" ({padded} images repeated per epoch to fill the last batch)" if padded else ""
    fix = f"Set train.batch_size: {batch}" if batch else "Set a smaller train.batch_size"
    if run.get("recipe_global_batch") and batch:  # a set global batch is kept whatever the batch_size
        fix = f"Set train.global_batch: {batch * world} (a preset's is ImageNet's: a small set needs a smaller one)"
    return Finding(
        id="few_steps",
        severity="critical" if n <= 1 else "warning",
        title=f"Only {n} optimizer step(s) per epoch: too few to learn",
        measured=f"{n} optimizer step(s) per epoch: {plan}{over}{padded}",
        threshold=f"report.min_steps_per_epoch = {limit} optimizer steps per epoch",
        fix=(
            f"{fix} (train.lr scales with the global batch), or with train.batch_size: auto a smaller "
            f"train.global_batch (batch_size auto now caps the batch of a small dataset itself: "
            "rectrain.train.batchplan.MIN_STEPS_PER_EPOCH). More epochs help too (train.epochs)."
        ),
    )


def chance_level(per_class: pd.DataFrame, n_classes: int) -> float:
    """The top-1 a model reaches without learning: the larger of 1 / classes and the share of the
    largest val class (always answering it: rectrain.chance.level)."""
    if per_class.empty or "images" not in per_class:
        return 1.0 / max(n_classes, 1)
    return chance.level(pd.to_numeric(per_class["images"], errors="coerce").fillna(0).astype(int).tolist())


def at_chance(data: RunData, report: ReportSettings, steps_finding: Finding | None) -> Finding | None:
    top1 = data.metrics.get("top1")
    n_classes = len(data.per_class) or len(data.classes)
    if top1 is None or n_classes < 2:
        return None
    chance = chance_level(data.per_class, n_classes)
    factor = float(report.chance_factor)
    if top1 > factor * chance:
        return None
    epochs = len(data.epochs) or data.run.get("epochs")
    why = (
        "the run made too few optimizer steps (see the finding above)"
        if steps_finding
        else "the run was too short or the learning rate does not suit the batch"
    )
    return Finding(
        id="chance_accuracy",
        severity="critical",
        title="Validation accuracy is at chance after training: the model learned nothing usable",
        measured=(
            f"val top-1 {100 * top1:.1f} % on {data.metrics.get('images')} val images after {epochs} epoch(s); "
            f"chance is {100 * chance:.1f} % ({n_classes} classes; the larger of 1 / classes and the largest "
            f"class's share of the val images)"
        ),
        threshold=f"top-1 at most report.chance_factor = {factor:g} x chance",
        fix=f"Most likely {why}. {MORE_STEPS_FIX}" + slow_setting_note(data.run),
    )


def slow_setting_note(run: Mapping) -> str:
    """The long-run recipe settings this run used that slow a short one, with the value to try
    (bench/RESULTS.md, "Defaults on a small real-image set"); "" when it used none."""
    if train_setting(run, "zero_init_residual") is True:
        return (
            " This run zero-initialised each residual branch (train.zero_init_residual: true, an ImageNet "
            "long-run setting), which slows a short run on a small set: try train.zero_init_residual: false "
            "(the schema's default; bench/RESULTS.md)."
        )
    return ""


def class_label(row: Mapping) -> str:
    name = str(row.get("name") or "")
    return f"{row.get('wnid')}" + (f" ({name})" if name else "")


def one_class(data: RunData, report: ReportSettings) -> Finding | None:
    pc = data.per_class
    if pc.empty or "predicted" not in pc or len(pc) < 2:
        return None
    predicted = pd.to_numeric(pc["predicted"], errors="coerce")
    images = pd.to_numeric(pc["images"], errors="coerce")
    total = float(predicted.sum())
    if total <= 0:
        return None
    top = int(predicted.idxmax())
    share, truth = float(predicted[top] / total), float(images[top] / images.sum())
    limit = float(report.one_class_share)
    if share <= limit or share <= 2 * truth:  # a class that truly is most of the val set is no collapse
        return None
    return Finding(
        id="one_class_predicted",
        severity="critical",
        title=f"One class is predicted for {100 * share:.0f} % of the val images",
        measured=(
            f"the model answered {class_label(pc.loc[top])} for {int(predicted[top])} of {int(total)} val images "
            f"({100 * share:.1f} %); that class is {100 * truth:.1f} % of them (per_class.csv's predicted column)"
        ),
        threshold=f"report.one_class_share = {100 * limit:.0f} % of the val images (and twice the class's own share)",
        fix=(
            "The network collapsed to one output: usually too few optimizer steps or a learning rate too high "
            "for the batch. Train more steps (a smaller train.batch_size on a small dataset, more train.epochs) "
            "or lower train.lr; check that the classes are balanced in the train split."
        ),
    )


def findings(data: RunData, report: ReportSettings) -> list[Finding]:
    """The learning findings of this run (none when it learned)."""
    steps = few_steps(data, report)
    return [f for f in (steps, at_chance(data, report, steps), one_class(data, report)) if f is not None]
