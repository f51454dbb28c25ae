"""Both loaders read the packed .rec, agree with the index, and shard every record once per epoch."""

import pytest
import torch
from helpers.train_data import colour_class, write_rec

from rectrain.loaders import LoaderSpec, build_loader, train_padding
from rectrain.loaders.pytorch import TorchLoader


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
