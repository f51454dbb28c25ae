"""DALI loader from the .rec: decode on the GPU ("mixed") when there is one and on the CPU otherwise,
random-resized-crop + flip + normalise in the pipeline.  The crop follows train.decode
(rectrain.loaders.DECODE_PATHS): roi = ROI decode + resize, full = full-image decode +
fn.random_resized_crop, cpu = roi on the CPU even with a GPU.  crop_mirror_normalize writes the
images in the training's dtype (float16 under fp16; bfloat16 where this DALI has the type, else
float32) and, with channels_last, HWC, so torch sees channels_last without a copy.

Training reads its records in the order of rectrain.loaders.order (train.order) - a new order of the
whole dataset every epoch from (seed, epoch), a full permutation or, on a hard disk, the quasi-random
order of shuffled blocks; dealt across the ranks as torch's DistributedSampler does; the torch
loader's order too - fed through fn.external_source (EpochRecords) from the one .rec by the .idx's
offsets, read ahead of the step by reader threads (rectrain.loaders.readahead).  A pipeline is built
per epoch with a seed from (seed, epoch, rank) and the epoch's crop size (LoaderSpec.crop_at,
train.progressive), so a resumed run replays exactly the epochs it missed, at their resolutions.  Within an epoch it is built with DALI's checkpointing on: `state()`
is the pipeline's checkpoint after the batches this loader has yielded (DALI counts the batches its
consumer took, not those waiting in the prefetch queue): the batch index the external source resumes
at and the crop and flip generators' states - the order itself needs nothing saved.  `epoch(e, start,
state)` rebuilds the epoch's pipeline from it and yields the epoch's remaining batches, the ones an
uninterrupted epoch would have yielded (tests/test_train_preempt.py checks them pixel for pixel).
Every training batch is full (the order is padded, the padding counted); evaluation reads its
shard with DALI's mxnet reader in file order, PARTIAL (padding dropped, every record exactly once).
On the CPU the train pipeline is run directly, not through DALIGenericIterator: batches land in
reused buffers and nothing past the epoch is decoded (DaliLoader._host_batches).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy, feed_ndarray, to_torch_type

from rectrain.data import pairowner
from rectrain.loaders.augment import NONE, AugmentPolicy
from rectrain.loaders.dali_augment import apply_policy
from rectrain.loaders.order import TrainOrder, order_for
from rectrain.loaders.readahead import ReadAhead, ReadPlan, ReadPool, plan_for
from rectrain.loaders.spec import (
    CROP_RATIO,
    CROP_SCALE,
    FULL_DECODE_HW_LOAD,
    IMAGENET_PREPROCESS,
    DaliOptions,
    LoaderSpec,
    Preprocess,
    decode_path,
    epoch_seed,
    train_batches_per_epoch,
    train_padding,
)
from rectrain.recordio import IndexedRecordReader, idx_arrays

# Preprocess.interpolation as DALI's resize takes it (antialiased when shrinking, as torchvision's and PIL's).
DALI_INTERP = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC}


def decoder_args(decode_device: str, opts: DaliOptions, jpeg_engine: bool) -> dict:
    """Keyword arguments for DALI's image decoders: the mixed (GPU) decoder's memory and hardware-decoder
    knobs, the preallocation hints only on a GPU with hardware JPEG decoders (`jpeg_engine`, the only
    place they act); the CPU decoder takes none of them."""
    if decode_device != "mixed":
        return {}
    width, height = opts.preallocate if jpeg_engine else (0, 0)
    return {
        "hw_decoder_load": opts.hw_decoder_load,
        "device_memory_padding": opts.device_memory_padding,
        "host_memory_padding": opts.host_memory_padding,
        "preallocate_width_hint": width,
        "preallocate_height_hint": height,
    }


def output_type(dtype: str) -> tuple:
    """(DALI type, torch dtype) crop_mirror_normalize writes for the spec's dtype: float32 where this
    DALI has no such type (1.34 has no bfloat16; autocast then casts in the first layer, as before)."""
    dali_type = {"float16": types.FLOAT16, "bfloat16": getattr(types, "BFLOAT16", None)}.get(dtype, types.FLOAT)
    if dali_type is None or dali_type not in to_torch_type:
        dali_type = types.FLOAT
    return dali_type, to_torch_type[dali_type]


def train_crop(jpegs, crop: str, decode_device: str, decoder_kwargs: dict, image_size: int):
    """The random-resized-crop (scale CROP_SCALE, ratio CROP_RATIO) of train.decode's path, resized to
    image_size: roi chooses the window first and decodes only that region (libjpeg-turbo / nvJPEG ROI
    decode), as DALI's ImageNet examples do; full decodes the whole image (the hardware engines take
    FULL_DECODE_HW_LOAD of them: they decode whole images only) and crops after.  Same distribution
    of windows (tests/test_decode_paths.py)."""
    if crop == "full":
        kwargs = dict(decoder_kwargs, hw_decoder_load=FULL_DECODE_HW_LOAD) if decoder_kwargs else {}
        images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, **kwargs)
        return fn.random_resized_crop(
            images, size=[image_size, image_size], random_area=list(CROP_SCALE), random_aspect_ratio=list(CROP_RATIO)
        )
    images = fn.decoders.image_random_crop(
        jpegs,
        device=decode_device,
        output_type=types.RGB,
        random_area=list(CROP_SCALE),
        random_aspect_ratio=list(CROP_RATIO),
        **decoder_kwargs,
    )
    return fn.resize(images, size=[image_size, image_size])


class EpochRecords:
    """fn.external_source's batch callback for one rank's training epoch: batch k is the records at
    positions k x batch ... of `order` (rectrain.loaders.order.train_order), from the one .rec by their
    .idx offsets, as (encoded images as uint8 arrays, int64 labels from the records' headers).  DALI
    passes the iteration index and, in a pipeline restored from its checkpoint, goes on from the
    iteration the checkpoint was taken at, so a batch's records follow from (seed, epoch, rank, batch
    index) alone.  Past the epoch's last batch: StopIteration, the end of the pass.

    DALI calls it in the consumer's thread - the one that runs the training step - so it does not read
    there: a rectrain.loaders.readahead.ReadAhead, started at the first batch asked for, reads the order
    in `pool`'s reader threads as `plan` says (plan_for: a quasi-random window's blocks whole, in offset
    order; the permutation's records in chunks of batches, several in flight), chunks ahead of the
    step; the call only waits for a chunk not in yet (before: 2.4-3.8 CPU-ms of that thread per batch of
    64 from the page cache, one seek per record on a hard disk: bench/RESULTS.md, "Quasi-random
    order and reads off the training thread")."""

    def __init__(
        self,
        reader: IndexedRecordReader,
        order: np.ndarray,
        batch_size: int,
        pool: ReadPool | None = None,
        plan: ReadPlan | None = None,
    ):
        self.reader, self.order, self.batch_size = reader, order, batch_size
        self.batches = len(order) // batch_size
        self.pool, self.plan = pool, plan or plan_for(None)
        self._reads: ReadAhead | None = None

    def __call__(self, iteration: int):
        if iteration >= self.batches:
            raise StopIteration
        if self._reads is None:
            self.pool = self.pool or ReadPool(self.plan.streams)
            self._reads = ReadAhead(self.reader, self.order, self.batch_size, self.plan, self.pool)
        return self._reads.batch(iteration)

    def close(self) -> None:
        """Cancel the reads not started (a pass its consumer left early)."""
        if self._reads is not None:
            self._reads.close()


@dataclass(frozen=True)
class EvalShard:
    """What an evaluation pipeline reads: shard `shard_id` of `num_shards` of the pair, in file order."""

    rec: str
    idx: str
    shard_id: int
    num_shards: int


@pipeline_def
def _pipeline(
    *,
    records: EpochRecords | EvalShard,
    image_size: int,
    eval_resize: int,
    decode_device: str,
    decoder_kwargs: dict,
    on_gpu: bool,
    crop: str = "roi",
    dtype=types.FLOAT,
    layout: str = "HWC",
    preprocess: Preprocess = IMAGENET_PREPROCESS,
    augment: AugmentPolicy = NONE,
):
    """Normalised images (DALI type `dtype`, `layout` HWC or CHW) + labels; both on the GPU when
    on_gpu.  `records`: a training epoch's EpochRecords (random-resized-crop of train.decode's path
    `crop`, train_crop, train.augment's policy where the decode ran, and a flip) or an EvalShard
    (resize + centre crop)."""
    train = isinstance(records, EpochRecords)
    if train:
        jpegs, labels = fn.external_source(source=records, num_outputs=2, batch=True, dtype=[types.UINT8, types.INT64])
    else:
        jpegs, labels = fn.readers.mxnet(
            path=records.rec,
            index_path=records.idx,
            shard_id=records.shard_id,
            num_shards=records.num_shards,
            pad_last_batch=True,
            stick_to_shard=True,
            name="Reader",
        )
    if train:
        images = train_crop(jpegs, crop, decode_device, decoder_kwargs, image_size)
        mirror = fn.random.coin_flip(probability=0.5)
        if augment.on:
            # timm flips before its policy, and a shear_y about the top-left corner is not mirror-symmetric
            images = apply_policy(fn.flip(images, horizontal=mirror), augment, image_size)
            mirror = False
    else:
        images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, **decoder_kwargs)
        images = fn.resize(images, resize_shorter=eval_resize, interp_type=DALI_INTERP[preprocess.interpolation])
        mirror = False
    if on_gpu:
        # Everything leaves the pipeline on the GPU, copied by DALI on its own stream: a CPU output
        # would be DALI-owned pinned memory that torch copies asynchronously while DALI already
        # refills it for the next batch (gpu_decode: false).  uint8 before normalising: 4x less to copy.
        images = images.gpu() if decode_device == "cpu" else images
        labels = labels.gpu()
    # Normalised, in the dtype the first layer computes in; HWC viewed as NCHW in torch is channels_last.
    images = fn.crop_mirror_normalize(
        images,
        dtype=dtype,
        output_layout=layout,
        crop=[image_size, image_size],
        mean=list(preprocess.mean),
        std=list(preprocess.std),
        mirror=mirror,
    )
    return images, labels


