"""Both loaders read the packed .rec, agree with the index, and shard every record once per epoch."""

import io

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from helpers.train_data import colour_class, tiny_train_settings, train_loader_spec, write_rec
from PIL import Image

from rectrain.distributed import Dist
from rectrain.loaders import IMAGENET_MEAN, IMAGENET_STD, LoaderSpec, build_loader, order, train_padding
from rectrain.loaders.dali import DaliLoader
from rectrain.loaders.pytorch import TorchLoader
from rectrain.recordio import IndexedRecordReader, IRHeader, RecordWriter, pack_record
from rectrain.train.run import make_loaders


@pytest.fixture(scope="module")
def colour_rec(tmp_path_factory):
    labels = [i % 5 for i in range(37)]
    return write_rec(tmp_path_factory.mktemp("colour"), labels), labels


@pytest.fixture(scope="module")
def id_rec(tmp_path_factory):
    """67 records, label = record id: 67 is not a multiple of 2 ranks x batch 8."""
    return write_rec(tmp_path_factory.mktemp("ids"), list(range(67)))


@pytest.mark.parametrize("kind", ["dali", "torch"])
@pytest.mark.parametrize("train", [True, False])
def test_loader_labels_match_image_content_and_index(colour_rec, kind, train):
    (rec, idx), labels = colour_rec
    loader = build_loader(kind, LoaderSpec(rec, idx, batch_size=8, image_size=24, train=train, workers=1))
    seen = []
    for images, y in loader.epoch(0):
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 24, 24)
        assert y.dtype == torch.int64
        assert torch.equal(colour_class(images), y % 5), "label not paired with its image"
        seen += y.tolist()
    expected = sorted(labels)
    if train:
        assert len(seen) == len(labels) + loader.padding_per_epoch
        assert set(seen) == set(expected)
    else:
        assert sorted(seen) == expected


def test_torch_loader_batch_decode_path_agrees(colour_rec):
    """The decode_jpeg batch path (GPU decode on CUDA machines) run here on the CPU."""
    (rec, idx), labels = colour_rec
    loader = TorchLoader(
        LoaderSpec(rec, idx, batch_size=8, image_size=24, train=False, workers=0), decode_on_device=True
    )
    seen = []
    for images, y in loader.epoch(0):
        assert torch.equal(colour_class(images), y % 5)
        seen += y.tolist()
    assert sorted(seen) == sorted(labels)


def test_torch_loader_workers_are_forked_by_a_forkserver_never_by_the_training_process(colour_rec):
    """A fork of a process whose other threads (gloo's) may hold the interpreter's runtime lock deadlocks
    the child on Python 3.11 (CPython gh-112275; rectrain.loaders.pytorch.worker_context): the workers'
    parent is the single-threaded forkserver, and each epoch gets new ones from it."""
    import psutil

    (rec, idx), _ = colour_rec
    loader = TorchLoader(LoaderSpec(rec, idx, batch_size=8, image_size=24, train=True, workers=1))
    me = psutil.Process()
    parents = []
    for epoch in (0, 1):
        batches = loader.epoch(epoch)
        next(batches)
        workers = [p for p in me.children(recursive=True) if p.ppid() != me.pid]
        assert workers, "no worker process"
        parents += [psutil.Process(w.ppid()) for w in workers]
        batches.close()
    assert {p.pid for p in parents} == {parents[0].pid} and parents[0].ppid() == me.pid
    assert "forkserver" in " ".join(parents[0].cmdline())


KILLED_READER = """
import json, sys, time, psutil
from rectrain.loaders import LoaderSpec
from rectrain.loaders.pytorch import TorchLoader
batches = TorchLoader(LoaderSpec(sys.argv[1], sys.argv[2], batch_size=8, image_size=24, workers=1)).epoch(0)
next(batches)
print(json.dumps([p.pid for p in psutil.Process().children(recursive=True)]), flush=True)
time.sleep(600)
"""


SIGNALLED_READER = """
import signal, sys, time
from rectrain.loaders import LoaderSpec
from rectrain.loaders.pytorch import TorchLoader
asked = []
for sig in (signal.SIGINT, signal.SIGTERM):  # as a rank's stop request handles them: finish, then stop
    signal.signal(sig, lambda s, f: asked.append(s))
loader = TorchLoader(LoaderSpec(sys.argv[1], sys.argv[2], batch_size=2, image_size=24, workers=1))
n = 0
for x, y in loader.epoch(0):
    n += 1
    if n == 1:
        print("first batch", flush=True)
        while len(asked) < 2:
            time.sleep(0.05)
print(f"read {n} batches of {loader.batches_per_epoch} after {sorted(asked)}", flush=True)
"""


