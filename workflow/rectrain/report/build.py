"""Assemble the report: numbers from the stage outputs, seaborn plots, diagnosis, rendered through
an autoescaping Jinja2 template (class names and paths are user data)."""

from __future__ import annotations

import math
from pathlib import Path

import jinja2
import pandas as pd
import yaml

from rectrain.data.subset import imagenet_1k, shipped
from rectrain.log import duration
from rectrain.report import efficiency, learning, plots, projection, provenance, reads, resolutions, slowdown
from rectrain.report.diagnosis import diagnose
from rectrain.report.inputs import RunData
from rectrain.report.stats import (
    data_wait_share_by_rank,
    gpu_memory_peak,
    gpu_util_mean,
    overall_data_wait_share,
    steady_steps,
    train_setting,
)
from rectrain.settings import IndexSettings, RecipeSettings, ReportSettings

TEMPLATES = Path(__file__).parent / "templates"
# The pipeline's own checkout (workflow/rectrain/report/ -> repo root): its commit is the code that
# made the numbers, wherever the workdir (--directory) is.
CODE_REPO = Path(__file__).resolve().parents[3]
# Epoch tables up to this long are shown whole; longer ones (90 epochs of ImageNet) show the first and
# last few, every k-th and the best epoch, with the full table behind a toggle.
EPOCHS_SHOWN = 12
EPOCH_ENDS = 3


def num(value, spec: str = ".1f", missing: str = "-") -> str:
    """Format a number for the tables; None/NaN/non-numbers show as `missing`."""
    if value is None or isinstance(value, str):
        return missing if value in (None, "") else value
    try:
        if math.isnan(float(value)):
            return missing
    except (TypeError, ValueError):
        return missing
    return format(value, spec)


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.ChainableUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["num"] = num
    env.filters["duration"] = lambda s: "-" if s is None else duration(s)
    return env


def _span_s(steps: pd.DataFrame) -> float:
    return float(steps["time"].max() - (steps["time"] - steps["wall_s"]).min())


def training_rates(steps: pd.DataFrame, eff: efficiency.Efficiency | None = None) -> dict:
    """img/s of the whole job and per rank from the step telemetry (all steps, wall clock), with each
    rank's steady-state rate against its calibration on synthetic data when `eff` has one."""
    if steps.empty:
        return {"total": None, "per_rank": []}
    span = _span_s(steps)
    shares = data_wait_share_by_rank(steps)
    paired = {r.rank: r for r in eff.per_rank} if eff is not None else {}
    per_rank = []
    for rank, g in steps.groupby("rank"):
        s = steady_steps(g)
        pair = paired.get(int(rank))
        per_rank.append(
            {
                "rank": int(rank),
                "steps": len(g),
                "images": int(g["images"].sum()),
                "img_s": g["images"].sum() / _span_s(g) if _span_s(g) > 0 else None,
                "steady_img_s": pair.real_img_s if pair else None,
                "synthetic_img_s": pair.synthetic_img_s if pair else None,
                "efficiency": pair.ratio if pair else None,
                # DeepLearningExamples' compute_ips: the rate if the loader never made this rank wait
                "compute_img_s": s["images"].sum() / s["compute_s"].sum() if s["compute_s"].sum() > 0 else None,
                "step_ms": 1000 * s["wall_s"].mean(),
                "wait_ms": 1000 * s["data_wait_s"].mean(),
                "compute_ms": 1000 * s["compute_s"].mean(),
                "wait_share": 100 * shares.get(rank, float("nan")),
            }
        )
    compute = [r["compute_img_s"] for r in per_rank if r["compute_img_s"]]
    return {
        "total": steps["images"].sum() / span if span > 0 else None,
        "per_rank": per_rank,
        # a rank's compute time includes waiting in the gradient all-reduce for ranks that were
        # still waiting on data, so the fastest rank's rate is the closest to pure compute
        "compute_total": max(compute) * len(per_rank) if compute else None,
    }


def headline(data: RunData) -> dict:
    """The page's one headline throughput (projection.HEADLINE): the finished epochs' wall-clock rate,
    else (no epoch finished yet) the steady rate so far, and its definition; `steady`: all ranks'
    steady rate (each epoch's first step left out), labelled as such beside it."""
    rate = projection.wall_clock_rate(data.epochs)
    steady = sum(efficiency.steady_rates(data.steps).values()) or None
    return {
        "img_s": rate if rate is not None else steady,
        "wall_clock": rate is not None,
        "steady": steady,
        "definition": projection.HEADLINE,
    }