class _HostBuffers:
    """Torch tensors reused for a CPU pipeline's image batches.

    A fresh 64x224x224x3 float32 batch is 38 MB, above glibc's largest mmap threshold (32 MB): each
    one is mapped anew and page-faulted in, ~25 CPU-ms a batch against ~6 for the copy into a buffer
    already touched (bench/RESULTS.md, "DALI loader: the per-batch overhead").  A buffer is reused only
    once nothing outside holds it (its storage's use count is back to what it was when only this pool
    held it): a consumer that keeps its batches gets fresh ones, never overwritten pixels."""

    def __init__(self, keep: int = 3):
        self.keep = keep  # the consumer's loop variable still holds the last batch while it asks for the next
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)  # absent: every batch fresh
        self._pool = []  # (tensor, its storage, the storage's use count with only the pool holding it)

    def copy(self, dali_tensor) -> torch.Tensor:
        shape, dtype = dali_tensor.shape(), to_torch_type[dali_tensor.dtype]
        for buf, storage, idle in self._pool:
            if self._use_count(storage._cdata) == idle and list(buf.shape) == shape and buf.dtype == dtype:
                return feed_ndarray(dali_tensor, buf)
        buf = torch.empty(shape, dtype=dtype)
        if self._use_count is not None:
            storage = buf.untyped_storage()
            self._pool = [*self._pool, (buf, storage, self._use_count(storage._cdata))][-self.keep :]
        return feed_ndarray(dali_tensor, buf)


