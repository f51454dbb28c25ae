"""Play a smaller card: cap this process's GPU memory (default 11 GB, a 2080 Ti) and run the training
preflight exactly as a run would (rectrain.train.batchplan.plan_batch): once at a fixed batch, which must stop
with the out-of-memory explanation, and once with `batch_size: auto`.

    python bench/oom_cap.py --cap-gb 11 --model resnet50 --size 224 --batch 256 --out bench/out/gpu

Writes <out>/oom_cap.txt (the message and the auto result) and oom_cap.json.  Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from rectrain import settings  # noqa: E402
from rectrain.distributed import Dist  # noqa: E402
from rectrain.loaders import resolve_loader, resolve_workers  # noqa: E402
from rectrain.snakefile.checks import check_config  # noqa: E402
from rectrain.train import batchplan  # noqa: E402
from rectrain.train.run import loader_spec, make_model, set_backend_flags  # noqa: E402


def cap_memory(device: torch.device, cap_gb: float) -> float:
    """Limit this process to cap_gb of the card; returns the fraction set."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_gb * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def preflight(block: dict, device: torch.device, num_classes: int) -> dict:
    """plan_batch for this train block: {'batch', 'grad_accum', 'report'} or {'error': message}."""
    cfg = check_config({"dataset": "oomcap", "train": block}, REPO / "config" / "schema.yaml", workdir=REPO)["train"]
    cfg = settings.train(cfg)
    set_backend_flags(cfg.network.cudnn_benchmark, device)
    model, loss_fn, _ = make_model(cfg.network, num_classes, device)
    d = Dist(0, 1, 0, 1, device)
    try:
        workers = resolve_workers(cfg.loaders.workers, d.local_world_size)
        spec = loader_spec(
            cfg.loaders,
            cfg.resolution,
            cfg.network,
            d,
            "",
            "",
            workers=workers,
            seed=cfg.launch.seed,
            epochs=cfg.optim.epochs,
        )
        classes = [{"label": k} for k in range(num_classes)]
        val_spec = spec.validation("", "", cfg.resolution.val_resolution)  # reserved for, as in a validated run
        choice = resolve_loader(cfg.loaders.loader, spec)
        parts = batchplan.RankParts(d, classes, model, loss_fn, 1, workers, spec, choice, {}, val_spec=val_spec)
        plan = batchplan.plan_batch(cfg.batch, d, parts, optim=cfg.optim, network=cfg.network)
        return {"batch": plan.batch, "grad_accum": plan.grad_accum, "report": plan.preflight}
    except batchplan.BatchDoesNotFit as exc:
        return {"error": str(exc)}
    finally:
        del model
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-gb", type=float, default=11.0)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("oom_cap needs a GPU: torch sees none")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    fraction = cap_memory(device, args.cap_gb)
    # No cuDNN autotuning: the search tries many batch sizes and each would be tuned anew.
    base = {
        "model": args.model,
        "image_size": args.size,
        "precision": args.precision,
        "channels_last": True,
        "cudnn_benchmark": False,
    }
    fixed = preflight({**base, "batch_size": args.batch}, device, args.num_classes)
    auto = preflight({**base, "batch_size": "auto", "global_batch": args.batch}, device, args.num_classes)
    gpu = batchplan.GpuInfo.of(device)
    lines = [
        f"{args.model} @{args.size}px {args.precision} channels_last on {gpu.label()} "
        f"(set_per_process_memory_fraction({fraction:.4f}))",
        f"batch_size: {args.batch} -> " + (fixed.get("error") or f"fits: {fixed['report']}"),
        f"batch_size: auto (global_batch {args.batch}) -> "
        + (
            auto.get("error")
            or f"batch {auto['batch']} x grad_accum {auto['grad_accum']} "
            f"(needs {auto['report']['need_mb']:.0f} MB of the {auto['report']['free_mb']:.0f} MB free)"
        ),
    ]
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "oom_cap.txt").write_text(text)
    (args.out / "oom_cap.json").write_text(
        json.dumps(
            {"cap_gb": args.cap_gb, "fraction": fraction, "gpu": gpu.label(), "fixed": fixed, "auto": auto},
            indent=2,
            default=str,
        )
    )
    print(text, end="")
    # The check passes when the fixed batch is explained (not a raw CUDA error) and auto finds a batch.
    return 0 if "error" in fixed and "batch" in auto else 1


if __name__ == "__main__":
    sys.exit(main())
