"""What a loader is asked for: the LoaderSpec (the pair, the batch, the rank, the device, the crops,
the decode path and dtype, the augmentation policy) with its DALI options; the numbers both loaders'
augmentation and decoding share (the ImageNet mean and std, the crop's scale and ratio, the
evaluation's centre crop, the decode paths); and what follows from a spec for every loader alike: a
training epoch's full batches per rank and their padding, and each rank's epoch seed.

Its own module, importing nothing of the loaders but the policy's parser (augment.py, which imports
none of them either): the DALI and torch loaders (dali.py, pytorch.py), their decoding (jpeg.py) and
the package's build_loader all read it, and rectrain.loaders re-exports it, so the package imports the
loaders it builds and none of them imports the package back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rectrain.loaders.augment import NONE, AugmentPolicy

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
EVAL_CROP_FRACTION = 0.875
# The torch loader's GPU decode (rectrain.loaders.jpeg.decode_batch) needs TorchCodec's image decoders.
TORCHCODEC_FIX = "install torchcodec==0.17.0 (envs/requirements-common.txt)"
# train.decode: how the DALI loader decodes a training image (dali.py).  roi = the crop window is drawn
# first and only it is decoded (fn.decoders.image_random_crop); full = the whole image is decoded, with
# the hardware JPEG engines taking up to all of them, then fn.random_resized_crop (MLPerf's path);
# cpu = decode, crop and resize on the CPU even with a GPU (the GPU only trains).
DECODE_PATHS = ("roi", "full", "cpu")
# auto = roi until a GPU measurement says otherwise: the one H200 run so far (bench/RESULTS.md) measured
# roi only, so there is nothing yet to choose another path by (bench/gpu_efficiency.py --decodes measures
# roi against full; issue 25).
AUTO_DECODE = "roi"
# The full path's share of images for the hardware JPEG engines, whatever dali_hw_decoder_load says:
# MLPerf's setting (NVIDIA's ResNet-50 submissions: hw_decoder_load 0.99 with a full decode).  GPUs
# without the engines ignore it.
FULL_DECODE_HW_LOAD = 0.99
# timm's RepeatAugSampler's selected_round: under repeated augmentation an epoch is the set's count
# rounded down to a multiple of this (epoch_positions).
REPEAT_ROUND = 256


def decode_path(setting: str) -> str:
    """train.decode as the path that runs: auto = AUTO_DECODE."""
    path = AUTO_DECODE if setting == "auto" else setting
    if path not in DECODE_PATHS:
        raise ValueError(f"unknown decode path {setting!r}: set train.decode to auto, {', '.join(DECODE_PATHS)}")
    return path


@dataclass(frozen=True)
class DaliOptions:
    """Knobs of DALI's mixed (GPU) decoder and pipeline; the train block's dali_* keys."""

    hw_decoder_load: float
    prefetch_queue_depth: int
    device_memory_padding: int  # bytes, reserved per decode thread
    host_memory_padding: int
    preallocate: tuple[int, int]  # (width, height) of the largest image; 0 = grow on demand

    @classmethod
    def from_config(cls, loaders) -> "DaliOptions":
        """From the train block's `loaders` part (rectrain.settings)."""
        return cls(
            hw_decoder_load=float(loaders.dali_hw_decoder_load),
            prefetch_queue_depth=int(loaders.dali_prefetch_queue_depth),
            device_memory_padding=int(loaders.dali_device_memory_padding),
            host_memory_padding=int(loaders.dali_host_memory_padding),
            preallocate=tuple(loaders.dali_preallocate),
        )

    @classmethod
    def defaults(cls) -> "DaliOptions":
        """The schema's defaults (config/schema.yaml is their only home)."""
        from rectrain import settings
        from rectrain.config import stage_block

        return cls.from_config(settings.train(stage_block("train", "{}")).loaders)


@dataclass(frozen=True)
class Preprocess:
    """How images become the network's input beyond the crop: the mean and std (of 0-255 values) taken
    off, and the interpolation of the evaluation's resize.  Training always uses ImageNet's constants
    (IMAGENET_PREPROCESS); weights trained elsewhere bring their own (timm's pretrained_cfg: the check)."""

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"  # or bicubic

    @classmethod
    def of_timm_cfg(cls, pretrained: dict) -> "Preprocess":
        """From a timm model's pretrained_cfg (its mean/std in [0, 1], its interpolation)."""
        return cls(
            mean=tuple(255 * float(m) for m in pretrained["mean"]),
            std=tuple(255 * float(s) for s in pretrained["std"]),
            interpolation=pretrained.get("interpolation") or "bilinear",
        )


IMAGENET_PREPROCESS = Preprocess()


