"""A pair you bring is as safe as a pair rectrain packs (issue #38): the .idx parsed as DALI reads it,
labels that cannot set the class count, files that are not regular refused without hanging, memory
bounded whatever the records' sizes, the fast storage's folder and the pair's ownership stamp checked
as the pack checks them, and a pair changed after its check refused by the loaders. Pairs are written
with rectrain's own RecordWriter (no mxnet needed); victims are files under tmp_path."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.packdata import jpeg, photo
from helpers.users import as_other_user, needs_root, shared_folder
from helpers.views import view

from rectrain.data import byo_recordio
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


# ---- items 1, 2, 11: the brought pair goes through the pack's folder and ownership rules ---------


@pytest.fixture
def shared():
    with shared_folder() as base:
        yield base


def labels_through(fast) -> list[float]:
    from rectrain.recordio import IndexedRecordReader, unpack_record

    return [
        unpack_record(payload)[0].label for _, payload in IndexedRecordReader(fast / "train.rec", fast / "train.idx")
    ]


@needs_root
def test_a_world_writable_fast_folder_is_locked_before_the_pair_is_linked_so_another_user_cannot_swap_it(shared):
    pair = make_pair(shared / "mine", n=4)
    fast = shared / "out" / "fast"
    fast.mkdir(parents=True)
    fast.chmod(0o777)  # made world-writable (umask 000, or by its other user)
    theirs = make_pair(shared / "theirs", n=4, labels=[999] * 4, name="theirs")
    check_pairs(block(pair), fast, shared / "out" / "pack", shared / "out" / "index", threads=1)
    assert fast.stat().st_mode & 0o777 == 0o755
    swap = "import os, sys; os.symlink(sys.argv[1], sys.argv[2] + '.x'); os.replace(sys.argv[2] + '.x', sys.argv[2])"
    proc = as_other_user(swap, theirs["rec"], fast / "train.rec")
    assert proc.returncode != 0 and "PermissionError" in proc.stderr
    assert labels_through(fast) == [0.0, 1.0, 0.0, 1.0]


def test_a_shuffled_copy_never_writes_through_a_link_planted_at_a_temporary_name(tmp_path):
    pair = make_pair(tmp_path / "pair", n=24, labels=sorted(i % 3 for i in range(24)))  # class-ordered
    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's own line\n")
    fast = tmp_path / "out" / "fast"
    fast.mkdir(parents=True)
    for name in ("train.rec", "train.idx"):
        (fast / f".{name}.tmp{os.getpid()}").symlink_to(victim)  # the names the copy used to write
    manifests, _ = check(tmp_path, pair, order="shuffle")
    assert manifests["train"]["existing"]["published"] == "rewritten shuffled"
    assert victim.read_bytes() == b"the victim's own line\n"
    assert sorted(labels_through(fast)) == sorted(float(i % 3) for i in range(24))


def test_a_second_working_directory_does_not_replace_the_pair_the_first_checked_nor_may_a_pack(tmp_path, monkeypatch):
    from helpers.packdata import run_pack, write_dataset

    from rectrain.data.pairowner import PairTaken

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    fast = tmp_path / "shared" / "fast"
    mine, theirs = make_pair(tmp_path / "mine", n=4), make_pair(tmp_path / "theirs", n=4, labels=[1, 0, 1, 0])
    monkeypatch.chdir(first)
    check_pairs(block(mine), fast, first / "pack", first / "index", threads=1)
    assert json.loads((fast / ".train.rec.run.json").read_text())["workdir"] == str(first)
    monkeypatch.chdir(second)
    with pytest.raises(PairTaken, match=f"belongs to the run in {first}"):
        check_pairs(block(theirs), fast, second / "pack", second / "index", threads=1)
    assert labels_through(fast) == [0.0, 1.0, 0.0, 1.0]
    raw, index = write_dataset(tmp_path / "raw", [(f"a/x{i}.JPEG", 0, jpeg(photo(40, 30, i))) for i in range(4)], 1)
    proc = run_pack(raw, index, fast.parent, cwd=second)
    assert proc.returncode == 2 and f"belongs to the run in {first}" in proc.stderr
    assert labels_through(fast) == [0.0, 1.0, 0.0, 1.0]


def test_the_onstart_hook_refuses_a_check_recordio_job_whose_pair_another_working_directory_owns(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from rectrain.snakefile import prestart

    fast = tmp_path / "fast"
    (tmp_path / "first").mkdir(), (tmp_path / "second").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    check_pairs(block(make_pair(tmp_path / "mine", n=4)), fast, tmp_path / "p", tmp_path / "i", threads=1)
    monkeypatch.chdir(tmp_path / "second")
    job = SimpleNamespace(rule=SimpleNamespace(name="check_recordio"), output=[str(fast / "train.rec")])
    [problem] = prestart.pair_problems([job])
    assert f"belongs to the run in {tmp_path / 'first'}" in problem


def test_rerunning_the_checks_cli_by_hand_over_its_own_published_pair_succeeds(tmp_path):
    pair = make_pair(tmp_path / "pair", n=4)
    out = tmp_path / "out"
    argv = ["--config-json", json.dumps({"train": pair}), "--fast", str(out / "fast")]
    argv += ["--pack-dir", str(out / "pack"), "--index-dir", str(out / "index"), "--threads", "1"]
    assert byo_recordio.main(argv) == 0
    assert byo_recordio.main(argv) == 0, "the second check followed the first one's link into 'fast storage'"
    assert os.path.realpath(out / "fast" / "train.rec") == pair["rec"]


# ---- item 8: a pair changed after its check is refused by the loaders ----------------------------


@pytest.mark.parametrize("kind", ["torch", "dali"])
def test_a_pair_replaced_after_its_check_is_refused_by_the_loaders_naming_the_recheck_command(tmp_path, kind):
    from rectrain.data.pairowner import PairChanged

    pair = make_pair(tmp_path / "pair", n=8)
    _, out = check(tmp_path, pair)
    fast = out / "fast"
    spec = LoaderSpec(
        str(fast / "train.rec"), str(fast / "train.idx"), batch_size=4, image_size=16, train=False, workers=0
    )
    assert len([y for _, ys in build_loader(kind, spec).epoch(0) for y in ys.tolist()]) == 8
    other = make_pair(tmp_path / "other", n=8, labels=[7] * 8, name="mine2")
    os.replace(other["rec"], pair["rec"])  # the user's .rec replaced by unchecked records
    with pytest.raises(
        PairChanged, match=r"is not the \.rec check_recordio checked .*snakemake --forcerun check_recordio"
    ):
        build_loader(kind, spec)


def test_a_rec_rewritten_in_place_keeping_its_size_and_mtime_is_refused_by_its_change_time(tmp_path):
    """Issue 47: the stamp holds the .rec's ctime, which no one can set back as os.utime sets the mtime."""
    from rectrain.data.pairowner import PairChanged, refuse_changed

    pair = make_pair(tmp_path / "pair", n=8)
    _, out = check(tmp_path, pair)
    fast = out / "fast"
    refuse_changed(fast / "train.rec", fast / "train.idx")
    before = os.stat(pair["rec"])
    data = bytearray(Path(pair["rec"]).read_bytes())
    data[40] ^= 0xFF  # a byte of the first image, the size unchanged
    time.sleep(0.01)  # a change time the file system can tell from the check's
    Path(pair["rec"]).write_bytes(bytes(data))
    os.utime(pair["rec"], ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(pair["rec"]).st_size, os.stat(pair["rec"]).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(PairChanged, match=r"is not the \.rec check_recordio checked"):
        refuse_changed(fast / "train.rec", fast / "train.idx")


# ---- item 5: the check's memory does not follow the records' sizes -------------------------------

MB = 1 << 20
# What the check may add to its process's peak (VmHWM) on records of 40 MB: one record at a time, in the
# few transient copies framing and the IRHeader split make (3 x 40 MB), plus the batch budget (16 MiB).
# Before the fix it held every record of a batch (12 x 40 MB) before decoding the first.
PEAK_BOUND = 3 * 40 * MB + 16 * MB

MEASURE = """
import json
import sys
from pathlib import Path

from rectrain import settings
from rectrain.config import stage_block
from rectrain.data.byo_recordio import PairError, check_pairs
from rectrain.recordio import RecordIOError

def peak():
    return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmHWM"))

rec, idx, out = sys.argv[1:]
block = settings.view("recordio", {**stage_block("recordio", "{}"), "train": {"rec": rec, "idx": idx}})
before = peak()
try:
    check_pairs(block, Path(out) / "fast", Path(out) / "pack", Path(out) / "index", threads=1)
    said = None
except (PairError, RecordIOError) as err:
    said = str(err)
print(json.dumps({"grew": peak() - before, "said": said}))
"""


def sparse_pair(folder, records: int, part_bytes: int, parts: int = 1):
    """A .rec of `records` records of `parts` parts of part_bytes each (an IRHeader, then zeros left as
    holes: megabytes on paper, nothing on disk), and its .idx."""
    import struct

    from rectrain.recordio import MAGIC

    folder.mkdir(parents=True, exist_ok=True)
    rec, idx = folder / "big.rec", folder / "big.idx"
    with open(rec, "wb") as f, open(idx, "w") as ix:
        for key in range(records):
            ix.write(f"{key}\t{f.tell()}\n")
            for part in range(parts):
                cflag = 0 if parts == 1 else (1 if part == 0 else 3 if part == parts - 1 else 2)
                f.write(struct.pack("<II", MAGIC, cflag << 29 | part_bytes))
                if part == 0:
                    f.write(struct.pack("<IfQQ", 0, 0.0, key, 0))
                f.seek(part_bytes - (24 if part == 0 else 0), 1)
        f.truncate(f.tell())
    return str(rec), str(idx)


def measured(tmp_path, rec, idx) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, rec, idx, str(tmp_path / "out")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_records_of_40_mb_are_checked_one_batch_budget_at_a_time_not_256_records_at_once(tmp_path):
    found = measured(tmp_path, *sparse_pair(tmp_path / "pair", records=12, part_bytes=40 * MB))
    assert "train record 0 (.idx key 0, byte offset 0): the image does not decode" in found["said"]
    print(f"check of 12 x 40 MB records: peak grew {found['grew'] / MB:.0f} MiB (bound {PEAK_BOUND / MB:.0f} MiB)")
    assert found["grew"] < PEAK_BOUND


def test_a_record_of_three_100_mb_parts_is_refused_by_its_size_before_it_is_read(tmp_path):
    found = measured(tmp_path, *sparse_pair(tmp_path / "pair", records=2, part_bytes=100 * MB, parts=3))
    assert "the record at byte offset 0 holds more than 67108864 bytes" in found["said"]
    assert "re-encode that image smaller" in found["said"]
    print(f"check of a 300 MB record: peak grew {found['grew'] / MB:.0f} MiB")
    assert found["grew"] < 32 * MB


def test_an_idx_larger_than_its_rec_is_refused_before_it_is_read(tmp_path):
    pair = make_pair(tmp_path / "pair", n=4)
    with open(pair["idx"], "r+b") as f:
        f.truncate(300 * MB)  # an .idx pointed at the wrong file: zeros, all holes
    found = measured(tmp_path, pair["rec"], pair["idx"])
    assert f"{pair['idx']} is {300 * MB} bytes, larger than its .rec" in found["said"]
    print(f"check of a 300 MB .idx: peak grew {found['grew'] / MB:.0f} MiB")
    assert found["grew"] < 32 * MB


def test_an_idx_pointed_at_the_rec_itself_is_refused_at_its_first_line_in_bounded_memory(tmp_path):
    """Issue 47: the .rec named as its own .idx is no larger than itself, so the size check passes; the
    .idx is parsed as a stream and refused at its first line instead of read whole (1.2 GB RSS before)."""
    rec, _ = sparse_pair(tmp_path / "pair", records=3, part_bytes=100 * MB)
    found = measured(tmp_path, rec, rec)
    assert f"{rec}:1: expected 'key<TAB>offset' in ASCII digits" in found["said"]
    print(f"check of a 300 MB .rec given as its .idx: peak grew {found['grew'] / MB:.0f} MiB")
    assert found["grew"] < 32 * MB


# ---- item 7: a FIFO in place of a file is refused, never waited on -------------------------------


@pytest.mark.parametrize("kind", ["idx", "lst", "classes"])
def test_a_fifo_swapped_in_after_the_parse_is_refused_naming_it_within_seconds(tmp_path, kind):
    pair = make_pair(tmp_path / "pair", n=4)
    fifo = tmp_path / f"swapped.{kind}"
    os.mkfifo(fifo)
    block = {"train": {**pair, kind: str(fifo)} if kind != "classes" else pair}
    if kind == "classes":
        block["classes"] = str(fifo)
    out = tmp_path / "out"
    argv = ["--config-json", json.dumps(block), "--fast", str(out / "fast"), "--pack-dir", str(out / "pack")]
    argv += ["--index-dir", str(out / "index"), "--threads", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "rectrain.data.byo_recordio", *argv], capture_output=True, text=True, timeout=20
    )
    assert proc.returncode == 1, proc.stderr
    assert f"{fifo} (" in proc.stderr and "is a named pipe (FIFO), not a regular file" in proc.stderr


