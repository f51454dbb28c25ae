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
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from rectrain import log as rlog  # noqa: E402
from rectrain.data.images import prepare  # noqa: E402
from rectrain.distributed import Dist  # noqa: E402
from rectrain.loaders import DaliOptions, LoaderSpec, build_loader  # noqa: E402
from rectrain.recordio import IndexedRecordReader, IRHeader, RecordWriter, pack_record, unpack_record  # noqa: E402
from rectrain.snakefile.checks import check_config  # noqa: E402
from rectrain.train import calibrate  # noqa: E402
from rectrain.train import trainer as T  # noqa: E402
from rectrain.train.optim import make_optimizer  # noqa: E402
from rectrain.train.run import make_model, set_backend_flags  # noqa: E402

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


def train_config(args, model: str, size: int) -> dict:
    block = {
        "model": model,
        "image_size": size,
        "batch_size": args.batch,
        "precision": args.precision,
        "channels_last": not args.no_channels_last,
        "compile": args.compile,
        "workers": args.workers,
        "gpu_decode": True,
        "dali_hw_decoder_load": args.hw_decoder_load,
        "epochs": 1,
        "warmup_epochs": 0,
        "devices": "cpu" if args.device == "cpu" else "auto",
    }
    return check_config({"dataset": "bench", "train": block}, REPO / "config" / "schema.yaml", workdir=REPO)["train"]


def measure(cfg, d, batches, num_classes: int, args) -> dict:
    """Steady-state img/s and data-wait share of a fresh model trained on `batches` - through the same
    measurement every training run's calibration makes (rectrain.train.calibrate)."""
    model, loss_fn = make_model(cfg, num_classes, d.device)
    n = args.warmup + args.steps
    optimizer, scheduler, scaler = make_optimizer(cfg, model, cfg["batch_size"], n)
    step = T.Step(model, loss_fn, optimizer, scheduler, scaler, 1, cfg["precision"], cfg["channels_last"], d)
    result = calibrate.measure(step, batches, args.steps, args.warmup)
    del model, optimizer
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


def markdown(rows: list[dict]) -> str:
    head = (
        "| GPU | loader (decode) | model | px | .rec side | batch | img/s real | img/s synthetic | ratio | "
        "data-wait share |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r.get("skipped"):
            lines.append(
                f"| {r['gpu']} | {r['loader']} | {r['model']} | {r['image_size']} | {r['rec_side'] or 'as packed'} "
                f"| {r['batch']} | skipped: {r['skipped']} | {r['synthetic_img_s']:.0f} | | |"
            )
            continue
        lines.append(
            f"| {r['gpu']} | {r['loader']} ({r['decode']}) | {r['model']} | {r['image_size']} | "
            f"{r['rec_side'] or 'as packed'} | {r['batch']} | {r['real_img_s']:.0f} | {r['synthetic_img_s']:.0f} | "
            f"{r['ratio']:.3f} | {r['data_wait_share']:.3f} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rec", required=True, help="packed train .rec (the pipeline's)")
    ap.add_argument("--idx", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--scratch", type=Path, help="folder for the re-packed .rec copies, kept for reuse (default: a temporary one)"
    )
    ap.add_argument("--runs", default=DEFAULT_RUNS, help=f"model:size[@rec_side],... (default {DEFAULT_RUNS})")
    ap.add_argument("--model", help="a single run: this model (with --size)")
    ap.add_argument("--size", type=int, help="a single run: this image size")
    ap.add_argument("--rec-side", type=int, default=0, help="a single run: re-encode the .rec at this shorter side")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40, help="measured steps per source (after warm-up)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--no-channels-last", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument(
        "--workers",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) - 2),
        help="DALI threads / torch worker processes (default: cores - 2)",
    )
    ap.add_argument("--hw-decoder-load", type=float, default=0.65)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded .rec copies")
    args = ap.parse_args(argv)
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
    """Every run: synthetic ceiling, then each loader from a .rec copy in `scratch`; writes the tables."""
    d = Dist(0, 1, 0, 1, device)
    gpu = device_name(device)
    n = args.warmup + args.steps
    # Records for one uninterrupted epoch of n steps, plus the loader's prefetch, so no epoch boundary
    # (pipeline rebuild, drain) falls inside the measurement.
    records = (n + 4) * args.batch
    rows = []
    t0 = time.monotonic()
    for model, size, side in runs:
        cfg = train_config(args, model, size)
        set_backend_flags(cfg, device)
        rec, idx = bench_rec(args.rec, args.idx, scratch, records, side, args.quality, args.workers)
        log(f"{model} @{size}px (.rec {'side ' + str(side) if side else 'as packed'}): synthetic")
        shape = calibrate.Shape(cfg["batch_size"], cfg["image_size"], args.num_classes)
        ceiling = measure(cfg, d, calibrate.synthetic_batches(shape, d.device, n), args.num_classes, args)
        log(f"  synthetic {ceiling['img_s']:.0f} img/s")
        base = {
            "gpu": gpu,
            "model": model,
            "image_size": size,
            "rec_side": side,
            "batch": args.batch,
            "precision": cfg["precision"],
            "channels_last": cfg["channels_last"],
            "compile": cfg["compile"],
            "workers": cfg["workers"],
            "synthetic_img_s": ceiling["img_s"],
        }
        spec = LoaderSpec(
            rec,
            idx,
            batch_size=args.batch,
            image_size=size,
            train=True,
            workers=cfg["workers"],
            device=str(device),
            gpu_decode=True,
            seed=0,
            dali=DaliOptions.from_config(cfg),
        )
        rows += [loader_row(kind, spec, cfg, d, args, base) for kind in args.loaders.split(",")]
    write_tables(args, rows, gpu, time.monotonic() - t0)
    return 0


def loader_row(kind: str, spec: LoaderSpec, cfg: dict, d, args, base: dict) -> dict:
    """One loader from the .rec: its steady-state img/s against the synthetic ceiling in `base`, or why
    it was skipped."""
    n = args.warmup + args.steps
    loader = build_loader(kind, spec)
    if loader.kind != kind:
        log(f"  {kind}: skipped, {loader.choice.note}")
        return {**base, "loader": kind, "skipped": loader.choice.note.split(":")[0] + " (not importable)"}
    if loader.batches_per_epoch < n:
        raise SystemExit(f"{spec.rec} has {loader.batches_per_epoch} batches per epoch, fewer than {n}")
    batches = loader.epoch(0)
    try:
        real = measure(cfg, d, batches, args.num_classes, args)
    finally:
        batches.close()  # stop the loader's workers / pipeline now, not at garbage collection
    ratio = real["img_s"] / base["synthetic_img_s"]
    log(f"  {kind}: {real['img_s']:.0f} img/s, ratio {ratio:.3f}, data wait {real['data_wait_share']:.1%}")
    return {
        **base,
        "loader": kind,
        "decode": loader.choice.decode.split(",")[0],
        "real_img_s": real["img_s"],
        "ratio": ratio,
        "data_wait_share": real["data_wait_share"],
        "steps": real["steps"],
    }


def write_tables(args, rows: list[dict], gpu: str, wall_s: float) -> None:
    table = markdown(rows)
    meta = {
        "device": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "warmup": args.warmup,
        "steps": args.steps,
        "wall_s": round(wall_s, 1),
        "argv": sys.argv[1:],
    }
    (args.out / "gpu_efficiency.md").write_text(table)
    (args.out / "gpu_efficiency.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(table)


if __name__ == "__main__":
    sys.exit(main())
