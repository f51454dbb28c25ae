"""index.classes and index.per_class through Snakemake (issue 35): three of the demo's five classes and
at most 5 train images of each are indexed, packed (counted in the manifests and read back by mxnet),
trained and evaluated on, and the report says it is a subset.  One run covers the two layouts the
demo's own runs do not: train from the official archive (archives/ILSVRC2012_img_train.tar, one tar
per class, read in place: the pack reads nested tar members), val from Kaggle's flat val_flat/
labelled by LOC_val_solution.csv (the demo's train/ and val/ folders removed, so auto-detection takes
both).  Class folders run through Snakemake in every demo pipeline (tests/test_pipeline_e2e.py); the
archive's val tar and the devkit's ground truth take the subset alike at the index stage
(tests/test_index_subset.py, every layout; tests/test_index.py reads the val tar's members as the
same bytes as the folders' files)."""

import csv
import json
import shutil
import subprocess
import textwrap
from collections import Counter

import pytest
import yaml
from helpers import snakemake
from helpers.packdata import REPO
from helpers.train_data import TINY_TRAIN
from helpers.views import view

from rectrain.config import stage_block
from rectrain.data import demo

pytestmark = pytest.mark.slow

DEMO = {"classes": 5, "train_per_class": 8, "val_per_class": 2, "min_size": 40, "max_size": 64, "bad_files": False}
TAKEN = [wnid for wnid, _ in demo.class_list(5)][1:4]
PER_CLASS = 5
MXPY = REPO / ".venv-mxnet" / "bin" / "python"
MX_LABELS = textwrap.dedent("""
    import collections, json, sys
    import mxnet as mx
    r = mx.recordio.MXIndexedRecordIO(sys.argv[2], sys.argv[1], "r")
    labels = collections.Counter(int(mx.recordio.unpack(r.read_idx(k))[0].label) for k in r.keys)
    print(json.dumps(sorted(labels.items())))
""")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A finished subset pipeline: the working folder, and Snakemake's output."""
    base = tmp_path_factory.mktemp("subset")
    demo.generate(view("demo", {**stage_block("demo", "{}"), **DEMO}), base / "raw")
    for folders in ("train", "val"):  # train from the archive, val from val_flat/ and the Kaggle CSV
        shutil.rmtree(base / "raw" / folders)
    config = {
        "dataset": "sub",
        "raw": str(base / "raw"),
        "index": {"classes": TAKEN, "per_class": PER_CLASS},
        "train": {**TINY_TRAIN, "epochs": 1, "cpu_processes": 1},
    }
    (base / "sub.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake("--directory", str(base), "--configfile", str(base / "sub.yaml"), "--cores", "2", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return base


def test_only_the_chosen_classes_and_images_are_packed_trained_and_evaluated(work):
    results = work / "results" / "sub"
    with open(results / "index" / "classes.tsv", newline="") as fh:
        assert [r["wnid"] for r in csv.DictReader(fh, delimiter="\t")] == sorted(TAKEN)
    manifests = {s: json.loads((results / "pack" / f"{s}.manifest.json").read_text()) for s in ("train", "val")}
    assert manifests["train"]["packed"] == 3 * PER_CLASS and manifests["val"]["packed"] == 3 * DEMO["val_per_class"]
    assert json.loads((results / "eval" / "metrics.json").read_text())["images"] == 3 * DEMO["val_per_class"]
    log = (work / "logs" / "index_raw" / "sub.log").read_text()
    assert "LOC_val_solution.csv" in log, "the flat val of the Kaggle layout"
    assert "archives/ILSVRC2012_img_train.tar (per-class tars, read in place)" in log, "train from the archive"
    with open(results / "index" / "train.tsv", newline="") as fh:
        train = list(csv.DictReader(fh, delimiter="\t"))
    assert len(train) == 3 * PER_CLASS
    assert all(r["source"].startswith(f"archives/ILSVRC2012_img_train.tar::{r['wnid']}.tar::") for r in train)
    assert "kept 3 of 5 classes, at most 5 train images per class: 15 of 40 train images, 6 of 10 val images" in log
    html = (results / "report.html").read_text()
    assert "<b>A subset:</b> 3 of 1000 ImageNet classes, at most 5 images per class" in html


@pytest.mark.skipif(not MXPY.exists(), reason=".venv-mxnet is missing: build it with `make mxnet-env`")
def test_mxnet_reads_the_subsets_records_with_contiguous_labels(work):
    rec = work / "results" / "fast_storage" / "sub"
    counts = {}
    for split in ("train", "val"):
        cmd = [str(MXPY), "-c", MX_LABELS, str(rec / f"{split}.rec"), str(rec / f"{split}.idx")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        counts[split] = Counter(dict(json.loads(proc.stdout)))
    assert counts == {"train": Counter({0: 5, 1: 5, 2: 5}), "val": Counter({0: 2, 1: 2, 2: 2})}
