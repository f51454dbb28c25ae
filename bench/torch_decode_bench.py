"""Torch loader decode benchmark: JPEG bytes -> uint8 CHW RGB tensor, images/s on one core.

    python bench/torch_decode_bench.py [--images 200] [--rounds 5] [--size 500x375]

The torch loader's decode step in isolation (no crop, no batching), every decoder on the same
photo-like JPEGs (bench/loader_bench.py's generator), in one thread, so img/s is img/s per core:
  pil-any          PIL Image.open (any format) + convert + PILToTensor: the worker path before #26
  torchvision.io   torchvision.io.decode_jpeg on the CPU: the batch path before #24 (deprecated)
  pil-jpeg         PIL Image.open(formats=["JPEG"]): the loader's fallback without simplejpeg
  simplejpeg       simplejpeg.decode_jpeg (libjpeg-turbo): the loader's worker decode
  torchcodec       torchcodec.decoders.decode_jpeg on the CPU (when installed): the batch path
  opencv           cv2.imdecode (not JPEG-only: shown for scale)
Rounds interleave the decoders (order reversed every other round); the table gives each one's median
and its median within-round ratio to pil-any. Decoders not installed are left out, saying so.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from loader_bench import make_jpeg  # noqa: E402


def _pil_any(data: bytes) -> torch.Tensor:
    from PIL import Image
    from torchvision.transforms.v2 import functional as F

    return F.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))


def _torchvision_io(data: bytes) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():  # the deprecation is the point of measuring it, not noise to repeat
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def _opencv(data: bytes) -> torch.Tensor:
    import cv2

    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    return torch.from_numpy(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)).permute(2, 0, 1)


def decoders() -> tuple[dict, list[str]]:
    """name -> decode function for what is installed, and the names left out (with why)."""
    from rectrain.loaders import jpeg

    found = {"pil-any": _pil_any, "torchvision.io": _torchvision_io, "pil-jpeg": jpeg.decode_pil}
    missing = []
    if jpeg.simplejpeg is not None:
        found["simplejpeg"] = jpeg.decode_simplejpeg
    else:
        missing.append("simplejpeg (not installed)")
    if jpeg.torchcodec_error() is None:
        from torchcodec.decoders import decode_jpeg

        found["torchcodec"] = lambda data: decode_jpeg(data, mode="RGB")
    else:
        missing.append(f"torchcodec ({jpeg.torchcodec_error()})")
    try:
        import cv2

        cv2.setNumThreads(1)
        found["opencv"] = _opencv
    except ImportError:
        missing.append("opencv (not installed)")
    return found, missing


def rate(decode, images: list[bytes]) -> float:
    start = time.perf_counter()
    for data in images:
        decode(data)
    return len(images) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", default="500x375", help="WxH of the generated JPEGs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    size = tuple(int(v) for v in args.size.split("x"))
    images = [make_jpeg(rng, size) for _ in range(args.images)]
    found, missing = decoders()
    reference = found["pil-any"](images[0])
    for name, decode in found.items():  # every decoder gives the same picture (libjpeg-turbo, ISLOW)
        diff = (decode(images[0]).int() - reference.int()).abs().max().item()
        print(f"{name}: max pixel difference to pil-any {diff}")
    rates = {name: [] for name in found}
    ratios = {name: [] for name in found}
    for r in range(args.rounds):
        order = list(found) if r % 2 == 0 else list(found)[::-1]
        this = {name: rate(found[name], images) for name in order}
        for name, value in this.items():
            rates[name].append(value)
            ratios[name].append(value / this["pil-any"])
    kb = sum(map(len, images)) / len(images) / 1e3
    print(f"\n{len(images)} JPEGs {args.size} (~{kb:.0f} KB), {args.rounds} rounds, one thread")
    print(f"{'decoder':<16}{'img/s/core':>12}{'vs pil-any':>12}")
    for name in found:
        print(f"{name:<16}{statistics.median(rates[name]):>12.0f}{statistics.median(ratios[name]):>12.2f}")
    for name in missing:
        print(f"left out: {name}")


if __name__ == "__main__":
    main()
