"""results/<dataset>/compare.html: every run of a dataset side by side (issue 50).

    python -m rectrain.report.compare --configs-json '{"<run>": <its whole config>, ...}' \
        --runs results/<ds>/<run> ... --out results/<ds>/compare.html

The compare rule runs it once every run's report is built; run by hand, it also shows runs still
training, stopped or diverged, from their live telemetry (as the live report reads it).  One page in
the report's style (its template's CSS, jinja2 autoescaping, seaborn plots embedded):

- the run table: model, parameters and FLOPs at the test resolution (rectrain.modelcost: the unit is
  stated), the recipe and its key settings, epochs, top-1/top-5 at each test resolution, img/s,
  GPU-hours, wall time, and finished / stopped / diverged / training;
- val top-1 per epoch overlaid for every run, and top-1 against wall time;
- accuracy against throughput, its Pareto front marked;
- the config differences between the runs, key by key.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.ticker import MaxNLocator

from rectrain import atomic, cli
from rectrain.log import utc_now
from rectrain.report import plots
from rectrain.report.build import environment
from rectrain.report.inputs import read_complete_csv
from rectrain.train.lifecycle.status import DIVERGED, FINISHED, STOPPED
from rectrain.train.telemetry import EPOCH_COLUMNS, LIVE_RUN_JSON

logger = logging.getLogger(__name__)

# The key settings shown beside each run's recipe (train keys; the rest are in the differences table).
KEY_SETTINGS = ("optimizer", "lr", "global_batch", "batch_size", "epochs", "image_size", "precision")


@dataclass
class RunView:
    """One run as far as it got: its status, run.json, epochs and evaluation."""

    name: str
    folder: Path
    status: str  # finished, stopped, diverged, training, not started
    run: dict = field(default_factory=dict)
    epochs: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=EPOCH_COLUMNS))
    metrics: dict = field(default_factory=dict)
    shown: dict = field(default_factory=dict)  # its config, as the page shows it


def _json(path: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return {}


def status_of(train: Path, run: dict, metrics: dict) -> str:
    """finished (published and evaluated), diverged, stopped (its checkpoint written on a stop),
    training (telemetry only), or not started."""
    ck = train / "checkpoints"
    if (ck / FINISHED).is_file() and run.get("finished"):
        return "finished" if metrics or not (train.parent / "eval").exists() else "finished, not evaluated"
    if (ck / DIVERGED).is_file():
        return "diverged"
    if (ck / STOPPED).is_file():
        return "stopped"
    return "training" if run else "not started"


def load_run(name: str, folder: Path, shown: dict | None = None) -> RunView:
    """The run in results/<ds>/<name>/: published outputs first, else the live telemetry; `shown`: its
    config as the page shows it (the compare rule's), else its train block from run.json."""
    train = folder / "train"
    run = _json(train / "run.json") or _json(train / "telemetry" / LIVE_RUN_JSON)
    published = train / "epochs.csv"
    epochs = read_complete_csv(published if published.is_file() else train / "telemetry" / "epochs.csv", EPOCH_COLUMNS)
    metrics = _json(folder / "eval" / "metrics.json")
    shown = shown or {"train": run.get("config") or {}}
    return RunView(name, folder, status_of(train, run, metrics), run, epochs, metrics, shown)


def gpus_of(run: dict) -> int:
    """The GPUs a run trained on (0 on CPU processes): its devices on each node."""
    devices = {str(d) for d in run.get("devices") or [] if not str(d).startswith("cpu")}  # ranks may share one
    return len(devices) * int(run.get("nodes") or 1)


def row(view: RunView) -> dict:
    """The run table's row (see the module doc)."""
    run, e, m, train = view.run, view.epochs, view.metrics, view.shown.get("train") or {}
    wall = float(e["wall_s"].sum()) if not e.empty else None
    rates = e["images_per_s"].dropna() if not e.empty else pd.Series(dtype=float)
    gpus = gpus_of(run)
    cost = m.get("cost") or {}
    latest = e.sort_values("epoch").iloc[-1] if not e.empty else None
    return {
        "name": view.name,
        "status": view.status,
        "model": run.get("model") or train.get("model"),
        "params_m": cost["params"] / 1e6 if cost.get("params") is not None else None,
        "gflops": cost["flops"] / 1e9 if cost.get("flops") is not None else None,
        "gmacs": cost["flops"] / 2e9 if cost.get("flops") is not None else None,
        "cost_size": cost.get("image_size"),
        "recipe": (view.shown.get("recipe") or {}).get("name"),
        "settings": {k: train[k] for k in KEY_SETTINGS if train.get(k) is not None},
        "epochs_done": int(latest["epoch"]) + 1 if latest is not None else 0,
        "epochs": run.get("epochs") or train.get("epochs"),
        "latest_top1": 100 * float(latest["val_single_view_top1"])
        if latest is not None and pd.notna(latest["val_single_view_top1"])
        else None,
        "resolutions": [
            {"crop": r["crop"], "top1": 100 * r["top1"], "top5": 100 * r["top5"]} for r in m.get("resolutions") or []
        ],
        "top1": 100 * m["top1"] if m.get("top1") is not None else None,
        "top5": 100 * m["top5"] if m.get("top5") is not None else None,
        "img_s": float(rates.mean()) if not rates.empty else None,
        "gpus": gpus,
        "gpu_hours": wall * gpus / 3600 if wall is not None else None,
        "wall_s": wall,
        "parent": run.get("parent"),
    }


def flatten(tree: dict, prefix: str = "") -> dict:
    """{dotted.key: value} of a nested dict."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def differences(configs: dict[str, dict]) -> list[dict]:
    """The keys whose value differs between the runs' configs, each with every run's value (the run's
    name itself left out)."""
    flat = {name: flatten(c) for name, c in configs.items()}
    keys = sorted({k for f in flat.values() for k in f} - {"run"})
    found = []
    for key in keys:
        values = [json.dumps(f.get(key), sort_keys=True, default=str) for f in flat.values()]
        if len(set(values)) > 1:
            found.append({"key": key, "values": [flat[name].get(key, "(unset)") for name in flat]})
    return found


def curves(views: list[RunView]) -> pd.DataFrame:
    """Every run's epochs, long: run, epoch (1-based), val top-1 (%), wall time (h) at its end."""
    frames = []
    for v in views:
        e = v.epochs.sort_values("epoch")
        if e.empty:
            continue
        frames.append(
            pd.DataFrame(
                {
                    "run": v.name,
                    "epoch": e["epoch"].astype(int) + 1,
                    "val top-1 (%)": 100 * e["val_single_view_top1"].astype(float),
                    "wall time (h)": e["wall_s"].astype(float).cumsum() / 3600,
                }
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def curves_plot(long: pd.DataFrame) -> str | None:
    """Val top-1 per epoch, and against wall time, every run overlaid."""
    if long.empty or long["val top-1 (%)"].isna().all():
        return None
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=plots.WIDE)
    sns.lineplot(long, x="epoch", y="val top-1 (%)", hue="run", marker="o", ax=by_epoch)
    sns.lineplot(long, x="wall time (h)", y="val top-1 (%)", hue="run", marker="o", ax=by_time, legend=False)
    by_epoch.set(title="Val top-1 per epoch (single view)", ylim=(0, None))
    by_time.set(title="Val top-1 against wall time", ylim=(0, None))
    by_time.xaxis.set_major_locator(MaxNLocator(5))  # short runs' hours have long tick labels
    fig.tight_layout()
    return plots.to_data_uri(fig)


def pareto(rows: list[dict]) -> list[str]:
    """The runs no other run beats on both top-1 and img/s."""
    pts = [(r["name"], r["top1"], r["img_s"]) for r in rows if r["top1"] is not None and r["img_s"] is not None]
    return [
        n for n, a, s in pts if not any((a2 >= a and s2 >= s) and (a2 > a or s2 > s) for n2, a2, s2 in pts if n2 != n)
    ]


def pareto_plot(rows: list[dict], front: list[str]) -> str | None:
    """Final top-1 against training img/s, one point per run, the Pareto front joined."""
    pts = pd.DataFrame([r for r in rows if r["top1"] is not None and r["img_s"] is not None])
    if pts.empty:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    sns.scatterplot(pts, x="img_s", y="top1", hue="name", s=80, ax=ax)
    on = pts[pts["name"].isin(front)].sort_values("img_s")
    ax.plot(on["img_s"], on["top1"], linestyle="--", color="grey", label="Pareto front")
    for _, r in pts.iterrows():
        ax.annotate(r["name"], (r["img_s"], r["top1"]), textcoords="offset points", xytext=(4, 4), fontsize="small")
    ax.set(xlabel="training img/s", ylabel="top-1 (%)", title="Accuracy against throughput")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return plots.to_data_uri(fig)


def build(views: list[RunView], dataset: str) -> str:
    """The page's HTML."""
    from rectrain.modelcost import UNIT

    rows = [row(v) for v in views]
    front = pareto(rows)
    page = environment().get_template("compare.html.j2")
    return page.render(
        title="rectrain comparison",
        dataset=dataset,
        generated=utc_now(),
        rows=rows,
        crops=sorted({r["crop"] for row_ in rows for r in row_["resolutions"]}),
        front=front,
        training=[r for r in rows if r["status"] in ("training", "stopped")],
        curves=curves_plot(curves(views)),
        pareto=pareto_plot(rows, front),
        differences=differences({v.name: v.shown for v in views}),
        names=[v.name for v in views],
        unit=UNIT,
    )


def _arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--configs-json", default="{}", help="{run name: its whole config} (the rule's params)")
    ap.add_argument("--runs", nargs="+", required=True, help="the runs' folders, results/<dataset>/<run>")
    ap.add_argument("--out", required=True)


def _run(args: argparse.Namespace, cfg: None) -> None:
    t = time.perf_counter()
    configs = json.loads(args.configs_json)
    folders = [Path(f) for f in args.runs]
    views = [load_run(f.name, f, configs.get(f.name)) for f in folders]
    dataset = folders[0].parent.name
    html = build(views, dataset)
    out = atomic.write_text(args.out, html)
    logger.info("%s: %d run(s) (%.2f MB, %.1f s)", out, len(views), len(html) / 1e6, time.perf_counter() - t)


def main(argv=None) -> int:
    return cli.main("compare", None, _arguments, _run, argv, errors={FileNotFoundError: 1})


if __name__ == "__main__":
    cli.end(main())
