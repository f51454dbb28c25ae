"""Turn training telemetry and pack manifests into plain-words findings, each with its fix.

Pure functions: inputs are the parsed telemetry tables (steps.csv, system.csv), run.json and the pack
manifests; thresholds come from the `report` config block. Nothing here reads files or plots, so every
rule can be tested with synthetic numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import pandas as pd

from rectrain.jpeg_engines import has_hw_jpeg
from rectrain.report import efficiency
from rectrain.report.efficiency import Evidence
from rectrain.report.stats import (
    data_wait_share_by_rank,
    during_steps,
    gpu_memory_peak,
    gpu_util_mean,
    overall_data_wait_share,
    train_setting,
)
from rectrain.settings import ReportSettings

# Severity order, most urgent first; "ok" is only used by the single no-problems statement.
SEVERITIES = ("critical", "warning", "info", "ok")

# Below this data-wait share a rank is not called starved even if it waits N times another rank:
# 0.4 % vs 0.1 % is a big ratio of nothing.
MIN_STARVED_SHARE = 0.05


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str
    title: str
    measured: str
    threshold: str
    fix: str


def _pct(share: float) -> str:
    return f"{100 * share:.1f} %"


# ---------------------------------------------------------------------------------------------
# Rules: each returns a Finding or None


def input_fix(run: Mapping | None) -> str:
    """How to feed the model faster, for the decoder this run actually used (run.json's `decode`,
    `loader_note` and its copy of the train block); the generic advice when run.json does not say."""
    run = run or {}
    decode = str(run.get("decode") or "")
    on_gpu = efficiency.on_gpu(run)
    storage = "keep the .rec on an SSD (pack.fast_storage)"
    shrink = "pre-shrink the images once (pack.resize, e.g. 160 for image_size 128)"

    def now(key: str) -> str:
        value = train_setting(run, key)
        return f" (now {value})" if value is not None else ""

    if on_gpu and run.get("loader_note"):
        return (
            f"DALI was requested but not importable, so the torch loader decoded on the GPU's CUDA cores, "
            f"competing with training: install DALI (nvidia-dali-cuda<CUDA major>0) so its mixed decoder "
            f"uses the hardware JPEG engines; also {storage}, or {shrink}."
        )
    if on_gpu and decode.startswith("cpu"):
        return (
            f"JPEGs were decoded on the CPU ({decode}) while the GPUs trained: set train.gpu_decode: true "
            f"with train.loader: dali (the mixed decoder), add decode threads (train.workers{now('workers')}), "
            f"{storage}, or {shrink}."
        )
    if decode.startswith("gpu: DALI"):
        return (
            f"The GPU decoder cannot keep up: raise train.dali_hw_decoder_load{now('dali_hw_decoder_load')} "
            f"toward 0.9 so the hardware JPEG engines take more images, add CPU threads for the decoder's "
            f"host stage (train.workers{now('workers')}, about cores / GPUs), deepen "
            f"train.dali_prefetch_queue_depth{now('dali_prefetch_queue_depth')}, {storage}, or {shrink}."
        )
    if decode.startswith(("gpu: TorchCodec", "gpu: torchvision")):  # runs before #24 decoded with torchvision.io
        return (
            f"The torch loader decodes on the GPU's CUDA cores, competing with training: use "
            f"train.loader: dali (hardware JPEG engines via the mixed decoder), add reader processes "
            f"(train.workers{now('workers')}), {storage}, or {shrink}."
        )
    return (
        "Feed the model faster: keep the .rec on an SSD (pack.fast_storage), decode on the GPU "
        f"(train.loader: dali, train.gpu_decode: true), add decode threads (train.workers{now('workers')}), or "
        "pre-shrink the images once (pack.resize, e.g. 160 for image_size 128)."
    )


def input_bound(
    steps: pd.DataFrame, report: ReportSettings, run: Mapping | None = None, ev: Evidence | None = None
) -> Finding | None:
    """Data wait above the threshold; with a calibration, also the throughput it costs and the fix
    that fits the CPU, disk and image-size evidence (without one, the advice for the decoder used)."""
    shares = data_wait_share_by_rank(steps)
    limit = float(report.data_wait_share)
    if shares.empty or shares.max() <= limit:
        return None
    overall = overall_data_wait_share(steps)
    per_rank = ", ".join(f"rank {r}: {_pct(v)}" for r, v in shares.items())
    worst = int(shares.idxmax())
    measured = f"data wait is {_pct(overall)} of step time over all ranks ({per_rank}); rank {worst} waits most"
    threshold = f"report.data_wait_share = {_pct(limit)} of step time"
    title, fix = "Training is input-bound: the model waits for data", input_fix(run)
    if ev is not None and ev.eff.measured:
        if _low_efficiency(ev, report):
            title = "Training is input-bound: the loader cannot keep up"
        measured += f"; {_efficiency_txt(ev)}"
        threshold += f"; report.input_efficiency = {float(report.input_efficiency):.2f}"
        fix = evidence_fix(run or {}, ev, report)
    return Finding(
        id="input_bound",
        severity="critical" if shares.max() > 2 * limit else "warning",
        title=title,
        measured=measured,
        threshold=threshold,
        fix=fix,
    )


def _efficiency_txt(ev: Evidence) -> str:
    ranks = ", ".join(f"rank {r.rank}: {r.ratio:.2f}" for r in ev.eff.per_rank if r.ratio is not None)
    return f"{ev.eff.headline()} ({ranks})"


def _low_efficiency(ev: Evidence, report: ReportSettings) -> bool:
    return ev.eff.measured and ev.eff.ratio is not None and ev.eff.ratio < float(report.input_efficiency)


def _efficiency_severity(ev: Evidence, report: ReportSettings) -> str:
    # as for data wait: critical when twice the tolerated share of throughput is lost
    return "critical" if 1 - ev.eff.ratio > 2 * (1 - float(report.input_efficiency)) else "warning"


def contention(run: Mapping, ev: Evidence, report: ReportSettings) -> Finding | None:
    """Low efficiency without waiting: decoding slows the steps themselves (shared cores or SMs)."""
    limit = float(report.data_wait_share)
    if not _low_efficiency(ev, report) or ev.wait is None or ev.wait > limit:
        return None
    gpu_decode = efficiency.on_gpu(run) and str(run.get("decode") or "").startswith("gpu")
    where = "the GPU's SMs" if gpu_decode else "the CPU cores"
    return Finding(
        id="contention",
        severity=_efficiency_severity(ev, report),
        title=f"Decoding competes with the model for {where}",
        measured=(
            f"{_efficiency_txt(ev)}, yet data wait is only {_pct(ev.wait)} of step time: the input pipeline's "
            "cost shows up as slower compute, not as waiting"
        ),
        threshold=(
            f"report.input_efficiency = {float(report.input_efficiency):.2f} with data wait at most "
            f"report.data_wait_share = {_pct(limit)}"
        ),
        fix=evidence_fix(run, ev, report),
    )


def _decode_cost_txt(ev: Evidence, run: Mapping) -> str:
    d = ev.decode
    if d is None:
        return "; the busy CPU time could not be split between decoding and the model"
    model = (
        f", less the model's own {1000 * d.model_core_s_per_image:.1f} ms per image on "
        f"{ev.eff.synthetic_total:.1f} img/s in the calibration"
        if not efficiency.on_gpu(run)
        else ", all of it counted as input work"
    )
    return (
        f"; the input pipeline costs {1000 * d.core_s_per_image:.1f} ms of CPU per image, "
        f"{d.per_core_img_s:.0f} img/s per core ({d.busy_cores:.2f} busy cores delivered "
        f"{ev.eff.real_total:.1f} img/s{model})"
    )


def cpu_bound(run: Mapping, ev: Evidence, report: ReportSettings) -> Finding | None:
    """CPU busy near 100 % while efficiency is low: the cores, not the disk or the loader's settings."""
    limit = float(report.cpu_busy_percent)
    if not _low_efficiency(ev, report) or ev.cpu_busy is None or ev.cpu_busy < limit:
        return None
    cores = f"{ev.cores}" if ev.cores else "its"
    if ev.decode is not None:
        extra = "" if efficiency.on_gpu(run) else f" on top of the {ev.cores} the model itself uses at that rate"
        need = (
            f"Feeding the model its {ev.eff.synthetic_total:.0f} img/s needs about {_cores(ev.decode.cores_needed)} "
            f"of decoding at the measured {ev.decode.per_core_img_s:.0f} img/s per core{extra}; the job has {cores}. "
        )
    else:
        need = f"The job's {cores} cores are all busy. "
    return Finding(
        id="cpu_bound",
        severity=_efficiency_severity(ev, report),
        title="The CPU is the bottleneck",
        measured=(
            f"CPU busy {ev.cpu_busy:.0f} % (median while training) of the job's {cores} cores while "
            f"{_efficiency_txt(ev)}{_decode_cost_txt(ev, run)}"
        ),
        threshold=(
            f"report.cpu_busy_percent = {limit:g} % with input efficiency below "
            f"report.input_efficiency = {float(report.input_efficiency):.2f}"
        ),
        fix=(
            need + "More decode workers would only split the same busy cores: run the job with more CPU cores "
            "(snakemake --cores, or more CPUs per GPU on a cluster), or decode less: "
            + ("; ".join(fix_tips(run, ev, report)) or "fewer pixels per image (pack.resize)")
            + "."
        ),
    )


