"""Does the GPU wait for data?  Training img/s from the .rec through each loader vs the same model on
synthetic data already on the GPU, measured side by side in one run.

    python bench/gpu_efficiency.py --rec results/fast_storage/gpudemo/train.rec \
        --idx results/fast_storage/gpudemo/train.idx --out bench/out/gpu

Runs (default): ResNet-50 and ResNet-18 at 224 px from the .rec as packed, and both at 160 px from a
copy re-encoded at shorter side 182 (what a low-resolution run would pack: decode cost is what starves
small models).  Each run trains with the project's own step (rectrain.train.trainer.run_steps: same model
set-up, AMP, channels_last, optimizer, step timing) for --warmup + --steps steps per source and
reports the steady-state img/s over the last --steps, the ratio real/synthetic and the mean share of
step time the GPU spent waiting for data.  To reach steady state inside one epoch the bench writes
its own .rec copies with every record repeated as often as needed (content does not matter for
throughput; the page cache holds them).
Writes <out>/gpu_efficiency.md and .json; the .rec copies (about 1 GB at the defaults) go to --scratch,
or to a temporary folder removed at the end, never to <out> (results must stay small enough to come back
from a lent GPU machine).  Runs on CPU too with tiny settings (tests):
    python bench/gpu_efficiency.py ... --device cpu --model resnet18 --size 64 --steps 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from rectrain import log as rlog  # noqa: E402
from rectrain import settings  # noqa: E402
from rectrain.data.images import prepare  # noqa: E402
from rectrain.distributed import Dist  # noqa: E402
from rectrain.loaders import DaliOptions, LoaderSpec, build_loader, image_dtype  # noqa: E402
from rectrain.loaders.augment import parse_policy  # noqa: E402
from rectrain.recordio import IndexedRecordReader, IRHeader, RecordWriter, pack_record, unpack_record  # noqa: E402
from rectrain.snakefile.checks import check_config  # noqa: E402
from rectrain.train import calibrate, telemetry  # noqa: E402
from rectrain.train import trainer as T  # noqa: E402
from rectrain.train.optim import make_optimizer  # noqa: E402
from rectrain.train.run import make_model, set_backend_flags, wrap  # noqa: E402
from rectrain.train.step import compiled_graphs  # noqa: E402

DEFAULT_RUNS = "resnet50:224,resnet18:224,resnet18:160@182,resnet50:160@182"
LOADERS = ("dali", "torch")


log = logging.getLogger("rectrain.bench.gpu_efficiency").info


def parse_runs(text: str) -> list[tuple[str, int, int]]:
    """'resnet50:224,resnet18:160@182' -> [(model, image size, .rec shorter side or 0 = as packed)]."""
    runs = []
    for item in text.split(","):
        model, _, rest = item.strip().partition(":")
        size, _, side = rest.partition("@")
        if not model or not size.isdigit() or (side and not side.isdigit()):
            raise SystemExit(f"--runs: cannot read {item!r}; write model:size or model:size@shorter_side")
        runs.append((model, int(size), int(side or 0)))
    return runs


def _reencode(args: tuple[bytes, int, int]) -> bytes:
    data, side, quality = args
    return prepare(data, side, quality)[0]


def bench_rec(
    src_rec: str, src_idx: str, dest: Path, records: int, side: int, quality: int, workers: int
) -> tuple[str, str]:
    """A .rec with at least `records` records: the source's, repeated, re-encoded at shorter side `side`
    (0 = original bytes) with the packer's own resize (rectrain.data.images.prepare)."""
    rec, idx = dest / f"bench_side{side}_{records}.rec", dest / f"bench_side{side}_{records}.idx"
    if rec.exists() and idx.exists():
        return str(rec), str(idx)
    with IndexedRecordReader(src_rec, src_idx) as reader:
        items = [unpack_record(payload) for _, payload in reader]
    if side:
        with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
            data = list(pool.map(_reencode, [(b, side, quality) for _, b in items], chunksize=32))
        items = [(h, d) for (h, _), d in zip(items, data, strict=True)]
    tmp_rec, tmp_idx = rec.with_suffix(".rec.tmp"), idx.with_suffix(".idx.tmp")
    with RecordWriter(tmp_rec, tmp_idx) as w:
        for i in range(max(records, len(items))):
            header, data = items[i % len(items)]
            w.write(i, pack_record(IRHeader(header.flag, header.label, i, 0), data))
    os.replace(tmp_rec, rec)
    os.replace(tmp_idx, idx)
    return str(rec), str(idx)


