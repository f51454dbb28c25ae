"""GPU memory DALI's mixed decoder takes, by pack variant, decoder padding and decode threads (issue 23,
point 8: size `train.dali_device_memory_padding` for 11 GB cards from what DALI needs, not from DALI's
example value).

    python bench/decoder_memory.py --out DIR [--scratch DIR] [--images 64] [--batch 32] [--dry]

Writes photo-like JPEGs in ImageNet's mix of sizes (bench/decode_cost.py) plus two 12 Mpx photos (a DSLR
frame, the kind of outlier a real training set holds), stores them as three pack variants
(rectrain.data.images.prepare: the originals, `pack.max_side: 500`, `pack.resize: 256`), and for each
variant builds rectrain's own DALI train loader on the GPU (train.decode roi, mixed decoder) at
  padding 0, 1 thread / padding 0, 4 threads / the schema's padding, 4 threads
and takes one epoch of it. Device memory is read with torch.cuda.mem_get_info (device-wide: DALI's
allocations are outside torch's allocator) minus what torch itself reserved, before the loader is
built and after its epoch; DALI's unused pool memory is released between rows
(nvidia.dali.backend.ReleaseUnusedMemory). From the rows: the decoder's need per thread at padding 0
((4 threads - 1 thread) / 3) and what the default padding adds. Writes DIR/decoder_memory.md and .json.
`--dry` rehearses on the CPU (no GPU: the memory columns are empty, the loaders run with DALI's CPU
decoder) so the device run is known to work before it costs device time. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench"))

from decode_cost import originals, write_variant  # noqa: E402
from pack_bench import imagenet_like  # noqa: E402

# (name, pack.resize, pack.max_side, pack.quality): what the recipes and the decode-cost table use.
VARIANTS = [("original", 0, 0, 90), ("longest 500", 0, 500, 90), ("shorter 256", 256, 0, 90)]
LARGE = (4288, 2848)  # 12.2 Mpx
MIB = 2**20


def large_photos(n: int, size: tuple[int, int] = LARGE) -> list[bytes]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        imagenet_like(rng, *size).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def rows_to_run(default_padding: int) -> list[tuple[int, int]]:
    """(device_memory_padding, decode threads) per row."""
    return [(0, 1), (0, 4), (default_padding, 4)]


def dali_mib(torch) -> float | None:
    """Device memory in use that torch's allocator does not hold (DALI's, and the CUDA context), MiB."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / MIB


def measure_row(variant: dict, padding: int, threads: int, batch: int, device: str) -> dict:
    import torch
    from nvidia.dali import backend

    from rectrain.loaders import DaliOptions, LoaderSpec, build_loader

    gc.collect()
    backend.ReleaseUnusedMemory()
    before = dali_mib(torch)
    opts = dataclasses.replace(DaliOptions.defaults(), device_memory_padding=padding)
    spec = LoaderSpec(
        variant["rec"], variant["idx"], batch_size=batch, image_size=224, workers=threads, device=device, dali=opts
    )
    start = time.perf_counter()
    loader = build_loader("dali", spec)
    batches = sum(1 for _ in loader.epoch(0))
    if device != "cpu":
        torch.cuda.synchronize()
    after = dali_mib(torch)
    seconds = time.perf_counter() - start
    del loader
    gc.collect()
    added = None if before is None else after - before
    return {"padding_mib": padding / MIB, "threads": threads, "batches": batches, "mib": added, "seconds": seconds}


def per_thread_need(rows: list[dict]) -> float | None:
    one, four = (next(r["mib"] for r in rows if r["padding_mib"] == 0 and r["threads"] == t) for t in (1, 4))
    return None if one is None else (four - one) / 3


def markdown(results: dict, default_padding: int) -> str:
    lines = [
        "| variant | largest stored image | padding MiB | threads | device MiB after one epoch | seconds |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, res in results.items():
        for r in res["rows"]:
            mib = "-" if r["mib"] is None else f"{r['mib']:.0f}"
            lines.append(
                f"| {name} | {res['largest']} | {r['padding_mib']:.0f} | {r['threads']} | {mib} | {r['seconds']:.1f} |"
            )
    lines.append("")
    for name, res in results.items():
        need = per_thread_need(res["rows"])
        padded = next(r["mib"] for r in res["rows"] if r["padding_mib"] == default_padding / MIB)
        zero = next(r["mib"] for r in res["rows"] if r["padding_mib"] == 0 and r["threads"] == 4)
        if need is None:
            lines.append(f"- {name}: no GPU, no memory measured (dry run)")
        else:
            lines.append(
                f"- {name}: the decoder's need per thread at padding 0: {need:.0f} MiB; the default padding "
                f"({default_padding / MIB:.0f} MiB) adds {padded - zero:.0f} MiB at 4 threads"
            )
    return "\n".join(lines) + "\n"


def largest_stored(variant: dict) -> str:
    sizes = [Image.open(io.BytesIO(d)).size for d in variant["stored"]]
    w, h = max(sizes, key=lambda s: s[0] * s[1])
    return f"{w}x{h}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="the tables' folder")
    ap.add_argument("--scratch", type=Path, help="the variants' .rec files (default: a temporary folder)")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dry", action="store_true", help="rehearse on the CPU with 17 images (one 2 Mpx)")
    args = ap.parse_args(argv)
    import torch

    from rectrain.loaders import DaliOptions

    device = "cpu" if args.dry or not torch.cuda.is_available() else "cuda:0"
    if device != "cpu":
        torch.zeros(1, device=device)  # the CUDA context first, so no row pays for it
    images = originals(16) + large_photos(1, (1600, 1200)) if args.dry else originals(args.images) + large_photos(2)
    default_padding = DaliOptions.defaults().device_memory_padding
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="decoder_memory_", dir=args.scratch) as scratch:
        results = {}
        for name, *pack in VARIANTS:
            variant = write_variant(Path(scratch), name, images, *pack)
            rows = [measure_row(variant, p, t, args.batch, device) for p, t in rows_to_run(default_padding)]
            results[name] = {"largest": largest_stored(variant), "rows": rows}
            print(f"{name}: {rows}", file=sys.stderr, flush=True)
    gpu = torch.cuda.get_device_name(0) if device != "cpu" else "none (dry run)"
    text = f"GPU: {gpu}; {len(images)} images, batch {args.batch}\n\n" + markdown(results, default_padding)
    (args.out / "decoder_memory.md").write_text(text)
    (args.out / "decoder_memory.json").write_text(json.dumps({"gpu": gpu, "results": results}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
