"""The index holds its rows compactly (rectrain.data.index.Rows) and still writes exactly the rows a
plain sorted list of (source, wnid) tuples would: same order, same ids, same labels."""

import csv
import tracemalloc

import pytest
from helpers.views import view

from rectrain.data import demo
from rectrain.data.index import Rows, discover, write_index

CFG = {
    "classes": 5,
    "train_per_class": 4,
    "val_per_class": 2,
    "min_size": 24,
    "max_size": 40,
    "quality": 80,
    "seed": 3,
    "bad_files": True,
}


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    out = tmp_path_factory.mktemp("rows") / "raw"
    demo.generate(view("demo", CFG), out)
    return out


def rows_of(groups: dict[str, list[tuple[str, str]]]) -> Rows:
    rows = Rows()
    for prefix, items in groups.items():
        rows.group(prefix)
        for name, wnid in items:
            rows.add(name, wnid)
    return rows


def test_rows_iterate_as_the_source_and_wnid_tuples_they_were_given():
    rows = rows_of({"train/b/": [("b_2.JPEG", "b"), ("b_1.JPEG", "b")], "train/a/": [("x/a_1.JPEG", "a")]})
    assert list(rows) == [("train/b/b_2.JPEG", "b"), ("train/b/b_1.JPEG", "b"), ("train/a/x/a_1.JPEG", "a")]
    assert len(rows) == 3 and rows.classes() == {"a", "b"}
    assert ("train/a/x/a_1.JPEG", "a") in rows and rows != [] and Rows() == []


def test_rows_keep_names_that_are_not_valid_utf8_byte_for_byte():
    odd = b"caf\xe9.JPEG".decode("utf-8", "surrogateescape")  # what os.scandir gives for a Latin-1 name
    rows = rows_of({"train/c/": [(odd, "c"), ("ü.JPEG", "c")]})
    assert [s for s, _ in rows] == [f"train/c/{odd}", "train/c/ü.JPEG"]


@pytest.mark.parametrize(
    "groups",
    [
        # class folders whose names sort differently from their prefixes ("ab" < "ab-" but "ab-/" < "ab/")
        {"t/ab/": [("z.JPEG", "ab"), ("a.JPEG", "ab")], "t/ab-/": [("b.JPEG", "ab-")], "t/A/": [("q.JPEG", "A")]},
        # a prefix that starts another: grouping cannot decide the order, every row is sorted at once
        {"t/a": [("b/2.JPEG", "x"), ("/1.JPEG", "y")], "t/a/": [("c.JPEG", "z")], "t/": [("a/0.JPEG", "w")]},
        # nested archive members and a flat group with one wnid per row
        {"T.tar::n2.tar::": [("n2_9.JPEG", "n2"), ("n2_10.JPEG", "n2")], "V.tar::": [("v2", "n2"), ("v1", "n1")]},
    ],
)
def test_rows_sort_exactly_like_sorted_tuples(groups):
    rows = rows_of(groups)
    assert list(rows.sorted()) == sorted(list(rows))


def test_keep_splits_rows_by_wnid_and_keeps_their_order():
    rows = rows_of({"val/": [("v3", "n1"), ("v1", "n9"), ("v2", "n1")]})
    kept, dropped = rows.keep({"n1"})
    assert list(kept) == [("val/v3", "n1"), ("val/v2", "n1")] and dropped == [("val/v1", "n9")]


def test_rows_take_far_less_memory_than_a_tuple_of_two_strings_per_image():
    wnids = [f"n{k:08d}" for k in range(100)]
    tracemalloc.start()
    rows = Rows()
    for wnid in wnids:
        rows.group(f"train/{wnid}/")
        for n in range(500):
            rows.add(f"{wnid}_{n}.JPEG", wnid)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # a list of (source, wnid) tuples holds ~150 bytes per row here (tuple 56, source str ~80, slot 8);
    # the names buffer (~16 bytes), an 8-byte end and a 4-byte code, with growth slack, stay under 45
    assert held / len(rows) < 45, f"{held / len(rows):.0f} bytes per row"


@pytest.mark.parametrize("layout", ["folders", "flat-kaggle", "flat-devkit", "archives"])
def test_index_tsvs_are_the_rows_of_a_plain_sorted_list(raw, tmp_path, layout):
    found = discover(raw, layout)
    assert isinstance(found.train, Rows) and isinstance(found.val, Rows)
    label = {w: i for i, w in enumerate(sorted({w for _, w in list(found.train)}))}
    expected = {
        split: [[str(i), s, str(label[w]), w] for i, (s, w) in enumerate(sorted(list(getattr(found, split))))]
        for split in ("train", "val")
    }
    write_index(found, tmp_path)
    for split, rows in expected.items():
        with open(tmp_path / f"{split}.tsv", newline="") as fh:
            table = list(csv.reader(fh, delimiter="\t"))
        assert table[0] == ["id", "source", "label", "wnid"]
        assert table[1:] == rows and len(rows) > 0