def efficiency_headline(eff: efficiency.Efficiency, steps: pd.DataFrame) -> dict:
    """The Throughput section's headline: input efficiency overall (at most 1: above it, what was
    measured and its spread say it is noise) and the data-wait share beside it."""
    wait = overall_data_wait_share(steps)
    cal = eff.calibration or {}
    return {
        "measured": eff.measured,
        "ratio": eff.ratio,
        "shown": eff.shown,
        "above_one": eff.above_one,
        "spread": efficiency.epoch_spread(steps, eff),
        "real": eff.real_total,
        "synthetic": eff.synthetic_total,
        "note": eff.note,
        "wait_pct": 100 * wait if wait is not None else None,
        "calibration": cal if eff.measured else None,
    }


def utilization(system: pd.DataFrame) -> dict:
    peaks, util = gpu_memory_peak(system), gpu_util_mean(system)
    gpus = [
        {
            "index": i,
            "util": util.get(i),
            "mem_used_gb": peaks[i][0] / 1024 if i in peaks else None,
            "mem_total_gb": peaks[i][1] / 1024 if i in peaks else None,
        }
        for i in sorted(set(peaks) | set(util))
    ]

    def stat(col, fn):
        return fn(system[col].dropna()) if col in system and not system[col].dropna().empty else None

    return {
        "gpus": gpus,
        "samples": len(system),
        "cpu_mean": stat("cpu_percent", pd.Series.mean),
        "job_cpu_mean": stat("job_cpu_percent", pd.Series.mean),  # the run's own processes (same scale)
        "iowait_mean": stat("iowait_percent", pd.Series.mean),
        "iowait_p90": stat("iowait_percent", lambda s: s.quantile(0.9)),
        "read_mean": stat("disk_read_mb_s", pd.Series.mean),
        "read_max": stat("disk_read_mb_s", pd.Series.max),
        "rss_max": stat("rss_mb", pd.Series.max),
    }


def class_table(per_class: pd.DataFrame, classes: pd.DataFrame) -> pd.DataFrame:
    """per_class.csv with numeric accuracy and the name of the class each one is most confused with."""
    if per_class.empty:
        return per_class
    pc = per_class.copy()
    pc["accuracy"] = pd.to_numeric(pc["accuracy"], errors="coerce")
    names = (
        dict(zip(classes["wnid"].astype(str), classes["name"].astype(str), strict=True)) if not classes.empty else {}
    )
    pc["most_confused_name"] = pc["most_confused_wnid"].astype(str).map(names).fillna("")
    return pc


