"""A finished run survives a rerun that fails (issue 22 item 5), through real Snakemake on a tiny demo:
a GPU asked for where none is fails before Snakemake removes anything; a failure inside the train job
(after Snakemake removed its outputs) leaves the finished run in checkpoints/, and the rerun with the
good config publishes it again without training; --forcerun train still trains again; a config
edited and edited back brings the finished run back from checkpoints/replaced/."""

import os

import pytest
import yaml
from helpers import copy_workflow, job_headers, scheduled_rules, snakemake, tiny_demo, tiny_train

from rectrain.train.lifecycle.checkpoint import load

pytestmark = pytest.mark.slow

TINY = {
    "demo": tiny_demo(train_per_class=12),
    "train": tiny_train(
        cpu_processes=1,
        epochs=1,
        batch_size=8,
        model="squeezenet1_1",
        calibration_steps=2,
    ),
}
TRAIN = "results/demo/main/train"
PUBLISHED = ["model.pt", "weights.safetensors", "steps.csv", "epochs.csv", "system.csv", "run.json"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A scratch copy of the workflow, a finished tiny run in it, and good.yaml / gpu.yaml beside it."""
    work = tmp_path_factory.mktemp("survive")
    copy_workflow(work)
    (work / "good.yaml").write_text(yaml.safe_dump(TINY))
    (work / "gpu.yaml").write_text(yaml.safe_dump({**TINY, "train": {**TINY["train"], "devices": [0]}}))
    proc = smk(work, "good.yaml", "--cores", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work


def smk(work, configfile, *args, timeout=600):
    # the target first: --configfile takes every word after it
    return snakemake(
        "--directory", str(work), "results/report.html", *args, "--configfile", str(work / configfile),
        cwd=work, snakefile=work / "Snakefile", timeout=timeout,
    )  # fmt: skip


def snapshot(work) -> dict:
    """Each published output and checkpoint: (inode, mtime, bytes)."""
    names = [*PUBLISHED, "checkpoints/last.pt", "checkpoints/epoch_0.pt"]
    return {n: (os.stat(work / TRAIN / n).st_ino, os.stat(work / TRAIN / n).st_mtime_ns) for n in names}


def test_a_gpu_asked_for_where_none_is_fails_before_any_output_is_removed(work):
    before = snapshot(work)
    proc = smk(work, "gpu.yaml", "--cores", "2")
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "config key 'train.devices' = [0] asks for GPU id(s) [0], but no GPU is visible here" in said
    assert "Fix: set train.devices: auto" in said
    assert "Removing output files" not in said and "train" not in {r for r, _ in job_headers(said)}, "no job started"
    assert snapshot(work) == before, "model.pt and the checkpoints untouched"


def test_a_failure_inside_the_job_keeps_the_finished_run_and_the_good_config_republishes_it(work):
    published = {n: (work / TRAIN / n).read_bytes() for n in PUBLISHED}
    last = load(work / TRAIN / "checkpoints" / "last.pt")
    # --no-hooks skips the onstart check: the launcher refuses the GPU inside the job, after Snakemake
    # removed the outputs - the failure issue 22 reported
    failed = smk(work, "gpu.yaml", "--cores", "2", "--no-hooks")
    assert failed.returncode != 0
    assert "train.devices asks for GPU ids [0] but no GPU is visible" in (work / "logs/train/demo/main.log").read_text()
    assert not (work / TRAIN / "model.pt").exists(), "Snakemake removed the failed job's outputs"
    kept = work / TRAIN / "checkpoints" / "finished"
    assert {n: (kept / n).read_bytes() for n in PUBLISHED} == published, "the finished run, kept"

    again = smk(work, "good.yaml", "--cores", "2")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    log = (work / "logs/train/demo/main.log").read_text()
    assert "restored the finished run's outputs" in log and "no training needed" in log
    assert "epoch 0" not in log, "no training step ran"
    assert {n: (work / TRAIN / n).read_bytes() for n in PUBLISHED} == published
    restored = load(work / TRAIN / "checkpoints" / "last.pt")
    assert restored["epoch"] == last["epoch"] and all(restored["model"][k].equal(v) for k, v in last["model"].items())
    dry = smk(work, "good.yaml", "-n")
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, "evaluate and report up to date"
    assert scheduled_rules(dry.stdout) == {}


def test_forcerun_train_still_trains_again(work):
    proc = smk(work, "good.yaml", "--cores", "2", "--forcerun", "train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (work / "logs/train/demo/main.log").read_text()
    assert "a forced rerun" in log and "epoch 0: train loss" in log and "restored" not in log
    assert [p.name for p in (work / TRAIN / "checkpoints" / "replaced").iterdir()][0].endswith(
        "-a-forced-rerun-that-run-finished-and-published"
    )


def test_a_config_edited_and_edited_back_brings_the_finished_run_back_without_training(work):
    (work / "lr.yaml").write_text(yaml.safe_dump({**TINY, "train": {**TINY["train"], "lr": 0.05}}))
    edited = smk(work, "lr.yaml", "--cores", "2")
    assert edited.returncode == 0, edited.stdout[-3000:] + edited.stderr[-3000:]
    assert "the train config changed (lr)" in (work / "logs/train/demo/main.log").read_text()
    model_lr = (work / TRAIN / "model.pt").read_bytes()
    kept = (work / TRAIN / "checkpoints" / "finished" / "model.pt").read_bytes()
    assert kept == model_lr, "the lr run kept in its turn"
    back = smk(work, "good.yaml", "--cores", "2")
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    log = (work / "logs/train/demo/main.log").read_text()
    assert "brought back the finished run moved aside to" in log and "no training needed" in log
    assert "epoch 0" not in log, "no training step ran"
    assert load(work / TRAIN / "model.pt")["config"]["lr"] == 0.1
