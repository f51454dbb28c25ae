"""The demo ImageNet generator: deterministic, ImageNet-shaped, learnable, with every planted defect."""

import csv
import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers.views import view
from PIL import Image

from rectrain.data import demo
from rectrain.data.archives import SourceReader

CFG = {
    "classes": 10,
    "train_per_class": 12,
    "val_per_class": 6,
    "min_size": 48,
    "max_size": 80,
    "quality": 90,
    "seed": 0,
    "bad_files": True,
}


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "raw"
    demo.generate(view("demo", CFG), out)
    return out


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def defects(raw: Path) -> dict[str, dict]:
    return {d["kind"]: d for d in json.loads((raw / "defects.json").read_text())["defects"]}


@pytest.mark.parametrize("processes", [1, 3], ids=["one process", "three drawing processes"])
def test_same_seed_gives_identical_bytes_for_every_file_including_tars(raw, tmp_path, processes):
    again = tmp_path / "again"
    demo.generate(view("demo", CFG), again, processes=processes)
    first, second = tree(raw), tree(again)
    assert sorted(first) == sorted(second)
    assert "archives/ILSVRC2012_img_train.tar" in first and "archives/ILSVRC2012_devkit_t12.tar.gz" in first
    assert [name for name in first if first[name] != second[name]] == []


def test_other_seed_gives_other_images(raw, tmp_path):
    other = tmp_path / "other"
    demo.generate(view("demo", {**CFG, "seed": 1, "classes": 2, "bad_files": False}), other)
    wnid = "n01440764"
    assert (other / f"train/{wnid}/{wnid}_1.JPEG").read_bytes() != (raw / f"train/{wnid}/{wnid}_1.JPEG").read_bytes()


def test_regeneration_removes_stale_files(tmp_path):
    out = tmp_path / "raw"
    demo.generate(view("demo", {**CFG, "classes": 3, "train_per_class": 2, "val_per_class": 1}), out)
    demo.generate(
        view("demo", {**CFG, "classes": 2, "train_per_class": 2, "val_per_class": 1, "bad_files": False}), out
    )
    assert sorted(p.name for p in (out / "train").iterdir()) == ["n01440764", "n01443537"]
    assert not (out / "val_flat" / "ILSVRC2012_val_00000003.JPEG").exists()
    assert json.loads((out / ".done").read_text())["classes"] == 2


def test_tree_has_every_layout_with_consistent_counts(raw):
    wnids = sorted(p.name for p in (raw / "train").iterdir())
    assert wnids == [w for w, _ in demo.class_list(10)] and wnids[0] == "n01440764"
    n_defects = len(demo.DEFECTS)
    train_files = list((raw / "train").rglob("*.JPEG"))
    assert len(train_files) == 10 * 12 + n_defects
    assert all(f.name.startswith(f.parent.name + "_") for f in train_files)
    val_folder = sorted(p.name for p in (raw / "val").rglob("*.JPEG"))
    val_flat = sorted(p.name for p in (raw / "val_flat").iterdir())
    assert val_folder == val_flat == [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, 61)]
    assert Counter(p.parent.name for p in (raw / "val").rglob("*.JPEG")) == {w: 6 for w in wnids}

    with tarfile.open(raw / "archives/ILSVRC2012_img_train.tar") as tar:
        assert tar.getnames() == [f"{w}.tar" for w in wnids]
        assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in tar.getmembers())
    with tarfile.open(raw / "archives/ILSVRC2012_img_val.tar") as tar:
        assert sorted(tar.getnames()) == val_flat

    with open(raw / "LOC_val_solution.csv", newline="") as fh:
        solution = {r["ImageId"]: r["PredictionString"].split() for r in csv.DictReader(fh)}
    folder_label = {p.stem: p.parent.name for p in (raw / "val").rglob("*.JPEG")}
    assert {k: v[0] for k, v in solution.items()} == folder_label
    # Boxes are "wnid x1 y1 x2 y2" with x1 < x2, y1 < y2.
    assert all(len(v) == 5 and int(v[1]) < int(v[3]) and int(v[2]) < int(v[4]) for v in solution.values())

    truth = [int(x) for x in (raw / "devkit/ILSVRC2012_validation_ground_truth.txt").read_text().split()]
    with open(raw / "devkit/meta.csv", newline="") as fh:
        meta = {int(r["ILSVRC2012_ID"]): r["WNID"] for r in csv.DictReader(fh)}
    assert len(truth) == 60
    assert {f"ILSVRC2012_val_{i:08d}": meta[t] for i, t in enumerate(truth, 1)} == folder_label
    # Like the real devkit, ILSVRC2012_IDs are not simply sorted-wnid order.
    assert [meta[i] for i in sorted(meta)] != wnids
    mapping = (raw / "LOC_synset_mapping.txt").read_text().splitlines()
    assert mapping[0] == "n01440764 tench, Tinca tinca" and len(mapping) == 10
    assert (raw / ".done").is_file()


