"""The raw-ImageNet indexer: every layout of the same images gives the same rows; archives are safe."""

import csv
import io
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path, PurePosixPath

import pytest
from helpers.packdata import TINY_DEMO
from helpers.views import view

from rectrain.data import demo, index
from rectrain.data.archives import SourceReader, UnsafeArchiveMember
from rectrain.data.index import LayoutError, discover, write_index

CFG = {**TINY_DEMO, "bad_files": True}
LAYOUTS = ["folders", "flat-kaggle", "flat-devkit", "archives"]


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("index") / "raw"
    demo.generate(view("demo", CFG), out)
    return out


def run_index(raw: Path, out: Path, layout: str = "auto") -> dict[str, list[dict]]:
    write_index(discover(raw, layout), out)
    tables = {}
    for name in ("train", "val", "classes", "unclassified"):
        with open(out / f"{name}.tsv", newline="") as fh:
            tables[name] = list(csv.DictReader(fh, delimiter="\t"))
    return tables


@pytest.fixture(scope="module")
def indexes(raw, tmp_path_factory):
    base = tmp_path_factory.mktemp("indexes")
    return {layout: run_index(raw, base / layout, layout) for layout in LAYOUTS + ["auto"]}


def image_name(source: str) -> str:
    return PurePosixPath(source.split("::")[-1]).name


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_every_layout_gives_the_folder_layouts_labels(indexes, layout):
    ref, got = indexes["folders"], indexes[layout]
    assert got["classes"] == ref["classes"]
    for split in ("train", "val"):
        assert Counter((r["wnid"], r["label"]) for r in got[split]) == Counter(
            (r["wnid"], r["label"]) for r in ref[split]
        )
        # The same image (by file name) has the same label, whatever the source naming.
        assert {image_name(r["source"]): r["label"] for r in got[split]} == {
            image_name(r["source"]): r["label"] for r in ref[split]
        }
    assert [image_name(r["source"]) for r in got["unclassified"]] == ["Thumbs.db"]


def test_auto_prefers_folders(indexes):
    assert indexes["auto"] == indexes["folders"]


def test_rows_ids_labels_and_classes_follow_the_contract(indexes, raw):
    tables = indexes["folders"]
    wnids = sorted(p.name for p in (raw / "train").iterdir())
    assert tables["classes"] == [{"label": str(i), "wnid": w, "name": n} for i, (w, n) in enumerate(demo.class_list(4))]
    assert [r["wnid"] for r in tables["classes"]] == wnids
    for split, count in (("train", 4 * 3 + len(demo.DEFECTS)), ("val", 4 * 2)):
        rows = tables[split]
        assert len(rows) == count
        assert [r["id"] for r in rows] == [str(i) for i in range(count)]
        assert [r["source"] for r in rows] == sorted(r["source"] for r in rows)
        assert all(wnids[int(r["label"])] == r["wnid"] for r in rows)
    # Planted bad images are classified (the packer, not the indexer, judges content).
    assert "train/n01440764/n01440764_4.JPEG" in {r["source"] for r in tables["train"]}


def test_archive_train_ids_match_folder_ids(indexes):
    folder, archive = indexes["folders"]["train"], indexes["archives"]["train"]
    assert [(r["id"], image_name(r["source"])) for r in folder] == [(r["id"], image_name(r["source"])) for r in archive]


def test_stray_file_is_listed_unclassified_with_a_reason(indexes):
    for layout in LAYOUTS:
        (row,) = indexes[layout]["unclassified"]
        assert row["source"].endswith("Thumbs.db") and "not an image extension" in row["reason"]


def test_source_reader_reads_the_same_bytes_from_folder_and_archive(indexes, raw):
    folder = {image_name(r["source"]): r["source"] for r in indexes["folders"]["train"] + indexes["folders"]["val"]}
    archive = {image_name(r["source"]): r["source"] for r in indexes["archives"]["train"] + indexes["archives"]["val"]}
    assert folder.keys() == archive.keys()
    with SourceReader(raw) as reader:
        for name in folder:
            assert reader.read(archive[name]) == reader.read(folder[name]) == (raw / folder[name]).read_bytes()


def test_source_reader_survives_pickling_into_workers(indexes, raw):
    reader = SourceReader(raw)
    source = indexes["archives"]["val"][0]["source"]
    first = reader.read(source)
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.read(source) == first
    reader.close()
    clone.close()


