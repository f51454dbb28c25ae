"""Pure-PyTorch loader from the same .rec: the fallback when DALI is unavailable, and the baseline.

A map-style Dataset over rectrain.recordio.IndexedRecordReader (its file descriptor opens lazily in
each worker).  Workers decode (rectrain.loaders.jpeg: simplejpeg for JPEG; Pillow, restricted to
those formats, for the PNG, BMP, TIFF, WebP or GIF records a pair of your own keeps) and crop/flip
with torchvision transforms v2, returning uint8 so little crosses the process boundary; the float
conversion and normalisation happen once per batch on the target device.  On a GPU with gpu_decode
(and TorchCodec installed), workers only read bytes and the batch is decoded by TorchCodec's
decode_jpeg(device="cuda").  A record in none of those formats stops the epoch naming the record.
Sharding (ShardSampler): train.order's order of all records per epoch (rectrain.loaders.order: a
permutation, or the quasi-random order on a hard disk), seeded by (seed, epoch), the same on every
rank; rank r takes every world-th record starting at r, like DistributedSampler.
Training samples are augmented under their own seed, drawn from (seed, epoch, rank, position in the
epoch) (SeededPositions): a crop does not depend on which worker decodes it, so an epoch resumed at
batch k (`epoch(e, start=k)`, the sampler started at position k x batch) sees exactly the samples,
crops and flips of the uninterrupted epoch's batches k and later.  Each training epoch crops to its
own size (LoaderSpec.crop_at, train.progressive): the transform is set before the epoch's DataLoader
starts its workers, which take their copy of the dataset then.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import multiprocessing.forkserver
import os
import select
import signal
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms import v2

from rectrain.loaders import jpeg, order
from rectrain.loaders.augment import torch_transform
from rectrain.loaders.spec import (
    CROP_RATIO,
    CROP_SCALE,
    LoaderSpec,
    epoch_seed,
    train_batches_per_epoch,
    train_padding,
)
from rectrain.recordio import IndexedRecordReader, header_label, unpack_record


def augment(spec: LoaderSpec, epoch: int = 0):
    """The uint8 CHW tensor (rectrain.loaders.jpeg; PILToTensor passes tensors through) -> uint8 CHW
    transform matching the DALI pipeline's semantics, cropping to `epoch`'s size when training, then
    train.augment's policy (timm's own transform, rectrain.loaders.augment.torch_transform)."""
    if spec.train:
        size = spec.crop_at(epoch)
        policy = torch_transform(spec.augment, size)
        return v2.Compose(
            [
                v2.PILToTensor(),
                v2.RandomResizedCrop(size, scale=CROP_SCALE, ratio=CROP_RATIO, antialias=True),
                v2.RandomHorizontalFlip(),
                *([policy] if policy else []),
            ]
        )
    interpolation = v2.InterpolationMode(spec.preprocess.interpolation)
    resize = v2.Resize(spec.eval_resize, interpolation=interpolation, antialias=True)
    return v2.Compose([v2.PILToTensor(), resize, v2.CenterCrop(spec.image_size)])


def worker_context():
    """Where the DataLoader's workers start: forked from a forkserver, never from the rank itself.

    On Python before 3.12 a child forked while any other thread holds the interpreter's runtime lock
    deadlocks in PyOS_AfterFork_Child before it runs a line of Python (CPython gh-112275, fixed in 3.12),
    and a training rank has such threads (gloo's, the likely holders: they enter Python from C++).
    A stress loop of 2-rank CPU runs hung 1 run in ~75: the worker of epoch 1, forked just after epoch
    0's validation all-reduce, waited on that lock forever (gdb), and its rank with it.  The forkserver is
    one single-threaded process per rank, started with the loader, that imports this module (torch, the
    decoders) once (rectrain.loaders.workerserver); every epoch's workers fork from it and get the
    dataset pickled."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["rectrain.loaders.workerserver"])  # no effect once the forkserver runs
    return ctx


# The signals a rank may act on (train.stop_signals, Ctrl-C, torchrun's): its forkserver and workers
# ignore them (rectrain.loaders.workerserver, end_with) and leave the stop to the rank.
RANK_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU")


def end_with(rank_pid: int, worker_id: int = 0) -> None:
    """worker_init_fn: the worker leaves the rank's signals to the rank, and ends when the rank ends,
    however it ends.

    A worker forked from the rank inherited the rank's handlers: Ctrl-C to the process group, or a
    SIGTERM to every process of the job (SLURM's at a time limit), asked the rank to stop after its step
    while the workers went on serving it.  From the forkserver a worker would die at once and its rank's
    next batch fail instead of the clean stop, so it ignores them - except a SIGTERM its rank sends: that
    is multiprocessing ending its daemonic workers (a rank exiting with an epoch unfinished, after a bad
    record say), which would otherwise wait for them forever.  torch's own watchdog in a worker watches
    its parent, now the forkserver, which lives as long as any process it forked: a rank killed outright
    (SIGKILL, the out-of-memory killer) would leave its workers and the forkserver waiting forever.  A
    pidfd becomes readable when the rank exits; where there is none (Linux before 5.3) the rank's pid is
    polled every second."""
    for name in RANK_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    # SIGTERM blocked (in this thread and every later one) and taken by terminated() alone, which knows
    # its sender; its action must not be SIG_IGN, which would discard it before anyone could wait for it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def terminated() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != rank_pid:
            pass
        os._exit(128 + signal.SIGTERM)

    def rank_gone() -> None:
        try:
            select.select([os.pidfd_open(rank_pid)], [], [])
        except (AttributeError, OSError):
            while os.path.exists(f"/proc/{rank_pid}"):
                time.sleep(1.0)
        os._exit(0)

    for watch in (terminated, rank_gone):
        threading.Thread(target=watch, name=f"rectrain-{watch.__name__}", daemon=True).start()


def start_worker_server():
    """worker_context, its forkserver started now: its imports then overlap the rank's setup (model,
    DDP, calibration) instead of coming before the first epoch's first batch."""
    ctx = worker_context()
    multiprocessing.forkserver.ensure_running()
    return ctx


class RecordDecodeError(RuntimeError):
    """A record's image cannot be decoded; str() names the .rec, the record and the cause."""


class RecordDataset(Dataset):
    """Records of a .rec in .idx file order -> (uint8 CHW image or raw bytes, label, record id)."""

    def __init__(self, rec: str, idx: str, transform=None, decode: bool = True):
        self.reader = IndexedRecordReader(rec, idx)
        self.transform, self.decode = transform, decode

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, key):
        """key: a record index, or (index, seed): the sample's augmentation seed (SeededPositions)."""
        if not isinstance(key, tuple):
            return self._item(key)
        i, seed = key
        with torch.random.fork_rng(devices=[]):  # the process's own RNG stream is left as it was
            torch.manual_seed(seed)
            return self._item(i)

    def _item(self, i: int):
        header, data = unpack_record(self.reader.nth(i)[1])
        if not self.decode:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), header_label(header), header.id
        try:
            image = jpeg.decode(data)
        except (OSError, ValueError) as err:
            raise RecordDecodeError(f"{self.reader.rec_path} record {i} (id {header.id}): {err}") from None
        return (self.transform(image) if self.transform else image), header_label(header), header.id


