"""Seaborn figures of the run, returned as PNG data URIs so the report is one self-contained file.

Every function returns None when its data is absent (CPU-only runs have no GPU plot), so the template
can say "not measured" instead of showing an empty axis.
"""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")  # no display on build machines; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from rectrain.report.stats import gpu_indices, steady_steps  # noqa: E402

sns.set_theme(style="whitegrid", context="notebook")
# Class names and paths come from user data: never let matplotlib treat "$...$" as TeX.
plt.rcParams["text.parse_math"] = False

WIDE = (10, 3.6)


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


def _bin_width(span_s: float) -> float:
    # ~60 points over the run, but never finer than a second (steps are coarser than that)
    return max(1.0, span_s / 60.0)


def _rank_order(labels) -> list[str]:
    return sorted(set(labels), key=lambda s: (s != "total", int(s.split()[-1]) if s[-1].isdigit() else -1))


def _rank_palette(labels) -> dict[str, tuple]:
    """The same colour for a rank in every plot; 'total' gets the first."""
    colours = sns.color_palette("tab10", 10)
    return {name: colours[0] if name == "total" else colours[(int(name.split()[-1]) + 1) % 10] for name in set(labels)}


def throughput_over_time(steps: pd.DataFrame, t0: float) -> pd.DataFrame:
    """img/s per step of each rank, and their sum per (epoch, step) as 'total' (DDP ranks step in
    lockstep), smoothed over ~1/60 of the run so long runs stay readable."""
    s = steps.sort_values(["rank", "epoch", "step"]).assign(
        img_s=steps["images"] / steps["wall_s"].where(steps["wall_s"] > 0), t=steps["time"] - t0
    )
    window = max(1, s.groupby("rank").size().max() // 60)
    per_rank = s.assign(series="rank " + s["rank"].astype(str))
    total = s.groupby(["epoch", "step"]).agg(img_s=("img_s", "sum"), t=("t", "max")).reset_index()
    total["series"] = "total"
    data = pd.concat([total, per_rank], ignore_index=True)[["series", "t", "img_s"]].sort_values(["series", "t"])
    data["img_s"] = data.groupby("series")["img_s"].transform(lambda v: v.rolling(window, min_periods=1).mean())
    return data


def throughput_plot(steps: pd.DataFrame, t0: float | None) -> str | None:
    if steps.empty or t0 is None:
        return None
    data = throughput_over_time(steps, t0)
    fig, ax = plt.subplots(figsize=WIDE)
    sns.lineplot(
        data=data,
        x="t",
        y="img_s",
        hue="series",
        hue_order=_rank_order(data["series"]),
        palette=_rank_palette(data["series"]),
        marker="o",
        markersize=3,
        ax=ax,
    )
    ax.set(xlabel="time since start (s)", ylabel="images / s", ylim=(0, None), title="Training throughput")
    return to_data_uri(fig)


def step_split_plot(steps: pd.DataFrame, t0: float | None) -> str | None:
    """Left: mean step time per rank split into data wait and compute. Right: data-wait share over
    time per rank, which shows a stall that starts mid-run (a .rec on a hard disk once the page cache runs out)."""
    if steps.empty or t0 is None:
        return None
    s = steady_steps(steps)
    fig, (left, right) = plt.subplots(1, 2, figsize=WIDE, gridspec_kw={"width_ratios": [1, 2]})
    means = s.groupby("rank")[["data_wait_s", "compute_s"]].mean() * 1000
    means.index = [f"rank {r}" for r in means.index]
    means.plot.bar(stacked=True, ax=left, color=sns.color_palette()[3:1:-1], rot=0)
    left.set(ylabel="ms per step", title="Step time split")
    left.legend(["data wait", "compute"], fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    t = s["time"] - t0
    width = _bin_width(float(t.max()))
    binned = (
        s.assign(bin=(t // width) * width + width / 2)
        .groupby(["bin", "rank"])[["data_wait_s", "wall_s"]]
        .sum()
        .reset_index()
    )
    binned["share"] = 100 * binned["data_wait_s"] / binned["wall_s"].where(binned["wall_s"] > 0)
    binned["rank"] = "rank " + binned["rank"].astype(str)
    sns.lineplot(
        data=binned,
        x="bin",
        y="share",
        hue="rank",
        hue_order=_rank_order(binned["rank"]),
        palette=_rank_palette(binned["rank"]),
        marker="o",
        markersize=3,
        ax=right,
    )
    right.set(xlabel="time since start (s)", ylabel="data wait (% of step)", ylim=(0, 100), title="Data wait over time")
    fig.tight_layout()
    return to_data_uri(fig)


def _long_gpu(system: pd.DataFrame, t0: float, kind: str) -> pd.DataFrame:
    frames = []
    for i in gpu_indices(system):
        if kind == "util" and f"gpu{i}_util" in system:
            y = system[f"gpu{i}_util"]
        elif kind == "mem" and f"gpu{i}_mem_used_mb" in system and f"gpu{i}_mem_total_mb" in system:
            y = 100 * system[f"gpu{i}_mem_used_mb"] / system[f"gpu{i}_mem_total_mb"]
        else:
            continue
        frames.append(pd.DataFrame({"t": system["time"] - t0, "value": y, "gpu": f"GPU {i}"}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def gpu_plot(system: pd.DataFrame, t0: float | None) -> str | None:
    if system.empty or t0 is None or not gpu_indices(system):
        return None
    fig, (util_ax, mem_ax) = plt.subplots(1, 2, figsize=WIDE)
    for ax, kind, label in ((util_ax, "util", "GPU util (%)"), (mem_ax, "mem", "GPU memory used (%)")):
        data = _long_gpu(system, t0, kind)
        if not data.empty:
            sns.lineplot(data=data, x="t", y="value", hue="gpu", ax=ax)
        ax.set(xlabel="time since start (s)", ylabel=label, ylim=(0, 105), title=label)
    fig.tight_layout()
    return to_data_uri(fig)


def cpu_io_plot(system: pd.DataFrame, t0: float | None) -> str | None:
    if system.empty or t0 is None:
        return None
    t = system["time"] - t0
    fig, (cpu_ax, disk_ax) = plt.subplots(1, 2, figsize=WIDE)
    for col, label in (("cpu_percent", "CPU busy"), ("iowait_percent", "iowait")):
        if col in system:
            cpu_ax.plot(t, system[col], label=label)
    cpu_ax.set(xlabel="time since start (s)", ylabel="% of CPU time", ylim=(0, 105), title="CPU and iowait")
    cpu_ax.legend(fontsize="small")
    if "disk_read_mb_s" in system:
        disk_ax.plot(t, system["disk_read_mb_s"], color=sns.color_palette()[2])
    disk_ax.set(xlabel="time since start (s)", ylabel="MB/s", title="Disk reads of the .rec device")
    fig.tight_layout()
    return to_data_uri(fig)


def learning_plot(epochs: pd.DataFrame) -> str | None:
    if epochs.empty:
        return None
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=WIDE)
    e = epochs.sort_values("epoch")
    for col, label in (("train_loss", "train loss"), ("val_loss", "val loss")):
        if col in e and e[col].notna().any():
            loss_ax.plot(e["epoch"], e[col], marker="o", label=label)
    loss_ax.set(xlabel="epoch", ylabel="loss", title="Loss per epoch")
    loss_ax.legend(fontsize="small")
    for col, label in (("train_acc", "train top-1"), ("val_top1", "val top-1"), ("val_top5", "val top-5")):
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
