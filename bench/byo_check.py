"""What checking an existing .rec costs per image: rectrain.data.byo_recordio's record walk (framing,
header, label) and its image check (rectrain.data.images.prepare, the pack's strict scan decode),
measured separately on one thread and beside the pack's own scan check, on ImageNet-sized photo-like JPEGs (500x375, q90) in a pair our
writer makes. Decides whether every image is decoded (bench/RESULTS.md, "Bring your own .rec").

    .venv/bin/python bench/byo_check.py [--images 400]
"""

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflow"))

from rectrain.data.byo_recordio import _check_image, _records  # noqa: E402
from rectrain.data.images import check_scan, read_jpeg_header  # noqa: E402
from rectrain.recordio import IRHeader, RecordWriter, idx_arrays, pack_record, unpack_record  # noqa: E402


def photo_jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:375, 0:500]
    base = np.stack([x * 255 // 499, y * 255 // 374, (x + y) * 127 // 873], -1) + rng.integers(0, 24, (375, 500, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=400)
    n = ap.parse_args().images
    images = [photo_jpeg(i % 16) for i in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        pair = {"rec": f"{tmp}/t.rec", "idx": f"{tmp}/t.idx"}
        with RecordWriter(pair["rec"], pair["idx"]) as w:
            for i, img in enumerate(images):
                w.write(i, pack_record(IRHeader(0, float(i % 10), i, 0), img))
        keys, offsets = idx_arrays(pair["idx"])
        start = time.perf_counter()
        payloads = [unpack_record(p) for *_, p in _records(pair, keys, offsets)]
        walk = time.perf_counter() - start
        start = time.perf_counter()
        for i, (_, img) in enumerate(payloads):
            _check_image((i, "", img))
        check = time.perf_counter() - start
        start = time.perf_counter()
        for _, img in payloads:
            check_scan(img, read_jpeg_header(img))
        pack_scan = time.perf_counter() - start
    kb = sum(map(len, images)) / n / 1024
    load = os.getloadavg()[0]
    print(
        f"{n} images of 500x375 q90 ({kb:.0f} KiB each), one thread, load average {load:.1f} on {os.cpu_count()} cores:"
    )
    print(f"  record walk (framing, header, label): {1000 * walk / n:.3f} ms/image")
    print(f"  image check (images.prepare, strict 1/8 decode): {1000 * check / n:.3f} ms/image")
    print(f"  the pack's own scan check on the same images (images.check_scan): {1000 * pack_scan / n:.3f} ms/image")
    print(f"  ImageNet train (1,281,167 images) on 8 threads: ~{1281167 * (walk + check) / n / 8 / 60:.1f} min of CPU")


if __name__ == "__main__":
    main()
