"""Input efficiency: the img/s a run reached on real data against the img/s the same model, batch and
settings reached on synthetic data already on the device (run.json's `calibration`), and the CPU and
image-size numbers that explain a shortfall.

Pure functions over parsed telemetry, like diagnosis.py: nothing here reads files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import pandas as pd

from rectrain.data.fit import Fit
from rectrain.report.stats import overall_data_wait_share, steady_steps, train_setting

# Standard ImageNet practice stores and resizes to 256 for a 224 crop: 8/7 of the crop size, which
# keeps RandomResizedCrop's scale range meaningful while dropping the pixels the crop never uses.
RESIZE_PER_CROP = 8 / 7
# The longest side the advice may name instead (FFCV's ImageNet), and when: if it removes at least
# MAX_SIDE_SHARE of the pixels pack.resize would, it costs about as little to decode while keeping
# the pixels that higher test resolutions and small random crops use. bench/RESULTS.md ("Decode cost
# per pack variant"): on ImageNet-like images, mostly within 500 px, it saves 10-40 % of the CPU
# decode and pack.resize 256 ~70 %, so resize stays the advice there; on larger photos max_side
# removes nearly as much.
ADVISED_MAX_SIDE = 500
MAX_SIDE_SHARE = 0.75


@dataclass(frozen=True)
class RankRate:
    rank: int
    real_img_s: float
    synthetic_img_s: float | None

    @property
    def ratio(self) -> float | None:
        return self.real_img_s / self.synthetic_img_s if self.synthetic_img_s else None


@dataclass(frozen=True)
class Efficiency:
    """Real steady-state img/s per rank against the calibration; `note` says why there is no ratio."""

    per_rank: tuple[RankRate, ...]
    note: str | None
    calibration: Mapping

    @property
    def measured(self) -> bool:
        return self.note is None

    def _paired(self) -> list[RankRate]:
        return [r for r in self.per_rank if r.synthetic_img_s]

    @property
    def real_total(self) -> float | None:
        return sum(r.real_img_s for r in self._paired()) if self.measured else None

    @property
    def synthetic_total(self) -> float | None:
        return sum(r.synthetic_img_s for r in self._paired()) if self.measured else None

    @property
    def ratio(self) -> float | None:
        """Over all ranks: their summed real rate over their summed synthetic rate."""
        return self.real_total / self.synthetic_total if self.measured and self.synthetic_total else None

    @property
    def shown(self) -> float | None:
        """The ratio as the headline gives it: at most 1 (real data cannot beat no input cost; above
        1 the calibration and the epochs ran at different speeds - measurement noise)."""
        return min(self.ratio, 1.0) if self.ratio is not None else None

    @property
    def above_one(self) -> bool:
        return self.ratio is not None and self.ratio > 1.0

    def headline(self) -> str:
        if not self.measured:
            return f"input efficiency {self.note}"
        value = (
            f"{self.shown:.2f} (measured {self.ratio:.2f}, above 1 is measurement noise)"
            if self.above_one
            else f"{self.ratio:.2f}"
        )
        return (
            f"input efficiency {value}: {self.real_total:.1f} img/s on real data against "
            f"{self.synthetic_total:.1f} img/s on synthetic data on the device"
        )


def synthetic_at(calibration: Mapping | None, resolution: int) -> float | None:
    """All ranks' synthetic img/s at `resolution` (None when not measured)."""
    cal = calibration or {}
    if cal.get("by_resolution"):
        cal = cal["by_resolution"].get(str(resolution)) or {}
    if cal.get("skipped"):
        return None
    rates = [float(v) for v in (cal.get("images_per_s") or {}).values()]
    return sum(rates) if rates else None


def steady_rates(steps: pd.DataFrame) -> dict[int, float]:
    """Steady-state img/s of each rank: its images over its step time, start-up steps excluded."""
    s = steady_steps(steps)
    if s.empty:
        return {}
    sums = s.groupby("rank")[["images", "wall_s"]].sum()
    sums = sums[sums["wall_s"] > 0]
    return {int(r): float(row["images"] / row["wall_s"]) for r, row in sums.iterrows()}


def epoch_spread(steps: pd.DataFrame, eff: Efficiency) -> tuple[float, float] | None:
    """(lowest, highest) input efficiency of a single epoch: each epoch's steady img/s of all ranks over
    the calibration's at its resolution (epoch_ceiling); the spread that says how much one measurement
    of it varies on this machine."""
    if not eff.measured or not eff.synthetic_total or steps.empty:
        return None
    s = steady_steps(steps)
    per = s.groupby(["epoch", "rank"])[["images", "wall_s"]].sum()
    per = per[per["wall_s"] > 0]
    rates = (per["images"] / per["wall_s"]).groupby(level="epoch").sum()
    rates = rates / pd.Series({e: epoch_ceiling(eff, int(e)) for e in rates.index}, dtype=float)
    return (float(rates.min()), float(rates.max())) if not rates.empty else None


