"""Bring your own .rec (recordio.train / recordio.val): pairs made by mxnet's own im2rec
(.venv-mxnet) are checked record by record and trained from end to end through Snakemake, in place
of index_raw and pack; a class-ordered pair is refused naming the fix or copied shuffled; a damaged
pair fails naming the record; the user's files are never written."""

import hashlib
import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import REPO, scheduled_rules, snakemake
from helpers.packdata import photo
from helpers.train_data import TINY_TRAIN
from helpers.views import view

from rectrain import settings
from rectrain.config import stage_block
from rectrain.data import byo_recordio, demo
from rectrain.data.byo_recordio import PairError, check_pairs
from rectrain.loaders import LoaderSpec, build_loader
from rectrain.recordio import IndexedRecordReader, RecordWriter, pack_record, unpack_record

MXPY = REPO / ".venv-mxnet" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not MXPY.exists(), reason=".venv-mxnet is missing: build it with `make mxnet-env` (envs/mxnet-interop.txt)"
)

DEMO = {"classes": 3, "train_per_class": 12, "val_per_class": 3, "min_size": 40, "max_size": 64, "bad_files": False}


def im2rec(prefix: Path, root: Path, *list_options: str) -> None:
    """mxnet's im2rec as a user runs it: the .lst (shuffled unless told --no-shuffle), then the pair."""
    for options in (["--list", "--recursive", *list_options], ["--pass-through", "--num-thread", "1"]):
        cmd = [str(MXPY), "-m", "mxnet.tools.im2rec", *options, str(prefix), str(root)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """im2rec pairs of a 3-class demo set: train and val shuffled (im2rec's default), and train again
    in class order (--no-shuffle)."""
    base = tmp_path_factory.mktemp("byo")
    demo.generate(view("demo", {**stage_block("demo", "{}"), **DEMO}), base / "raw")
    im2rec(base / "train", base / "raw" / "train")
    im2rec(base / "val", base / "raw" / "val")
    im2rec(base / "ordered", base / "raw" / "train", "--no-shuffle")
    return base


def pair(base: Path, prefix: str, lst: bool = True) -> dict:
    given = {"rec": str(base / f"{prefix}.rec"), "idx": str(base / f"{prefix}.idx")}
    return {**given, "lst": str(base / f"{prefix}.lst")} if lst else given


def check(tmp_path: Path, **block):
    out = tmp_path / "out"
    cfg = settings.view("recordio", stage_block("recordio", json.dumps(block)))
    return check_pairs(cfg, out / "fast", out / "pack", out / "index", threads=2), out


def digest(*paths: Path) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def test_an_im2rec_pair_is_checked_linked_and_named_from_its_lst_folders(pairs, tmp_path):
    before = digest(pairs / "train.rec", pairs / "train.idx")
    manifests, out = check(tmp_path, train=pair(pairs, "train"), val=pair(pairs, "val"))
    assert (out / "fast" / "train.rec").resolve() == (pairs / "train.rec").resolve()
    assert (out / "fast" / "val.idx").is_symlink()
    assert digest(pairs / "train.rec", pairs / "train.idx") == before, "the user's pair was written"
    classes = (out / "index" / "classes.tsv").read_text().splitlines()
    assert classes[0] == "label\twnid\tname" and [c.split("\t")[1] for c in classes[1:]] == sorted(
        p.name for p in (pairs / "raw" / "train").iterdir()
    )
    man = json.loads((out / "pack" / "train.manifest.json").read_text())
    assert man == manifests["train"]
    assert (man["discovered"], man["packed"], man["skipped"], man["num_classes"]) == (36, 36, 0, 3)
    assert man["existing"]["published"] == "symlinked" and man["existing"]["class_ordered"] is False
    assert man["existing"]["checked_records"] == man["verified_decoded"] == 36


def test_a_class_ordered_pair_is_refused_naming_the_fix_and_nothing_is_published(pairs, tmp_path):
    with pytest.raises(PairError, match=r"is in class order \(3 runs of equal labels.*Set recordio.order: shuffle"):
        check(tmp_path, train=pair(pairs, "ordered"))
    assert not any(p.is_file() for p in (tmp_path / "out").rglob("*")), "a refused pair published something"


def test_a_class_ordered_pair_is_copied_shuffled_byte_for_byte_when_asked(pairs, tmp_path, caplog):
    manifests, out = check(tmp_path, train=pair(pairs, "ordered"), order="shuffle")
    assert "copying its records in a shuffled order" in caplog.text
    copy = IndexedRecordReader(out / "fast" / "train.rec", out / "fast" / "train.idx")
    source = IndexedRecordReader(pairs / "ordered.rec", pairs / "ordered.idx")
    assert not (out / "fast" / "train.rec").is_symlink()
    assert sorted(copy.keys) == sorted(source.keys) and copy.keys != source.keys
    assert all(copy.read(key) == source.read(key) for key in source.keys), "a payload changed"
    labels = [unpack_record(payload)[0].label for _, payload in copy]
    assert byo_recordio.label_runs(labels)["class_ordered"] is False
    assert manifests["train"]["existing"]["published"] == "rewritten shuffled"


def damaged(pairs: Path, tmp_path: Path, change) -> dict:
    """A copy of the shuffled im2rec train pair with `change(rec_bytes, idx_lines)` applied."""
    rec, idx = (pairs / "train.rec").read_bytes(), (pairs / "train.idx").read_text().splitlines()
    rec, idx = change(rec, idx)
    (tmp_path / "bad.rec").write_bytes(rec)
    (tmp_path / "bad.idx").write_text("\n".join(idx) + "\n")
    return {"rec": str(tmp_path / "bad.rec"), "idx": str(tmp_path / "bad.idx")}


def test_a_truncated_rec_fails_naming_the_record(pairs, tmp_path):
    last_key, last_offset = (int(x) for x in (pairs / "train.idx").read_text().splitlines()[-1].split("\t"))
    bad = damaged(pairs, tmp_path, lambda rec, idx: (rec[: last_offset + 100], idx))
    with pytest.raises(PairError, match=rf"record 35 \(.idx key {last_key}\): .*truncated .rec"):
        check(tmp_path, train=bad)


def test_an_idx_pointing_past_the_end_fails_naming_the_line_and_key(pairs, tmp_path):
    def past_end(rec, idx):
        key = idx[-1].split("\t")[0]
        return rec, [*idx[:-1], f"{key}\t{len(rec) + 64}"]

    bad = damaged(pairs, tmp_path, past_end)
    key = (pairs / "train.idx").read_text().splitlines()[-1].split("\t")[0]
    with pytest.raises(PairError, match=rf"bad.idx line 36 \(key {key}\) points at byte offset \d+, past the end"):
        check(tmp_path, train=bad)


def test_a_record_the_idx_does_not_list_fails_naming_its_offset(pairs, tmp_path):
    last_offset = (pairs / "train.idx").read_text().splitlines()[-1].split("\t")[1]
    bad = damaged(pairs, tmp_path, lambda rec, idx: (rec, idx[:-1]))
    with pytest.raises(
        PairError, match=rf"bad.rec holds a record at byte offset {last_offset} that .*bad.idx does not list"
    ):
        check(tmp_path, train=bad)


def rewritten(pairs: Path, tmp_path: Path, edit) -> dict:
    """The shuffled im2rec train pair written again by our writer, `edit(i, header, image)` applied."""
    reader = IndexedRecordReader(pairs / "train.rec", pairs / "train.idx")
    with RecordWriter(tmp_path / "edited.rec", tmp_path / "edited.idx") as writer:
        for i, (key, payload) in enumerate(reader):
            header, image = unpack_record(payload)
            writer.write(key, pack_record(*edit(i, header, image)))
    return {"rec": str(tmp_path / "edited.rec"), "idx": str(tmp_path / "edited.idx")}


def test_a_label_out_of_range_of_the_class_list_fails_naming_the_record(pairs, tmp_path):
    edited = rewritten(pairs, tmp_path, lambda i, h, img: (h._replace(label=7.0) if i == 5 else h, img))
    (tmp_path / "classes.txt").write_text("n01440764\nn01443537\nn01484850\n")
    key = IndexedRecordReader(edited["rec"], edited["idx"]).keys[5]
    with pytest.raises(PairError, match=rf"train record 5 \(.idx key {key}\) has label 7, outside the 3 classes"):
        check(tmp_path, train=edited, classes=str(tmp_path / "classes.txt"))


def test_a_label_that_disagrees_with_the_lst_fails_naming_the_record(pairs, tmp_path):
    edited = rewritten(pairs, tmp_path, lambda i, h, img: (h._replace(label=(h.label + 1) % 3) if i == 2 else h, img))
    with pytest.raises(PairError, match=r"record 2 \(.idx key \d+, byte offset \d+\) has label \d but the .lst gives"):
        check(tmp_path, train={**edited, "lst": str(pairs / "train.lst")})


def test_an_undecodable_record_fails_naming_the_record(pairs, tmp_path):
    edited = rewritten(pairs, tmp_path, lambda i, h, img: (h, img[: len(img) // 2] if i == 9 else img))
    key = IndexedRecordReader(edited["rec"], edited["idx"]).keys[9]
    with pytest.raises(
        PairError, match=rf"train record 9 \(.idx key {key}, byte offset \d+\): the image does not decode"
    ):
        check(tmp_path, train=edited)


def _saved(fmt: str, seed: int) -> bytes:
    buf = io.BytesIO()
    photo(48, 36, seed).save(buf, fmt)
    return buf.getvalue()


def test_a_gif_record_that_dali_cannot_decode_fails_naming_the_record_before_anything_is_published(pairs, tmp_path):
    """The pack would re-encode a GIF; kept as it is, DALI (measured: 'GIF images are not supported.')
    would stop training at it mid-epoch.  The check stops first, naming the record and the fix."""
    edited = rewritten(pairs, tmp_path, lambda i, h, img: (h, _saved("GIF", i) if i == 4 else img))
    key = IndexedRecordReader(edited["rec"], edited["idx"]).keys[4]
    with pytest.raises(PairError) as caught:
        check(tmp_path, train=edited)
    message = str(caught.value)
    assert message.startswith(f"train record 4 (.idx key {key}, byte offset ")
    assert (
        "DALI, the loader the pipeline trains with, cannot decode this GIF image (GIF images are not supported.)"
        in message
    )
    assert "im2rec without --pass-through" in message and "recordio.train: null" in message
    assert not (tmp_path / "out" / "fast" / "train.rec").exists() and not (tmp_path / "out" / "pack").exists()


def test_where_dali_cannot_decode_even_a_plain_jpeg_no_record_is_refused_for_its_sake(
    pairs, tmp_path, monkeypatch, caplog
):
    """A DALI that fails on everything (a broken install) must not refuse good records in its name."""
    monkeypatch.setattr(byo_recordio, "decode_errors", lambda images: ["Unrecognized image format."] * len(images))
    byo_recordio._dali_decode_errors.cache_clear()
    try:
        edited = rewritten(pairs, tmp_path, lambda i, h, img: (h, _saved("GIF", i) if i == 4 else img))
        manifests, _ = check(tmp_path, train=edited)
    finally:
        byo_recordio._dali_decode_errors.cache_clear()
    assert manifests["train"]["existing"]["formats"] == {"JPEG": 35, "GIF": 1}
    assert "DALI cannot be used here (Unrecognized image format.)" in caplog.text


@pytest.mark.parametrize("kind", ["dali", "torch"])
def test_a_png_record_of_an_im2rec_pass_through_pair_is_kept_and_both_loaders_read_every_record(pairs, tmp_path, kind):
    """ImageNet's one PNG named .JPEG stays a PNG record in a --pass-through im2rec pair: the check keeps
    it (DALI decodes PNG), the manifest counts the formats, and neither loader stops at it (the torch
    loader refused it mid-epoch before)."""
    edited = rewritten(pairs, tmp_path, lambda i, h, img: (h, _saved("PNG", i) if i == 3 else img))
    manifests, out = check(tmp_path, train=edited)
    existing = manifests["train"]["existing"]
    assert existing["formats"] == {"JPEG": 35, "PNG": 1}
    key = IndexedRecordReader(edited["rec"], edited["idx"]).keys[3]
    assert [k["id"] for k in existing["kept_unusual"]] == [key] and "PNG" in existing["kept_unusual"][0]["reason"]
    spec = LoaderSpec(
        str(out / "fast" / "train.rec"),
        str(out / "fast" / "train.idx"),
        batch_size=8,
        image_size=16,
        train=False,
        workers=0,
    )
    labels = [y for _, ys in build_loader(kind, spec).epoch(0) for y in ys.tolist()]
    assert len(labels) == 36


def test_an_unshuffled_val_pair_is_used_in_place(pairs, tmp_path):
    """Evaluation counts every record whatever the order: only train is judged."""
    manifests, out = check(tmp_path, train=pair(pairs, "train"), val=pair(pairs, "ordered"))
    assert manifests["val"]["existing"]["class_ordered"] is True
    assert (out / "fast" / "val.rec").is_symlink()


# ---------------------------------------------------------------------------------------------
# Through Snakemake: check_recordio instead of index_raw and pack, then train, evaluate and report.


@pytest.fixture(scope="module")
def work(pairs, tmp_path_factory):
    base = tmp_path_factory.mktemp("byo-run")
    config = {
        "dataset": "byo",
        "recordio": {"train": pair(pairs, "train"), "val": pair(pairs, "val")},
        "train": {**TINY_TRAIN, "epochs": 1},
    }
    (base / "byo.yaml").write_text(yaml.safe_dump(config))
    return base


def smk(work: Path, *args, config: str = "byo.yaml", timeout=600):
    return snakemake("--directory", str(work), "--configfile", str(work / config), *args, timeout=timeout)


def test_the_dry_run_checks_the_pair_instead_of_indexing_and_packing(work):
    proc = smk(work, "-n", "results/report.html")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert scheduled_rules(proc.stdout) == {
        "check_recordio": 1,
        "train": 1,
        "evaluate": 1,
        "report": 1,
        "current_report": 1,
    }


def test_without_a_val_pair_the_dry_run_leaves_evaluate_out(work):
    config = yaml.safe_load((work / "byo.yaml").read_text())
    del config["recordio"]["val"]
    (work / "trainonly.yaml").write_text(yaml.safe_dump(config))
    proc = smk(work, "-n", "-p", "results/report.html", config="trainonly.yaml")  # -p: the commands, for val.rec
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert scheduled_rules(proc.stdout) == {"check_recordio": 1, "train": 1, "report": 1, "current_report": 1}
    assert "val.rec" not in proc.stdout


def test_a_missing_pair_file_fails_before_any_work_naming_the_key(work, tmp_path):
    config = yaml.safe_load((work / "byo.yaml").read_text())
    config["recordio"]["val"]["idx"] = str(tmp_path / "nowhere.idx")
    (work / "missing.yaml").write_text(yaml.safe_dump(config))
    proc = smk(work, "-n", "results/report.html", config="missing.yaml")
    assert proc.returncode != 0
    assert f"config key 'recordio.val.idx' = '{tmp_path / 'nowhere.idx'}': no such file" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_an_im2rec_pair_trains_evaluates_and_the_report_says_where_the_data_came_from(work, pairs):
    proc = smk(work, "--cores", "2", "results/report.html", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (work / "results" / "byo" / "index" / "train.tsv").exists(), "the index ran"
    metrics = json.loads((work / "results" / "byo" / "main" / "eval" / "metrics.json").read_text())
    assert metrics["images"] == 9, metrics
    html = (work / "results" / "report.html").read_text()
    assert "train: from an existing pair</b> (recordio.train; not packed here)" in html
    assert f"{(pairs / 'train.rec').resolve()}" in html and "used in place (symlinked into fast storage)" in html
    assert scheduled_rules(smk(work, "-n", "results/report.html").stdout) == {}  # finished: nothing left to run
    # The same pair checked again (its manifest's timings differ): the training command that follows
    # republishes the finished run, it does not train again (issue 38 item 10).
    again = smk(work, "--cores", "2", "results/report.html", "--forcerun", "check_recordio", timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    train_log = (work / "logs" / "train" / "byo" / "main.log").read_text()
    assert "restored the finished run's outputs" in train_log and "epoch 0: train loss" not in train_log, train_log
    # the recordio block's keys: operational ones rerun nothing, the others the check and what follows
    for key, value, expected in [
        ("threads", 1, set()),
        ("progress_s", 1, set()),
        ("order", "shuffle", {"check_recordio", "train", "evaluate", "report", "current_report"}),
    ]:
        config = yaml.safe_load((work / "byo.yaml").read_text())
        config["recordio"][key] = value
        (work / "edited.yaml").write_text(yaml.safe_dump(config))
        dry = smk(work, "-n", "results/report.html", config="edited.yaml")
        assert set(scheduled_rules(dry.stdout)) == expected, (key, dry.stdout[-2000:])
    shutil.rmtree(work / "results" / "fast_storage")  # the links, not the user's pair
    assert (pairs / "train.rec").is_file()