def test_images_are_imagenet_shaped_and_within_the_size_range(raw):
    sizes = [Image.open(p).size for p in (raw / "val_flat").iterdir()]
    assert all(48 <= min(s) and max(s) <= 80 for s in sizes)
    assert sum(w > h for w, h in sizes) > sum(w < h for w, h in sizes) > 0  # mostly landscape, some portrait


def test_defects_are_in_distinct_classes_and_same_bytes_in_folder_and_archive(raw):
    planted = defects(raw)
    assert set(planted) == {kind for kind, _, _ in demo.DEFECTS} | {"stray"}
    image_defects = [d for d in planted.values() if d["kind"] != "stray"]
    assert len({d["wnid"] for d in image_defects}) == len(image_defects)
    with SourceReader(raw) as reader:
        for d in planted.values():
            assert d["expected"] in ("repair", "skip", "keep", "unclassified")
            assert reader.read(d["source"]) == reader.read(d["archive_source"])


def _open(raw, kind) -> bytes:
    return (raw / defects(raw)[kind]["source"]).read_bytes()


def test_cmyk_defect_is_a_cmyk_jpeg(raw):
    img = Image.open(io.BytesIO(_open(raw, "cmyk")))
    assert (img.format, img.mode) == ("JPEG", "CMYK")


def test_png_defect_is_png_content_named_jpeg(raw):
    d = defects(raw)["png"]
    assert d["source"].endswith(".JPEG") and Image.open(io.BytesIO(_open(raw, "png"))).format == "PNG"


def test_grayscale_defect_is_a_single_channel_jpeg(raw):
    img = Image.open(io.BytesIO(_open(raw, "grayscale")))
    assert (img.format, img.mode) == ("JPEG", "L")


def test_truncated_defect_fails_to_decode(raw):
    img = Image.open(io.BytesIO(_open(raw, "truncated")))
    assert img.format == "JPEG"
    with pytest.raises(OSError, match="truncated"):
        img.load()


def test_zero_byte_defect_is_empty(raw):
    assert _open(raw, "zero_byte") == b""


def test_not_image_defect_is_not_decodable(raw):
    with pytest.raises(Image.UnidentifiedImageError):
        Image.open(io.BytesIO(_open(raw, "not_image")))


def test_exif_rotated_defect_has_orientation_6(raw):
    img = Image.open(io.BytesIO(_open(raw, "exif_rotated")))
    assert img.getexif().get(0x0112) == 6


def test_progressive_defect_is_progressive(raw):
    img = Image.open(io.BytesIO(_open(raw, "progressive")))
    assert img.info.get("progressive") or img.info.get("progression")
    assert not Image.open(raw / "train/n01440764/n01440764_1.JPEG").info.get("progressive")


def test_no_defects_without_bad_files(tmp_path):
    demo.generate(
        view("demo", {**CFG, "classes": 2, "train_per_class": 2, "val_per_class": 1, "bad_files": False}), tmp_path
    )
    assert json.loads((tmp_path / "defects.json").read_text())["defects"] == []
    assert len(list((tmp_path / "train").rglob("*"))) == 2 + 4


def test_min_size_above_max_size_is_refused_naming_both_keys(tmp_path):
    with pytest.raises(SystemExit, match="min_size.*max_size"):
        demo.generate(view("demo", {**CFG, "min_size": 100, "max_size": 80}), tmp_path)


def features(path: Path) -> np.ndarray:
    """A 4x4x4 colour histogram of a 16x16 thumbnail: position-free, so robust to crops and flips."""
    pixels = np.asarray(Image.open(path).convert("RGB").resize((16, 16))).reshape(-1, 3) // 64
    hist = np.bincount(pixels[:, 0] * 16 + pixels[:, 1] * 4 + pixels[:, 2], minlength=64)
    return hist / hist.sum()


def test_classes_are_learnable_by_nearest_centroid_far_above_chance(raw):
    bad = {d["source"] for d in defects(raw).values()}
    wnids = sorted(p.name for p in (raw / "train").iterdir())
    centroids = np.stack(
        [
            np.mean(
                [
                    features(p)
                    for p in sorted((raw / "train" / w).iterdir())
                    if p.relative_to(raw).as_posix() not in bad
                ],
                axis=0,
            )
            for w in wnids
        ]
    )
    val = sorted((raw / "val").rglob("*.JPEG"))
    predicted = [wnids[np.argmin(((centroids - features(p)) ** 2).sum(1))] for p in val]
    accuracy = np.mean([w == p.parent.name for w, p in zip(predicted, val, strict=True)])
    chance = 1 / len(wnids)
    print(f"nearest-centroid accuracy {accuracy:.2f}")
    assert accuracy >= 3 * chance, f"nearest-centroid accuracy {accuracy:.2f} vs chance {chance:.2f}"


def test_packer_treats_each_planted_defect_as_the_manifest_says(raw):
    from rectrain.data.images import Skip, prepare

    for d in defects(raw).values():
        try:
            _, repaired = prepare((raw / d["source"]).read_bytes(), 0, 90)
            action = "repair" if repaired else "keep"
        except Skip:
            action = "skip"
        assert action == {"unclassified": "skip"}.get(d["expected"], d["expected"]), d
