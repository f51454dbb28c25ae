"""A run that goes wrong says so last, through Snakemake (issue 51): a tiny pipeline whose train images
were dealt to random class folders (shuffled labels) trains 2 epochs of 9 optimizer steps and ends at
chance - weights.json marked, the report's first card, the line last on the console, exit status 1 -
and the same command with train.allow_chance: true (an operational key: nothing reruns) exits 0.  Then
training is made to fail (its loss NaN from the second step: faults.NONFINITE_AT_ENV): Snakemake's
error block is short on the console, whole at the end of the job's log, and the console's last line is
the stage's own cause."""

import json
import random
import shutil

import pytest
import yaml
from helpers import copy_workflow, snakemake, tiny_train
from helpers.views import view

from rectrain.chance import EXIT_AT_CHANCE
from rectrain.config import stage_block
from rectrain.data import demo
from rectrain.train.lifecycle.faults import NONFINITE_AT_ENV

pytestmark = pytest.mark.slow

DEMO = {"classes": 3, "train_per_class": 24, "val_per_class": 10, "min_size": 40, "max_size": 64, "bad_files": False}
REPORT = "results/shuffled/main/report.html"


def shuffled_raw(root):
    """The demo's class folders (train/<wnid>/, val/<wnid>/) with every train image moved to a class
    folder drawn at random, the counts per class kept: labels that say nothing about the images."""
    demo.generate(view("demo", {**stage_block("demo", "{}"), **DEMO}), root)
    for other in ("archives", "val_flat", "devkit"):
        shutil.rmtree(root / other, ignore_errors=True)
    (root / "LOC_val_solution.csv").unlink(missing_ok=True)
    images = sorted((root / "train").glob("*/*.JPEG"))
    folders = [p.parent for p in images]
    random.Random(0).shuffle(folders)
    moved = [p.rename(root / f"moving-{i}.JPEG") for i, p in enumerate(images)]
    for i, (image, folder) in enumerate(zip(moved, folders, strict=True)):
        image.rename(folder / f"shuffled-{i}.JPEG")


def run(work, *args, env=None):
    return snakemake("--directory", str(work), "--cores", "2", *args, cwd=work, snakefile=work / "Snakefile",
                     timeout=900, env=env)  # fmt: skip


def last_line(proc) -> str:
    return (proc.stdout + proc.stderr).strip().splitlines()[-1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = copy_workflow(tmp_path_factory.mktemp("went_wrong"))
    shuffled_raw(work / "raw")
    train = {**tiny_train(cpu_processes=2, epochs=2, batch_size=4, calibration_steps=1), "allow_chance": False}
    config = {"dataset": "shuffled", "raw": str(work / "raw"), "train": train}
    (work / "run.yaml").write_text(yaml.safe_dump(config))
    return work


def test_a_run_at_chance_is_marked_carded_ends_in_its_line_and_fails_unless_allowed(work):
    first = run(work, REPORT, "--configfile", "run.yaml")
    out = first.stdout + first.stderr
    assert first.returncode == EXIT_AT_CHANCE, out[-3000:]
    line = last_line(first)
    assert line.startswith("[rectrain] at chance: val top-1 ") and line.endswith(f"(exit status {EXIT_AT_CHANCE})")
    assert "on 30 val images is within noise of chance (33.3 %; at most 53.4 % is chance + 2.33" in line
    assert "after 2 epochs of 9 optimizer steps" in line
    results = work / "results" / "shuffled" / "main"
    marked = json.loads((results / "train" / "weights.json").read_text())["at_chance"]
    metrics = json.loads((results / "eval" / "metrics.json").read_text())
    assert marked == metrics["at_chance"] and marked["top1"] == metrics["top1"] <= marked["limit"]
    html = (results / "report.html").read_text()
    assert html.index('<section id="at-chance"') < html.index('<section id="summary">'), "the first card"
    again = run(work, REPORT, "--configfile", "run.yaml")
    assert again.returncode == EXIT_AT_CHANCE and "Nothing to be done" in again.stdout + again.stderr
    assert last_line(again) == line, "a run with nothing to do still ends at chance"
    allowed = run(work, REPORT, "--configfile", "run.yaml", "--config", "train={allow_chance: true}")
    assert allowed.returncode == 0, (allowed.stdout + allowed.stderr)[-3000:]
    assert last_line(allowed).endswith("(train.allow_chance: true: exit status 0)")


def test_a_training_failure_ends_the_console_with_its_cause_and_keeps_snakemakes_block_in_the_jobs_log(work):
    failed = run(work, REPORT, "--configfile", "run.yaml", "--forcerun", "train",
                 env={NONFINITE_AT_ENV: "0:1"})  # fmt: skip
    out = failed.stdout + failed.stderr
    assert failed.returncode == 1, out[-3000:]
    assert last_line(failed).startswith("[rectrain] train failed: rank 0: training diverged at epoch 0 step 4 (lr "), (
        out[-3000:]
    )
    assert last_line(failed).endswith("(exit status 1) (log: logs/train/shuffled/main.log)")
    assert "Error in rule train (job " in out and "input:" not in out and "--config-json" not in out, out[-3000:]
    log = (work / "logs" / "train" / "shuffled" / "main.log").read_text()
    block = log[log.index("---- Snakemake's error block for this job ----") :]
    assert "Error in rule train:" in block and "input: " in block and "python -m rectrain.train --config-json" in block