def _cores(n: int) -> str:
    return f"{n} core" if n == 1 else f"{n} cores"


def _resize_tip(ev: Evidence) -> str | None:
    r = ev.resize
    if r is None or (r.packed_resize and r.packed_resize <= r.target):
        return None
    now = f", now {r.packed_resize}" if r.packed_resize else ", now pass-through"
    if r.packed_max_side:
        now = f", now pack.max_side: {r.packed_max_side}"
    head = f"pack a lower-resolution .rec (pack.resize: {r.target}{now})"
    if r.saving is None:
        return f"{head}: decode time falls with the pixels removed (the .rec could not be read to measure them)"
    if r.saving < 0.1:
        return None
    measured = f"the packed images average {r.mpx_now:.2f} Mpx (sample of {r.sampled})"
    if r.advise_max_side:
        side = efficiency.ADVISED_MAX_SIDE
        return (
            f"pack a .rec with a {side} px longest side (pack.max_side: {side}, now pass-through): {measured}, "
            f"{r.mpx_max_side:.2f} Mpx at {side} px on the longest side, so about {100 * r.max_side_saving:.0f} % less "
            f"decode work, nearly the {100 * r.saving:.0f} % of pack.resize: {r.target}, while keeping the pixels "
            "that higher test resolutions and small random crops use"
        )
    return (
        f"{head}: {measured}, {r.mpx_after:.2f} Mpx "
        f"at {r.target} px on the shorter side, so about {100 * r.saving:.0f} % less decode work"
    )