class ShardSampler(Sampler[int]):
    """Indices of one rank's share of an epoch (rectrain.loaders.order: the DALI loader's order too).

    train (pad_to_batch): every rank gets train_batches_per_epoch full batches (whole optimizer steps of
    `accum` micro-batches), the permutation padded from its start as DistributedSampler pads (each record
    `repeats` times in a row under repeated augmentation, as timm's RepeatAugSampler); eval: every index
    exactly once, no padding."""

    def __init__(
        self,
        n: int,
        rank: int,
        world_size: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        pad_to_batch: bool,
        accum: int = 1,
        blocks: order.Blocks | None = None,
        repeats: int = 1,
    ):
        """blocks: the quasi-random order's (rectrain.loaders.order.order_for); None = the permutation.
        repeats: train.repeated_aug, each record's copies per epoch (training only)."""
        if shuffle != pad_to_batch:
            raise ValueError("ShardSampler: shuffle and pad_to_batch go together (training) or not at all (eval)")
        self.n, self.rank, self.world, self.batch, self.accum = n, rank, world_size, batch_size, accum
        self.shuffle, self.seed, self.pad, self.blocks, self.repeats = shuffle, seed, pad_to_batch, blocks, repeats
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            return map(
                int,
                order.train_order(
                    self.n,
                    self.rank,
                    self.world,
                    self.batch,
                    self.seed,
                    self.epoch,
                    accum=self.accum,
                    blocks=self.blocks,
                    repeats=self.repeats,
                ),
            )
        return map(int, order.eval_order(self.n, self.rank, self.world))

    def __len__(self) -> int:
        if self.pad:
            return train_batches_per_epoch(self.n, self.world, self.batch, self.accum, self.repeats) * self.batch
        return len(range(self.rank, self.n, self.world))


class SeededPositions(Sampler):
    """(record index, augmentation seed) for the positions of `sampler`'s epoch from `start` on."""

    def __init__(self, sampler: Sampler[int], seed: int, start: int = 0):
        self.sampler, self.seed, self.start = sampler, seed, start

    def __iter__(self):
        rest = itertools.islice(iter(self.sampler), self.start, None)
        for pos, i in enumerate(rest, start=self.start):
            yield i, (self.seed * 1_000_003 + pos) % (2**31 - 1)

    def __len__(self) -> int:
        return len(self.sampler) - self.start


def _collate_bytes(batch):
    data, labels, ids = zip(*batch, strict=True)
    return list(data), torch.tensor(labels, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64)