@dataclass(frozen=True)
class LoaderSpec:
    rec: str
    idx: str
    batch_size: int
    image_size: int
    train: bool = True
    grad_accum: int = 1  # train: micro-batches per optimizer step (an epoch is whole steps of them)
    rank: int = 0
    world_size: int = 1
    workers: int = 2
    device: str = "cpu"  # where batches land: "cpu" or "cuda:<local rank>"
    gpu_decode: bool = True  # decode JPEGs on the GPU when device is cuda
    seed: int = 0
    dali: DaliOptions = field(default_factory=DaliOptions.defaults)
    resize: int | None = None  # eval: the shorter side before the centre crop; None = image_size / 0.875
    # train: each epoch's crop (train.progressive, rectrain.train.resolution); () = image_size every epoch
    crops: tuple[int, ...] = ()

    decode: str = "auto"  # train.decode (DECODE_PATHS, or auto)
    order: str = "auto"  # train.order (rectrain.loaders.order.ORDERS): the training order's kind
    dtype: str = "float32"  # the images' dtype (image_dtype): float32, float16 or bfloat16
    channels_last: bool = True  # images in NHWC memory (viewed as NCHW), as channels_last training wants
    preprocess: Preprocess = IMAGENET_PREPROCESS  # normalisation, and the evaluation resize's interpolation
    augment: AugmentPolicy = NONE  # train.augment.policy, parsed (rectrain.loaders.augment); training only
    repeated_aug: int = 1  # train.repeated_aug: each record's copies per epoch (rectrain.loaders.order)

    @property
    def step_batches(self) -> int:
        """Micro-batches per optimizer step that an epoch is made whole in: grad_accum when training,
        1 for evaluation (every record once, nothing padded)."""
        return self.grad_accum if self.train else 1

    @property
    def repeats(self) -> int:
        """Copies of each record an epoch's order holds: repeated_aug when training, 1 for evaluation."""
        return self.repeated_aug if self.train else 1

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def crop_at(self, epoch: int) -> int:
        """The side of the crops `epoch` yields: its entry of `crops` when training with a schedule (an
        epoch past the schedule keeps its last), else image_size."""
        if not (self.train and self.crops):
            return self.image_size
        return self.crops[min(max(epoch, 0), len(self.crops) - 1)]

    @property
    def largest_crop(self) -> int:
        """The largest crop any epoch yields: what device memory must hold."""
        return max(self.crops) if self.train and self.crops else self.image_size

    @property
    def jpeg_engine(self) -> bool:
        """The batches' GPU has hardware JPEG decoders (rectrain.jpeg_engines): DALI's preallocation
        hints reserve memory only there (DALI: "applicable only to the mixed backend in NVIDIA Ampere
        GPU architecture"), so they are passed and counted only there."""
        import torch

        from rectrain.jpeg_engines import has_hw_jpeg

        if not self.on_gpu:
            return False
        try:
            return has_hw_jpeg(torch.cuda.get_device_name(self.device))
        except (RuntimeError, AssertionError):  # no driver to ask (a plan made for a GPU not here): none
            return False

    @property
    def gpu_decodes(self) -> bool:
        """JPEGs are to be decoded on the GPU: there is one, train.gpu_decode, and decode is not 'cpu'."""
        return self.on_gpu and self.gpu_decode and decode_path(self.decode) != "cpu"

    @property
    def eval_resize(self) -> int:
        return self.resize or eval_resize_for(self.image_size)

    def validation(self, rec: str, idx: str, size: int | None = None) -> LoaderSpec:
        """The per-epoch validation loader's spec, from this training one: every record of `rec` once, a
        centre crop of `size` (train.val_resolution; None: image_size) from a shorter side of it / 0.875,
        not augmented."""
        size = size or self.image_size
        return replace(self, rec=rec, idx=idx, train=False, image_size=size, crops=(), augment=NONE)


def eval_resize_for(crop: int) -> int:
    """The shorter side a centre crop of `crop` px is taken from: the crop is 0.875 of it, as in
    torchvision's and FFCV's ImageNet evaluation (224 of 256)."""
    return int(round(crop / EVAL_CROP_FRACTION))


def epoch_positions(n: int, repeats: int = 1) -> int:
    """Samples an epoch covers across all ranks before it is made whole optimizer steps: the n records;
    under repeated augmentation (train.repeated_aug > 1) the count of timm's RepeatAugSampler, n // 256 x
    256 (its selected_round=256; over its world ranks, floor of that / world each), so an epoch is as long
    as without repeats and sees about n / repeats records, each `repeats` times (rectrain.loaders.order).
    Below 256 records, where that count would be 0, all n (timm 1.0's fallback too: ceil(n / world) a rank)."""
    if repeats <= 1:
        return n
    return n // REPEAT_ROUND * REPEAT_ROUND or n


def train_batches_per_epoch(n: int, world_size: int, batch_size: int, accum: int = 1, repeats: int = 1) -> int:
    """Full batches every rank trains on per epoch: the epoch's samples (epoch_positions: the n records,
    or timm's RepeatAugSampler's count under `repeats`) in whole optimizer steps of the global batch
    (world_size x batch_size x accum), rounded up (the shortfall is the padding).  Whole steps, so the
    epoch's last optimizer step holds a full global batch like every other: with a count of
    micro-batches that were not a multiple of `accum` (train.grad_accum) the last step summed fewer and
    still divided by accum - 7/8 of a step at 2 x 256 x accum 8 on ImageNet.  Under repeats that is at
    most one optimizer step's samples per rank beyond timm's count, and exactly it where the global
    batch divides n // 256 x 256."""
    return accum * math.ceil(epoch_positions(n, repeats) / (world_size * batch_size * accum))


def train_padding(n: int, world_size: int, batch_size: int, accum: int = 1, repeats: int = 1) -> int:
    """Samples yielded per epoch across all ranks beyond the epoch's (epoch_positions), so that every
    optimizer step is a full global batch: records yielded twice, or under repeats records' further copies."""
    per_rank = train_batches_per_epoch(n, world_size, batch_size, accum, repeats)
    return world_size * per_rank * batch_size - epoch_positions(n, repeats)


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed for one rank's epoch; fits DALI's and torch's seed ranges."""
    return (seed * 1_000_003 + epoch * 10_007 + rank * 101 + 1) % (2**31 - 1)
