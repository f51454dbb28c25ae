"""Hostile raw datasets: the indexer accounts for every file, or fails naming the split, archive or offset.

Each test builds its own small damaged input (issue 11, point 1) and asserts the outcome and the message.
"""

import ast
import io
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers.packdata import TINY_DEMO, TINY_WNIDS, tiny_demo_raw

from rectrain.data import archives, demo, index
from rectrain.data.archives import TRAIN_TAR, VAL_TAR, CorruptArchive
from rectrain.data.demo import tar_bytes
from rectrain.data.index import LayoutError, discover

CFG = TINY_DEMO
WNIDS = TINY_WNIDS


@pytest.fixture(scope="module")
def demo_raw(tmp_path_factory):
    return tiny_demo_raw(tmp_path_factory, "hostile")


def kaggle_flat(demo_raw: Path, root: Path) -> Path:
    """train/<wnid>/ + a flat val/ labelled by LOC_val_solution.csv (the Kaggle download)."""
    root.mkdir()
    shutil.copytree(demo_raw / "train", root / "train")
    shutil.copytree(demo_raw / "val_flat", root / "val")
    shutil.copy(demo_raw / "LOC_val_solution.csv", root)
    return root


def foldered(demo_raw: Path, root: Path) -> Path:
    root.mkdir()
    shutil.copytree(demo_raw / "train", root / "train")
    shutil.copytree(demo_raw / "val", root / "val")
    return root


