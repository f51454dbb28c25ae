"""Data loaders that read the packed .rec/.idx: DALI (default) and pure PyTorch (fallback, baseline).

Both yield (images, labels): images NCHW normalised with the ImageNet mean/std on the loader's device,
in the training's input dtype (`image_dtype`: float16 under fp16, bfloat16 under bf16 where the loader
has it, else float32) and, with channels_last, in NHWC memory (an NCHW view, nothing for the step to
copy); labels int64 taken from each record's IRHeader (so they agree with the index by construction).
Same augmentation semantics in both: train = random-resized-crop (scale 0.08-1, ratio 3/4-4/3) to
the epoch's crop (`LoaderSpec.crop_at`: image_size, or train.progressive's resolution of the epoch) +
horizontal flip; eval = resize the shorter side to `resize` (default image_size/0.875) +
centre crop to image_size (rectrain.evaluate tests several such resolutions in one run).

Sharding and the last batch (the part that makes or breaks DDP):
- train: every rank yields the same number of FULL batches, ceil(ceil(N / world) / batch) of them;
  the shortfall is padded with repeated records and counted (`padding_per_epoch`).  Equal counts mean
  no rank waits forever in an all-reduce at the epoch end; full batches mean no empty or size-1 batch
  (BatchNorm cannot train on those).
- eval: every record exactly once across ranks, no padding; a rank's last batch may be short or even
  empty (evaluation does no per-batch collectives, so uneven counts are harmless).
Each epoch's order is a pure function of (seed, epoch, rank), so a resumed run sees the same data;
within an epoch a loader resumes from its `state()` at batch k (mid-epoch checkpoints).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rectrain.data import pairowner

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

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
# The images' dtype for each train.precision: what autocast would cast the first layer's input to.
IMAGE_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def decode_path(setting: str) -> str:
    """train.decode as the path that runs: auto = AUTO_DECODE."""
    path = AUTO_DECODE if setting == "auto" else setting
    if path not in DECODE_PATHS:
        raise ValueError(f"unknown decode path {setting!r}: set train.decode to auto, {', '.join(DECODE_PATHS)}")
    return path


def image_dtype(precision: str) -> str:
    """The dtype a loader's images should have for train.precision (a torch dtype's name)."""
    return IMAGE_DTYPES[precision]


def image_itemsize(kind: str, dtype: str) -> int:
    """Bytes per value of the images loader `kind` yields when asked for `dtype`: what they take on the
    device.  DALI writes bfloat16 only where it has the type (1.34 does not: float32 then)."""
    if kind == "dali":
        from rectrain.loaders.dali import output_type

        return output_type(dtype)[1].itemsize
    import torch

    return getattr(torch, dtype).itemsize


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
class LoaderSpec:
    rec: str
    idx: str
    batch_size: int
    image_size: int
    train: bool = True
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
    dtype: str = "float32"  # the images' dtype (image_dtype): float32, float16 or bfloat16
    channels_last: bool = True  # images in NHWC memory (viewed as NCHW), as channels_last training wants

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


def eval_resize_for(crop: int) -> int:
    """The shorter side a centre crop of `crop` px is taken from: the crop is 0.875 of it, as in
    torchvision's and FFCV's ImageNet evaluation (224 of 256)."""
    return int(round(crop / EVAL_CROP_FRACTION))


def resolve_workers(setting: int | str, local_ranks: int, cores: int | None = None) -> int:
    """train/evaluate ``workers``: a number as given, or 'auto' = this node's cores shared by the
    ranks on it, so eight GPUs on 16 cores do not start 8 x 12 decode threads."""
    if setting != "auto":
        return int(setting)
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // max(1, local_ranks))


def train_batches_per_epoch(n: int, world_size: int, batch_size: int) -> int:
    return math.ceil(math.ceil(n / world_size) / batch_size)


def train_padding(n: int, world_size: int, batch_size: int) -> int:
    """Records yielded twice per epoch across all ranks, so that every rank gets equal full batches."""
    return world_size * train_batches_per_epoch(n, world_size, batch_size) * batch_size - n


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed for one rank's epoch; fits DALI's and torch's seed ranges."""
    return (seed * 1_000_003 + epoch * 10_007 + rank * 101 + 1) % (2**31 - 1)


@functools.lru_cache(maxsize=1)
def dali_import_error() -> str | None:
    """Why DALI cannot be used here (None when it can)."""
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install (missing libcuda, ABI) is as unusable as none
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True)
class LoaderChoice:
    kind: str  # the loader that will run: 'dali' or 'torch'
    decode: str  # where and how JPEGs are decoded, in words (run.json, the log)
    note: str | None = None  # why the choice differs from the request; None when it does not
    decode_path: str | None = None  # the DALI loader's train.decode path (DECODE_PATHS); None for torch