def _gpu_tip(run: Mapping, idle: float | None) -> str | None:
    names = efficiency.gpu_names(run)
    if not names:
        return None
    decode = str(run.get("decode") or "")
    engine = [n for n in names if has_hw_jpeg(n)]
    load = train_setting(run, "dali_hw_decoder_load")
    now = f" (now {load})" if load is not None else ""
    if engine and decode.startswith("gpu: DALI"):
        return (
            f"raise train.dali_hw_decoder_load{now} toward 0.9: the {engine[0]} has a hardware JPEG decoder, "
            "and the images it takes leave the SMs to the model"
        )
    if engine:
        return (
            f"decode on the {engine[0]}'s hardware JPEG decoder (train.loader: dali, train.gpu_decode: true, "
            f"train.dali_hw_decoder_load{now} toward 0.9)"
        )
    if decode.startswith("gpu"):
        other = (
            f"decode on the CPU instead (train.gpu_decode: false; about {idle:.1f} cores are idle)"
            if idle is not None and idle >= 1
            else "shrinking the images is what helps"
        )
        return f"the {names[0]} has no hardware JPEG decoder, so GPU decoding runs on the SMs the model uses: {other}"
    return None


def _idle_cores(ev: Evidence, report: ReportSettings) -> float | None:
    """Idle cores, when the CPU is below the saturation threshold; None when saturated or unknown."""
    if ev.cpu_busy is None or not ev.cores or ev.cpu_busy >= float(report.cpu_busy_percent):
        return None
    return ev.cores * (1 - ev.cpu_busy / 100)