def epoch_ceiling(eff: Efficiency, epoch: int) -> float | None:
    """All ranks' synthetic img/s for `epoch`: under train.progressive its training resolution's own
    calibration (the calibration's `resolutions` and `by_resolution`), else the run's."""
    cal = eff.calibration or {}
    per_epoch = cal.get("resolutions") or []
    if cal.get("by_resolution") and 0 <= epoch < len(per_epoch):
        return synthetic_at(cal, per_epoch[epoch])
    return eff.synthetic_total


def _not_measured(run: Mapping) -> str | None:
    cal = run.get("calibration")
    if cal is None:
        return "not measured: run.json has no calibration (written before training measured one)"
    if cal.get("skipped"):
        return f"not measured: the calibration did not run ({cal['skipped']})"
    if not cal.get("images_per_s"):
        return "not measured: the calibration recorded no img/s"
    return None


def input_efficiency(steps: pd.DataFrame, run: Mapping | None) -> Efficiency:
    run = run or {}
    real = steady_rates(steps)
    note = _not_measured(run)
    cal = run.get("calibration") or {}
    synthetic = {int(k): float(v) for k, v in (cal.get("images_per_s") or {}).items() if v}
    if note is None and not real:
        note = "not measured: no training steps in steps.csv"
    if note is None and not set(real) & set(synthetic):
        note = f"not measured: the calibration has ranks {sorted(synthetic)}, steps.csv ranks {sorted(real)}"
    per_rank = tuple(RankRate(r, v, synthetic.get(r) if note is None else None) for r, v in sorted(real.items()))
    return Efficiency(per_rank=per_rank, note=note, calibration=cal)


def cpu_busy_percent(system: pd.DataFrame, steps: pd.DataFrame) -> float | None:
    """Median CPU busy % (system.csv, iowait excluded) over the samples taken while steps ran; the
    median, so start-up and the validation passes between epochs do not decide it."""
    if "cpu_percent" not in system or system["cpu_percent"].dropna().empty:
        return None
    sys = system.dropna(subset=["cpu_percent"])
    if not steps.empty and "time" in sys:
        start, end = float((steps["time"] - steps["wall_s"]).min()), float(steps["time"].max())
        during = sys[(sys["time"] >= start) & (sys["time"] <= end)]
        sys = during if not during.empty else sys
    return float(sys["cpu_percent"].median())


@dataclass(frozen=True)
class DecodeCost:
    """CPU cost of the input pipeline, derived from measured rates (see decode_cost)."""

    busy_cores: float
    core_s_per_image: float  # CPU seconds the input pipeline spent per image
    model_core_s_per_image: float  # CPU seconds the model itself needs per image (0 on GPUs)
    cores_needed: int  # for the input pipeline alone, at the synthetic-data rate

    @property
    def per_core_img_s(self) -> float:
        return 1.0 / self.core_s_per_image


def decode_cost(eff: Efficiency, busy_percent: float | None, cores: int | None, on_gpu: bool) -> DecodeCost | None:
    """How many cores the input pipeline needs to feed the model at its synthetic-data rate.

    Derivation, from measured numbers only: while training, `busy_percent` of the job's `cores` were
    busy and the job delivered R img/s (steps.csv), so each image cost busy_cores / R CPU seconds.
    On GPUs the model's own CPU work (one Python thread per rank launching kernels) is counted as
    input work, so the per-core rate is a lower bound and the core count an upper bound. On CPU
    processes the model shares the cores: the calibration ran the model alone on the same cores at
    S img/s, so it costs cores / S CPU seconds per image, and the rest is the input pipeline's.
    Feeding S img/s then takes S x (input CPU seconds per image) cores. None when a number is missing
    or the model alone explains the busy time (nothing left to attribute to decoding).
    """
    if not eff.measured or busy_percent is None or not cores or not eff.real_total:
        return None
    busy_cores = cores * min(busy_percent, 100.0) / 100.0
    per_image = busy_cores / eff.real_total
    model = 0.0 if on_gpu else cores / eff.synthetic_total
    decode = per_image - model
    if decode <= 0:
        return None
    return DecodeCost(
        busy_cores=busy_cores,
        core_s_per_image=decode,
        model_core_s_per_image=model,
        cores_needed=math.ceil(eff.synthetic_total * decode),
    )


def suggested_resize(image_size: int) -> int:
    """Shorter side for pack.resize: 8/7 of the training crop, rounded up to a multiple of 8."""
    return int(math.ceil(image_size * RESIZE_PER_CROP / 8) * 8)


