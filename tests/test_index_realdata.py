"""Data as users have it (issue 24, points 3-5): Tiny-ImageNet and images below a class folder, every
format the pack opens whatever its extension, and file names the index TSVs cannot hold.

Each test builds a small tree and asserts the outcome and the message; the layout and format tests
also pack what was indexed, so the labels and repair reasons are those of the real pack."""

import csv
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers.packdata import REPO, photo, png_bytes, run_pack
from PIL import Image

from rectrain.data import formats
from rectrain.data.images import prepare
from rectrain.data.index import discover
from rectrain.data.indextable import read_table
from rectrain.recordio import scan_records, unpack_record
from rectrain.tables import read_tsv

# One colour per class: a packed record's pixels say which class its image was, whatever the label.
COLOURS = [(220, 30, 30), (30, 220, 30), (30, 30, 220)]
TINY_WNIDS = ["n01443537", "n01629819", "n01641577"]
TINY_WORDS = {"n01443537": "goldfish, Carassius auratus", "n01629819": "European fire salamander"}


def solid(colour, fmt: str = "JPEG", size=(40, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, fmt)
    return buf.getvalue()


def tiny_imagenet(root: Path, per_class: int = 2) -> Path:
    """Tiny-ImageNet as tiny-imagenet-200.zip extracts: train/<wnid>/images/*.JPEG with a boxes file
    beside, val/images/ labelled by val/val_annotations.txt, wnids.txt, words.txt (with ids of other
    classes too), and an unlabelled test/images/."""
    for k, wnid in enumerate(TINY_WNIDS):
        images = root / "train" / wnid / "images"
        images.mkdir(parents=True)
        for n in range(per_class):
            (images / f"{wnid}_{n}.JPEG").write_bytes(solid(COLOURS[k]))
        (root / "train" / wnid / f"{wnid}_boxes.txt").write_text(f"{wnid}_0.JPEG\t0\t0\t40\t32\n")
    (root / "val" / "images").mkdir(parents=True)
    lines = []
    for i, k in enumerate([2, 0, 1, 1, 0, 2]):  # not in class order: labels must come from the annotations
        (root / "val" / "images" / f"val_{i}.JPEG").write_bytes(solid(COLOURS[k]))
        lines.append(f"val_{i}.JPEG\t{TINY_WNIDS[k]}\t0\t0\t40\t32")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    (root / "test" / "images").mkdir(parents=True)
    (root / "test" / "images" / "test_0.JPEG").write_bytes(solid((0, 0, 0)))
    (root / "wnids.txt").write_text("\n".join(TINY_WNIDS) + "\n")
    words = {"n00001740": "entity", **TINY_WORDS}
    (root / "words.txt").write_text("".join(f"{w}\t{name}\n" for w, name in words.items()))
    return root


def run_index(raw: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    cmd = [sys.executable, "-m", "rectrain.data.index", "--raw", str(raw), "--out", str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def tables(index: Path) -> dict[str, list[dict]]:
    return {name: read_tsv(index / f"{name}.tsv") for name in ("train", "val", "classes", "unclassified")}


def packed_colours(rec: Path) -> dict[int, tuple[int, int]]:
    """id -> (label, index of the class colour the stored image shows)."""
    out = {}
    for _, payload in scan_records(rec):
        header, image = unpack_record(payload)
        mean = np.asarray(Image.open(io.BytesIO(image)).convert("RGB"), dtype=float).mean((0, 1))
        out[int(header.id)] = (int(header.label), int(np.argmin([np.abs(mean - c).sum() for c in COLOURS])))
    return out


# ---- layouts ---------------------------------------------------------------------------------


def test_tiny_imagenet_is_detected_with_val_labels_from_its_annotations_and_names_from_words(tmp_path):
    raw = tiny_imagenet(tmp_path / "tiny-imagenet-200")
    proc = run_index(raw, tmp_path / "index")
    assert proc.returncode == 0, proc.stderr
    t = tables(tmp_path / "index")
    assert [(r["source"], r["wnid"]) for r in t["train"]][:2] == [
        ("train/n01443537/images/n01443537_0.JPEG", "n01443537"),
        ("train/n01443537/images/n01443537_1.JPEG", "n01443537"),
    ]
    assert {r["source"]: r["wnid"] for r in t["val"]} == {
        f"val/images/val_{i}.JPEG": TINY_WNIDS[k] for i, k in enumerate([2, 0, 1, 1, 0, 2])
    }
    assert [(r["wnid"], r["name"]) for r in t["classes"]] == [(w, TINY_WORDS.get(w, "")) for w in TINY_WNIDS]
    boxes = {r["source"] for r in t["unclassified"]}
    assert boxes == {f"train/{w}/{w}_boxes.txt" for w in TINY_WNIDS}, "the boxes files are listed, nothing else"
    assert "[index] val: val/images/ labelled by val/val_annotations.txt" in proc.stderr
    assert (
        "[index] train/: 3 class folders hold images in sub-folders (e.g. n01443537, n01629819, n01641577); "
        "an image below a class folder is of that class"
    ) in proc.stderr
    assert "warning" not in proc.stderr, "wnids.txt matches the train folders"


def test_tiny_imagenet_inside_the_folder_its_zip_makes_is_found(tmp_path):
    tiny_imagenet(tmp_path / "raw" / "tiny-imagenet-200")
    found = discover(tmp_path / "raw")
    assert len(found.train) == 6 and len(found.val) == 6
    assert found.layout["val"] == "tiny-imagenet-200/val/images/ labelled by tiny-imagenet-200/val/val_annotations.txt"


def test_tiny_imagenet_wnids_list_that_differs_from_the_train_folders_is_a_warning(tmp_path):
    raw = tiny_imagenet(tmp_path / "raw")
    (raw / "wnids.txt").write_text("\n".join([*TINY_WNIDS[:2], "n09999999"]) + "\n")
    found = discover(raw)
    assert found.warnings == [
        "wnids.txt lists 3 classes, train holds 3: 1 listed without images (e.g. n09999999), "
        "1 not listed (e.g. n01641577)"
    ]


def test_tiny_imagenet_index_and_pack_store_every_image_under_its_own_class_label(tmp_path):
    raw = tiny_imagenet(tmp_path / "raw")
    assert run_index(raw, tmp_path / "index").returncode == 0
    for split in ("train", "val"):
        proc = run_pack(raw, tmp_path / "index", tmp_path / split, split=split)
        assert proc.returncode == 0, proc.stderr
        stored = packed_colours(tmp_path / split / "fast" / f"{split}.rec")
        assert len(stored) == 6
        assert all(label == colour for label, colour in stored.values()), stored
        assert sorted({label for label, _ in stored.values()}) == [0, 1, 2]


def test_images_in_sub_folders_of_a_class_folder_are_that_class(tmp_path):
    raw = tmp_path / "raw"
    for split in ("train", "val"):
        (raw / split / "cat" / "2019" / "summer").mkdir(parents=True)
        (raw / split / "cat" / "a.jpg").write_bytes(solid(COLOURS[0]))
        (raw / split / "cat" / "2019" / "summer" / "b.jpg").write_bytes(solid(COLOURS[0]))
        (raw / split / "dog").mkdir()
        (raw / split / "dog" / "c.jpg").write_bytes(solid(COLOURS[1]))
    (raw / "train" / "cat" / ".thumbnails").mkdir()
    (raw / "train" / "cat" / ".thumbnails" / "a.jpg").write_bytes(solid(COLOURS[0]))
    found = discover(raw)
    assert list(found.train.sorted()) == [
        ("train/cat/2019/summer/b.jpg", "cat"),
        ("train/cat/a.jpg", "cat"),
        ("train/dog/c.jpg", "dog"),
    ]
    assert found.unclassified == [("train/cat/.thumbnails/a.jpg", "hidden folder below class directory cat")]
    assert found.notes[0].startswith("train/: 1 class folders hold images in sub-folders (e.g. cat)")


# ---- formats ---------------------------------------------------------------------------------


def every_format() -> dict[str, bytes]:
    """name -> content: each supported format under its own extension in odd cases, content under a
    name that says nothing (no extension, .dat), and text under an unknown extension."""
    img = photo(48, 36, 3)

    def saved(fmt):
        buf = io.BytesIO()
        img.save(buf, fmt)
        return buf.getvalue()

    return {
        "a.JPG": saved("JPEG"),
        "b.Jpeg": saved("JPEG"),
        "c.png": png_bytes(img),
        "d.GIF": saved("GIF"),
        "e.bmp": saved("BMP"),
        "f.TIFF": saved("TIFF"),
        "g.webp": saved("WEBP"),
        "h": saved("PNG"),
        "i.dat": saved("JPEG"),
        "notes.md": b"# not an image\n",
    }


def test_every_format_the_pack_opens_is_indexed_whatever_the_extension_or_its_case(tmp_path):
    raw = tmp_path / "raw"
    for split in ("train", "val"):
        (raw / split / "c0").mkdir(parents=True)
        for name, data in every_format().items():
            (raw / split / "c0" / name).write_bytes(data)
    found = discover(raw)
    assert sorted(s.rpartition("/")[2] for s, _ in found.train) == sorted(set(every_format()) - {"notes.md"})
    ((source, reason),) = [u for u in found.unclassified if u[0].startswith("train/")]
    assert source == "train/c0/notes.md"
    assert reason == (
        "not an image extension (.md; accepted, any case: .apng, .bmp, .gif, .jfif, .jpe, .jpeg, .jpg, .png, "
        ".tif, .tiff, .webp) and its first bytes are none of JPEG, PNG, GIF, BMP, TIFF, WEBP"
    )


def test_non_jpeg_images_are_packed_re_encoded_and_listed_as_repaired_with_the_reason_their_name_fits(tmp_path):
    raw = tmp_path / "raw"
    (raw / "train" / "c0").mkdir(parents=True)
    (raw / "val" / "c0").mkdir(parents=True)
    for name, data in every_format().items():
        (raw / "train" / "c0" / name).write_bytes(data)
    (raw / "train" / "c0" / "j.JPEG").write_bytes(png_bytes(photo(40, 30, 4)))  # the real ImageNet case
    (raw / "val" / "c0" / "v.jpg").write_bytes(solid(COLOURS[0]))
    assert run_index(raw, tmp_path / "index").returncode == 0
    proc = run_pack(raw, tmp_path / "index", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    import json

    manifest = json.loads((tmp_path / "out" / "pack" / "train.manifest.json").read_text())
    repaired = {r["source"].rpartition("/")[2]: r["reason"] for r in manifest["repaired"]}
    assert repaired == {
        "c.png": "PNG re-encoded as JPEG",
        "d.GIF": "GIF re-encoded as JPEG",
        "e.bmp": "BMP re-encoded as JPEG",
        "f.TIFF": "TIFF re-encoded as JPEG",
        "g.webp": "WEBP re-encoded as JPEG",
        "h": "PNG content named without an extension re-encoded as JPEG",
        "j.JPEG": "PNG content named as JPEG re-encoded as JPEG",
    }
    assert manifest["packed"] == 10 and manifest["skipped_files"] == []


def test_repair_reason_names_a_mismatch_only_where_name_and_content_differ():
    data = png_bytes(photo(32, 24, 5))
    assert prepare(data, 0, 90, name="x.PNG")[1] == "PNG re-encoded as JPEG"
    assert prepare(data, 0, 90, name="a.tar::x.JPEG")[1] == "PNG content named as JPEG re-encoded as JPEG"
    assert prepare(data, 0, 90, name="x.webp")[1] == "PNG content named .webp re-encoded as JPEG"


def test_format_signatures_recognise_each_supported_format_by_its_first_bytes():
    img = photo(16, 12, 6)
    for fmt in formats.SUPPORTED_FORMATS:
        buf = io.BytesIO()
        img.save(buf, fmt)
        assert formats.sniff(buf.getvalue()[: formats.HEAD_BYTES]) == fmt
    assert formats.sniff(b"%!PS-Adobe-3.0 EPSF") is None and formats.sniff(b"") is None


# ---- names -----------------------------------------------------------------------------------

LATIN1 = b"caf\xe9.jpg".decode("utf-8", "surrogateescape")  # what os.scandir gives for a Latin-1 name
NAMES = {
    "tab": ("a\tb.jpg", "name contains a tab, which separates the index's columns: rename the file"),
    "newline": ("a\nb.jpg", "name contains a line break (newline or carriage return), which ends an index row"),
    "carriage return": ("a\rb.jpg", "name contains a line break (newline or carriage return), which ends an index row"),
    "archive separator": ("a::b.jpg", "name contains '::', which separates an archive from its member in a source"),
    "not UTF-8": (LATIN1, "name is not valid UTF-8 (shown with its odd bytes as \\xNN; e.g. Latin-1"),
}


def odd_name_tree(root: Path, name: str) -> Path:
    for split in ("train", "val"):
        (root / split / "c0").mkdir(parents=True)
        (root / split / "c0" / "ok.jpg").write_bytes(solid(COLOURS[0]))
    (root / "train" / "c0" / 'quote"d.jpg').write_bytes(solid(COLOURS[0]))
    with open(os.fsencode(root / "train" / "c0") + b"/" + os.fsencode(name), "wb") as fh:
        fh.write(solid(COLOURS[0]))
    return root


def pandas_rows(path: Path) -> list[dict]:
    frame = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)
    return frame.to_dict("records")


@pytest.mark.parametrize("kind", NAMES)
def test_odd_file_name_is_unclassified_with_its_reason_and_every_reader_gets_the_same_rows(tmp_path, kind):
    name, reason = NAMES[kind]
    raw = odd_name_tree(tmp_path / "raw", name)
    proc = run_index(raw, tmp_path / "index")
    assert proc.returncode == 0, proc.stderr
    index = tmp_path / "index"
    (row,) = read_tsv(index / "unclassified.tsv")
    shown = "caf\\xe9.jpg" if kind == "not UTF-8" else name
    assert row["source"] == f"train/c0/{shown}" and row["reason"].startswith(reason)
    for table in ("train", "unclassified"):
        assert pandas_rows(index / f"{table}.tsv") == read_tsv(index / f"{table}.tsv"), table
    table = read_table(index / "train.tsv")
    assert list(table.iter_sources()) == [r["source"] for r in read_tsv(index / "train.tsv")]
    assert list(table.iter_sources()) == ["train/c0/ok.jpg", 'train/c0/quote"d.jpg']


def test_class_folder_whose_name_is_not_utf8_lists_its_files_with_the_reason(tmp_path):
    raw = odd_name_tree(tmp_path / "raw", "plain.jpg")
    odd = os.fsencode(raw / "train") + b"/caf\xe9"
    os.mkdir(odd)
    with open(odd + b"/x.jpg", "wb") as fh:
        fh.write(solid(COLOURS[1]))
    assert run_index(raw, tmp_path / "index").returncode == 0
    rows = read_tsv(tmp_path / "index" / "unclassified.tsv")
    assert [r["source"] for r in rows] == ["train/caf\\xe9/x.jpg"]
    assert rows[0]["reason"].startswith("class directory name is not valid UTF-8")
    assert [r["wnid"] for r in read_tsv(tmp_path / "index" / "classes.tsv")] == ["c0"]


def test_quoted_name_is_packed_under_its_own_source(tmp_path):
    raw = odd_name_tree(tmp_path / "raw", "plain.jpg")
    assert run_index(raw, tmp_path / "index").returncode == 0
    proc = run_pack(raw, tmp_path / "index", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    rows = {int(r["id"]): r["source"] for r in csv.DictReader(open(tmp_path / "index" / "train.tsv"), delimiter="\t")}
    assert rows[2] == 'train/c0/quote"d.jpg'
    assert sorted(packed_colours(tmp_path / "out" / "fast" / "train.rec")) == [0, 1, 2]