def fix_tips(run: Mapping, ev: Evidence, report: ReportSettings) -> list[str]:
    """The fixes the measurements support, most direct first."""
    tips = []
    if run.get("loader_note") and efficiency.on_gpu(run):
        tips.append("install DALI (nvidia-dali-cuda<CUDA major>0): it was requested but not importable")
    if ev.iowait is not None and max(ev.iowait) > float(report.iowait_percent):
        tips.append(
            f"stage the .rec to faster storage (pack.stage_to_local: true, or pack.fast_storage on an SSD): "
            f"iowait averaged {ev.iowait[0]:.1f} %, p90 {ev.iowait[1]:.1f} %"
        )
    idle = _idle_cores(ev, report)
    decode_on_cpu = not efficiency.on_gpu(run) or str(run.get("decode") or "cpu").startswith("cpu")
    if idle is not None and idle >= 1 and decode_on_cpu:
        workers = train_setting(run, "workers")
        now = f" (now {workers})" if workers is not None else ""
        tips.append(
            f"add decode workers (train.workers{now}): the CPU was busy {ev.cpu_busy:.0f} %, "
            f"about {idle:.1f} of {ev.cores} cores idle"
        )
    return tips + [t for t in (_resize_tip(ev), _gpu_tip(run, idle)) if t]


def evidence_fix(run: Mapping, ev: Evidence, report: ReportSettings) -> str:
    """fix_tips as a sentence; the advice for the decoder used when the evidence points at none."""
    text = "; ".join(fix_tips(run, ev, report))
    return text[0].upper() + text[1:] + "." if text else input_fix(run)


def rank_imbalance(steps: pd.DataFrame, system: pd.DataFrame, report: ReportSettings) -> Finding | None:
    shares = data_wait_share_by_rank(steps)
    if len(shares) < 2:
        return None
    ratio_limit = float(report.imbalance_ratio)
    hi_rank, lo_rank = int(shares.idxmax()), int(shares.idxmin())
    hi, lo = float(shares[hi_rank]), float(shares[lo_rank])
    ratio = hi / lo if lo > 0 else float("inf")
    if hi < MIN_STARVED_SHARE or ratio < ratio_limit:
        return None
    ratio_txt = f"{ratio:.1f}x as much" if lo > 0 else "it never waits"
    util = gpu_util_mean(system)
    util_txt = ""
    if len(util) >= 2:
        util_txt = "; mean GPU util " + ", ".join(f"GPU {i}: {u:.0f} %" for i, u in util.items())
    return Finding(
        id="rank_imbalance",
        severity="critical",
        title=f"Rank imbalance: rank {hi_rank} starves for data while rank {lo_rank} does not",
        measured=(
            f"rank {hi_rank} waits on data {_pct(hi)} of its step time, rank {lo_rank} "
            f"{_pct(lo)} ({ratio_txt}){util_txt}. In DDP every rank waits for the "
            f"slowest, so the whole job runs at rank {hi_rank}'s pace"
        ),
        threshold=(
            f"report.imbalance_ratio = {ratio_limit:g}x (and the starved rank above "
            f"{_pct(MIN_STARVED_SHARE)} data wait)"
        ),
        fix=(
            f"Rank {hi_rank}'s reader is slower: this is the signature of a .rec read from a hard disk "
            "once the page cache is exhausted (one GPU at 100 % while the other sits at 0-10 %). "
            "Move the .rec to an SSD (pack.fast_storage) or stage it to node-local storage "
            "(pack.stage_to_local: true); check that nothing else competes for that rank's CPU cores."
        ),
    )