def test_a_stop_signal_to_the_whole_process_group_leaves_the_loader_workers_serving_the_rank(colour_rec):
    """Ctrl-C (SIGINT to the process group) or SIGTERM to every process: the rank asks itself to stop
    after its step and reads the batches it still needs; its workers, started from the forkserver with
    default handlers, leave those signals to the rank (rectrain.loaders.pytorch.end_with)."""
    import os
    import signal
    import subprocess
    import sys

    (rec, idx), _ = colour_rec
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED_READER, rec, idx], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout.readline() == "first batch\n"
    os.killpg(proc.pid, signal.SIGINT)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert out.strip() == f"read 19 batches of 19 after {[int(signal.SIGINT), int(signal.SIGTERM)]}", err[-3000:]


LEFT_MID_EPOCH = """
import sys
from rectrain.loaders import LoaderSpec
from rectrain.loaders.pytorch import TorchLoader
batches = TorchLoader(LoaderSpec(sys.argv[1], sys.argv[2], batch_size=2, image_size=24, workers=1)).epoch(0)
next(batches)  # still referenced at exit, as by a traceback: multiprocessing ends the worker at exit
sys.exit(3)
"""


def test_a_process_exiting_with_an_epoch_unfinished_ends_its_workers_and_exits(colour_rec):
    """At exit multiprocessing sends SIGTERM to the daemonic workers still running and waits for them;
    the workers ignore every other SIGTERM (end_with), this one ends them."""
    import subprocess
    import sys

    (rec, idx), _ = colour_rec
    done = subprocess.run([sys.executable, "-c", LEFT_MID_EPOCH, rec, idx], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-3000:]