def class_views(table: pd.DataFrame, n: int) -> dict[str, pd.DataFrame]:
    """Worst and best n classes (at most half the classes each), the n most-confused pairs (a class and the one it is most often taken
    for, by count), and every class sorted by wnid (the class finder)."""
    if table.empty:
        return {k: table for k in ("worst", "best", "confused", "all")}
    count = pd.to_numeric(table["most_confused_count"], errors="coerce")
    images = pd.to_numeric(table["images"], errors="coerce")
    pairs = table.assign(count=count, share=count / images.where(images > 0))
    ends = min(n, len(table) // 2)  # with few classes, each half: the worst and the best never share a row
    worst = table.sort_values(["accuracy", "label"]).head(ends)
    # the best among the others: classes of equal accuracy (all at 100 %, say) are not listed as both
    best = table.drop(worst.index).sort_values(["accuracy", "label"], ascending=[False, True]).head(ends)
    return {
        "worst": worst,
        "best": best,
        "confused": pairs[pairs["count"] > 0].sort_values(["count", "label"], ascending=[False, True]).head(n),
        "all": table.sort_values(["wnid", "label"]),
    }


def epoch_val_px(run: dict) -> int | None:
    """The centre crop of each epoch's validation: train.val_resolution, null = train.image_size."""
    return train_setting(run, "val_resolution") or train_setting(run, "image_size")


def epoch_rows(epochs: pd.DataFrame) -> tuple[list[dict], list[dict]]:
    """(every epoch, the rows shown): short runs whole; long runs the first and last EPOCH_ENDS
    epochs, every k-th (about EPOCHS_SHOWN rows in all) and the best val top-1, each shown row marked
    with the number of epochs left out before it. The best epoch is marked in both."""
    if epochs.empty:
        return [], []
    e = epochs.sort_values("epoch").reset_index(drop=True)
    e["best"] = False
    if "val_single_view_top1" in e and e["val_single_view_top1"].notna().any():
        e.loc[e["val_single_view_top1"].idxmax(), "best"] = True
    every = e.assign(skipped=0).to_dict("records")
    if len(e) <= EPOCHS_SHOWN:
        return every, every
    k = -(-len(e) // (EPOCHS_SHOWN - 2 * EPOCH_ENDS))  # ceil
    keep = set(range(EPOCH_ENDS)) | set(range(len(e) - EPOCH_ENDS, len(e))) | set(range(k - 1, len(e), k))
    keep |= set(e.index[e["best"]])
    rows, last = [], -1
    for i in sorted(keep):
        rows.append({**every[i], "skipped": i - last - 1})
        last = i
    return every, rows


# With this many classes or fewer, top-5 holds every class (or nearly): 100 % says nothing.
TOP5_MIN_CLASSES = 6


def class_columns(classes: pd.DataFrame) -> dict:
    """What the class tables' two text columns hold: WordNet ids and names (ImageNet), or the class
    folder names of a dataset of one's own (classes.tsv's wnid column holds `cat`, name is empty)."""
    wnids = classes["wnid"].astype(str) if "wnid" in classes else pd.Series(dtype=str)
    names = classes["name"].astype(str) if "name" in classes else pd.Series(dtype=str)
    is_wnid = not wnids.empty and bool(wnids.str.match(projection.WNID).all())
    return {"id": "wnid" if is_wnid else "class (folder)", "names": bool((names != "").any())}


def resumed(run: dict) -> dict | None:
    """Where a resumed run continued from (run.json's resumed_from_epoch, resumed_despite, and
    diverged_before: the run stopped on divergence, rectrain.train.lifecycle.divergence); None when it started at
    epoch 0."""
    start = run.get("resumed_from_epoch")
    if not start:
        return None
    return {
        "epoch": int(start),
        "after": int(start) - 1,
        "despite": list(run.get("resumed_despite") or []),
        "diverged": run.get("diverged_before"),
    }


def world_size_changes(run: dict) -> list[str]:
    """Each world size the run trained with, from the epoch it began (run.json's world_sizes), in words;
    empty when it never changed."""
    sizes = run.get("world_sizes") or []
    if len(sizes) < 2:
        return []
    return [
        f"epoch {w['epoch']}: {w['world_size']} process(es), {w['batch_size']} x grad_accum {w['grad_accum']}"
        for w in sizes
    ]


def own_usage(data: RunData) -> dict[str, dict]:
    """Stage name (as the benchmark rows name it) -> the CPU and memory the stage measured of its own
    processes (rectrain.usage), where its output records it."""
    found = {f"pack {split}": m.get("usage") for split, m in data.manifests.items()}
    found.update({"train": data.run.get("usage"), "evaluate": data.metrics.get("usage")})
    return {stage: u for stage, u in found.items() if u}


def stage_rows(data: RunData) -> list[dict]:
    """The Stages table: Snakemake's benchmark per stage, with CPU time and peak RSS replaced by the
    stage's own measurement where it has one (Snakemake samples every 30 s, from the wrapper shell
    on: a short stage reads as that shell)."""
    own = own_usage(data)
    rows = []
    for row in data.benchmarks.to_dict("records"):
        u = own.get(row["rule"])
        if u:
            row = {**row, "cpu_time": u["cpu_s"], "max_rss": u["max_rss_mb"], "measured_by": u["measured_by"]}
        else:
            row = {**row, "measured_by": "Snakemake benchmark (samples every 30 s)"}
        rows.append(row)
    return rows


def summary(data: RunData, dataset: str, rates: dict) -> dict:
    run, metrics, bench = data.run, data.metrics, data.benchmarks
    n_classes = int(metrics.get("num_classes") or len(data.per_class) or len(data.classes))
    devices = run.get("devices") or []
    return {
        "dataset": dataset,
        "model": run.get("model"),
        "check": data.check,  # the check stage's report.json, once it has run
        "devices": ", ".join(map(str, devices)) or "-",
        "world_size": run.get("world_size"),
        "nodes": run.get("nodes"),
        "loader": run.get("loader"),
        "decode_path": run.get("decode_path"),
        "augment": run.get("augment"),  # train.augment.policy as it ran (absent from older run.json: none)
        "compiled": run.get("compiled"),
        "precision": run.get("precision"),
        "batch_size": run.get("batch_size"),
        "grad_accum": run.get("grad_accum"),
        "global_batch": run.get("global_batch"),
        "image_size": run.get("image_size"),
        "epochs": run.get("epochs", len(data.epochs)),
        "top1": 100 * metrics["top1"] if metrics.get("top1") is not None else None,
        # params and FLOPs at the headline test resolution (rectrain.modelcost), its unit stated
        "cost": metrics.get("cost"),
        # a branch (train.resume_from): the run and checkpoint it started from
        "parent": run.get("parent"),
        # train.ema: the raw and the averaged weights, each measured (metrics.json's variants), and epochs.csv's EMA columns
        "variants": metrics.get("variants"),
        "ema_epochs": "ema_val_single_view_top1" in data.epochs
        and data.epochs["ema_val_single_view_top1"].notna().any(),
        "top5": 100 * metrics["top5"] if metrics.get("top5") is not None else None,
        "top5_trivial": 0 < n_classes < TOP5_MIN_CLASSES,
        "n_classes": n_classes,
        "resumed": resumed(run),
        "world_sizes": world_size_changes(run),
        "eval_images": metrics.get("images"),
        "eval_loader": metrics.get("loader"),
        "eval_img_s": metrics.get("images_per_s"),
        # the headline's resolution (absent from a metrics.json written before evaluate.resolutions) and
        # one row per resolution tested, the headline first
        "eval_crop": metrics.get("crop"),
        "eval_resize": metrics.get("resize"),
        "eval_flip_tta": bool(metrics.get("flip_tta")),
        "eval_rows": metrics.get("resolutions") or [],
        # no evaluate stage ran: the dataset has no val split (index.absent_splits)
        "no_val": not data.paths.get("eval") and not metrics,
        "train_img_s": rates["total"],
        "total_wall_s": float(bench["s"].sum()) if not bench.empty and "s" in bench else None,
        "stages": [(r["rule"], r.get("s")) for r in bench.to_dict("records")],
        "image_mpx": image_mpx(data.image_sizes),
    }


def subset_scope(classes: pd.DataFrame, index, demo_classes: int | None = None) -> str | None:
    """What part of its raw set a run of index.classes / index.per_class (the index block's view) saw, in
    words - "100 of 1000 ImageNet classes, at most 260 images per class" - or None for the whole set.
    Of ImageNet's 1000 only for a list shipped for ImageNet (index.classes: imagenet100); of the demo's
    own `demo_classes` for the generated demo (raw null); else as chosen."""
    if index.classes is None and index.per_class is None:
        return None
    wnids = set(classes["wnid"].astype(str)) if "wnid" in classes else set()
    if index.classes is None:
        scope = f"all {len(wnids)} classes"
    elif isinstance(index.classes, str) and index.classes in shipped() and wnids and wnids <= imagenet_1k():
        scope = f"{len(wnids)} of {projection.IMAGENET_CLASSES} ImageNet classes"
    elif demo_classes:
        scope = f"{len(wnids)} of the demo's {demo_classes} classes"
    else:
        scope = f"{len(wnids)} classes chosen by index.classes"
    cap = f", at most {index.per_class} images per class (training; validation whole)" if index.per_class else ""
    return scope + cap


def image_mpx(sizes: pd.DataFrame | None) -> float | None:
    """Mean megapixels of the sampled packed train images (the per-image cost a projection carries over)."""
    if sizes is None or sizes.empty:
        return None
    return float((sizes["width"] * sizes["height"]).mean() / 1e6)


def time_to_accuracy(data: RunData, recipe: RecipeSettings, like_imagenet: bool) -> dict:
    """The Time-to-accuracy section: measured rate and epoch time per training resolution, and for a
    run of a preset (recipe: the recipe block's view) its published top-1 beside full ImageNet's
    projected time on this hardware."""
    rows = projection.per_resolution(data.steps, data.epochs, data.run, like_imagenet=like_imagenet)
    tta = projection.time_to_accuracy(recipe, rows, data.epochs, data.run, data.metrics, like_imagenet=like_imagenet)
    recorded = "resolution" in data.epochs
    return {
        "by_resolution": rows,
        "tta": tta,
        "resolution_recorded": recorded,
        "imagenet_train": projection.IMAGENET_TRAIN,
    }


def storage_warnings(manifests: dict) -> list[str]:
    """The packs' storage warnings, each once (both splits usually share one), without the "WARNING: " that
    marks them in the pack's log: the report's own label says it."""
    warnings = (w for m in manifests.values() if (w := (m.get("storage") or {}).get("warning")))
    return list(dict.fromkeys(w.removeprefix("WARNING: ") for w in warnings))


def _plots(data: RunData, axis, views: dict) -> dict:
    """The report's figures, by name (rectrain.report.plots)."""
    return {
        "throughput": plots.throughput_plot(data.steps, axis),
        "step_split": plots.step_split_plot(data.steps, axis),
        "gpu": plots.gpu_plot(data.system, axis),
        "cpu_io": plots.cpu_io_plot(data.system, axis),
        "learning": plots.learning_plot(data.epochs),
        "classes": plots.classes_plot(views["worst"], views["best"]),
        "stages": plots.stages_plot(data.benchmarks),
    }


def findings_of(data: RunData, report: ReportSettings) -> list:
    """The diagnosis (rectrain.report.diagnosis) with the findings on whether the run learned
    (learning), on the training reads (reads) and on epochs other processes slowed (slowdown)."""
    return diagnose(
        data.steps,
        data.system,
        data.run,
        data.manifests,
        report,
        image_sizes=data.image_sizes,
        learned=[*learning.findings(data, report), *reads.findings(data.run, report)],
        paced=[f for f in [slowdown.other_processes(data.steps, data.system, report)] if f],
    )


def build(
    data: RunData,
    report: ReportSettings,
    *,
    recipe: RecipeSettings,
    index: IndexSettings,
    dataset: str,
    shown: dict,
    repo: Path | str = CODE_REPO,
    live: dict | None = None,
) -> str:
    """The report as one self-contained HTML string, from the blocks it reads (report, recipe, index: their
    views) and the dataset's name; shown: the whole config as completed, printed as YAML (no key of it is
    read); live: an unfinished run's banner (inprogress)."""
    findings = findings_of(data, report)
    axis = plots.time_axis(data.steps, data.system)
    eff = efficiency.input_efficiency(data.steps, data.run)
    rates = training_rates(data.steps, eff)
    views = class_views(class_table(data.per_class, data.classes), int(report.classes_shown))
    all_epochs, shown_epochs = epoch_rows(data.epochs)
    like_imagenet = projection.imagenet_like(data.classes)
    context = {
        "title": report.title,
        "like_imagenet": like_imagenet,
        "summary": summary(data, dataset, rates),
        "subset": subset_scope(
            data.classes, index, (shown.get("demo") or {}).get("classes") if shown.get("raw") is None else None
        ),
        "projection": projection.project(data.steps, data.epochs, data.run, data.metrics, like_imagenet=like_imagenet),
        "headline": headline(data),
        **time_to_accuracy(data, recipe, like_imagenet),
        "class_columns": class_columns(data.classes),
        "findings": findings,
        "at_chance": data.metrics.get("at_chance"),  # the evaluate stage's verdict: the first card
        "rates": rates,
        "eff": efficiency_headline(eff, data.steps),
        "reads": reads.summary(data.run),
        "util": utilization(data.system),
        "resolutions": resolutions.resolution_rows(data.epochs, data.steps, data.run),
        "epochs": all_epochs,
        "epoch_summary": shown_epochs,
        "epochs_collapsed": len(shown_epochs) < len(all_epochs),
        "epoch_val_px": epoch_val_px(data.run),
        "classes": {name: view.to_dict("records") for name, view in views.items()},
        "n_classes": len(data.per_class),
        "manifests": data.manifests,
        "storage_warnings": storage_warnings(data.manifests),
        "stages": stage_rows(data),
        "plot_x": axis.words if axis else "",
        "plots": _plots(data, axis, views),
        "config_yaml": yaml.safe_dump(shown, sort_keys=False, default_flow_style=False),
        "prov": provenance.collect(data.run, repo),
        "run": data.run,
        "paths": data.paths,
    }
    return environment().get_template("report.html.j2").render(**context, live=live)
