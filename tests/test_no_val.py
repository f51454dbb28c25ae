"""A dataset without a val split (`index.absent_splits: [val]`) runs end to end through Snakemake: only
train is packed, training validates no epoch and says so, the evaluate stage is left out (asked for by
name, it says why it cannot run), and the report states there is no val split."""

import csv
import shutil

import pytest
import yaml
from helpers import scheduled_rules, snakemake
from helpers.train_data import TINY_TRAIN
from helpers.views import view

from rectrain.data import demo

pytestmark = pytest.mark.slow

DEMO = {"classes": 3, "train_per_class": 12, "val_per_class": 2, "min_size": 40, "max_size": 64, "bad_files": False}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A scratch working folder whose raw root holds train/<wnid>/ only, and its config."""
    base = tmp_path_factory.mktemp("noval")
    demo.generate(view("demo", {**demo_defaults(), **DEMO}), base / "demo")
    raw = base / "raw"
    shutil.copytree(base / "demo" / "train", raw / "train")
    config = {
        "dataset": "noval",
        "raw": str(raw),
        "index": {"absent_splits": ["val"]},
        "train": {**TINY_TRAIN, "epochs": 1},
    }
    (base / "noval.yaml").write_text(yaml.safe_dump(config))
    return base


def demo_defaults() -> dict:
    from rectrain.config import stage_block

    return stage_block("demo", "{}")


def smk(work, *args, timeout=600):
    return snakemake("--directory", str(work), "--configfile", str(work / "noval.yaml"), *args, timeout=timeout)


def test_dry_run_packs_train_only_and_leaves_evaluate_out(work):
    proc = smk(work, "-n", "-p", "results/report.html")  # -p: the commands, for val.rec
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = {"index_raw": 1, "pack": 1, "train": 1, "report": 1, "current_report": 1}  # + the copy of the report
    assert scheduled_rules(proc.stdout) == expected
    assert "val.rec" not in proc.stdout


def test_asking_for_evaluate_says_there_is_no_val_split(work):
    proc = smk(work, "-n", "results/noval/main/eval/metrics.json")
    assert proc.returncode != 0
    assert "evaluate: this dataset has no val split (index.absent_splits lists val)" in proc.stdout + proc.stderr


def test_real_run_trains_without_validation_and_the_report_says_there_is_no_val_split(work):
    proc = smk(work, "--cores", "2", "results/report.html", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fast = work / "results" / "fast_storage" / "noval"
    assert sorted(p.name for p in fast.iterdir() if not p.name.startswith(".")) == ["train.idx", "train.rec"]
    assert not (work / "results" / "noval" / "main" / "eval").exists()
    train_log = (work / "logs" / "train" / "noval" / "main.log").read_text()
    assert "no val split (--val-rec not given, index.absent_splits): epochs are not validated" in train_log
    assert "epoch 0: train loss" in train_log and ", no val split, " in train_log
    with open(work / "results" / "noval" / "main" / "train" / "epochs.csv", newline="") as f:
        epochs = list(csv.DictReader(f))
    assert [
        (e["epoch"], e["val_single_view_loss"], e["val_single_view_top1"], e["val_single_view_top5"]) for e in epochs
    ] == [("0", "", "", "")]
    assert float(epochs[0]["train_loss"]) > 0
    html = (work / "results" / "report.html").read_text()
    assert "none: this dataset has no val split (index.absent_splits: [val]), so nothing was evaluated" in html
    assert "No per-class accuracy: this dataset has no val split" in html
    assert scheduled_rules(smk(work, "-n", "results/report.html").stdout) == {}  # finished: nothing left to run
