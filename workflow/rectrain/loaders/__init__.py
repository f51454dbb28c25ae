"""Data loaders that read the packed .rec/.idx: DALI (default) and pure PyTorch (fallback, baseline).

Both yield (images, labels): images float32 NCHW normalised with the ImageNet mean/std on the loader's
device, labels int64 taken from each record's IRHeader (so they agree with the index by construction).
Same augmentation semantics in both: train = random-resized-crop (scale 0.08-1, ratio 3/4-4/3) to
image_size + horizontal flip; eval = resize the shorter side to image_size/0.875 + centre crop.

Sharding and the last batch (the part that makes or breaks DDP):
- train: every rank yields the same number of FULL batches, ceil(ceil(N / world) / batch) of them;
  the shortfall is padded with repeated records and counted (`padding_per_epoch`).  Equal counts mean
  no rank waits forever in an all-reduce at the epoch end; full batches mean no empty or size-1 batch
  (BatchNorm cannot train on those).
- eval: every record exactly once across ranks, no padding; a rank's last batch may be short or even
  empty (evaluation does no per-batch collectives, so uneven counts are harmless).
Each epoch's order is a pure function of (seed, epoch, rank), so a resumed run sees the same data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
EVAL_CROP_FRACTION = 0.875


@dataclass(frozen=True)
class LoaderSpec:
    rec: str
    idx: str
    batch_size: int
    image_size: int
    train: bool = True
    rank: int = 0
    world_size: int = 1
    workers: int = 2
    device: str = "cpu"          # where batches land: "cpu" or "cuda:<local rank>"
    gpu_decode: bool = True      # decode JPEGs on the GPU when device is cuda
    seed: int = 0

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def eval_resize(self) -> int:
        return int(round(self.image_size / EVAL_CROP_FRACTION))


def train_batches_per_epoch(n: int, world_size: int, batch_size: int) -> int:
    return math.ceil(math.ceil(n / world_size) / batch_size)


def train_padding(n: int, world_size: int, batch_size: int) -> int:
    """Records yielded twice per epoch across all ranks, so that every rank gets equal full batches."""
    return world_size * train_batches_per_epoch(n, world_size, batch_size) * batch_size - n


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed for one rank's epoch; fits DALI's and torch's seed ranges."""
    return (seed * 1_000_003 + epoch * 10_007 + rank * 101 + 1) % (2**31 - 1)


def build_loader(kind: str, spec: LoaderSpec):
    """The loader `kind` ('dali' or 'torch') for spec; see the module doc for what both promise."""
    if kind == "dali":
        from rectrain.loaders.dali import DaliLoader
        return DaliLoader(spec)
    if kind == "torch":
        from rectrain.loaders.pytorch import TorchLoader
        return TorchLoader(spec)
    raise ValueError(f"unknown loader {kind!r}: set train.loader to 'dali' or 'torch'")
