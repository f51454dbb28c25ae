"""A real consumer: DALI's fn.readers.mxnet (CPU) reads the packed demo split; every label is the
index's label for that record id, every record decodes to RGB, and the planted defects are repaired
or listed as skipped with counts that add up."""

import csv
import json

import numpy as np
import pytest
from helpers.packdata import run_pack
from helpers.views import view

from rectrain.data import demo, index
from rectrain.recordio import read_idx

dali = pytest.importorskip("nvidia.dali")
from nvidia.dali import fn, pipeline_def, types  # noqa: E402

DEMO = {
    "classes": 8,
    "train_per_class": 5,
    "val_per_class": 2,
    "min_size": 48,
    "max_size": 96,
    "quality": 90,
    "seed": 0,
    "bad_files": True,
}
BATCH = 8


@pytest.fixture(scope="module")
def packed_demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    demo.generate(view("demo", DEMO), root / "raw")
    index.write_index(index.discover(root / "raw"), root / "index")
    proc = run_pack(root / "raw", root / "index", root / "out")
    assert proc.returncode == 0, proc.stderr
    return root


def _dali_read(rec, idx, n):
    """(labels, images) of the first n records in file order, decoded on the CPU."""

    @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None)
    def pipe():
        jpegs, labels = fn.readers.mxnet(path=[str(rec)], index_path=[str(idx)], random_shuffle=False, name="Reader")
        return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB), labels

    p = pipe()
    p.build()
    assert p.epoch_size("Reader") == n
    labels, images = [], []
    while len(labels) < n:
        imgs, labs = p.run()
        for i in range(BATCH):
            labels.append(float(np.asarray(labs.at(i)).ravel()[0]))
            images.append(np.asarray(imgs.at(i)))
    return labels[:n], images[:n]


def test_dali_reads_every_record_with_the_index_label_and_decodes_it_as_rgb(packed_demo):
    root = packed_demo
    fast = root / "out" / "fast"
    with open(root / "index" / "train.tsv", newline="") as f:
        label_of = {int(r["id"]): int(r["label"]) for r in csv.DictReader(f, delimiter="\t")}
    keys = [k for k, _ in read_idx(fast / "train.idx")]
    labels, images = _dali_read(fast / "train.rec", fast / "train.idx", len(keys))
    assert labels == [float(label_of[k]) for k in keys]
    assert all(im.ndim == 3 and im.shape[2] == 3 and min(im.shape[:2]) >= 16 for im in images)


def test_planted_defects_are_repaired_or_skipped_and_counts_add_up(packed_demo):
    root = packed_demo
    fast = root / "out" / "fast"
    manifest = json.loads((root / "out" / "pack" / "train.manifest.json").read_text())
    planted = json.loads((root / "raw" / "defects.json").read_text())["defects"]
    with open(root / "index" / "train.tsv", newline="") as f:
        id_of = {r["source"]: int(r["id"]) for r in csv.DictReader(f, delimiter="\t")}
    skipped = {s["id"]: s["reason"] for s in manifest["skipped_files"]}
    repaired = {r["id"]: r["reason"] for r in manifest["repaired"]}
    assert manifest["discovered"] == len(id_of) == manifest["packed"] + manifest["skipped"]
    keys = [k for k, _ in read_idx(fast / "train.idx")]
    _, images = _dali_read(fast / "train.rec", fast / "train.idx", len(keys))
    decoded = dict(zip(keys, images, strict=True))
    for d in planted:
        if d["expected"] == "unclassified":
            assert d["source"] not in id_of
            continue
        rid = id_of[d["source"]]
        if d["expected"] == "skip":
            assert rid in skipped and skipped[rid], d
            assert rid not in decoded
        else:
            # cmyk, png, exif_rotated are re-encoded; clean grayscale/progressive JPEGs pass through
            # (SPEC/issue 3) and DALI still hands them over as RGB.
            assert decoded[rid].shape[2] == 3, d
            if d["kind"] in ("cmyk", "png", "exif_rotated"):
                assert rid in repaired, d
    assert set(skipped) == {id_of[d["source"]] for d in planted if d["expected"] == "skip"}
