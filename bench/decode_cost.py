"""What decoding each pack variant costs the CPU: DALI's CPU decoders per image and per core.

    .venv/bin/python bench/decode_cost.py [--images 320] [--rounds 3] [--batch 32]

The 2080 Ti case (issue 25): a GPU without a hardware JPEG engine decodes ImageNet-sized images with
nvJPEG's hybrid backend, whose Huffman (entropy) stage runs on the CPU. This measures, on one DALI
thread (``device_id=None``, the CPU-only pipeline), for each variant of the same photo-like set:
  full     ``fn.decoders.image(device="cpu")``: the whole decode (entropy + IDCT + colour), an upper
           bound of the hybrid path's CPU part and the exact cost of a CPU-decode training path
  roi      ``fn.decoders.image_random_crop(device="cpu")`` (ImageNet's random-resized-crop area
           0.08-1): libjpeg-turbo skips the IDCT outside the crop but still entropy-decodes down to it
  entropy  libjpeg-turbo (simplejpeg) at 1/8 scale in grayscale: every Huffman code read, almost no
           IDCT and no colour work - a proxy for the part the hybrid decoder leaves on the CPU
Each is CPU seconds of the whole process (time.process_time: DALI's threads included, the .rec read
by ``fn.readers.mxnet`` included) per image, after a warm-up. Variants are what the pack writes
(rectrain.data.images.prepare): original bytes; shorter side 256 / 320 (pack.resize) and longest side
500 (pack.max_side) at quality 90 and 75. Images are a mix like ImageNet's (most near 500x375, some
smaller, a few larger: mean ~440x340). "Cores for N img/s" = N x CPU-ms / 1000: 1000 img/s is one
2080 Ti training ResNet-50 (~700-1000), 2000 two. Rounds alternate the order of the variants; cells
are the median over rounds and the spread (max-min)/median. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import simplejpeg
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench"))

from pack_bench import imagenet_like  # noqa: E402

from rectrain.data.images import prepare  # noqa: E402
from rectrain.recordio import IRHeader, RecordWriter, pack_record  # noqa: E402

# (name, pack.resize, pack.max_side, pack.quality)
VARIANTS = [
    ("original", 0, 0, 90),
    ("shorter 256 q90", 256, 0, 90),
    ("shorter 256 q75", 256, 0, 75),
    ("shorter 320 q90", 320, 0, 90),
    ("shorter 320 q75", 320, 0, 75),
    ("longest 500 q90", 0, 500, 90),
    ("longest 500 q75", 0, 500, 75),
]
DECODERS = ("full", "roi", "entropy")
FEEDS = (1000, 2000)  # img/s: one 2080 Ti on ResNet-50, two
GRAIN = 20  # sigma of the grain added (see originals)


def photo_size(rng: np.random.Generator) -> tuple[int, int]:
    """ImageNet-like sizes: 62 % around 500x375 (a quarter portrait), 30 % smaller, 8 % larger."""
    pick = rng.random()
    if pick < 0.62:
        long, short = 500, int(rng.choice([375, 333, 375, 400]))
    elif pick < 0.92:
        long = int(rng.integers(250, 460))
        short = int(long * rng.uniform(0.66, 0.8))
    else:
        long = int(rng.integers(640, 1280))
        short = int(long * rng.uniform(0.66, 0.75))
    return (long, short) if rng.random() < 0.75 else (short, long)


def originals(n: int) -> list[bytes]:
    """Photo-like JPEGs at q85-95 with grain added to the pack bench's pictures, so that they take
    ImageNet's ~0.6 bytes per pixel (110 KB at its mean ~0.18 Mpx): the pictures alone compress to
    half that, and the entropy decode's cost follows the bytes."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        picture = np.asarray(imagenet_like(rng, *photo_size(rng)), dtype=np.float32)
        grainy = np.clip(picture + rng.normal(0, GRAIN, picture.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(grainy).save(buf, "JPEG", quality=int(rng.choice([85, 90, 95])))
        out.append(buf.getvalue())
    return out


def write_variant(root: Path, name: str, images: list[bytes], resize: int, max_side: int, quality: int) -> dict:
    """The variant's .rec/.idx as the pack stores it; returns its paths, payloads and mean size."""
    stored = [prepare(data, resize, quality, max_side=max_side)[0] for data in images]
    rec, idx = root / f"{name.replace(' ', '_')}.rec", root / f"{name.replace(' ', '_')}.idx"
    with RecordWriter(rec, idx) as w:
        for key, data in enumerate(stored):
            w.write(key, pack_record(IRHeader(0, float(key % 10), key, 0), data))
    pixels = [simplejpeg.decode_jpeg_header(d)[:2] for d in stored]
    return {
        "rec": str(rec),
        "idx": str(idx),
        "stored": stored,
        "bytes": float(np.mean([len(d) for d in stored])),
        "pixels": float(np.mean([h * w for h, w in pixels])),
    }


def _pipeline(variant: dict, decoder: str, batch: int):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=1, device_id=None, prefetch_queue_depth=2)
    def decode():
        jpegs, _ = fn.readers.mxnet(path=[variant["rec"]], index_path=[variant["idx"]], name="r")
        if decoder == "full":
            return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        return fn.decoders.image_random_crop(
            jpegs, device="cpu", output_type=types.RGB, random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 4 / 3]
        )

    pipe = decode(seed=0)
    pipe.build()
    return pipe


