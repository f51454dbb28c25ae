"""What a mid-epoch resume of the DALI loader costs in host memory: the reader's per-sample allocation
(fn.readers.mxnet `tensor_init_bytes`) at DALI's default 1 MiB against the .rec's mean record
(rectrain.loaders.dali.record_buffer_bytes), side by side in one run.

    .venv/bin/python bench/dali_resume_memory.py [--records 2000] [--kb 110] [--repeats 2]

Writes a .rec of noise JPEGs of about --kb KB (ImageNet's full-size JPEGs average ~110 KB), takes
the train pipeline's checkpoint after 2 batches of one epoch, and restores it in a fresh interpreter
per measurement (its heap grows only by the restore): heap (VmData) and resident (VmRSS) growth and
the seconds to the restored epoch's first batch.  The train loader's shuffle buffer is
rectrain.loaders.dali.SHUFFLE_BUFFER records.  A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

WORKFLOW = Path(__file__).resolve().parents[1] / "workflow"
sys.path.insert(0, str(WORKFLOW))

from rectrain.recordio import IRHeader, RecordWriter, pack_record  # noqa: E402

# One restore, in a fresh interpreter: argv = rec idx state before|after.
RESTORE = """
import sys, time
from rectrain.loaders import LoaderSpec
from rectrain.loaders import dali


def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) * 1024


rec, idx, state, side = sys.argv[1:5]
if side == "before":  # DALI's default allocation, as the loader had it
    dali.record_buffer_bytes = lambda rec, records: dali.DALI_TENSOR_INIT_BYTES
spec = LoaderSpec(rec, idx, batch_size=32, image_size=64, rank=0, world_size=2, workers=2)
loader = dali.DaliLoader(spec)
heap, rss, started = status("VmData"), status("VmRSS"), time.perf_counter()
next(iter(loader.epoch(0, 2, open(state, "rb").read())))
print(loader.sample_bytes, status("VmData") - heap, status("VmRSS") - rss, time.perf_counter() - started)
"""


def write_rec(folder: Path, n: int, kb: int) -> tuple[str, str]:
    """n noise JPEGs of about kb KB, labels 0..9."""
    from PIL import Image

    rng = np.random.default_rng(0)
    side = int((kb * 1024 / 0.6) ** 0.5)  # noise at quality 75: ~0.6 bytes per pixel
    rec, idx = folder / "big.rec", folder / "big.idx"
    with RecordWriter(rec, idx) as w:
        for key in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "JPEG", quality=75)
            w.write(key, pack_record(IRHeader(0, float(key % 10), key, 0), buf.getvalue()))
    return str(rec), str(idx)


def checkpoint(rec: str, idx: str, path: Path) -> None:
    from rectrain.loaders import LoaderSpec
    from rectrain.loaders.dali import DaliLoader

    loader = DaliLoader(LoaderSpec(rec, idx, batch_size=32, image_size=64, rank=0, world_size=2, workers=2))
    for taken, _ in enumerate(loader.epoch(0), 1):
        if taken == 2:
            break
    path.write_bytes(loader.state())


def restore(rec: str, idx: str, state: Path, side: str) -> tuple[int, int, int, float]:
    proc = subprocess.run(
        [sys.executable, "-c", RESTORE, rec, idx, str(state), side],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=str(WORKFLOW)),
    )
    init, heap, rss, seconds = proc.stdout.split()[-4:]
    return int(init), int(heap), int(rss), float(seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--kb", type=int, default=110)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rec, idx = write_rec(Path(tmp), args.records, args.kb)
        mean_kb = Path(rec).stat().st_size / args.records / 1024
        state = Path(tmp) / "state"
        checkpoint(rec, idx, state)
        print(f"{args.records} records, mean {mean_kb:.0f} KB; restore after 2 batches of 32, shard 0 of 2")
        rows = {"before": [], "after": []}
        for _ in range(args.repeats):
            for side in rows:  # alternated: both sides see the same machine load
                rows[side].append(restore(rec, idx, state, side))
        gib = 2**30
        for side, runs in rows.items():
            heaps = [r[1] / gib for r in runs]
            rsss = [r[2] / gib for r in runs]
            secs = [r[3] for r in runs]
            print(
                f"{side:6s} tensor_init_bytes {runs[0][0]:>8d}: heap +{min(heaps):.2f}-{max(heaps):.2f} GiB, "
                f"resident +{min(rsss):.2f}-{max(rsss):.2f} GiB, first batch {min(secs):.2f}-{max(secs):.2f} s"
            )
        ratio = [b[1] / a[1] for b, a in zip(rows["before"], rows["after"], strict=True)]
        print(f"heap growth before/after: {min(ratio):.1f}-{max(ratio):.1f}x")


if __name__ == "__main__":
    main()
