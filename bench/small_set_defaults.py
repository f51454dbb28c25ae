"""What each default training setting does to a short run on a small real-image set: scikit-learn's
bundled handwritten digits (1,797 real 8x8 scans of 10 digits, shipped with the package, no download),
upscaled to 16 px JPEGs and packed as .rec/.idx (1,400 train, 397 val), trained from the schema's
defaults with one setting flipped at a time, on one CPU process (deterministic), in fp32.

    OMP_NUM_THREADS=1 .venv/bin/python bench/small_set_defaults.py [--epochs 8] [--only defaults]

Prints one line per setting: the last epoch's val top-1 (epochs.csv's single-view validation; the EMA's
for a row with train.ema) and the seconds it took. tests/test_small_set_learns.py trains the defaults'
row and today's recipe row and holds them to this table (bench/RESULTS.md, "Defaults on a small
real-image set", "Today's recipe on a small real-image set"). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from rectrain.recordio import IRHeader, RecordWriter, pack_record  # noqa: E402

TRAIN_IMAGES = 1400  # of the 1,797: the rest is the val split
# The short run's settings: the schema's defaults but for what makes it a short run on this set.  Its
# precision is the default (auto: fp32 on a CPU): bf16 on a CPU turned runs on this set to NaN at random,
# torch's CPU bf16 convolution backward reading uninitialised memory at 16 px (bench/bf16_cpu_conv.py).
SHORT_RUN = {
    "devices": "cpu",
    "cpu_processes": 1,
    "image_size": 16,
    "epochs": 8,
    "workers": 1,
    "calibration_steps": 0,
    "progress_s": 600,
    "precision": "auto",
}
# Each default recipe setting the schema holds for ImageNet's long runs, and its other value.
FLIPPED = {
    "zero_init_residual: false": {"zero_init_residual": False},
    "label_smoothing: 0": {"label_smoothing": 0.0},
    "nesterov: false": {"nesterov": False},
    "warmup_epochs: 0": {"warmup_epochs": 0},
    "zero_init_residual: true (the ImageNet value)": {"zero_init_residual": True},
}
# Today's recipe ingredients (issue 49) on the defaults: RandAugment (DeiT's and ConvNeXt's policy), Mixup
# and CutMix (their alphas) and the weights' EMA (a decay and warm-up a run of a few hundred steps can follow).
TODAY = {
    "augment": {"policy": "rand-m9-mstd0.5-inc1"},
    "mixup": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0},
    "ema": {"decay": 0.99, "warmup": True},
}
RECIPES = {"RandAugment + Mixup/CutMix + EMA": TODAY}


def digits_dataset(root: Path, size: int = 16, seed: int = 0) -> list[str]:
    """sklearn's digits as train/val .rec/.idx + classes.tsv under root, each image upscaled (bicubic)
    to size x size RGB JPEG, split by a seeded permutation; returns the train CLI's data arguments."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    root.mkdir(parents=True, exist_ok=True)
    args = []
    for split, keys in (("train", order[:TRAIN_IMAGES]), ("val", order[TRAIN_IMAGES:])):
        rec, idx = root / f"{split}.rec", root / f"{split}.idx"
        with RecordWriter(rec, idx) as w:
            for n, key in enumerate(keys):
                pixels = (digits.images[key] * (255 / 16)).astype(np.uint8)
                image = Image.fromarray(pixels).resize((size, size), Image.BICUBIC).convert("RGB")
                buf = io.BytesIO()
                image.save(buf, "JPEG", quality=95)
                label = float(digits.target[key])
                w.write(n, pack_record(IRHeader(0, label, n, 0), buf.getvalue()))
        prefix = "--" if split == "train" else "--val-"
        args += [f"{prefix}rec", str(rec), f"{prefix}idx", str(idx)]
    tsv = root / "classes.tsv"
    tsv.write_text("label\twnid\tname\n" + "".join(f"{k}\tdigit{k}\tdigit {k}\n" for k in range(10)))
    return [*args, "--classes", str(tsv)]


def train(data: list[str], out: Path, **overrides) -> tuple[float, float]:
    """(the last epoch's val top-1 - of the EMA's weights when train.ema is on, the weights it publishes -,
    seconds) of one run from the schema's defaults with SHORT_RUN and `overrides`; raises with the run's
    stderr when it fails."""
    cfg = json.dumps({**SHORT_RUN, **overrides})
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "workflow"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "rectrain.train", "--config-json", cfg, *data, "--out", str(out), "--threads", "1"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    with open(out / "epochs.csv", newline="") as f:
        last = list(csv.DictReader(f))[-1]
    column = "ema_val_single_view_top1" if overrides.get("ema", {}).get("decay") else "val_single_view_top1"
    return float(last[column]), time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=SHORT_RUN["epochs"])
    ap.add_argument("--only", nargs="*", help="rows to run: 'defaults' and/or FLIPPED's or RECIPES' names")
    ap.add_argument("--precision", default=SHORT_RUN["precision"], help="train.precision of every row")
    ap.add_argument("--seeds", type=int, nargs="*", default=[0], help="train.seed: each row once per seed")
    args = ap.parse_args()
    rows = {"defaults": {}, **FLIPPED, **RECIPES}
    with tempfile.TemporaryDirectory() as tmp:
        data = digits_dataset(Path(tmp) / "digits")
        for name, overrides in rows.items():
            if args.only and name not in args.only:
                continue
            for seed in args.seeds:
                out = Path(tmp) / f"run{len(os.listdir(tmp))}"
                try:
                    top1, seconds = train(
                        data, out, epochs=args.epochs, precision=args.precision, seed=seed, **overrides
                    )
                except RuntimeError as err:  # a diverged run stops (train.nonfinite_steps): its last line says where
                    print(
                        f"digits, {args.epochs} epochs, {args.precision}, seed {seed}, {name}: FAILED: {str(err).strip().splitlines()[-1]}"
                    )
                    continue
                print(
                    f"digits 1,400/397 at 16 px, {args.epochs} epochs, {args.precision}, seed {seed}, {name}: "
                    f"val top-1 {top1:.3f} ({seconds:.0f} s)"
                )


if __name__ == "__main__":
    main()