class TorchLoader:
    kind = "torch"

    def __init__(self, spec: LoaderSpec, decode_on_device: bool | None = None):
        self.spec = spec
        # Batch decode on the device (GPU by default when there is one; forcing it on CPU is for tests).
        # On a GPU that needs TorchCodec (choose_loader says so in the run's log when it is missing).
        if decode_on_device is None:
            decode_on_device = spec.gpu_decodes and jpeg.torchcodec_error() is None
        self.decode_on_device = decode_on_device
        self.transform = augment(spec)
        self.dataset = RecordDataset(
            spec.rec, spec.idx, None if self.decode_on_device else self.transform, decode=not self.decode_on_device
        )
        self.worker_context = start_worker_server() if spec.workers else None
        self.size = len(self.dataset)
        self.image_dtype = getattr(torch, spec.dtype)
        w, b, a = spec.world_size, spec.batch_size, spec.step_batches
        self.padding_per_epoch = train_padding(self.size, w, b, a, spec.repeats) if spec.train else 0
        self.batches_per_epoch = train_batches_per_epoch(self.size, w, b, a, spec.repeats)
        # train.order; the workers read each record where the order puts it (no read-ahead of blocks here)
        self.order = order.order_for(spec.order, self.dataset.reader, b) if spec.train else None
        self.sampler = ShardSampler(
            self.size,
            spec.rank,
            w,
            b,
            shuffle=spec.train,
            seed=spec.seed,
            pad_to_batch=spec.train,
            accum=a,
            blocks=self.order.blocks if self.order else None,
            repeats=spec.repeats,
        )
        device = torch.device(spec.device)
        self._mean = torch.tensor(spec.preprocess.mean, device=device).view(1, 3, 1, 1)
        self._std = torch.tensor(spec.preprocess.std, device=device).view(1, 3, 1, 1)

    def batches(self, epoch: int, start: int = 0):
        """(uint8 images or raw bytes, labels, record ids) batches of one epoch from batch `start` on,
        before normalisation."""
        s = self.spec
        self.sampler.set_epoch(epoch)
        sampler = self.sampler
        if s.train:
            self._set_transform(augment(s, epoch))
            sampler = SeededPositions(self.sampler, epoch_seed(s.seed, epoch, s.rank), start * s.batch_size)
        loader = DataLoader(
            self.dataset,
            batch_size=s.batch_size,
            sampler=sampler,
            num_workers=s.workers,
            multiprocessing_context=self.worker_context,
            worker_init_fn=functools.partial(end_with, os.getpid()) if s.workers else None,
            pin_memory=s.on_gpu,
            drop_last=False,
            collate_fn=_collate_bytes if self.decode_on_device else None,
            prefetch_factor=4 if s.workers else None,
            generator=torch.Generator().manual_seed(epoch_seed(s.seed, epoch, s.rank)),
        )
        return iter(loader)

    def _set_transform(self, transform) -> None:
        """The augmentation the next DataLoader's workers (or the batch decode) apply."""
        self.transform = transform
        if not self.decode_on_device:
            self.dataset.transform = transform

    def _decode_batch(self, data: list[torch.Tensor], ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        try:
            images = jpeg.decode_batch(data, device)
        except (RuntimeError, ValueError) as err:
            position = getattr(err, "position", None)
            where = f"record id {int(ids[position])}" if position is not None else f"one of records {ids.tolist()}"
            raise RecordDecodeError(f"{self.spec.rec} {where}: {err}") from None
        return torch.stack([self.transform(img) for img in images])

    def state(self) -> None:
        """Nothing beyond the position: the epoch's order and every sample's seed follow from it."""
        return None

    def read_stats(self) -> None:
        """Not measured: the records are read in the worker processes, one at a time."""
        return None

    def epoch(self, epoch: int, start: int = 0, state=None):
        """(images, labels) batches of one epoch from batch `start` on (`state` is not needed: see state)."""
        device = torch.device(self.spec.device)
        # GPU decode runs on its own stream: batch k+1 decodes while step k still computes on the main
        # stream (the training loop keeps the host a step ahead), instead of queueing behind it.
        side = torch.cuda.Stream(device) if self.decode_on_device and device.type == "cuda" else None
        for images, labels, ids in self.batches(epoch, start):
            if side:
                # nvJPEG writes the decoded images from its own stream into tensors allocated on `side`;
                # the allocator hands `side` memory back as soon as the previous batch's kernels are
                # queued, not done, so they must be done before nvJPEG may write into it.
                side.synchronize()
            with torch.cuda.stream(side) if side else contextlib.nullcontext():
                if self.decode_on_device:
                    images = self._decode_batch(images, ids, device)
                images = images.to(device, non_blocking=True).float().sub_(self._mean).div_(self._std)
                # The DALI loader's dtype and layout (rectrain.loaders): what the first layer computes in.
                layout = torch.channels_last if self.spec.channels_last else torch.contiguous_format
                images = images.to(self.image_dtype, memory_format=layout)
            if side:
                main = torch.cuda.current_stream(device)
                main.wait_stream(side)
                images.record_stream(main)  # the allocator must not reuse it before the main stream is done
            yield images, labels.to(device, non_blocking=True)
