"""Two datasets in one working directory, one after the other: the demo, then a small custom dataset of
class folders. Each keeps its own report (results/<dataset>/report.html), both runs stay up to date,
results/report.html is the report of the dataset it was last asked for, and `snakemake --report`
bundles one dataset's artefacts only."""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import pytest
import yaml
from helpers import copy_workflow, job_headers, scheduled_rules, snakemake
from helpers.packdata import jpeg, photo
from helpers.train_data import TINY_TRAIN

pytestmark = pytest.mark.slow

TRAIN = {**TINY_TRAIN, "epochs": 1}
DEMO = {"classes": 3, "train_per_class": 8, "val_per_class": 2, "min_size": 40, "max_size": 64, "bad_files": False}
DATASETS = ("demo", "mydata")


def custom_tree(root: Path) -> Path:
    for split, count in (("train", 8), ("val", 2)):
        for label, cls in enumerate(["cat", "dog", "owl"]):
            (root / split / cls).mkdir(parents=True)
            for i in range(count):
                (root / split / cls / f"{i}.jpg").write_bytes(jpeg(photo(56, 48, seed=100 * label + i)))
    return root


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Both datasets run, the demo first, each through `snakemake results/report.html`."""
    work = copy_workflow(tmp_path_factory.mktemp("two"))
    configs = {
        "demo": {"demo": DEMO, "train": TRAIN},
        "mydata": {"dataset": "mydata", "raw": str(custom_tree(work / "mydata-raw")), "train": TRAIN},
    }
    for name, cfg in configs.items():
        (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    for name in DATASETS:
        proc = smk(work, name, "--cores", "2", "results/report.html", timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work


def smk(work: Path, dataset: str, *args: str, timeout=300):
    return snakemake(
        "--directory",
        str(work),
        *args,
        "--configfile",
        str(work / f"{dataset}.yaml"),
        cwd=work,
        snakefile=work / "Snakefile",
        timeout=timeout,
    )


def report_of(work: Path, dataset: str) -> Path:
    return work / "results" / dataset / "main" / "report.html"


def test_each_dataset_keeps_its_own_report_and_the_shared_one_is_the_last_asked_for(work):
    assert all(report_of(work, ds).stat().st_size > 0 for ds in DATASETS)
    assert report_of(work, "demo").read_bytes() != report_of(work, "mydata").read_bytes()
    assert (work / "results" / "report.html").read_bytes() == report_of(work, "mydata").read_bytes()


def test_after_both_runs_each_config_has_nothing_to_do(work):
    for dataset in DATASETS:
        proc = smk(work, dataset, "-n")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert scheduled_rules(proc.stdout) == {}, (dataset, proc.stdout[-3000:])


def test_asking_for_results_report_html_again_copies_that_datasets_report_and_reruns_no_stage(work):
    proc = smk(work, "demo", "--cores", "1", "results/report.html")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [rule for rule, _ in job_headers(proc.stdout + proc.stderr)] == ["current_report"]
    assert (work / "results" / "report.html").read_bytes() == report_of(work, "demo").read_bytes()
    assert all(scheduled_rules(smk(work, ds, "-n").stdout) == {} for ds in DATASETS)


@pytest.mark.parametrize("dataset", DATASETS)
def test_snakemake_report_bundles_only_that_datasets_artefacts(work, tmp_path, dataset):
    bundle = tmp_path / f"{dataset}.zip"
    proc = smk(work, dataset, "--report", str(bundle))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with zipfile.ZipFile(bundle) as zf:
        index = zf.read(f"{bundle.stem}/report.html").decode()  # the bundle's folder is named after it
        names = zf.namelist()
    categories = json.loads(re.search(r"categories = (\{.*?\});\n", index).group(1))
    items = sorted(f for sub in categories.values() for files in sub.values() for f in files)
    assert f"results/{dataset}/main/report.html" in items, items
    assert all(item.startswith(f"results/{dataset}/") for item in items), items
    other = next(ds for ds in DATASETS if ds != dataset)
    assert not [n for n in names if f"/{other}/" in n], f"{other}'s files in {dataset}'s bundle"