def test_source_outside_raw_root_is_refused(raw):
    with pytest.raises(ValueError, match="relative to the raw root"):
        SourceReader(raw).read("../escape.JPEG")


def copy_subset(raw: Path, dest: Path, names: list[str]) -> Path:
    dest.mkdir()
    for name in names:
        src = raw / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest / name)
    return dest


def test_archives_alone_with_devkit_tgz_give_the_same_labels(raw, indexes, tmp_path):
    root = tmp_path / "raw"
    root.mkdir()
    for name in ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"):
        shutil.copy(raw / "archives" / name, root / name)
    tables = run_index(root, tmp_path / "index")  # auto: no folders, no Kaggle CSV
    assert {image_name(r["source"]): r["label"] for r in tables["val"]} == {
        image_name(r["source"]): r["label"] for r in indexes["folders"]["val"]
    }
    assert tables["val"][0]["source"] == "ILSVRC2012_img_val.tar::ILSVRC2012_val_00000001.JPEG"
    assert all(r["name"] for r in tables["classes"])  # names from the devkit meta when no mapping file


def test_flat_val_image_without_ground_truth_is_unclassified(raw, tmp_path):
    root = copy_subset(raw, tmp_path / "raw", ["train", "val_flat", "LOC_val_solution.csv"])
    shutil.copy(root / "val_flat/ILSVRC2012_val_00000001.JPEG", root / "val_flat/ILSVRC2012_val_00099999.JPEG")
    tables = run_index(root, tmp_path / "index")
    assert len(tables["val"]) == 8
    assert {
        "source": "val_flat/ILSVRC2012_val_00099999.JPEG",
        "reason": "no ground truth for this image in LOC_val_solution.csv",
    } in tables["unclassified"]
    assert all(r["name"] == "" for r in tables["classes"])  # no mapping file: names empty, not invented


def test_val_class_missing_from_train_is_unclassified(raw, tmp_path):
    root = copy_subset(raw, tmp_path / "raw", ["train", "val"])
    shutil.rmtree(root / "train/n01440764")
    tables = run_index(root, tmp_path / "index")
    assert {r["wnid"] for r in tables["val"]} == {"n01443537", "n01484850", "n01491361"}
    assert sum("not one of the train classes" in r["reason"] for r in tables["unclassified"]) == 2


def test_odd_files_in_class_folders_are_listed_not_indexed(raw, tmp_path):
    root = copy_subset(raw, tmp_path / "raw", ["train", "val"])
    (root / "train/n01443537/._n01443537_1.JPEG").write_bytes(b"\0\5\26\7")
    (root / "train/notes.txt").write_text("x")
    (root / "train/n01443537/extra").mkdir()
    (root / "train/n01443537/extra/a.JPEG").write_bytes(b"x")
    (root / "train/.cache").mkdir()
    (root / "train/.cache/b.JPEG").write_bytes(b"x")
    tables = run_index(root, tmp_path / "index")
    reasons = {r["source"]: r["reason"] for r in tables["unclassified"]}
    assert reasons["train/n01443537/._n01443537_1.JPEG"].startswith("hidden file")
    assert reasons["train/notes.txt"] == "outside any class directory"
    assert reasons["train/.cache/b.JPEG"] == "hidden class directory"
    # an image below a class folder is of that class (tests/test_index_realdata.py has the layouts)
    assert {"id": "5", "source": "train/n01443537/extra/a.JPEG", "label": "1", "wnid": "n01443537"} in tables["train"]
    assert len(tables["train"]) == 4 * 3 + len(demo.DEFECTS) + 1 and len(tables["classes"]) == 4


def test_kaggle_nested_layout_is_found(raw, tmp_path):
    root = tmp_path / "raw"
    images = root / "ILSVRC/Data/CLS-LOC"
    images.mkdir(parents=True)
    shutil.copytree(raw / "train", images / "train")
    shutil.copytree(raw / "val_flat", images / "val")
    shutil.copy(raw / "LOC_val_solution.csv", root)
    shutil.copy(raw / "LOC_synset_mapping.txt", root)
    tables = run_index(root, tmp_path / "index")
    assert len(tables["val"]) == 8 and tables["val"][0]["source"].startswith("ILSVRC/Data/CLS-LOC/val/")
    assert tables["classes"][0]["name"] == "tench, Tinca tinca"


