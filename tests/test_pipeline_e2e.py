"""The whole demo pipeline through Snakemake, in a scratch working directory, as `make report` runs it.

One run (module fixture) backs several checks: the report exists, the model learned (so labels
stayed aligned from the generator through index, pack, DALI and DDP), a second dry-run schedules
nothing, and editing one config block schedules exactly that stage and what depends on it.
"""

import json
import re

import pytest
import yaml
from helpers import REPO, scheduled_rules, snakemake

pytestmark = pytest.mark.slow

DOWNSTREAM_OF_TRAIN = {"train", "evaluate", "report"}
DOWNSTREAM_OF_PACK = {"pack", "train", "evaluate", "report"}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    work = tmp_path_factory.mktemp("pipeline")
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfgfile = work / "config.yaml"
    cfgfile.write_text(yaml.safe_dump(config))
    proc = snakemake(
        "--cores", "2", "--configfile", str(cfgfile), "--directory", str(work), "results/report.html", timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return work, config


def dryrun_with(work, config, tmp_path, **blocks):
    edited = json.loads(json.dumps(config))
    for block, changes in blocks.items():
        edited[block].update(changes)
    cfgfile = tmp_path / "edited.yaml"
    cfgfile.write_text(yaml.safe_dump(edited))
    proc = snakemake("-n", "--configfile", str(cfgfile), "--directory", str(work), "results/report.html")
    assert proc.returncode == 0, proc.stderr
    return set(scheduled_rules(proc.stdout))


def test_pipeline_produces_report_and_learns(pipeline):
    work, _ = pipeline
    html = (work / "results" / "report.html").read_text()
    assert "Diagnosis" in html and "Throughput" in html
    metrics = json.loads((work / "results" / "demo" / "eval" / "metrics.json").read_text())
    # 10 demo classes: chance is 0.10. A model that reaches 0.6 on held-out images can only do so
    # if every stage kept each image with its own label (a shuffled label map scores ~0.10).
    assert metrics["top1"] >= 0.6, metrics
    assert metrics["images"] == 120
    # Training's own last val pass scores the checkpointed weights on the same records.
    last_epoch = (work / "results" / "demo" / "train" / "epochs.csv").read_text().strip().splitlines()[-1]
    val_top1 = float(last_epoch.split(",")[4])
    assert abs(val_top1 - metrics["top1"]) <= 1 / 120 + 1e-9, (val_top1, metrics)


def test_unchanged_config_schedules_nothing(pipeline, tmp_path):
    work, config = pipeline
    assert dryrun_with(work, config, tmp_path) == set()


def test_editing_train_lr_reruns_train_and_dependents_only(pipeline, tmp_path):
    work, config = pipeline
    assert dryrun_with(work, config, tmp_path, train={"lr": 0.05}) == DOWNSTREAM_OF_TRAIN


def test_editing_pack_quality_reruns_pack_and_everything_after(pipeline, tmp_path):
    work, config = pipeline
    assert dryrun_with(work, config, tmp_path, pack={"quality": 80}) == DOWNSTREAM_OF_PACK


def test_editing_report_thresholds_reruns_report_only(pipeline, tmp_path):
    work, config = pipeline
    assert dryrun_with(work, config, tmp_path, report={"iowait_percent": 30}) == {"report"}


def test_training_code_is_an_input_of_train(pipeline):
    work, _ = pipeline
    proc = snakemake("-n", "--forcerun", "train", "--directory", str(work), "results/report.html")
    job = re.search(r"(?:local)?rule train:\n(.*?)\n\n", proc.stdout, re.S)
    assert job and "workflow/rectrain/train/trainer.py" in job.group(1), proc.stdout[:3000]
