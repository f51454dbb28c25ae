"""A pair you bring is as safe as a pair rectrain packs (issue #38): the .idx parsed as DALI reads it,
labels that cannot set the class count, files that are not regular refused without hanging, memory
bounded whatever the records' sizes, the fast storage's folder and the pair's ownership stamp checked
as the pack checks them, and a pair changed after its check refused by the loaders. Pairs are written
with rectrain's own RecordWriter (no mxnet needed); victims are files under tmp_path."""

import pytest
from helpers.packdata import jpeg, photo
from helpers.views import view

from rectrain.data.byo_recordio import PairError, check_pairs
from rectrain.loaders import LoaderSpec, build_loader
from rectrain.recordio import IRHeader, RecordIOError, RecordWriter, pack_record


def make_pair(folder, n=20, labels=None, name="mine", image=None):
    """A shuffled-looking pair of n tiny JPEGs in folder; labels default to alternating 0, 1."""
    folder.mkdir(parents=True, exist_ok=True)
    rec, idx = folder / f"{name}.rec", folder / f"{name}.idx"
    labels = [i % 2 for i in range(n)] if labels is None else labels
    with RecordWriter(rec, idx) as w:
        for i, label in enumerate(labels):
            w.write(i, pack_record(IRHeader(0, float(label), i, 0), image or jpeg(photo(24, 24, i))))
    return {"rec": str(rec), "idx": str(idx)}


def block(train, **more):
    return view("recordio", train=train, **more)


def check(tmp_path, train, out="out", **more):
    out = tmp_path / out
    return check_pairs(block(train, **more), out / "fast", out / "pack", out / "index", threads=1), out


# ---- item 3: one strict .idx parser, as DALI reads it --------------------------------------------


def _edit_idx_line(pair, lineno, edit):
    lines = open(pair["idx"], "rb").read().split(b"\n")
    lines[lineno - 1] = edit(lines[lineno - 1])
    open(pair["idx"], "wb").write(b"\n".join(lines))


@pytest.mark.parametrize("field", ["key", "offset"])
def test_an_idx_line_python_reads_and_dali_does_not_is_refused_by_the_check_and_the_dali_loader(tmp_path, field):
    """`1_0` is 10 to int() and the end of the .idx to DALI: the check counted 20, DALI read 10."""
    pair = make_pair(tmp_path / "pair")

    def underscore(line):
        key, offset = line.split(b"\t")
        return b"1_0\t" + offset if field == "key" else key + b"\t" + offset[:-1] + b"_" + offset[-1:]

    _edit_idx_line(pair, 11, underscore)
    with pytest.raises(RecordIOError, match=r"mine\.idx:11: expected 'key<TAB>offset' in ASCII"):
        check(tmp_path, pair)
    spec = LoaderSpec(pair["rec"], pair["idx"], batch_size=4, image_size=16, train=False, workers=0)
    with pytest.raises(RecordIOError, match=r"mine\.idx:11: .*DALI stops reading an \.idx at such a line"):
        build_loader("dali", spec)


def test_an_idx_line_with_non_ascii_digits_or_two_tabs_is_refused_naming_the_line(tmp_path):
    from rectrain.recordio import idx_arrays, read_idx

    pair = make_pair(tmp_path / "pair", n=4)
    _edit_idx_line(pair, 2, lambda line: "\u0661".encode() + line[1:])  # ARABIC-INDIC DIGIT ONE
    for reader in (idx_arrays, read_idx):
        with pytest.raises(RecordIOError, match=r"mine\.idx:2: "):
            reader(pair["idx"])
    _edit_idx_line(pair, 2, lambda line: b"1\t\t" + line.split(b"\t")[-1])
    for reader in (idx_arrays, read_idx):
        with pytest.raises(RecordIOError, match=r"mine\.idx:2: "):
            reader(pair["idx"])


# ---- item 6: labels that cannot set the class count ----------------------------------------------


@pytest.mark.parametrize("stray", [2e6, 1e9])
def test_one_huge_label_is_refused_naming_the_record_and_the_class_list_fix(tmp_path, stray):
    labels = [i % 3 for i in range(40)]
    labels[17] = stray
    pair = make_pair(tmp_path / "pair", labels=labels)
    with pytest.raises(PairError) as err:
        check(tmp_path, pair)
    said = str(err.value)
    assert f"train record 17 (.idx key 17) has label {int(stray)}" in said and "recordio.classes" in said
    assert not (tmp_path / "out/index/classes.tsv").exists()


def test_labels_of_a_subset_of_classes_still_set_the_count_without_a_class_list(tmp_path):
    """ImageNet's labels 0-999 kept on a few classes: sparse, not stray."""
    labels = [0, 999] * 6
    manifests, out = check(tmp_path, make_pair(tmp_path / "pair", n=12, labels=labels))
    assert manifests["train"]["num_classes"] == 1000


@pytest.mark.parametrize("label", [float("nan"), float("inf")])
def test_a_non_finite_label_gets_the_checks_named_error(tmp_path, label):
    labels = [i % 2 for i in range(6)]
    labels[4] = label
    with pytest.raises(PairError, match=r"record 4 \(\.idx key 4, byte offset \d+\): label .* is not a class index"):
        check(tmp_path, make_pair(tmp_path / "pair", n=6, labels=labels))
