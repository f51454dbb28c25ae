"""Seaborn figures of the run, returned as PNG data URIs so the report is one self-contained file.

Every function returns None when its data is absent (CPU-only runs have no GPU plot), so the template
can say "not measured" instead of showing an empty axis.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # no display on build machines; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from rectrain.report.stats import gpu_indices, steady_steps  # noqa: E402

sns.set_theme(style="whitegrid", context="notebook")
# Class names and paths come from user data: never let matplotlib treat "$...$" as TeX.
plt.rcParams["text.parse_math"] = False

WIDE = (10, 3.6)
# Runs with this many epochs or more are plotted per epoch (bands), shorter ones over time.
EPOCH_BINS_FROM = 10
CPU_SERIES = (("cpu_percent", "CPU busy"), ("iowait_percent", "iowait"))


def to_data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def start_time(steps: pd.DataFrame, system: pd.DataFrame) -> float | None:
    """Common time origin of the run: the start of the first step or the first sample."""
    starts = []
    if not steps.empty:
        starts.append(float((steps["time"] - steps["wall_s"]).min()))
    if not system.empty and "time" in system:
        starts.append(float(system["time"].min()))
    return min(starts) if starts else None


@dataclass(frozen=True)
class Axis:
    """The x axis of the time plots.  A long run (EPOCH_BINS_FROM epochs or more: ImageNet's 90 epochs of
    5005 steps are 900,900 step rows and 60 hours of samples) is drawn per epoch - each row falls in the
    epoch that had started when it was written, validation included - a short one in ~60 time bins.
    Each bin is drawn as its median with a band from its 10th to its 90th percentile, so the picture
    and the page size do not grow with the run."""

    t0: float
    span_s: float
    epoch_starts: pd.Series | None  # start time of each epoch, index = epoch, ascending; None: time bins

    @property
    def label(self) -> str:
        return "epoch" if self.epoch_starts is not None else "time since start (s)"

    @property
    def words(self) -> str:
        """How the plots' alt texts say what a point is."""
        per = "per epoch" if self.epoch_starts is not None else "over time"
        return f"{per} (median and 10-90th percentile band)"

    def bins(self, times: pd.Series) -> pd.Series:
        """The x of each row: its epoch, or the middle of its time bin in seconds since t0."""
        if self.epoch_starts is not None:
            at = np.searchsorted(self.epoch_starts.to_numpy(), times.to_numpy(), side="right") - 1
            return pd.Series(self.epoch_starts.index.to_numpy()[np.clip(at, 0, None)], index=times.index)
        width = max(1.0, self.span_s / 60.0)  # never finer than a second (steps are coarser than that)
        return ((times - self.t0) // width) * width + width / 2


def time_axis(steps: pd.DataFrame, system: pd.DataFrame) -> Axis | None:
    t0 = start_time(steps, system)
    if t0 is None:
        return None
    ends = [float(steps["time"].max())] if not steps.empty else []
    ends += [float(system["time"].max())] if not system.empty and "time" in system else []
    starts = None
    if not steps.empty and steps["epoch"].nunique() >= EPOCH_BINS_FROM:
        starts = (steps["time"] - steps["wall_s"]).groupby(steps["epoch"]).min().sort_values()
    return Axis(t0, max(ends) - t0, starts)


def bands(frame: pd.DataFrame, x: str, y: str, series: str) -> pd.DataFrame:
    """Per (series, x): the median of y and its 10th and 90th percentiles (columns mid, lo, hi)."""
    q = frame.dropna(subset=[y]).groupby([series, x])[y].quantile([0.1, 0.5, 0.9]).unstack()
    return q.set_axis(["lo", "mid", "hi"], axis=1).reset_index()


def draw_bands(ax, b: pd.DataFrame, x: str, series: str, colours: dict | None = None, order=None) -> None:
    """Each series' median as a line, its 10-90th percentile as a shaded band."""
    for i, name in enumerate(order or sorted(b[series].unique())):
        g = b[b[series] == name].sort_values(x)
        colour = (colours or {}).get(name, sns.color_palette()[i % 10])
        ax.plot(g[x], g["mid"], marker="o", markersize=3, color=colour, label=name)
        ax.fill_between(g[x], g["lo"], g["hi"], color=colour, alpha=0.2, linewidth=0)
    ax.legend(fontsize="small")


def _rank_order(labels) -> list[str]:
    return sorted(set(labels), key=lambda s: (s != "total", int(s.split()[-1]) if s[-1].isdigit() else -1))


def _rank_palette(labels) -> dict[str, tuple]:
    """The same colour for a rank in every plot; 'total' gets the first."""
    colours = sns.color_palette("tab10", 10)
    return {name: colours[0] if name == "total" else colours[(int(name.split()[-1]) + 1) % 10] for name in set(labels)}


def throughput_over_time(steps: pd.DataFrame, axis: Axis) -> pd.DataFrame:
    """img/s per step of each rank, and their sum per (epoch, step) as 'total' (DDP ranks step in
    lockstep), as bands per bin of the axis."""
    s = steps.assign(img_s=steps["images"] / steps["wall_s"].where(steps["wall_s"] > 0))
    per_rank = s.assign(series="rank " + s["rank"].astype(str))[["series", "time", "img_s"]]
    total = s.groupby(["epoch", "step"]).agg(img_s=("img_s", "sum"), time=("time", "max")).reset_index()
    data = pd.concat([total.assign(series="total")[["series", "time", "img_s"]], per_rank], ignore_index=True)
    return bands(data.assign(x=axis.bins(data["time"])), "x", "img_s", "series")


def throughput_plot(steps: pd.DataFrame, axis: Axis | None) -> str | None:
    if steps.empty or axis is None:
        return None
    data = throughput_over_time(steps, axis)
    fig, ax = plt.subplots(figsize=WIDE)
    draw_bands(ax, data, "x", "series", _rank_palette(data["series"]), _rank_order(data["series"]))
    ax.set(xlabel=axis.label, ylabel="images / s", ylim=(0, None), title="Training throughput (median, 10-90 %)")
    return to_data_uri(fig)


def step_split_plot(steps: pd.DataFrame, axis: Axis | None) -> str | None:
    """Left: mean step time per rank split into data wait and compute. Right: data-wait share per bin
    and rank, which shows a stall that starts mid-run (a .rec on a hard disk once the page cache runs out)."""
    if steps.empty or axis is None:
        return None
    s = steady_steps(steps)
    fig, (left, right) = plt.subplots(1, 2, figsize=WIDE, gridspec_kw={"width_ratios": [1, 2]})
    means = s.groupby("rank")[["data_wait_s", "compute_s"]].mean() * 1000
    means.index = [f"rank {r}" for r in means.index]
    means.plot.bar(stacked=True, ax=left, color=sns.color_palette()[3:1:-1], rot=0)
    left.set(ylabel="ms per step", title="Step time split")
    left.legend(["data wait", "compute"], fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    share = 100 * s["data_wait_s"] / s["wall_s"].where(s["wall_s"] > 0)
    data = pd.DataFrame({"x": axis.bins(s["time"]), "share": share, "rank": "rank " + s["rank"].astype(str)})
    b = bands(data, "x", "share", "rank")
    draw_bands(right, b, "x", "rank", _rank_palette(b["rank"]), _rank_order(b["rank"]))
    right.set(xlabel=axis.label, ylabel="data wait (% of step)", ylim=(0, 100), title="Data wait (median, 10-90 %)")
    fig.tight_layout()
    return to_data_uri(fig)


def _long_gpu(system: pd.DataFrame, axis: Axis, kind: str) -> pd.DataFrame:
    frames = []
    x = axis.bins(system["time"])
    for i in gpu_indices(system):
        if kind == "util" and f"gpu{i}_util" in system:
            y = system[f"gpu{i}_util"]
        elif kind == "mem" and f"gpu{i}_mem_used_mb" in system and f"gpu{i}_mem_total_mb" in system:
            y = 100 * system[f"gpu{i}_mem_used_mb"] / system[f"gpu{i}_mem_total_mb"]
        else:
            continue
        frames.append(pd.DataFrame({"x": x, "value": y, "gpu": f"GPU {i}"}))
    return bands(pd.concat(frames, ignore_index=True), "x", "value", "gpu") if frames else pd.DataFrame()


def gpu_plot(system: pd.DataFrame, axis: Axis | None) -> str | None:
    if system.empty or axis is None or not gpu_indices(system):
        return None
    fig, (util_ax, mem_ax) = plt.subplots(1, 2, figsize=WIDE)
    for ax, kind, label in ((util_ax, "util", "GPU util (%)"), (mem_ax, "mem", "GPU memory used (%)")):
        data = _long_gpu(system, axis, kind)
        if not data.empty:
            draw_bands(ax, data, "x", "gpu")
        ax.set(xlabel=axis.label, ylabel=label, ylim=(0, 105), title=label)
    fig.tight_layout()
    return to_data_uri(fig)


def cpu_io_plot(system: pd.DataFrame, axis: Axis | None) -> str | None:
    if system.empty or axis is None:
        return None
    fig, (cpu_ax, disk_ax) = plt.subplots(1, 2, figsize=WIDE)
    x = axis.bins(system["time"])
    cpu = [pd.DataFrame({"x": x, "v": system[c], "s": label}) for c, label in CPU_SERIES if c in system]
    if cpu:
        draw_bands(cpu_ax, bands(pd.concat(cpu, ignore_index=True), "x", "v", "s"), "x", "s")
    cpu_ax.set(xlabel=axis.label, ylabel="% of CPU time", ylim=(0, 105), title="CPU and iowait")
    if "disk_read_mb_s" in system:
        disk = bands(pd.DataFrame({"x": x, "v": system["disk_read_mb_s"], "s": "reads"}), "x", "v", "s")
        if not disk.empty:
            draw_bands(disk_ax, disk, "x", "s", {"reads": sns.color_palette()[2]})
    disk_ax.set(xlabel=axis.label, ylabel="MB/s", ylim=(0, None), title="Disk reads of the .rec device")
    fig.tight_layout()
    return to_data_uri(fig)


def learning_plot(epochs: pd.DataFrame) -> str | None:
    if epochs.empty:
        return None
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=WIDE)
    e = epochs.sort_values("epoch")
    for col, label in (
        ("train_loss", "train loss"),
        ("val_single_view_loss", "val loss (single view)"),
        ("ema_val_single_view_loss", "EMA's val loss (single view)"),
    ):
        if col in e and e[col].notna().any():
            loss_ax.plot(e["epoch"], e[col], marker="o", label=label)
    loss_ax.set(xlabel="epoch", ylabel="loss", title="Loss per epoch")
    loss_ax.legend(fontsize="small")
    for col, label in (
        ("train_acc", "train top-1"),
        ("val_single_view_top1", "val top-1 (single view)"),
        ("val_single_view_top5", "val top-5 (single view)"),
        ("ema_val_single_view_top1", "EMA's val top-1 (single view)"),
    ):
        if col in e and e[col].notna().any():
            acc_ax.plot(e["epoch"], 100 * e[col], marker="o", label=label)
    acc_ax.set(xlabel="epoch", ylabel="accuracy (%)", ylim=(0, 100), title="Accuracy per epoch")
    acc_ax.legend(fontsize="small")
    for ax in (loss_ax, acc_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return to_data_uri(fig)


def classes_plot(worst: pd.DataFrame, best: pd.DataFrame) -> str | None:
    """Bar charts of the worst and the best classes side by side, labelled by wnid (names may be long
    or hostile; the tables below show them, escaped)."""
    if worst.empty:
        return None
    rows = max(len(worst), len(best))
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.3 * rows + 1.2))
    for ax, view, colour, title in (
        (axes[0], worst, sns.color_palette()[3], "Worst classes"),
        (axes[1], best, sns.color_palette()[2], "Best classes"),
    ):
        sns.barplot(x=100 * view["accuracy"].astype(float), y=view["wnid"].astype(str), ax=ax, color=colour, orient="h")
        ax.set(xlabel="val accuracy (%)", ylabel="", xlim=(0, 100), title=title)
    fig.tight_layout()
    return to_data_uri(fig)


def stages_plot(bench: pd.DataFrame) -> str | None:
    if bench.empty or "s" not in bench:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bench) + 1))
    sns.barplot(x=bench["s"], y=bench["rule"], ax=ax, color=sns.color_palette()[0], orient="h")
    ax.set(xlabel="wall time (s)", ylabel="", title="Wall time per stage")
    return to_data_uri(fig)