def test_a_training_process_killed_outright_leaves_no_loader_worker_nor_forkserver_behind(colour_rec):
    """SIGKILL (the out-of-memory killer's) mid-epoch: torch's watchdog in a worker watches its parent,
    the forkserver, which lives while its workers do; rectrain's worker_init_fn ends them with the rank."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import psutil

    (rec, idx), _ = colour_rec
    proc = subprocess.Popen([sys.executable, "-c", KILLED_READER, rec, idx], stdout=subprocess.PIPE, text=True)
    left = json.loads(proc.stdout.readline())
    assert len(left) >= 2, "the forkserver and a worker"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 15
    while left := [pid for pid in left if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]:
        assert time.monotonic() < deadline, f"still running 15 s after the kill: {left}"
        time.sleep(0.1)


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_two_ranks_see_every_record_once_per_epoch(id_rec, kind):
    rec, idx = id_rec
    n, world, batch = 67, 2, 8
    loaders = [
        build_loader(
            kind, LoaderSpec(rec, idx, batch_size=batch, image_size=16, rank=r, world_size=world, workers=1, seed=3)
        )
        for r in range(world)
    ]
    assert loaders[0].padding_per_epoch == train_padding(n, world, batch) == 2 * 5 * 8 - 67
    orders = []
    for epoch in range(2):
        ids, batch_counts = [], []
        for loader in loaders:
            sizes = []
            for _, y in loader.epoch(epoch):
                sizes.append(len(y))
                ids += y.tolist()
            batch_counts.append(len(sizes))
            assert set(sizes) == {batch}, "train batches must all be full (no empty/size-1 batch)"
        assert batch_counts == [loaders[0].batches_per_epoch] * world, "ranks must run equal batch counts"
        assert set(ids) == set(range(n)), "a record was never seen this epoch"
        assert len(ids) == n + loaders[0].padding_per_epoch, "duplicates beyond the counted padding"
        orders.append(ids)
    assert orders[0] != orders[1], "train order must change between epochs"


@pytest.mark.parametrize("kind", ["permutation", "quasi-random"])
def test_two_dali_epochs_read_different_orders_of_all_records_dealt_across_ranks_and_a_resume_goes_on_in_it(
    id_rec, kind, monkeypatch
):
    """Read from the records' ids (label = id): each rank's epoch is train.order's - a new order of the
    whole set from (seed, epoch), dealt round-robin (here quasi-random over ~1 KB blocks and 2-batch
    windows, several of each) - not a fixed shard of the .rec in file order; read ahead by the reader
    threads, batch for batch, and from the DALI checkpoint of a pass left after 3 batches on."""
    monkeypatch.setattr(order, "BLOCK_BYTES", 1000)
    monkeypatch.setattr(order, "WINDOW_BYTES", 2 * 8 * 800)
    rec, idx = id_rec
    reader = IndexedRecordReader(rec, idx)
    file_ids = reader.file_keys  # the record ids in .rec order
    n, world, batch = 67, 2, 8
    blocks = order.blocks_of(reader.offsets, reader.file_size, batch) if kind == "quasi-random" else None
    assert blocks is None or (len(blocks.starts) > 5 and 1 <= blocks.window_batches < 4)
    spec = dict(batch_size=batch, image_size=16, world_size=world, seed=7, order=kind, workers=1)
    read = {}
    for rank in range(world):
        loader = DaliLoader(LoaderSpec(rec, idx, rank=rank, **spec))
        assert loader.order.choice.used == kind
        for epoch in (0, 1):
            read[rank, epoch] = [i for _, y in loader.epoch(epoch) for i in y.tolist()]
            assert (
                read[rank, epoch]
                == file_ids[order.train_order(n, rank, world, batch, 7, epoch, blocks=blocks)].tolist()
            )
        first = loader.epoch(1)
        head = [i for _, y in (next(first) for _ in range(3)) for i in y.tolist()]
        again = DaliLoader(LoaderSpec(rec, idx, rank=rank, **spec))
        rest = [i for _, y in again.epoch(1, 3, loader.state()) for i in y.tolist()]
        assert head + rest == read[rank, 1], "a resumed pass left the order"
    for rank in range(world):
        assert read[rank, 0] != read[rank, 1], "two epochs read the same order"
        assert set(read[rank, 0]) != set(read[rank, 1]), "a rank keeps the same records every epoch"


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_eval_shards_are_exact_without_padding(id_rec, kind):
    rec, idx = id_rec
    ids = []
    for r in range(2):
        loader = build_loader(
            kind, LoaderSpec(rec, idx, batch_size=8, image_size=16, rank=r, world_size=2, train=False, workers=1)
        )
        ids += [i for _, y in loader.epoch(0) for i in y.tolist()]
    assert sorted(ids) == list(range(67))


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_epoch_data_is_a_function_of_seed_epoch_rank(id_rec, kind):
    """What makes resume exact: rebuilding the loader replays the same epoch."""
    rec, idx = id_rec
    spec = LoaderSpec(rec, idx, batch_size=8, image_size=16, rank=1, world_size=2, workers=1, seed=5)
    a = [(x, y) for x, y in build_loader(kind, spec).epoch(1)]
    b = [(x, y) for x, y in build_loader(kind, spec).epoch(1)]
    assert all(torch.equal(ya, yb) and torch.equal(xa, xb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))


def test_dali_cpu_batches_the_consumer_keeps_are_never_overwritten(id_rec):
    """The CPU train path reuses its batch buffers; a batch still held must keep its pixels."""
    rec, idx = id_rec
    loader = build_loader("dali", LoaderSpec(rec, idx, batch_size=8, image_size=16, workers=1, seed=2))
    kept = [(x, x.clone(), y) for x, y in loader.epoch(0)]
    assert len(kept) == loader.batches_per_epoch > 3, "more batches than the buffer pool holds"
    assert len({x.data_ptr() for x, _, _ in kept}) == len(kept), "two kept batches share memory"
    assert all(torch.equal(x, first_seen) for x, first_seen, _ in kept), "a kept batch was overwritten"


def test_dali_builds_each_pipeline_only_once_every_earlier_one_of_train_and_validation_is_gone(id_rec):
    """Two DALI pipelines alive at once hold two sets of threads and buffers, and two mxnet readers made
    the newer one copy every sample instead of sharing the mapped .rec: ~1.7 GB more per rank and
    +0.4-1.5 CPU-s at an epoch's start (bench/RESULTS.md; validation still reads through one).  A finished pass's
    pipeline must be gone before the next is built, whichever loader builds it; one its consumer left
    early stays for state() and goes at that loader's next build."""
    import weakref

    rec, idx = id_rec
    train = build_loader("dali", LoaderSpec(rec, idx, batch_size=8, image_size=16, workers=1, seed=2))
    val = build_loader("dali", LoaderSpec(rec, idx, batch_size=8, image_size=16, train=False, workers=1))
    built, alive_at_build = [], []
    for loader in (train, val):

        def recording_build(*args, build=loader._build, **kwargs):
            alive_at_build.append(sum(ref() is not None for ref in built))
            pipe = build(*args, **kwargs)
            built.append(weakref.ref(pipe))
            return pipe

        loader._build = recording_build
    for epoch in range(3):
        if epoch == 1:
            for _ in train.epoch(epoch):
                break  # a stop mid-epoch: the loader's state is asked for after the consumer left
            assert train.state(), "no state after the consumer left the epoch"
            continue
        for _ in train.epoch(epoch):
            pass
        assert sum(len(y) for _, y in val.epoch(0)) == 67, "validation sees every record once"
    assert len(alive_at_build) == 5
    assert alive_at_build == [0] * 5, "an earlier pipeline was alive at a build"