def choose_loader(
    requested: str,
    has_cuda: bool,
    has_dali: bool,
    gpu_decode: bool = True,
    dali_error: str | None = None,
    torchcodec_error: str | None = None,
    *,
    decode: str = AUTO_DECODE,
) -> LoaderChoice:
    """The loader and decoder for train.loader=`requested` on this machine (a pure decision).

    DALI requested but not importable: the torch loader reads the same .rec, decoding on the GPU with
    TorchCodec's decode_jpeg when there is one - slower than DALI's hardware decoder, never a crash.
    The torch loader's GPU decode needs TorchCodec (`torchcodec_error`: why it cannot be imported);
    without it the workers decode on the CPU, saying why.  `decode`: train.decode (the DALI loader's
    path; 'cpu' keeps both loaders' decode off the GPU)."""
    if requested not in ("dali", "torch"):
        raise ValueError(f"unknown loader {requested!r}: set train.loader to 'dali' or 'torch'")
    kind = "torch" if requested == "dali" and not has_dali else requested
    path = decode_path(decode)
    gpu_decode = gpu_decode and path != "cpu"
    gpu = has_cuda and gpu_decode and (kind == "dali" or torchcodec_error is None)
    notes = []
    if kind != requested:
        notes.append(
            f"train.loader is 'dali' but DALI cannot be imported ({dali_error or 'not installed'}): using the "
            f"torch loader on the same .rec instead, decoding "
            + ("on the GPU with TorchCodec's decode_jpeg" if gpu else "on the CPU in worker processes")
            + ". For DALI's mixed decoder install nvidia-dali-cuda<CUDA major>0 (e.g. nvidia-dali-cuda120); "
            "to keep the torch loader and silence this, set train.loader: torch"
        )
    if kind == "torch" and has_cuda and gpu_decode and not gpu:
        notes.append(
            f"train.gpu_decode is true but TorchCodec cannot be imported ({torchcodec_error}): the torch loader "
            f"decodes on the CPU in worker processes. For its GPU decode {TORCHCODEC_FIX}; "
            "to silence this, set train.gpu_decode: false"
        )
    if kind == "dali":
        return LoaderChoice(kind, dali_decode(path, gpu), "; ".join(notes) or None, path)
    else:
        decode = (
            "gpu: TorchCodec decode_jpeg (nvJPEG), one batched call per step"
            if gpu
            else "cpu: simplejpeg (libjpeg-turbo, JPEG only) in train.workers worker processes"
        )
    return LoaderChoice(kind, decode, "; ".join(notes) or None)


def dali_decode(path: str, gpu: bool) -> str:
    """The DALI loader's decode in words, "gpu: ..." or "cpu: ..." (run.json's `decode`)."""
    if not gpu:
        crop = "full-image decode, then random_resized_crop" if path == "full" else "ROI decode of the crop window"
        return f"cpu: DALI (libjpeg-turbo) in train.workers threads, {crop} (train.decode: {path})"
    if path == "full":
        return (
            "gpu: DALI mixed decoder, full-image decode (nvJPEG; hardware JPEG engines take "
            f"{FULL_DECODE_HW_LOAD} of the images), then random_resized_crop on the GPU (train.decode: full)"
        )
    return (
        "gpu: DALI mixed decoder, ROI decode of the crop window (nvJPEG; hardware JPEG engines take "
        "dali_hw_decoder_load of the images) (train.decode: roi)"
    )


class Loader(Protocol):
    """What a built loader offers the training and evaluation code (DaliLoader, TorchLoader)."""

    kind: str  # 'dali' or 'torch': the class that runs
    spec: LoaderSpec
    size: int  # records in the .rec
    batches_per_epoch: int  # on this rank; equal on every rank when training
    padding_per_epoch: int  # records repeated per epoch across all ranks so every batch is full
    choice: LoaderChoice  # what was asked for, what runs and why (build_loader sets it)
    image_dtype: torch.dtype  # the images' dtype: spec.dtype, or float32 where the loader lacks it

    def epoch(self, epoch: int, start: int = 0, state=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, labels) batches of one epoch, in this rank's order for that epoch; a training
        epoch resumed from batch `start` with the `state()` taken there yields exactly the batches
        start, start + 1, ... of the uninterrupted epoch."""
        ...

    def state(self):
        """A training epoch's position beyond the batch count (weights_only-loadable, None if none):
        DALI's pipeline checkpoint; nothing for the torch loader (its order and crops follow from it)."""
        ...


def resolve_loader(requested: str, spec: LoaderSpec) -> LoaderChoice:
    """choose_loader for this machine and spec."""
    from rectrain.loaders import jpeg

    error = dali_import_error() if requested == "dali" else None
    codec_error = jpeg.torchcodec_error() if spec.gpu_decodes else None
    return choose_loader(requested, spec.on_gpu, error is None, spec.gpu_decode, error, codec_error, decode=spec.decode)


def build_loader(kind: str, spec: LoaderSpec) -> Loader:
    """The loader `kind` ('dali' or 'torch') for spec; see the module doc for what both promise.
    The loader's `.choice` (LoaderChoice) says what runs; a DALI request without DALI falls back to torch."""
    pairowner.refuse_changed(spec.rec, spec.idx)  # a brought pair replaced since its check
    choice = resolve_loader(kind, spec)
    if choice.note:
        log.warning(choice.note)
    loader = _build(choice.kind, spec)
    loader.choice = choice
    return loader


def _build(kind: str, spec: LoaderSpec):
    if kind == "dali":
        from rectrain.loaders.dali import DaliLoader

        return DaliLoader(spec)
    if kind == "torch":
        from rectrain.loaders.pytorch import TorchLoader

        return TorchLoader(spec)
    raise ValueError(f"unknown loader {kind!r}: set train.loader to 'dali' or 'torch'")