def pixel_saving(sizes: pd.DataFrame | None, fit: Fit) -> tuple[float, float, float] | None:
    """(mean megapixels now, mean megapixels stored by `fit` (pack.resize or pack.max_side), share of
    pixels saved) over a sample of the packed images (width, height columns). JPEG decode time grows
    with the pixel count (every 8x8 block is entropy-decoded, inverse-transformed and colour-converted),
    so the share of pixels saved is the expected share of decode time saved."""
    if sizes is None or sizes.empty:
        return None
    w, h = sizes["width"].astype(float), sizes["height"].astype(float)
    now = w * h
    sides = pd.concat([w, h], axis=1)
    side = sides.min(axis=1) if fit.shorter else sides.max(axis=1)
    scale = (fit.limit / side).clip(upper=1.0)  # the pack never enlarges
    after = now * scale**2
    return float(now.mean() / 1e6), float(after.mean() / 1e6), float(1.0 - after.sum() / now.sum())


def on_gpu(run: Mapping) -> bool:
    cuda = any(str(dev).startswith("cuda") for dev in run.get("devices") or [])
    return run.get("backend") == "nccl" or cuda or bool(run.get("gpus"))


def gpu_names(run: Mapping) -> list[str]:
    return list(dict.fromkeys(str(g.get("name")) for g in run.get("gpus") or [] if g.get("name")))


@dataclass(frozen=True)
class ResizeGain:
    target: int  # suggested pack.resize
    packed_resize: int  # pack.resize the .rec was built with (0 = pass-through)
    sampled: int  # images whose headers were read (0 = none: the .rec was not readable)
    mpx_now: float | None = None
    mpx_after: float | None = None
    saving: float | None = None  # share of decoded pixels (and so of decode time) saved
    packed_max_side: int = 0  # pack.max_side the .rec was built with (0 = none)
    mpx_max_side: float | None = None  # mean megapixels at ADVISED_MAX_SIDE
    max_side_saving: float | None = None

    @property
    def advise_max_side(self) -> bool:
        """pack.max_side: ADVISED_MAX_SIDE is the better advice than pack.resize: target (see MAX_SIDE_SHARE),
        for a pass-through .rec whose 4:3 images would keep a shorter side of at least the target."""
        if self.packed_resize or self.packed_max_side or not self.saving or self.max_side_saving is None:
            return False
        keeps_target = Fit(longer=ADVISED_MAX_SIDE).typical_shorter_side() >= self.target
        return keeps_target and self.max_side_saving >= MAX_SIDE_SHARE * self.saving


@dataclass(frozen=True)
class Evidence:
    """Everything the input findings weigh, measured once."""

    eff: Efficiency
    wait: float | None  # data-wait share of step time, all ranks
    cpu_busy: float | None  # median CPU busy % while steps ran
    cores: int | None  # CPU cores the job may use (run.json)
    iowait: tuple[float, float] | None  # mean, p90 %
    decode: DecodeCost | None
    resize: ResizeGain | None


def _iowait(system: pd.DataFrame) -> tuple[float, float] | None:
    if "iowait_percent" not in system or system["iowait_percent"].dropna().empty:
        return None
    io = system["iowait_percent"].dropna()
    return float(io.mean()), float(io.quantile(0.9))


def resize_gain(run: Mapping, manifests: Mapping, sizes: pd.DataFrame | None) -> ResizeGain | None:
    image_size = train_setting(run, "image_size")
    if not image_size:
        return None
    target = suggested_resize(int(image_size))
    train = manifests.get("train") or {}
    packed, packed_max_side = int(train.get("resize") or 0), int(train.get("max_side") or 0)
    saved = pixel_saving(sizes, Fit(shorter=target))
    if saved is None:
        return ResizeGain(target, packed, 0, packed_max_side=packed_max_side)
    _, mpx_max_side, max_side_saving = pixel_saving(sizes, Fit(longer=ADVISED_MAX_SIDE))
    return ResizeGain(target, packed, len(sizes), *saved, packed_max_side, mpx_max_side, max_side_saving)


def gather(
    steps: pd.DataFrame, system: pd.DataFrame, run: Mapping, manifests: Mapping, sizes: pd.DataFrame | None = None
) -> Evidence:
    eff = input_efficiency(steps, run)
    busy = cpu_busy_percent(system, steps)
    cores = int(run["cores"]) if run.get("cores") else None
    return Evidence(
        eff=eff,
        wait=overall_data_wait_share(steps),
        cpu_busy=busy,
        cores=cores,
        iowait=_iowait(system),
        decode=decode_cost(eff, busy, cores, on_gpu(run)),
        resize=resize_gain(run, manifests, sizes),
    )