def train_config(args, model: str, size: int, mode: str) -> dict:
    """The train block of one run; `mode`: eager, or the torch.compile mode (train.compile_mode)."""
    block = {
        "model": model,
        "image_size": size,
        "batch_size": args.batch,
        "precision": args.precision,
        "channels_last": not args.no_channels_last,
        "compile": mode != "eager",
        "compile_mode": "default" if mode == "eager" else mode,
        "workers": args.workers,
        "gpu_decode": True,
        "dali_hw_decoder_load": args.hw_decoder_load,
        "epochs": 1,
        "warmup_epochs": 0,
        "devices": "cpu" if args.device == "cpu" else "auto",
    }
    return check_config({"dataset": "bench", "train": block}, REPO / "config" / "schema.yaml", workdir=REPO)["train"]


def bench_step(cfg: dict, d: Dist, num_classes: int) -> T.Step:
    """A fresh model as training builds and wraps it (rectrain.train.run: make_model, wrap - so
    torch.compile with train.compile_mode), with its optimizer: one per run and compile mode, shared by
    the synthetic ceiling and every loader, so it compiles once and all sources run the same graph."""
    torch._dynamo.reset()  # the ResNets share their forward's code: without a reset the cache limit is hit
    s = settings.train(cfg)
    model, loss_fn, _ = make_model(s.network, num_classes, d.device)
    optimizer, scheduler, scaler = make_optimizer(
        s.optim, model, s.batch.batch_size, 10_000, family=s.network.model, precision=s.network.precision
    )
    net = wrap(model, d, s.launch, s.network)
    return T.Step(net, loss_fn, optimizer, scheduler, scaler, 1, s.network.precision, s.network.channels_last, d)


class UtilSampler(threading.Thread):
    """NVML utilisation of the bench's GPU every 0.1 s (rectrain.train.telemetry's reader): `mean(t0, t1)`
    over the samples within a measurement's steady steps; None off a GPU or without NVML."""

    def __init__(self, device: torch.device):
        super().__init__(name="gpu-util-sampler", daemon=True)
        self.nvml = telemetry._Nvml() if device.type == "cuda" else None
        self.index = device.index or 0
        self.samples: list[tuple[float, float]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        if self.nvml is None or self.index >= len(self.nvml.handles):
            return
        nv = self.nvml.nv
        while not self._halt.wait(0.1):
            util = self.nvml.field(self.index, "util", lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu)
            if util != "":
                self.samples.append((time.time(), float(util)))

    def mean(self, window: tuple[float, float]) -> float | None:
        inside = [u for t, u in self.samples if window[0] <= t <= window[1]]
        return sum(inside) / len(inside) if inside else None

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)


def measure(step: T.Step, batches, args, util: UtilSampler) -> dict:
    """Steady-state img/s and data-wait share on `batches` - through the same measurement every training
    run's calibration makes (rectrain.train.calibrate) - with the GPU utilisation over those steps and
    the graphs torch.compile made meanwhile (0 once the run's warm-up compiled them)."""
    graphs = compiled_graphs()
    result = calibrate.measure(step, batches, args.steps, args.warmup)
    result["gpu_util"] = util.mean(result.pop("window"))
    result["compiles"] = compiled_graphs() - graphs
    return result


def bench_device(text: str) -> torch.device:
    """--device as a torch.device with an index: 'cuda' -> cuda:0, since torch.cuda.set_device refuses a
    CUDA device without one ("Expected a torch.device with a specified index"); 'cuda:1', 'cpu' as given."""
    device = torch.device(text)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", 0)
    return device


