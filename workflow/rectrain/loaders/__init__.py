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
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rectrain.data import pairowner

# What a loader is asked for lives in its own module (spec.py), which the loaders import without this
# package's code: re-exported here, where the stages import it from.
from rectrain.loaders.spec import (
    AUTO_DECODE,
    CROP_RATIO,
    CROP_SCALE,
    DECODE_PATHS,
    EVAL_CROP_FRACTION,
    FULL_DECODE_HW_LOAD,
    IMAGENET_MEAN,
    IMAGENET_PREPROCESS,
    IMAGENET_STD,
    REPEAT_ROUND,
    TORCHCODEC_FIX,
    DaliOptions,
    LoaderSpec,
    Preprocess,
    decode_path,
    epoch_positions,
    epoch_seed,
    eval_resize_for,
    train_batches_per_epoch,
    train_padding,
)

__all__ = [
    "REPEAT_ROUND",
    "epoch_positions",
    "AUTO_DECODE",
    "CROP_RATIO",
    "CROP_SCALE",
    "DECODE_PATHS",
    "EVAL_CROP_FRACTION",
    "FULL_DECODE_HW_LOAD",
    "IMAGENET_MEAN",
    "IMAGENET_PREPROCESS",
    "IMAGENET_STD",
    "IMAGE_DTYPES",
    "TORCHCODEC_FIX",
    "DaliOptions",
    "Loader",
    "LoaderChoice",
    "LoaderSpec",
    "Preprocess",
    "build_loader",
    "choose_loader",
    "dali_decode",
    "dali_import_error",
    "decode_path",
    "epoch_seed",
    "eval_resize_for",
    "image_dtype",
    "image_itemsize",
    "resolve_loader",
    "resolve_workers",
    "train_batches_per_epoch",
    "train_padding",
]

if TYPE_CHECKING:
    import torch

    from rectrain.loaders.order import TrainOrder

log = logging.getLogger(__name__)

# The images' dtype for each train.precision: what autocast would cast the first layer's input to.
IMAGE_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


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


def resolve_workers(setting: int | str, local_ranks: int, cores: int | None = None) -> int:
    """train/evaluate ``workers``: a number as given, or 'auto' = this node's cores shared by the
    ranks on it, so eight GPUs on 16 cores do not start 8 x 12 decode threads."""
    if setting != "auto":
        return int(setting)
    cores = cores or len(os.sched_getaffinity(0))
    return max(1, cores // max(1, local_ranks))


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
    order: TrainOrder | None  # train.order as it runs (rectrain.loaders.order); None when evaluating

    def epoch(self, epoch: int, start: int = 0, state=None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(images, labels) batches of one epoch, in this rank's order for that epoch; a training
        epoch resumed from batch `start` with the `state()` taken there yields exactly the batches
        start, start + 1, ... of the uninterrupted epoch."""
        ...

    def state(self):
        """A training epoch's position beyond the batch count (weights_only-loadable, None if none):
        DALI's pipeline checkpoint; nothing for the torch loader (its order and crops follow from it)."""
        ...

    def read_stats(self) -> dict | None:
        """What the training reads did so far (rectrain.loaders.readahead.ReadStats, with the order that
        ran); None where not measured (the torch loader's workers, evaluation)."""
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