def reasons(found) -> dict[str, str]:
    return dict(found.unclassified)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(index.__file__).parents[2]))
    cmd = [sys.executable, "-m", "rectrain.data.index", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


# ---------------------------------------------------------------- layout detection and empty splits


@pytest.mark.parametrize("content", ["empty", "with a notebook copy"])
def test_hidden_notebook_folder_in_flat_val_does_not_make_val_foldered(demo_raw, tmp_path, content):
    root = kaggle_flat(demo_raw, tmp_path / "raw")
    (root / "val/.ipynb_checkpoints").mkdir()
    if content != "empty":
        (root / "val/.ipynb_checkpoints/look-checkpoint.ipynb").write_text("{}")
    found = discover(root)
    assert len(found.val) == 8
    assert found.layout["val"] == "val/ labelled by LOC_val_solution.csv"
    if content != "empty":
        assert reasons(found) == {"val/.ipynb_checkpoints/look-checkpoint.ipynb": "directory inside flat val"}


def test_empty_visible_folder_in_flat_val_does_not_make_val_foldered(demo_raw, tmp_path):
    root = kaggle_flat(demo_raw, tmp_path / "raw")
    (root / "val/n01440764").mkdir()
    assert len(discover(root).val) == 8


def test_flat_val_without_labels_in_folder_layout_is_an_error_naming_split_layout_and_finding(demo_raw, tmp_path):
    # Foldered val/ holding only non-images: 0 val images must stop the index, not publish an empty val.
    root = foldered(demo_raw, tmp_path / "raw")
    for image in (root / "val").rglob("*.JPEG"):  # text files: a JPEG named .txt is indexed by its content
        image.with_suffix(".txt").write_text("notes")
        image.unlink()
    with pytest.raises(LayoutError) as err:
        discover(root)
    msg = str(err.value)
    assert msg.startswith("val: no images indexed. Layout detected: folders (val/<wnid>/)")
    assert "Found instead: 8 x not an image extension (.txt;" in msg
    assert "absent_splits: [val]" in msg
    proc = run_cli("--raw", str(root), "--out", str(tmp_path / "out"))
    assert proc.returncode == 1 and "[index] val: no images indexed." in proc.stderr
    assert not (tmp_path / "out").exists()


def test_flat_val_whose_labels_name_no_file_is_an_error_with_the_reason(demo_raw, tmp_path):
    root = kaggle_flat(demo_raw, tmp_path / "raw")
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\nILSVRC2012_val_00099999,n01440764 1 1 2 2\n")
    with pytest.raises(LayoutError, match=r"val: no images indexed\. Layout detected: flat") as err:
        discover(root)
    assert "8 x no ground truth for this image in LOC_val_solution.csv" in str(err.value)


def test_val_of_only_hidden_folders_is_an_error_saying_what_was_there(demo_raw, tmp_path):
    root = kaggle_flat(demo_raw, tmp_path / "raw")
    shutil.rmtree(root / "val")
    (root / "val/.ipynb_checkpoints").mkdir(parents=True)
    with pytest.raises(LayoutError) as err:
        discover(root)
    assert str(err.value).startswith("val: no val images under")
    assert "found instead: val/ holds 0 files and 1 folders (1 hidden, 0 empty" in str(err.value)


def test_train_of_only_hidden_and_empty_folders_is_an_error_naming_train(demo_raw, tmp_path):
    root = tmp_path / "raw"
    (root / "train/.cache").mkdir(parents=True)
    (root / "train/.cache/n01440764_1.JPEG").write_bytes(b"x")
    (root / "train/n01440764").mkdir()
    shutil.copytree(demo_raw / "val", root / "val")
    with pytest.raises(LayoutError) as err:
        discover(root)
    assert "no train/<wnid>/ folders or ILSVRC2012_img_train.tar" in str(err.value)
    assert "found instead: train/ holds 0 files and 2 folders (1 hidden, 1 empty" in str(err.value)


def test_val_absent_on_purpose_indexes_train_only_and_the_cli_reads_it_from_the_config(demo_raw, tmp_path):
    root = tmp_path / "raw"
    root.mkdir()
    shutil.copytree(demo_raw / "train", root / "train")
    with pytest.raises(LayoutError, match="val: no val images under .*found instead: val/ does not exist"):
        discover(root)
    found = discover(root, absent_splits=["val"])
    assert found.val == [] and len(found.train) == 12
    assert discover(root, "folders", absent_splits=["val"]).layout["val"].startswith("absent")
    assert found.layout["val"] == "absent (index.absent_splits in the config)"
    proc = run_cli("--raw", str(root), "--out", str(tmp_path / "out"), "--config-json", '{"absent_splits": ["val"]}')
    assert proc.returncode == 0, proc.stderr
    assert "[index] train 12 images, val 0 images, 4 classes, 0 unclassified" in proc.stderr
    assert (tmp_path / "out/val.tsv").read_text() == "id\tsource\tlabel\twnid\n"
    refused = run_cli(
        "--raw", str(root), "--out", str(tmp_path / "o2"), "--config-json", '{"absent_splits": ["train"]}'
    )
    assert refused.returncode != 0 and "index.absent_splits.0' = 'train'" in refused.stderr


def test_class_of_val_that_train_lacks_is_a_warning_with_folders(demo_raw, tmp_path):
    root = foldered(demo_raw, tmp_path / "raw")
    shutil.rmtree(root / "train/n01440764")
    found = discover(root)
    assert found.warnings == [
        "val: 2 val images of 1 classes that train lacks (e.g. n01440764) are listed in unclassified.tsv; "
        "expected only when train is a subset made on purpose"
    ]


def test_empty_class_folder_and_non_wnid_names_are_reported_once_with_counts(demo_raw, tmp_path):
    root = foldered(demo_raw, tmp_path / "raw")
    for name in ("cats", "dogs"):
        shutil.copytree(root / "train/n01440764", root / f"train/{name}")
    (root / "train/n09999999").mkdir()
    found = discover(root)
    assert found.warnings == [
        "1 class folders in train/ hold no images and are not classes (e.g. n09999999)",
        "2 of 6 train classes are not WordNet ids (n + 8 digits), e.g. cats, dogs: fine for a custom dataset; "
        "labels are the sorted class names",
    ]
    assert {w for _, w in found.train} == {*WNIDS, "cats", "dogs"}


# ---------------------------------------------------------------- archives


def make_archives(root: Path, per_class: int = 2, classes=WNIDS[:3]) -> Path:
    """Official-named train/val archives for `classes`, val labelled by LOC_val_solution.csv."""
    root.mkdir()
    inner = [
        (f"{w}.tar", tar_bytes([(f"{w}_{n}.JPEG", bytes([k, n]) * 300) for n in range(per_class)]))
        for k, w in enumerate(classes)
    ]
    (root / TRAIN_TAR).write_bytes(tar_bytes(inner))
    val = [(f"ILSVRC2012_val_{i:08d}.JPEG", b"v" * 100) for i in range(1, len(classes) + 1)]
    (root / VAL_TAR).write_bytes(tar_bytes(val))
    csv = "".join(f"ILSVRC2012_val_{i:08d},{w} 1 1 2 2\n" for i, w in enumerate(classes, start=1))
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + csv)
    return root


