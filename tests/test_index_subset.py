"""Class subsets and at most N images per class at the index stage (index.classes, index.per_class):
every layout takes the same classes and images, labels stay contiguous, classes.tsv lists the subset,
a copy of the raw set elsewhere picks the same files, missing classes are refused by name."""

import csv
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import PurePosixPath

import pytest
from helpers.views import view
from test_index_realdata import TINY_WNIDS, tiny_imagenet

from rectrain.data import demo, subset
from rectrain.data.index import discover, take_subset, write_index

LAYOUTS = ["folders", "flat-kaggle", "flat-devkit", "archives"]
DEMO = {"classes": 4, "train_per_class": 5, "val_per_class": 2, "min_size": 24, "max_size": 40, "quality": 80}
WNIDS = [wnid for wnid, _ in demo.class_list(4)]
TAKEN = [WNIDS[3], WNIDS[1]]  # not in sorted order: labels follow the sorted wnids all the same


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("subset") / "raw"
    demo.generate(view("demo", {**DEMO, "seed": 7, "bad_files": False}), out)
    return out


def tables(out):
    return {
        n: list(csv.DictReader(open(out / f"{n}.tsv", newline=""), delimiter="\t")) for n in ("train", "val", "classes")
    }


def indexed(raw, out, layout="auto", classes=TAKEN, per_class=2, seed=0):
    found = discover(raw, layout)
    kept = take_subset(found, classes, per_class, seed)
    write_index(found, out)
    return tables(out), kept


def name(source):
    return PurePosixPath(source.split("::")[-1]).name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_class_subset_with_per_class_is_taken_alike_in_every_layout(raw, tmp_path, layout):
    got, kept = indexed(raw, tmp_path / layout, layout)
    ref, _ = indexed(raw, tmp_path / "ref", "folders")
    assert [(r["label"], r["wnid"]) for r in got["classes"]] == [("0", WNIDS[1]), ("1", WNIDS[3])]
    assert Counter(r["wnid"] for r in got["train"]) == {WNIDS[1]: 2, WNIDS[3]: 2}, "at most 2 per class"
    assert Counter(r["wnid"] for r in got["val"]) == {WNIDS[1]: 2, WNIDS[3]: 2}, "validation whole"
    assert {r["label"] for r in got["train"] + got["val"]} == {"0", "1"}, "contiguous labels"
    for split in ("train", "val"):
        assert sorted(name(r["source"]) for r in got[split]) == sorted(name(r["source"]) for r in ref[split])
    assert (kept.classes, kept.of_classes, kept.train, kept.of_train, kept.val, kept.of_val) == (2, 4, 4, 20, 4, 8)


def test_tiny_imagenet_takes_a_subset_too(tmp_path):
    root = tiny_imagenet(tmp_path / "tiny", per_class=4)
    got, _ = indexed(root, tmp_path / "out", classes=TINY_WNIDS[:2], per_class=3)
    assert [r["wnid"] for r in got["classes"]] == sorted(TINY_WNIDS[:2])
    assert Counter(r["wnid"] for r in got["train"]) == {w: 3 for w in TINY_WNIDS[:2]}
    assert {r["wnid"] for r in got["val"]} == set(TINY_WNIDS[:2]) and len(got["val"]) == 4


def test_two_copies_of_the_raw_set_pick_the_same_files_and_another_seed_others(raw, tmp_path):
    """Two machines' working directories: the same raw set copied under another absolute path (new
    inodes, another directory order) gives byte-identical index TSVs."""
    copy = tmp_path / "elsewhere" / "imagenet"
    shutil.copytree(raw, copy)
    indexed(raw, tmp_path / "a", "folders", classes=None, per_class=3)
    indexed(copy, tmp_path / "b", "folders", classes=None, per_class=3)
    for n in ("train", "val", "classes"):
        assert (tmp_path / "a" / f"{n}.tsv").read_bytes() == (tmp_path / "b" / f"{n}.tsv").read_bytes()
    other, _ = indexed(raw, tmp_path / "c", "folders", classes=None, per_class=3, seed=1)
    mine = tables(tmp_path / "a")["train"]
    assert len(other["train"]) == len(mine) == 12 and other["train"] != mine, "index.seed chooses others"


def test_a_subset_naming_classes_the_raw_set_lacks_is_refused_naming_them(raw, tmp_path):
    with pytest.raises(subset.SubsetError) as err:
        indexed(raw, tmp_path, classes=[WNIDS[0], "n99999998", "n99999999"])
    assert "2 class(es) the raw set's train split does not hold: n99999998, n99999999" in str(err.value)
    assert WNIDS[0] + "," not in str(err.value)


def test_classes_come_from_a_list_a_file_with_comments_or_a_shipped_name(tmp_path):
    listed = tmp_path / "mine.txt"
    listed.write_text("# my three\nn01440764\n\nn01443537  # goldfish\nn01484850\n")
    assert subset.resolve(str(listed)) == ["n01440764", "n01443537", "n01484850"]
    assert subset.resolve(["a", "b"]) == ["a", "b"] and subset.resolve(None) is None
    assert len(subset.resolve("imagenet100")) == 100
    with pytest.raises(subset.SubsetError, match="neither a file nor a list shipped with rectrain"):
        subset.resolve(str(tmp_path / "missing.txt"))


def test_imagenet100_names_exactly_100_distinct_wnids_all_in_imagenet_1k():
    names = subset.read_names(subset.SUBSETS / "imagenet100.txt")
    one_k = subset.read_names(subset.IMAGENET_1K)
    assert len(names) == len(set(names)) == 100
    assert len(one_k) == len(set(one_k)) == 1000 and one_k == sorted(one_k), "ImageNet-1k's labels are sorted wnids"
    assert set(names) <= set(one_k)
    assert set(WNIDS[:4]) <= set(one_k), "the demo's real classes are ImageNet's"
    assert "github.com/HobbitLong/CMC" in (subset.SUBSETS / "imagenet100.txt").read_text(), "its source cited"


def test_the_index_log_says_what_the_subset_kept(raw, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cfg = json.dumps({"classes": TAKEN, "per_class": 2})
    cmd = [sys.executable, "-m", "rectrain.data.index", "--config-json", cfg, "--raw", str(raw), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "index.classes [2 names], index.per_class 2: kept 2 of 4 classes, at most 2 train images per class: "
        "4 of 20 train images, 4 of 8 val images" in proc.stderr
    )
    missing = json.dumps({"classes": ["n99999999"]})
    proc = subprocess.run([*cmd[:4], missing, *cmd[5:]], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "does not hold: n99999999" in proc.stderr and "Traceback" not in proc.stderr


# ---- issue 47 item 10: an index.classes file that is a FIFO or not UTF-8 is a one-line refusal ------


def test_index_classes_swapped_for_a_fifo_after_the_parse_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "classes.txt"
    os.mkfifo(fifo)
    code = f"from rectrain.data import subset; subset.resolve({str(fifo)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"index.classes = '{fifo}': {fifo} (index.classes) is a named pipe (FIFO), not a regular file: point it "
            "at the file itself; give a list of class names, one a line"
        )
    )


def test_an_index_classes_file_that_is_not_utf8_is_refused_naming_the_key_and_the_byte(tmp_path):
    (tmp_path / "classes.txt").write_bytes("n01440764\nn0144\xe9\n".encode("latin-1"))
    with pytest.raises(
        subset.SubsetError, match=r"index.classes = .*classes.txt' is not UTF-8 text \(byte 15: b'\\xe9'\)"
    ):
        subset.resolve(str(tmp_path / "classes.txt"))