def _rotational_sources(run: Mapping, manifests: Mapping[str, Mapping]) -> list[str]:
    found = []
    for split, man in sorted(manifests.items()):
        st = (man or {}).get("storage") or {}
        if st.get("rotational") is True:
            found.append(f"{split}.rec at {st.get('path') or man.get('rec')} (device {st.get('device') or '?'})")
    dev = (run or {}).get("rec_device") or {}
    if dev.get("rotational") is True:
        found.append(f"training read {dev.get('path')} (device {dev.get('device') or '?'})")
    return found


HDD_LESSON = (
    "A .rec on a hard disk has slowed a run from 70 s to 5 min per 500 steps at 47 % iowait once the "
    "page cache ran out; moving the .rec to an SSD fixed it."
)


def rec_on_rotational(run: Mapping, manifests: Mapping[str, Mapping]) -> Finding | None:
    where = _rotational_sources(run, manifests)
    if not where:
        return None
    return Finding(
        id="rec_on_rotational",
        severity="warning",
        title="The .rec file is on a rotational disk (HDD)",
        measured="; ".join(where) + " - the device reports rotational = 1",
        threshold="any .rec on a device with rotational = 1",
        fix=(
            "Set pack.fast_storage to a directory on an SSD/NVMe and rerun (only pack and the stages "
            "after it rerun). " + HDD_LESSON
        ),
    )


def high_iowait(system: pd.DataFrame, report: ReportSettings) -> Finding | None:
    if "iowait_percent" not in system or system["iowait_percent"].dropna().empty:
        return None
    io = system["iowait_percent"].dropna()
    mean, p90 = float(io.mean()), float(io.quantile(0.9))
    limit = float(report.iowait_percent)
    if max(mean, p90) <= limit:
        return None
    read_txt = ""
    if "disk_read_mb_s" in system and not system["disk_read_mb_s"].dropna().empty:
        read_txt = f"; the .rec device read {system['disk_read_mb_s'].mean():.1f} MB/s on average"
    return Finding(
        id="high_iowait",
        severity="critical" if mean > limit else "warning",
        title="The CPUs wait on disk I/O",
        measured=f"iowait mean {mean:.1f} %, p90 {p90:.1f} % over {len(io)} samples{read_txt}",
        threshold=f"report.iowait_percent = {limit:g} % (mean or p90)",
        fix=(
            "Reads of the .rec are too slow for the loader: move the .rec to an SSD (pack.fast_storage), "
            "stage it to local storage (pack.stage_to_local: true), or shrink it (pack.resize) so it fits "
            "in the page cache. " + HDD_LESSON
        ),
    )


def _batch_txt(run: Mapping) -> tuple[int | None, int, int | None]:
    batch = run.get("batch_size")
    batch = int(batch) if isinstance(batch, (int, float)) else None
    accum = int(run.get("grad_accum") or 1)
    gb = run.get("global_batch")
    return batch, accum, int(gb) if isinstance(gb, (int, float)) else None