def test_forced_layout_that_is_missing_names_what_it_looked_for(raw, tmp_path):
    root = copy_subset(raw, tmp_path / "raw", ["train", "val"])
    with pytest.raises(LayoutError, match="--layout flat-devkit: no flat val folder"):
        discover(root, "flat-devkit")
    with pytest.raises(LayoutError, match="ILSVRC2012_img_train.tar"):
        discover(root, "archives")
    with pytest.raises(LayoutError, match="not a directory"):
        discover(tmp_path / "nowhere")


def tar_with(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def regular(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def link(name: str, kind=tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, "/etc/passwd"
    return info, b""


def archive_root(tmp_path: Path, val_members=None, class_members=None) -> Path:
    root = tmp_path / "raw"
    root.mkdir()
    class_members = class_members or [regular("n01440764_1.JPEG")]
    (root / "ILSVRC2012_img_train.tar").write_bytes(tar_with([regular("n01440764.tar", tar_with(class_members))]))
    (root / "ILSVRC2012_img_val.tar").write_bytes(tar_with(val_members or [regular("ILSVRC2012_val_00000001.JPEG")]))
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\nILSVRC2012_val_00000001,n01440764 1 1 2 2 \n")
    return root


def test_handmade_archives_with_long_names_read_by_offset(tmp_path):
    long_name = "n01440764_" + "9" * 150 + ".JPEG"  # GNU long-name header before the data
    root = archive_root(tmp_path, class_members=[regular("n01440764_1.JPEG", b"first"), regular(long_name, b"second")])
    tables = run_index(root, tmp_path / "index")
    sources = [r["source"] for r in tables["train"]]
    assert sources == [
        "ILSVRC2012_img_train.tar::n01440764.tar::n01440764_1.JPEG",
        f"ILSVRC2012_img_train.tar::n01440764.tar::{long_name}",
    ]
    with SourceReader(root) as reader:
        assert [reader.read(s) for s in sources] == [b"first", b"second"]


@pytest.mark.parametrize("member", ["../../x.JPEG", "/abs/x.JPEG"])
def test_val_tar_member_escaping_the_archive_is_refused_by_name(tmp_path, member):
    root = archive_root(tmp_path, val_members=[regular("ILSVRC2012_val_00000001.JPEG"), regular(member)])
    with pytest.raises(UnsafeArchiveMember) as err:
        discover(root, "archives")
    assert repr(member) in str(err.value) and "ILSVRC2012_img_val.tar" in str(err.value)
    assert not (tmp_path / "x.JPEG").exists() and not Path("/abs/x.JPEG").exists()


@pytest.mark.parametrize("member", ["../../x.JPEG", "/abs/x.JPEG"])
def test_nested_class_tar_member_escaping_is_refused_naming_both_tars(tmp_path, member):
    root = archive_root(tmp_path, class_members=[regular("n01440764_1.JPEG"), regular(member)])
    with pytest.raises(UnsafeArchiveMember, match=r"ILSVRC2012_img_train\.tar::n01440764\.tar") as err:
        discover(root, "archives")
    assert repr(member) in str(err.value)


@pytest.mark.parametrize(
    "kind, what", [(tarfile.SYMTYPE, "link"), (tarfile.LNKTYPE, "link"), (tarfile.CHRTYPE, "device")]
)
def test_links_and_devices_in_tars_are_refused(tmp_path, kind, what):
    root = archive_root(tmp_path, val_members=[link("ILSVRC2012_val_00000001.JPEG", kind)])
    with pytest.raises(UnsafeArchiveMember, match=what):
        discover(root, "archives")


def test_cli_writes_four_tsvs_and_fails_with_the_member_named(raw, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(index.__file__).parents[2]))
    out = tmp_path / "index"
    proc = subprocess.run(
        [sys.executable, "-m", "rectrain.data.index", "--raw", str(raw), "--out", str(out), "--layout", "archives"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["classes.tsv", "train.tsv", "unclassified.tsv", "val.tsv"]
    assert "[index] train 20 images, val 8 images, 4 classes, 1 unclassified" in proc.stderr

    bad = archive_root(tmp_path, val_members=[regular("../../x.JPEG")])
    proc = subprocess.run(
        [sys.executable, "-m", "rectrain.data.index", "--raw", str(bad), "--out", str(tmp_path / "o2")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode != 0 and "'../../x.JPEG'" in proc.stderr and not (tmp_path / "o2").exists()