def header_offsets(data: bytes) -> dict[str, tuple[int, int]]:
    """member name -> (header offset, data offset)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: (m.offset, m.offset_data) for m in tar}


def damage(path: Path, offset: int, data: bytes) -> None:
    blob = bytearray(path.read_bytes())
    blob[offset : offset + len(data)] = data
    path.write_bytes(bytes(blob))


def test_corrupt_member_header_in_train_archive_is_an_error_naming_archive_and_offset(tmp_path):
    root = make_archives(tmp_path / "raw")
    second = header_offsets((root / TRAIN_TAR).read_bytes())[f"{WNIDS[1]}.tar"][0]
    damage(root / TRAIN_TAR, second + 148, b"XXXXXXX")  # the header checksum field
    assert discover_error(root) == (
        f"{TRAIN_TAR}: no valid tar header at byte {second} of {TRAIN_TAR}: the listing stops there and every "
        f"member after it would be lost; the archive is damaged, re-download it (check its md5)"
    )


def discover_error(root: Path) -> str:
    with pytest.raises(CorruptArchive) as err:
        discover(root, "archives")
    return str(err.value)


def test_corrupt_header_inside_a_class_tar_names_both_tars_and_both_offsets(tmp_path):
    root = make_archives(tmp_path / "raw")
    outer = (root / TRAIN_TAR).read_bytes()
    _, start = header_offsets(outer)[f"{WNIDS[0]}.tar"]
    inner_off = header_offsets(outer[start:])[f"{WNIDS[0]}_1.JPEG"][0]
    damage(root / TRAIN_TAR, start + inner_off, b"\xff" * 100)
    msg = discover_error(root)
    assert msg.startswith(f"{TRAIN_TAR}::{WNIDS[0]}.tar: no valid tar header at byte {inner_off} of ")
    assert f"(byte {start + inner_off} of {TRAIN_TAR})" in msg


def test_truncated_train_archive_names_the_member_that_runs_past_the_end(tmp_path):
    root = make_archives(tmp_path / "raw")
    header, data_at = header_offsets((root / TRAIN_TAR).read_bytes())[f"{WNIDS[2]}.tar"]
    cut = data_at + 1000
    os.truncate(root / TRAIN_TAR, cut)
    msg = discover_error(root)
    assert msg.startswith(f"{TRAIN_TAR}: member '{WNIDS[2]}.tar' at byte {header} of {TRAIN_TAR} claims ")
    assert f"but the archive ends at byte {cut}: it is truncated" in msg


def test_archive_cut_at_a_member_boundary_lacks_the_end_marker(tmp_path):
    root = make_archives(tmp_path / "raw")
    cut = header_offsets((root / VAL_TAR).read_bytes())["ILSVRC2012_val_00000003.JPEG"][0]
    os.truncate(root / VAL_TAR, cut)
    assert discover_error(root).startswith(
        f"{VAL_TAR} ends at byte {cut} without an end-of-archive marker (expected after the last member, "
        f"at byte {cut} of {VAL_TAR}): the archive is truncated"
    )


def test_zeroed_block_inside_an_archive_is_not_taken_for_its_end(tmp_path):
    # An interrupted download into a preallocated file leaves zeros where a header should be.
    root = make_archives(tmp_path / "raw")
    header, data_at = header_offsets((root / VAL_TAR).read_bytes())["ILSVRC2012_val_00000002.JPEG"]
    damage(root / VAL_TAR, header, bytes(512))
    msg = discover_error(root)
    assert (
        f"{VAL_TAR}: data continues at byte {data_at} of {VAL_TAR} after an end-of-archive marker at byte {header}"
        in msg
    )


def test_class_missing_from_the_official_train_archive_is_an_error(tmp_path):
    root = make_archives(tmp_path / "raw")
    (root / TRAIN_TAR).write_bytes(
        tar_bytes([(f"{w}.tar", tar_bytes([(f"{w}_1.JPEG", b"x")])) for w in (WNIDS[0], WNIDS[2])])
    )
    with pytest.raises(LayoutError) as err:
        discover(root, "archives")
    assert str(err.value).startswith(
        f"whole classes missing from {TRAIN_TAR}: 1 val images of 1 classes that train lacks (e.g. {WNIDS[1]})"
    )


def test_empty_class_tar_in_the_official_train_archive_is_an_error(tmp_path):
    root = make_archives(tmp_path / "raw")
    inner = [(f"{w}.tar", tar_bytes([(f"{w}_1.JPEG", b"x")] if w != WNIDS[1] else [])) for w in WNIDS[:3]]
    (root / TRAIN_TAR).write_bytes(tar_bytes(inner))
    with pytest.raises(LayoutError, match=rf"{TRAIN_TAR}::{WNIDS[1]}\.tar holds no images \(0 members\): class "):
        discover(root, "archives")


def test_official_count_difference_is_one_warning_with_both_numbers_said_once_in_the_log(tmp_path, demo_raw):
    root = make_archives(tmp_path / "raw")
    found = discover(root)
    counts = (
        "counts differ from the official ILSVRC2012 archives: "
        f"{TRAIN_TAR} holds 3 classes (official: 1,000); {TRAIN_TAR} holds 6 train files (official: 1,281,167); "
        f"{VAL_TAR} holds 3 val files (official: 50,000)."
    )
    assert len(found.warnings) == 1 and found.warnings[0].startswith(counts)
    proc = run_cli("--raw", str(root), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("[index] warning: counts differ from the official") == 1
    # Folders are not the official archives: no count warning for a small folder dataset.
    assert discover(foldered(demo_raw, tmp_path / "folders")).warnings == []


# ---------------------------------------------------------------- special files and links


@pytest.mark.timeout(60)
def test_fifo_in_a_class_folder_is_listed_not_indexed_and_does_not_block(demo_raw, tmp_path):
    root = foldered(demo_raw, tmp_path / "raw")
    os.mkfifo(root / "train/n01440764/n01440764_99.JPEG")
    os.mkfifo(root / "val/fifo.JPEG")
    found = discover(root)
    assert reasons(found) == {
        "train/n01440764/n01440764_99.JPEG": "a named pipe (FIFO), not a regular file",
        "val/fifo.JPEG": "a named pipe (FIFO), not a regular file",
    }
    assert len(found.train) == 12


@pytest.mark.timeout(60)
def test_fifo_and_socket_in_flat_val_are_listed_with_their_kind(demo_raw, tmp_path, monkeypatch):
    root = kaggle_flat(demo_raw, tmp_path / "raw")
    os.mkfifo(root / "val/ILSVRC2012_val_00000009.JPEG")
    monkeypatch.chdir(root / "val")  # AF_UNIX paths are limited to ~100 bytes: bind a short relative name
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind("s.JPEG")
        found = discover(root)
    assert reasons(found) == {
        "val/ILSVRC2012_val_00000009.JPEG": "a named pipe (FIFO), not a regular file",
        "val/s.JPEG": "a socket, not a regular file",
    }
    assert len(found.val) == 8


def test_device_file_is_listed_as_a_device(demo_raw, tmp_path):
    root = foldered(demo_raw, tmp_path / "raw")
    try:
        os.mknod(root / "train/n01440764/null.JPEG", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    assert reasons(discover(root)) == {"train/n01440764/null.JPEG": "a character device, not a regular file"}


def test_symlinks_outside_the_root_are_listed_and_inside_the_root_followed(demo_raw, tmp_path):
    root = foldered(demo_raw, tmp_path / "raw")
    secret = tmp_path / "secret.JPEG"
    secret.write_bytes(b"private key")
    cls = root / "train/n01440764"
    (cls / "leak.JPEG").symlink_to(secret)
    (cls / "copy.JPEG").symlink_to(cls / "n01440764_1.JPEG")
    (cls / "gone.JPEG").symlink_to(tmp_path / "raw/nowhere.JPEG")
    (cls / "loop.JPEG").symlink_to(cls / "loop.JPEG")
    (root / "train/n09999999").symlink_to(tmp_path)  # a class folder that is a link out of the root
    found = discover(root)
    got = reasons(found)
    assert got["train/n01440764/leak.JPEG"] == f"symbolic link resolving outside the raw root (to {secret})"
    assert got["train/n09999999"] == f"symbolic link resolving outside the raw root (to {tmp_path})"
    assert got["train/n01440764/gone.JPEG"] == "broken or looping symbolic link (No such file or directory)"
    assert got["train/n01440764/loop.JPEG"].startswith("broken or looping symbolic link")
    assert ("train/n01440764/copy.JPEG", "n01440764") in found.train
    assert not any("leak" in source or "secret" in source for source, _ in found.train)


def test_split_folder_linked_from_another_disk_is_indexed(demo_raw, tmp_path):
    # A user keeping train on another disk links it in: the split's own folder bounds its links.
    elsewhere = tmp_path / "disk2/train"
    shutil.copytree(demo_raw / "train", elsewhere)
    root = tmp_path / "raw"
    root.mkdir()
    (root / "train").symlink_to(elsewhere)
    shutil.copytree(demo_raw / "val", root / "val")
    found = discover(root)
    assert len(found.train) == 12 and found.unclassified == []


# ---------------------------------------------------------------- devkit meta.mat (scipy)


def write_meta_mat(path: Path, ids_to_wnids: dict[int, str]) -> None:
    """The devkit's meta.mat shape: a struct array `synsets` with the 1000 leaves and inner nodes."""
    from scipy.io import savemat

    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height"]
    rows = [(i, w, f"words {w}", "a class", 0, np.zeros((1, 0)), 0) for i, w in ids_to_wnids.items()]
    rows.append((max(ids_to_wnids) + 1, "n00001740", "entity", "the root", 2, np.array([1, 2]), 5))
    synsets = np.zeros((len(rows), 1), dtype=[(f, object) for f in fields])
    for k, row in enumerate(rows):
        synsets[k, 0] = tuple(np.array([[v]]) if isinstance(v, int) else v for v in row)
    savemat(path, {"synsets": synsets})


