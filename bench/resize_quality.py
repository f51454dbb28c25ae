"""The pack's shrink filter against the alternatives: quality and time per image, side by side.

    .venv/bin/python bench/resize_quality.py [--images 24] [--repeats 7]

Generates the pack benchmark's photo-like pictures (~500x375), stores each as a q90 JPEG, decodes
it (simplejpeg, as the pack does) and shrinks it to several shorter sides with each filter. Quality
is the PSNR against an area average of the *uncompressed* picture (what an ideal shrink would
store) and, as a second opinion, against a Lanczos downscale of it; then what the pack would store:
the shrunk pixels encoded at q90 (4:2:0), its PSNR against the area average and its mean size. Time
is the best of ``--repeats`` passes over all images on one thread. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import simplejpeg
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench"))

from pack_bench import imagenet_like  # noqa: E402

from rectrain.data.images import shrink  # noqa: E402

FILTERS = {
    "rectrain shrink (Gaussian prefilter + bilinear)": shrink,
    "OpenCV INTER_AREA": lambda a, size: cv2.resize(a, size, interpolation=cv2.INTER_AREA),
    "OpenCV INTER_LINEAR (im2rec)": lambda a, size: cv2.resize(a, size, interpolation=cv2.INTER_LINEAR),
    "Pillow BOX (previous pack)": lambda a, size: np.asarray(Image.fromarray(a).resize(size, Image.Resampling.BOX)),
    "Pillow BILINEAR (antialiased)": lambda a, size: np.asarray(
        Image.fromarray(a).resize(size, Image.Resampling.BILINEAR)
    ),
}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255**2 / np.mean((a.astype(np.float64) - b) ** 2)))


def stored(pixels: np.ndarray) -> bytes:
    return simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), quality=90, colorspace="RGB", colorsubsampling="420")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sides", default="320,256,224,200")
    args = parser.parse_args()
    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    originals, decoded = [], []
    for _ in range(args.images):
        picture = imagenet_like(rng, 500, 375)
        buf = io.BytesIO()
        picture.save(buf, "JPEG", quality=90)
        originals.append(np.asarray(picture))
        decoded.append(simplejpeg.decode_jpeg(buf.getvalue(), colorspace="RGB"))
    print(
        f"{args.images} photo-like 500x375 q90 JPEGs; PSNR dB vs area / Lanczos downscale of the "
        f"uncompressed picture; ms per image, one thread, best of {args.repeats}"
    )
    print(
        f"{'short side (ratio)':20s} {'filter':48s} {'area ref':>8s} {'Lanczos':>8s} {'ms':>6s} "
        f"{'stored':>7s} {'KB':>5s}"
    )
    for short in (int(s) for s in args.sides.split(",")):
        size = (round(500 * short / 375), short)
        area = [cv2.resize(o, size, interpolation=cv2.INTER_AREA) for o in originals]
        lanczos = [np.asarray(Image.fromarray(o).resize(size, Image.Resampling.LANCZOS)) for o in originals]
        for name, resize in FILTERS.items():
            out = [resize(d, size) for d in decoded]
            jpegs = [stored(o) for o in out]
            kept = [simplejpeg.decode_jpeg(j, colorspace="RGB") for j in jpegs]
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for d in decoded:
                    resize(d, size)
                best = min(best, (time.perf_counter() - start) / len(decoded))
            print(
                f"{f'{short} ({375 / short:.2f}x)':20s} {name:48s} "
                f"{np.mean([psnr(o, r) for o, r in zip(out, area, strict=True)]):8.2f} "
                f"{np.mean([psnr(o, r) for o, r in zip(out, lanczos, strict=True)]):8.2f} {best * 1e3:6.3f} "
                f"{np.mean([psnr(k, r) for k, r in zip(kept, area, strict=True)]):7.2f} {np.mean([len(j) for j in jpegs]) / 1e3:5.1f}"
            )


if __name__ == "__main__":
    main()
