"""Both loaders read the packed .rec, agree with the index, and shard every record once per epoch."""
import io

import numpy as np
import pytest
import torch
from PIL import Image

from rectrain.loaders import IMAGENET_MEAN, IMAGENET_STD, LoaderSpec, build_loader, train_padding
from rectrain.loaders.pytorch import TorchLoader
from rectrain.recordio import IRHeader, RecordWriter, pack_record

PALETTE = [(230, 25, 25), (25, 230, 25), (25, 25, 230), (230, 230, 25), (25, 230, 230)]


def write_rec(path, labels, size=(40, 30), seed=0):
    """A .rec/.idx whose record k holds a JPEG of colour PALETTE[labels[k] % 5] (with noise) and label
    labels[k]; records are written in a shuffled order, as the packer does."""
    rng = np.random.default_rng(seed)
    rec, idx = path / "data.rec", path / "data.idx"
    with RecordWriter(rec, idx) as w:
        for key in rng.permutation(len(labels)):
            colour = np.array(PALETTE[labels[key] % len(PALETTE)], np.int16)
            pixels = np.clip(colour + rng.integers(-10, 10, (size[1], size[0], 3)), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, "JPEG", quality=90)
            w.write(int(key), pack_record(IRHeader(0, float(labels[key]), int(key), 0), buf.getvalue()))
    return str(rec), str(idx)


def colour_class(images):
    """Nearest PALETTE entry of each normalised image's mean colour."""
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3)
    std = torch.tensor(IMAGENET_STD).view(1, 3)
    rgb = images.float().mean(dim=(2, 3)) * std + mean
    return torch.cdist(rgb, torch.tensor(PALETTE, dtype=torch.float)).argmin(dim=1)


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
    loader = TorchLoader(LoaderSpec(rec, idx, batch_size=8, image_size=24, train=False, workers=0),
                         decode_on_device=True)
    seen = []
    for images, y in loader.epoch(0):
        assert torch.equal(colour_class(images), y % 5)
        seen += y.tolist()
    assert sorted(seen) == sorted(labels)


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_two_ranks_see_every_record_once_per_epoch(id_rec, kind):
    rec, idx = id_rec
    n, world, batch = 67, 2, 8
    loaders = [build_loader(kind, LoaderSpec(rec, idx, batch_size=batch, image_size=16, rank=r, world_size=world,
                                             workers=1, seed=3)) for r in range(world)]
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
        loader = build_loader(kind, LoaderSpec(rec, idx, batch_size=8, image_size=16, rank=r, world_size=2,
                                               train=False, workers=1))
        ids += [i for _, y in loader.epoch(0) for i in y.tolist()]
    assert sorted(ids) == list(range(67))


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_epoch_data_is_a_function_of_seed_epoch_rank(id_rec, kind):
    """What makes resume exact: rebuilding the loader replays the same epoch."""
    rec, idx = id_rec
    spec = LoaderSpec(rec, idx, batch_size=8, image_size=16, rank=1, world_size=2, workers=1, seed=5)
    a = [(x, y) for x, y in build_loader(kind, spec).epoch(1)]
    b = [(x, y) for x, y in build_loader(kind, spec).epoch(1)]
    assert all(torch.equal(ya, yb) and torch.equal(xa, xb) for (xa, ya), (xb, yb) in zip(a, b))