def test_a_fifo_at_parse_time_is_named_a_fifo_not_a_missing_file(tmp_path):
    from rectrain.snakefile.byo import byo_problems

    pair = make_pair(tmp_path / "pair", n=4)
    os.mkfifo(tmp_path / "pipe.lst")
    byo = view("recordio", train={**pair, "lst": str(tmp_path / "pipe.lst")})
    [problem] = byo_problems(byo, "fast", tmp_path)
    assert "recordio.train.lst" in problem and "a named pipe (FIFO), not a regular file" in problem
    assert "no such file" not in problem


def test_a_pair_replaced_during_training_is_refused_at_the_next_epochs_dali_rebuild(tmp_path):
    from rectrain.data.pairowner import PairChanged

    pair = make_pair(tmp_path / "pair", n=8)
    _, out = check(tmp_path, pair)
    fast = out / "fast"
    spec = LoaderSpec(
        str(fast / "train.rec"), str(fast / "train.idx"), batch_size=4, image_size=16, train=False, workers=0
    )
    loader = build_loader("dali", spec)
    assert len([y for _, ys in loader.epoch(0) for y in ys.tolist()]) == 8
    os.replace(make_pair(tmp_path / "other", n=8, labels=[7] * 8, name="x")["rec"], pair["rec"])
    with pytest.raises(PairChanged, match=r"snakemake --forcerun check_recordio"):
        list(loader.epoch(1))