def use_device(text: str) -> torch.device:
    """The bench's device, made current when it is a GPU."""
    device = bench_device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no GPU: use --device cpu (tiny settings) or a GPU machine")
        torch.cuda.set_device(device)
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({len(os.sched_getaffinity(0))} cores)"


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def markdown(rows: list[dict]) -> str:
    head = (
        "| GPU | compile | loader (decode), policy | model | px | .rec side | batch | img/s real | img/s synthetic | ratio | "
        "data-wait share | GPU util % | repeats: real / synthetic img/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        policy = "" if r.get("augment", "none") == "none" else f", {r['augment']}"
        where = f"| {r['gpu']} | {r['compile']} | {r['loader']}"
        size = f"| {r['model']} | {r['image_size']} | {r['rec_side'] or 'as packed'} | {r['batch']} "
        if r.get("skipped"):
            lines.append(f"{where}{policy} {size}| skipped: {r['skipped']} | {r['synthetic_img_s']:.0f} | | | | |")
            continue
        pairs = ", ".join(f"{a:.0f} / {b:.0f}" for a, b in zip(r["repeats_real"], r["repeats_synthetic"], strict=True))
        lines.append(
            f"{where} ({r['decode']}){policy} {size}| {r['real_img_s']:.0f} | {r['synthetic_img_s']:.0f} | {r['ratio']:.3f} | "
            f"{r['data_wait_share']:.3f} | {_num(r['gpu_util'], '.0f')} | {pairs} |"
        )
    return head + "\n".join(lines) + "\n"


# --dry: the same code paths on a CPU at tiny sizes (a rehearsal of the device run, tests/test_gpu_bench.py)
DRY = {
    "device": "cpu",
    "runs": "resnet18:32,resnet18:24@28",
    "batch": 4,
    "steps": 3,
    "warmup": 1,
    "workers": 1,
    "precision": "fp32",  # bf16 convolutions on a CPU without AMX take seconds a step
}
DEFAULTS = {"runs": DEFAULT_RUNS, "batch": 256, "steps": 40, "warmup": 10, "precision": "bf16"}
COMPILE_MODES = ("eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rec", required=True, help="packed train .rec (the pipeline's)")
    ap.add_argument("--idx", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--scratch", type=Path, help="folder for the re-packed .rec copies, kept for reuse (default: a temporary one)"
    )
    ap.add_argument("--runs", help=f"model:size[@rec_side],... (default {DEFAULT_RUNS})")
    ap.add_argument("--model", help="a single run: this model (with --size)")
    ap.add_argument("--size", type=int, help="a single run: this image size")
    ap.add_argument("--rec-side", type=int, default=0, help="a single run: re-encode the .rec at this shorter side")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--decodes", default="roi", help="the DALI loader's train.decode paths, each a row (roi,full,cpu)")
    ap.add_argument(
        "--compile", default="eager", help=f"comma list of {', '.join(COMPILE_MODES)}: eager and/or torch.compile modes"
    )
    ap.add_argument("--repeats", type=int, default=1, help="each source measured this many times, interleaved")
    ap.add_argument("--dry", action="store_true", help=f"rehearse on the CPU at tiny sizes: {DRY} unless given")
    ap.add_argument("--device")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", type=int, help="measured steps per source (after warm-up; default 40)")
    ap.add_argument("--warmup", type=int, help="default 10")
    ap.add_argument("--precision", choices=["bf16", "fp16", "fp32"], help="default bf16")
    ap.add_argument("--no-channels-last", action="store_true")
    ap.add_argument("--workers", type=int, help="DALI threads / torch worker processes (default: cores - 2)")
    ap.add_argument("--hw-decoder-load", type=float, default=0.65)
    ap.add_argument(
        "--augment", default="none", help="train.augment.policy of the loaders, each a row (none,rand-m6-mstd0.5-inc1)"
    )
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded .rec copies")
    args = ap.parse_args(argv)
    for key, value in {**DEFAULTS, **(DRY if args.dry else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.workers = args.workers or max(1, len(os.sched_getaffinity(0)) - 2)
    modes = args.compile.split(",")
    if not set(modes) <= set(COMPILE_MODES):
        raise SystemExit(f"--compile {args.compile}: each mode is one of {', '.join(COMPILE_MODES)}")
    args.modes = modes
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rlog.setup("gpu_efficiency")
    runs = [(args.model, args.size, args.rec_side)] if args.model else parse_runs(args.runs)
    if args.model and not args.size:
        raise SystemExit("--model needs --size")
    device = use_device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.scratch is None:
        with tempfile.TemporaryDirectory(prefix="gpu_efficiency-") as tmp:
            return bench(args, runs, device, Path(tmp))
    args.scratch.mkdir(parents=True, exist_ok=True)
    return bench(args, runs, device, args.scratch)


def bench(args, runs: list[tuple[str, int, int]], device: torch.device, scratch: Path) -> int:
    """Every run and compile mode: the synthetic ceiling and each loader (and DALI decode path) from a
    .rec copy in `scratch`; the tables are rewritten after each, so a bench cut short keeps its rows."""
    d = Dist(0, 1, 0, 1, device)
    gpu = device_name(device)
    # Records for one uninterrupted epoch of n steps, plus the loader's prefetch, so no epoch boundary
    # (pipeline rebuild, drain) falls inside the measurement.
    records = (args.warmup + args.steps + 4) * args.batch
    rows = []
    t0 = time.monotonic()
    util = UtilSampler(device)
    util.start()
    try:
        for model, size, side in runs:
            rec, idx = bench_rec(args.rec, args.idx, scratch, records, side, args.quality, args.workers)
            for mode in args.modes:
                rows += run_rows(args, (model, size, side), mode, (rec, idx), d, util)
                write_tables(args, rows, gpu, time.monotonic() - t0)
    finally:
        util.stop()
    print(markdown(rows))
    return 0


def sources(args) -> list[tuple[str, str | None, str]]:
    """(loader, decode path, train.augment.policy) of each measured source after the synthetic one: DALI
    once per --decodes, each loader once per --augment policy."""
    out = []
    for policy in args.augment.split(","):
        for kind in args.loaders.split(","):
            decodes = args.decodes.split(",") if kind == "dali" else [None]
            out += [(kind, decode, policy) for decode in decodes]
    return out


def run_rows(args, run: tuple[str, int, int], mode: str, rec_idx: tuple[str, str], d: Dist, util) -> list[dict]:
    """One run in one compile mode: a model built and compiled once, warmed up (compiling) on synthetic
    data, then --repeats rounds of synthetic + each source, interleaved; a row per source."""
    model, size, side = run
    cfg = train_config(args, model, size, mode)
    set_backend_flags(cfg["cudnn_benchmark"], d.device)
    step = bench_step(cfg, d, args.num_classes)
    specs = {src: loader_spec(src, rec_idx, cfg, d, args) for src in sources(args)}
    dtype = next((build_loader(k, s).image_dtype for (k, _, _), s in specs.items()), torch.float32)
    shape = calibrate.Shape(cfg["batch_size"], size, args.num_classes, dtype, cfg["channels_last"])
    log(f"{model} @{size}px (.rec {'side ' + str(side) if side else 'as packed'}), {mode}: warm-up")
    t = time.monotonic()
    calibrate.measure(step, calibrate.synthetic_batches(shape, d.device, args.warmup + 1), 1, args.warmup)
    log(f"  warm-up (compilation included) {time.monotonic() - t:.1f} s, {compiled_graphs()} graph(s)")
    synthetic, real = [], {src: [] for src in specs}
    for _ in range(args.repeats):
        n = args.warmup + args.steps
        synthetic.append(measure(step, calibrate.synthetic_batches(shape, d.device, n), args, util))
        log(f"  synthetic {synthetic[-1]['img_s']:.0f} img/s")
        for src, spec in specs.items():
            real[src].append(source_result(src, spec, step, args, util))
    base = {
        "gpu": device_name(d.device),
        "model": model,
        "image_size": size,
        "rec_side": side,
        "batch": args.batch,
        "precision": cfg["precision"],
        "channels_last": cfg["channels_last"],
        "compile": mode,
        "workers": cfg["workers"],
        "synthetic_img_s": mean(r["img_s"] for r in synthetic),
        "repeats_synthetic": [r["img_s"] for r in synthetic],
        "synthetic_gpu_util": mean_or_none(r["gpu_util"] for r in synthetic),
    }
    del step
    if d.device.type == "cuda":
        torch.cuda.empty_cache()
    return [source_row(src, results, base) for src, results in real.items()]


def loader_spec(src: tuple[str, str | None, str], rec_idx: tuple[str, str], cfg: dict, d: Dist, args) -> LoaderSpec:
    kind, decode, policy = src
    return LoaderSpec(
        *rec_idx,
        batch_size=args.batch,
        image_size=cfg["image_size"],
        train=True,
        workers=cfg["workers"],
        device=str(d.device),
        gpu_decode=True,
        seed=0,
        dali=DaliOptions.from_config(settings.train(cfg).loaders),
        decode=decode or "auto",
        dtype=image_dtype(cfg["precision"]),
        channels_last=cfg["channels_last"],
        augment=parse_policy(policy),
    )


def source_result(src, spec: LoaderSpec, step: T.Step, args, util) -> dict:
    """One source's measurement from the .rec, or {'skipped': why} when the loader cannot run here."""
    kind, decode, policy = src
    loader = build_loader(kind, spec)
    if loader.kind != kind:
        log(f"  {kind}: skipped, {loader.choice.note}")
        return {"skipped": loader.choice.note.split(":")[0] + " (not importable)"}
    n = args.warmup + args.steps
    if loader.batches_per_epoch < n:
        raise SystemExit(f"{spec.rec} has {loader.batches_per_epoch} batches per epoch, fewer than {n}")
    batches = loader.epoch(0)
    try:
        result = measure(step, batches, args, util)
    finally:
        batches.close()  # stop the loader's workers / pipeline now, not at garbage collection
    result["decode"] = loader.choice.decode.split(",")[0] + (f", {decode}" if decode else "")
    shown = f"{kind} {decode or ''}" + ("" if policy == "none" else f" {policy}")
    log(f"  {shown}: {result['img_s']:.0f} img/s, data wait {result['data_wait_share']:.1%}")
    return result


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def mean_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def source_row(src, results: list[dict], base: dict) -> dict:
    """A table row: the source's mean over the repeats against the synthetic mean of the same run."""
    kind, decode, policy = src
    name = kind if decode is None else f"{kind} {decode}"
    base = {**base, "augment": policy}
    if any("skipped" in r for r in results):
        return {**base, "loader": name, "skipped": results[0]["skipped"]}
    real = mean(r["img_s"] for r in results)
    return {
        **base,
        "loader": name,
        "decode_path": decode,
        "decode": results[0]["decode"],
        "real_img_s": real,
        "ratio": real / base["synthetic_img_s"],
        "data_wait_share": mean(r["data_wait_share"] for r in results),
        "gpu_util": mean_or_none(r["gpu_util"] for r in results),
        "compiles": sum(r["compiles"] for r in results),  # graphs compiled while measuring it, warm-ups included
        "repeats_real": [r["img_s"] for r in results],
        "steps": results[0]["steps"],
    }


def write_tables(args, rows: list[dict], gpu: str, wall_s: float) -> None:
    table = markdown(rows)
    meta = {
        "device": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "wall_s": round(wall_s, 1),
        "argv": sys.argv[1:],
    }
    (args.out / "gpu_efficiency.md").write_text(table)
    (args.out / "gpu_efficiency.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