def gpu_memory(system: pd.DataFrame, run: Mapping, report: ReportSettings) -> list[Finding]:
    peaks = gpu_memory_peak(system)
    if not peaks:
        return []
    high, low = float(report.gpu_mem_high), float(report.gpu_mem_low)
    batch, accum, gb = _batch_txt(run or {})
    shares = {i: used / total for i, (used, total) in peaks.items() if total > 0}
    detail = ", ".join(
        f"GPU {i}: {peaks[i][0] / 1024:.1f} of {peaks[i][1] / 1024:.1f} GB ({_pct(s)})" for i, s in shares.items()
    )
    out = []
    hot = {i: s for i, s in shares.items() if s > high}
    if hot:
        if batch and batch > 1:
            keep = f" keeps the global batch of {gb}" if gb else " keeps the global batch"
            suggestion = f"train.batch_size: {max(1, batch // 2)} with train.grad_accum: {accum * 2}{keep}"
        else:
            suggestion = "a lower train.batch_size with a higher train.grad_accum"
        out.append(
            Finding(
                id="gpu_memory_high",
                severity="warning",
                title="GPU memory is near its limit: risk of out-of-memory",
                measured=f"peak memory use {detail}",
                threshold=f"report.gpu_mem_high = {_pct(high)} of GPU memory",
                fix=(
                    f"Use {suggestion}, or train.batch_size: auto. An out-of-memory on the GPU can surface "
                    "as 'CUDA error: an illegal memory access' instead of an OOM message (a batch "
                    "of 128 on 11 GB cards has done that)."
                ),
            )
        )
    if shares and max(shares.values()) < low:
        if batch:
            factor = max(2, int(high / max(max(shares.values()), 1e-6)))
            factor = min(factor, 4)  # memory does not scale linearly with batch; stay conservative
            suggestion = f"train.batch_size: {batch * factor} (now {batch})"
        else:
            suggestion = "a larger train.batch_size"
        out.append(
            Finding(
                id="gpu_memory_headroom",
                severity="info",
                title="GPU memory is mostly unused",
                measured=f"peak memory use {detail}",
                threshold=f"report.gpu_mem_low = {_pct(low)} of GPU memory",
                fix=(
                    f"Try {suggestion} or train.batch_size: auto for more images per step; train.lr is "
                    "scaled with the global batch (train.lr_scaling: under auto linear, or sqrt for AdamW and LAMB as timm scales them)."
                ),
            )
        )
    return out


def low_gpu_util(steps: pd.DataFrame, system: pd.DataFrame, run: Mapping, report: ReportSettings) -> Finding | None:
    # While the steps ran: the first GPU run's whole-run mean (44 %) hid 84-100 % inside its short epochs.
    util = gpu_util_mean(during_steps(system, steps))
    if not util:
        return None
    mean_util = sum(util.values()) / len(util)
    wait = overall_data_wait_share(steps)
    util_limit, wait_limit = float(report.gpu_util_low), float(report.data_wait_share)
    if mean_util >= util_limit or wait is None or wait > wait_limit:
        return None
    tips = []
    if not train_setting(run, "compile"):
        tips.append("train.compile: true (torch.compile fuses kernels)")
    if not train_setting(run, "channels_last"):
        tips.append("train.channels_last: true (faster convolutions on tensor cores)")
    if str(train_setting(run, "precision") or "fp32") == "fp32":
        tips.append("train.precision: bf16 (or fp16 on GPUs without bf16 such as the RTX 2080 Ti)")
    if train_setting(run, "cudnn_benchmark") is False:
        tips.append("train.cudnn_benchmark: true (cuDNN picks the fastest kernels for the fixed shape)")
    if tips:
        fix = "The GPU is not kept busy by the model itself. Turn on " + "; ".join(tips) + "."
    else:
        fix = (
            "compile, channels_last and mixed precision are already on: raise train.batch_size "
            "so each kernel does more work, or check for host-side work in the step (logging, syncs)."
        )
    per_gpu = ", ".join(f"GPU {i}: {u:.0f} %" for i, u in util.items())
    return Finding(
        id="low_gpu_util",
        severity="warning",
        title="GPUs are underused although data arrives in time",
        measured=f"mean GPU util {mean_util:.0f} % ({per_gpu}) during the training steps, with data wait "
        f"{_pct(wait)} of step time",
        threshold=(
            f"report.gpu_util_low = {util_limit:g} % with data wait at most report.data_wait_share = {_pct(wait_limit)}"
        ),
        fix=fix,
    )


def _examples(entries: Iterable[Mapping], limit: int = 3) -> str:
    items = [f"{e.get('source')} ({e.get('reason')})" for e in list(entries)[:limit]]
    return "; ".join(items)


