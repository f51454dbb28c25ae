"""index.classes and index.per_class through Snakemake (issue 35): three of the demo's five classes and
at most 5 train images of each are indexed, packed (counted in the manifests and read back by mxnet),
trained and evaluated on, and the report says it is a subset.  One run covers the two layouts the
demo's own runs do not: train from the official archive (archives/ILSVRC2012_img_train.tar, one tar
per class, read in place: the pack reads nested tar members), val from Kaggle's flat val_flat/
labelled by LOC_val_solution.csv (the demo's train/ and val/ folders removed, so auto-detection takes
both).  A second raw root holding only the official archives (train tar, val tar, devkit .tar.gz) is
indexed and packed through Snakemake with the same subset: the val tar labelled by the devkit's
ground truth.  Class folders run through Snakemake in every demo pipeline (tests/test_pipeline_e2e.py);
tests/test_index_subset.py takes the subset in every layout at the index stage."""

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


def mx_label_counts(rec_dir) -> dict:
    """{split: Counter of labels} as mxnet reads the pair's records."""
    counts = {}
    for split in ("train", "val"):
        cmd = [str(MXPY), "-c", MX_LABELS, str(rec_dir / f"{split}.rec"), str(rec_dir / f"{split}.idx")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        counts[split] = Counter(dict(json.loads(proc.stdout)))
    return counts


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
    assert json.loads((results / "main" / "eval" / "metrics.json").read_text())["images"] == 3 * DEMO["val_per_class"]
    log = (work / "logs" / "index_raw" / "sub.log").read_text()
    assert "LOC_val_solution.csv" in log, "the flat val of the Kaggle layout"
    assert "archives/ILSVRC2012_img_train.tar (per-class tars, read in place)" in log, "train from the archive"
    with open(results / "index" / "train.tsv", newline="") as fh:
        train = list(csv.DictReader(fh, delimiter="\t"))
    assert len(train) == 3 * PER_CLASS
    assert all(r["source"].startswith(f"archives/ILSVRC2012_img_train.tar::{r['wnid']}.tar::") for r in train)
    assert "kept 3 of 5 classes, at most 5 train images per class: 15 of 40 train images, 6 of 10 val images" in log
    html = (results / "main" / "report.html").read_text()
    assert "<b>A subset:</b> 3 classes chosen by index.classes, at most 5 images per class" in html


@pytest.mark.skipif(not MXPY.exists(), reason=".venv-mxnet is missing: build it with `make mxnet-env`")
def test_mxnet_reads_the_subsets_records_with_contiguous_labels(work):
    counts = mx_label_counts(work / "results" / "fast_storage" / "sub")
    assert counts == {"train": Counter({0: 5, 1: 5, 2: 5}), "val": Counter({0: 2, 1: 2, 2: 2})}


@pytest.mark.skipif(not MXPY.exists(), reason=".venv-mxnet is missing: build it with `make mxnet-env`")
def test_the_official_archives_alone_are_indexed_and_packed_as_the_same_subset_val_labelled_by_the_devkit(
    tmp_path,
):
    """Only archives/ (ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar, ILSVRC2012_devkit_t12.tar.gz) in
    the raw root: Snakemake indexes and packs the three classes (the stages after pack are the same code
    as the run above, so they are not run again), the val tar's images labelled from the devkit."""
    raw = tmp_path / "raw"
    demo.generate(view("demo", {**stage_block("demo", "{}"), **DEMO}), tmp_path / "demo")
    shutil.copytree(tmp_path / "demo" / "archives", raw / "archives")
    for kaggle in ("LOC_val_solution.csv", "LOC_synset_mapping.txt"):  # the devkit must be what labels val
        (raw / "archives" / kaggle).unlink()
    config = {"dataset": "arch", "raw": str(raw), "index": {"classes": TAKEN, "per_class": PER_CLASS}}
    (tmp_path / "arch.yaml").write_text(yaml.safe_dump(config))
    targets = [f"results/arch/pack/{split}.manifest.json" for split in ("train", "val")]
    proc = snakemake(
        "--directory", str(tmp_path), *targets, "--configfile", str(tmp_path / "arch.yaml"), "--cores", "2"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "logs" / "index_raw" / "arch.log").read_text()
    assert "ILSVRC2012_devkit_t12.tar.gz" in log and "LOC_val_solution.csv" not in log, log
    with open(tmp_path / "results" / "arch" / "index" / "val.tsv", newline="") as fh:
        val = list(csv.DictReader(fh, delimiter="\t"))
    assert sorted({r["wnid"] for r in val}) == sorted(TAKEN) and len(val) == 3 * DEMO["val_per_class"]
    assert all(r["source"].startswith("archives/ILSVRC2012_img_val.tar::") for r in val), val[:2]
    truth = {p.name: p.parent.name for p in (tmp_path / "demo" / "val").glob("*/*.JPEG")}  # the generator's
    assert {r["wnid"] for r in val if truth[r["source"].rsplit("::", 1)[1]] != r["wnid"]} == set(), "devkit labels"
    counts = mx_label_counts(tmp_path / "results" / "fast_storage" / "arch")
    assert counts == {"train": Counter({0: 5, 1: 5, 2: 5}), "val": Counter({0: 2, 1: 2, 2: 2})}