def test_flat_devkit_val_is_labelled_through_a_real_meta_mat(demo_raw, tmp_path):
    root = tmp_path / "raw"
    root.mkdir()
    shutil.copytree(demo_raw / "train", root / "train")
    shutil.copytree(demo_raw / "val_flat", root / "val")
    (root / "devkit").mkdir()
    shutil.copy(demo_raw / "devkit/ILSVRC2012_validation_ground_truth.txt", root / "devkit")
    meta_csv = (demo_raw / "devkit/meta.csv").read_text().splitlines()[1:]
    write_meta_mat(root / "devkit/meta.mat", {int(line.split(",")[0]): line.split(",")[1] for line in meta_csv})
    found = discover(root, "flat-devkit")
    expected = {p.name: p.parent.name for p in (demo_raw / "val").glob("*/*.JPEG")}
    assert {Path(s).name: w for s, w in found.val} == expected
    assert found.layout["val"] == "val/ labelled by devkit ground truth (devkit)"
    assert found.names[WNIDS[0]] == f"words {WNIDS[0]}" and "n00001740" not in found.names


def test_meta_mat_without_scipy_says_how_to_fix(demo_raw, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.io", None)  # import fails as where scipy is not installed
    root = kaggle_flat(demo_raw, tmp_path / "raw")
    (root / "LOC_val_solution.csv").unlink()
    (root / "devkit").mkdir()
    shutil.copy(demo_raw / "devkit/ILSVRC2012_validation_ground_truth.txt", root / "devkit")
    (root / "devkit/meta.mat").write_bytes(b"MATLAB 5.0 MAT-file")
    with pytest.raises(LayoutError, match="needs scipy.*LOC_val_solution.csv"):
        discover(root, "auto")


# ---------------------------------------------------------------- one home for the official names


def test_official_file_names_are_defined_only_in_archives():
    names = {archives.TRAIN_TAR, archives.VAL_TAR, archives.DEVKIT_TGZ, archives.GROUND_TRUTH}
    names |= {archives.KAGGLE_CSV, archives.SYNSET_MAPPING, archives.META_MAT, archives.META_CSV}
    for module in (index, demo):
        tree = ast.parse(Path(module.__file__).read_text())
        literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        docstring = ast.get_docstring(tree)
        assert not (names & (literals - {docstring})), module.__name__


def test_demo_cli_fills_a_partial_config_block_from_the_schema_and_logs_through_logging(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(index.__file__).parents[2]))
    block = json.dumps({"classes": 2, "train_per_class": 1, "val_per_class": 1, "bad_files": False})
    cmd = [sys.executable, "-m", "rectrain.data.demo", "--config-json", block, "--out", str(tmp_path / "d")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[demo] val: 2 images" in proc.stderr
    assert json.loads((tmp_path / "d/.done").read_text()) == {
        "classes": 2,
        "defects": 0,
        "train_files": 2,
        "val_images": 2,
    }
    bad = subprocess.run([*cmd[:4], '{"classes": 1}', *cmd[5:]], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "demo.classes' = 1" in bad.stderr