# Loaders whose last pass has ended: their pipelines are dropped before the next build of any loader.
_FINISHED: "weakref.WeakSet[DaliLoader]" = weakref.WeakSet()


class DaliLoader:
    kind = "dali"

    def __init__(self, spec: LoaderSpec):
        self.spec = spec
        # Training reads records by their offsets (EpochRecords): the .idx's arrays, a few int64 a record.
        self.reader = IndexedRecordReader(spec.rec, spec.idx) if spec.train else None
        self.size = len(self.reader) if spec.train else len(idx_arrays(spec.idx)[0])
        w, b, a = spec.world_size, spec.batch_size, spec.step_batches
        # train.order (permutation or quasi-random) and the reader threads of every epoch's EpochRecords
        self.order: TrainOrder | None = order_for(spec.order, self.reader, b) if spec.train else None
        self.read_plan = plan_for(self.order.window_batches) if spec.train else None
        self.reads = ReadPool(self.read_plan.streams) if spec.train else None
        self._epoch_records: EpochRecords | None = None
        if self.reads is not None:
            weakref.finalize(self, self.reads.close)
        self.padding_per_epoch = train_padding(self.size, w, b, a, spec.repeats) if spec.train else 0
        self.batches_per_epoch = train_batches_per_epoch(self.size, w, b, a, spec.repeats)
        self._train_iter = None  # the epoch's, for state(); None on the CPU, which runs _train_pipe itself
        self._train_pipe = None
        self._eval_iter = None  # the last validation pass's, until the next build
        self._dali_dtype, self.image_dtype = output_type(spec.dtype)

    def _records(self, epoch: int) -> EpochRecords | EvalShard:
        s = self.spec
        if not s.train:
            return EvalShard(s.rec, s.idx, s.rank, s.world_size)
        order = self.order.indices(
            self.size, s.rank, s.world_size, s.batch_size, s.seed, epoch, accum=s.grad_accum, repeats=s.repeats
        )
        self._epoch_records = EpochRecords(self.reader, order, s.batch_size, self.reads, self.read_plan)
        return self._epoch_records

    def read_stats(self) -> dict | None:
        """The training reads so far (rectrain.loaders.readahead.ReadStats) with the order that ran;
        None for an evaluation loader."""
        if self.reads is None:
            return None
        return {"order": self.order.choice.used, "threads": self.reads.threads, **self.reads.stats.as_dict()}

    def _build(self, epoch: int, checkpoint: bytes | None = None):
        s = self.spec
        pairowner.refuse_changed(s.rec, s.idx)  # a brought pair replaced mid-run
        gpu = s.on_gpu
        device_id = (torch.device(s.device).index or 0) if gpu else None
        decode_device = "mixed" if s.gpu_decodes else "cpu"
        pipe = _pipeline(
            records=self._records(epoch),
            image_size=s.crop_at(epoch),
            eval_resize=s.eval_resize,
            decode_device=decode_device,
            decoder_kwargs=decoder_args(decode_device, s.dali, decode_device == "mixed" and s.jpeg_engine),
            on_gpu=gpu,
            crop="full" if decode_path(s.decode) == "full" else "roi",
            dtype=self._dali_dtype,
            layout="HWC" if s.channels_last else "CHW",
            preprocess=s.preprocess,
            augment=s.augment if s.train else NONE,
            enable_conditionals=s.train and s.augment.on,  # the policy's per-op split (dali_augment)
            batch_size=s.batch_size,
            num_threads=max(1, s.workers),
            device_id=device_id,
            prefetch_queue_depth=s.dali.prefetch_queue_depth,
            seed=epoch_seed(s.seed, epoch, s.rank),
            enable_checkpointing=s.train,
            checkpoint=checkpoint,
        )
        pipe.build()
        return pipe

    def _iterator(self, epoch: int, checkpoint: bytes | None = None) -> DALIGenericIterator:
        """A pass's iterator: a training epoch's ends at EpochRecords' StopIteration, an evaluation
        shard's at the reader's end (PARTIAL: its padding dropped)."""
        s = self.spec
        return DALIGenericIterator(
            self._build(epoch, checkpoint),
            ["images", "labels"],
            reader_name=None if s.train else "Reader",
            last_batch_policy=LastBatchPolicy.FILL if s.train else LastBatchPolicy.PARTIAL,
            auto_reset=False,  # one pass per iterator: each epoch builds its own (epoch)
        )

    def state(self) -> bytes:
        """The train pipeline's DALI checkpoint after the batches yielded so far in this epoch."""
        if self._train_iter is None:
            return self._train_pipe.checkpoint()  # counts the batches taken with outputs()
        return self._train_iter.checkpoints()[0]

    def _release_pipelines(self) -> None:
        """Before a pipeline is built: drop this loader's last one and every other loader's finished pass
        (train or validation), so only one pipeline's threads, prefetched batches and reader buffers are
        alive at a time.  (An mxnet reader alive beside a new one once made the new one copy every
        sample instead of sharing the mapped .rec: bench/RESULTS.md, "DALI loader: the epoch boundary";
        validation still reads through one.)  Done here, not when a pass ends, so the teardown stays out
        of the epoch's timed steps."""
        for loader in [self, *_FINISHED]:
            loader._train_iter = loader._train_pipe = loader._eval_iter = None
            if loader._epoch_records is not None:  # reads not started yet are not wanted any more
                loader._epoch_records.close()
                loader._epoch_records = None
        _FINISHED.clear()

    def _host_batches(self, epoch: int, start: int, state: bytes | None):
        """The CPU train pipeline's batches, run without DALIGenericIterator: it copies each batch into
        a fresh torch.empty, and on the CPU that allocation costs 4x the copy (see _HostBuffers); and
        it keeps the prefetch queue full to the end, so prefetch_queue_depth batches of the next epoch
        are decoded and thrown away with the pipeline.  Here nothing past the epoch is scheduled (the
        order is padded to full batches: train_order)."""
        remaining = self.batches_per_epoch - start
        self._release_pipelines()
        pipe = self._train_pipe = self._build(epoch, state if start else None)
        if remaining <= 0:
            return
        buffers = _HostBuffers()
        pipe.schedule_run()  # the first call fills the prefetch queue
        scheduled = self.spec.dali.prefetch_queue_depth
        for _ in range(remaining):
            images, labels = pipe.outputs()
            batch = {"images": buffers.copy(images.as_tensor()), "labels": torch.from_numpy(labels.as_array())}
            if scheduled < remaining:
                pipe.schedule_run()
                scheduled += 1
            yield batch

    def epoch(self, epoch: int, start: int = 0, state: bytes | None = None):
        """Iterator of (images, labels) for one epoch; from batch `start` on with the `state()` taken there."""
        if self.spec.train and not self.spec.on_gpu:
            self._train_iter = None
            it = ([batch] for batch in self._host_batches(epoch, start, state))  # the iterator's shape
        elif self.spec.train:
            self._release_pipelines()
            it = self._train_iter = self._iterator(epoch, state if start else None)
        else:
            self._release_pipelines()
            it = self._eval_iter = self._iterator(0)
        yield from self._to_device(it)
        # The pass is over: its pipeline goes at the next build of any loader (_release_pipelines).
        # One its consumer left early stays for state() until this loader's next build.
        del it
        _FINISHED.add(self)

    def _to_device(self, batches):
        device = torch.device(self.spec.device)
        for batch in batches:
            images, labels = batch[0]["images"], batch[0]["labels"]
            if images.shape[0] == 0:
                continue  # eval only: a rank whose shard ended on a batch boundary
            images = images.to(device, non_blocking=True)
            if self.spec.channels_last:
                images = images.permute(0, 3, 1, 2)  # NHWC viewed as NCHW: channels_last, nothing copied
            yield images, labels.view(-1).to(device, torch.int64, non_blocking=True)