def pack_quality(manifests: Mapping[str, Mapping]) -> list[Finding]:
    skipped, repaired, total = [], [], 0
    for _, man in sorted(manifests.items()):
        man = man or {}
        skipped += man.get("skipped_files") or []
        repaired += man.get("repaired") or []
        total += int(man.get("discovered") or 0)
    out = []
    if skipped:
        out.append(
            Finding(
                id="images_skipped",
                severity="warning",
                title=f"{len(skipped)} image(s) could not be packed and are not in the .rec",
                measured=(f"{len(skipped)} of {total} discovered images skipped, e.g. {_examples(skipped)}"),
                threshold="any skipped image",
                fix=(
                    "See the Data section for every skipped file and its reason; replace or remove them in "
                    "the raw dataset (the `raw` config key) and rerun, or accept the loss if they are junk."
                ),
            )
        )
    if repaired:
        out.append(
            Finding(
                id="images_repaired",
                severity="info",
                title=f"{len(repaired)} image(s) were repaired while packing",
                measured=f"{len(repaired)} of {total} discovered images re-encoded, e.g. {_examples(repaired)}",
                threshold="any repaired image",
                fix="Nothing to do: they were re-encoded as RGB JPEG so every loader can decode them.",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------


def _healthy(steps: pd.DataFrame, system: pd.DataFrame, ev: Evidence) -> Finding:
    parts = []
    if ev.eff.per_rank:
        parts.append(f"{ev.eff.headline()}")
    wait = overall_data_wait_share(steps)
    if wait is not None:
        parts.append(f"data wait {_pct(wait)} of step time (compute-bound)")
    if "iowait_percent" in system and not system["iowait_percent"].dropna().empty:
        parts.append(f"iowait mean {system['iowait_percent'].mean():.1f} %")
    peaks = gpu_memory_peak(system)
    if peaks:
        parts.append("peak GPU memory " + ", ".join(f"GPU {i}: {_pct(u / t)}" for i, (u, t) in peaks.items() if t > 0))
    util = gpu_util_mean(system)
    if util:
        parts.append("mean GPU util " + ", ".join(f"GPU {i}: {u:.0f} %" for i, u in util.items()))
    return Finding(
        id="no_problems",
        severity="ok",
        title="No problems found",
        measured="; ".join(parts) or "no telemetry rows",
        threshold="all report.* thresholds",
        fix="Nothing to change.",
    )


def diagnose(
    steps: pd.DataFrame,
    system: pd.DataFrame,
    run: Mapping | None,
    manifests: Mapping[str, Mapping] | None,
    report: ReportSettings,
    image_sizes: pd.DataFrame | None = None,
    *,
    learned: Iterable[Finding] = (),
    paced: Iterable[Finding] = (),
) -> list[Finding]:
    """All findings, most urgent first. Exactly one 'no_problems' finding when no rule flags a problem
    (informational findings such as repaired images may accompany it). `image_sizes` (width, height of
    a sample of the packed train images) lets the resize advice quote the decode work it saves;
    `learned`: the findings on whether the run learned (rectrain.report.learning); `paced`: on epochs
    that ran slower than the others (rectrain.report.slowdown)."""
    run, manifests = run or {}, manifests or {}
    ev = efficiency.gather(steps, system, run, manifests, image_sizes)
    found: list[Finding] = []
    for f in (
        input_bound(steps, report, run, ev),
        contention(run, ev, report),
        cpu_bound(run, ev, report),
        rank_imbalance(steps, system, report),
        rec_on_rotational(run, manifests),
        high_iowait(system, report),
        low_gpu_util(steps, system, run, report),
    ):
        if f is not None:
            found.append(f)
    found += gpu_memory(system, run, report)
    found += pack_quality(manifests)
    found += list(learned) + list(paced)
    if not any(f.severity in ("critical", "warning") for f in found):
        found.append(_healthy(steps, system, ev))
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))