def cpu_ms_per_image(variant: dict, decoder: str, batch: int) -> float:
    """CPU ms per image of one decoder on one thread over the variant's images, after a warm-up."""
    n = len(variant["stored"])
    if decoder == "entropy":
        start = time.process_time()
        for data in variant["stored"]:
            simplejpeg.decode_jpeg(data, colorspace="GRAY", min_factor=8)
        return 1000 * (time.process_time() - start) / n
    pipe = _pipeline(variant, decoder, batch)
    for _ in range(2):
        pipe.run()
    steps = max(1, n // batch)
    start = time.process_time()
    for _ in range(steps):
        pipe.run()
    elapsed = time.process_time() - start
    del pipe
    return 1000 * elapsed / (steps * batch)


def measure(variants: dict, rounds: int, batch: int) -> dict:
    """{(variant, decoder): [ms per round]}; every other round runs the variants in reverse order."""
    times: dict = {}
    for r in range(rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            for decoder in DECODERS:
                times.setdefault((name, decoder), []).append(cpu_ms_per_image(variants[name], decoder, batch))
        print(f"round {r + 1}/{rounds} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    return times


def table(variants: dict, times: dict) -> list[str]:
    head = ["variant", "KB/img", "Mpx/img"]
    head += [f"{d} ms (spread)" for d in DECODERS] + [f"{d} img/s/core" for d in DECODERS]
    head += [f"cores {d} @{n}" for n in FEEDS for d in DECODERS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in variants.items():
        ms = {d: statistics.median(times[(name, d)]) for d in DECODERS}
        spread = {d: (max(times[(name, d)]) - min(times[(name, d)])) / ms[d] for d in DECODERS}
        row = [name, f"{v['bytes'] / 1e3:.1f}", f"{v['pixels'] / 1e6:.3f}"]
        row += [f"{ms[d]:.2f} ({100 * spread[d]:.0f} %)" for d in DECODERS]
        row += [f"{1000 / ms[d]:.0f}" for d in DECODERS]
        row += [f"{n * ms[d] / 1000:.1f}" for n in FEEDS for d in DECODERS]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    t0 = time.time()
    load_before = os.getloadavg()
    images = originals(args.images)
    with tempfile.TemporaryDirectory(prefix="decode_cost_") as tmp:
        variants = {name: write_variant(Path(tmp), name, images, *spec) for name, *spec in VARIANTS}
        print(f"data ready in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        times = measure(variants, args.rounds, args.batch)
    load_after = os.getloadavg()
    print(
        f"{args.images} images, {args.rounds} rounds, batch {args.batch}, 1 DALI thread, {os.cpu_count()} cores; "
        f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, "
        f"after {'/'.join(f'{x:.2f}' for x in load_after)}; {time.time() - t0:.0f} s"
    )
    print("\n".join(table(variants, times)))


if __name__ == "__main__":
    main()