def test_dali_host_buffers_reuse_a_batch_buffer_only_once_nothing_holds_it():
    import weakref

    import numpy as np
    from nvidia.dali.tensors import TensorCPU

    from rectrain.loaders.dali import _HostBuffers

    buffers = _HostBuffers()
    batch = TensorCPU(np.arange(2 * 4 * 4 * 3, dtype=np.float32).reshape(2, 4, 4, 3))
    dropped = weakref.ref(buffers.copy(batch).permute(0, 3, 1, 2)._base)
    held = buffers.copy(batch)
    assert held is dropped(), "a buffer nobody holds was not reused"
    view = held.permute(0, 3, 1, 2)
    del held
    fresh = buffers.copy(batch)
    assert fresh is not view._base and fresh.data_ptr() != view.data_ptr(), "a buffer held via a view was reused"
    assert torch.equal(fresh, torch.from_numpy(np.array(batch)))


@pytest.fixture(scope="module")
def ramp_rec(tmp_path_factory):
    """One 60x40 JPEG whose red ramps 0-255 left to right and green top to bottom: the scale and the part
    of the image a resize + crop keeps show in every pixel. (rec, idx, the JPEG's bytes)"""
    h, w = 40, 60
    red, green = (
        np.broadcast_to(np.linspace(0, 255, w), (h, w)),
        np.broadcast_to(np.linspace(0, 255, h)[:, None], (h, w)),
    )
    buf = io.BytesIO()
    Image.fromarray(np.stack([red, green, np.full((h, w), 128.0)], -1).astype(np.uint8)).save(buf, "JPEG", quality=95)
    tmp = tmp_path_factory.mktemp("ramp")
    with RecordWriter(tmp / "ramp.rec", tmp / "ramp.idx") as writer:
        writer.write(0, pack_record(IRHeader(0, 0.0, 0, 0), buf.getvalue()))
    return str(tmp / "ramp.rec"), str(tmp / "ramp.idx"), buf.getvalue()


def resized_and_cropped(jpeg: bytes, resize: int, crop: int) -> torch.Tensor:
    """PIL decode, torchvision's shorter-side resize and centre crop, normalised as the loaders do."""
    image = TF.center_crop(TF.resize(Image.open(io.BytesIO(jpeg)).convert("RGB"), resize), crop)
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (TF.pil_to_tensor(image)[None].float() - mean) / std


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_both_loaders_honour_the_eval_resize_and_crop(ramp_rec, kind):
    """Each (crop, resize) against torchvision's reference at that resize and at 2 px either side: measured
    mean differences 0.003 (DALI) and 0.000 (torch) at the right resize, 0.029 or more at a wrong one.
    The sizes leave even margins: DALI and PIL round a half-pixel centre-crop anchor differently."""
    rec, idx, jpeg = ramp_rec
    for crop, resize, shorter in ((24, 28, 28), (32, 36, 36), (28, None, 32)):  # None: 28 / 0.875 = 32
        spec = LoaderSpec(rec, idx, batch_size=1, image_size=crop, resize=resize, train=False, workers=1)
        assert spec.eval_resize == shorter
        images = next(iter(build_loader(kind, spec).epoch(0)))[0]
        assert images.shape == (1, 3, crop, crop)
        gap = {
            s: float((images - resized_and_cropped(jpeg, s, crop)).abs().mean())
            for s in (shorter - 2, shorter, shorter + 2)
        }
        assert gap[shorter] < 0.01 < min(gap[shorter - 2], gap[shorter + 2]), (crop, resize, gap)


@pytest.mark.parametrize("val_resolution,crop,shorter", [(None, 16, 18), (24, 24, 27)])
def test_per_epoch_validation_runs_at_train_val_resolution(colour_rec, val_resolution, crop, shorter):
    """train.val_resolution: the crop (and shorter side = crop / 0.875) of each epoch's validation; null =
    image_size. Training itself stays at image_size."""
    (rec, idx), labels = colour_rec
    cfg = tiny_train_settings(image_size=16, val_resolution=val_resolution, loader="torch")
    spec = train_loader_spec(cfg, Dist(0, 1, 0, 1, torch.device("cpu")), rec, idx, workers=1)
    val_spec = spec.validation(rec, idx, cfg.resolution.val_resolution)  # as run.prepare_rank builds it
    train_loader, val_loader = make_loaders(cfg.loaders.loader, spec, val_spec, batch=8)
    assert (val_loader.spec.image_size, val_loader.spec.eval_resize, val_loader.spec.train) == (crop, shorter, False)
    assert next(iter(train_loader.epoch(0)))[0].shape[2:] == (16, 16)
    seen = [(images.shape[2:], y) for images, y in val_loader.epoch(0)]
    assert {shape for shape, _ in seen} == {(crop, crop)}
    assert sorted(torch.cat([y for _, y in seen]).tolist()) == sorted(labels)
