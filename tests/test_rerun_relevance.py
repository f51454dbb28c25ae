"""Which config keys make a stage's output (and a training run) another one: declared once, in the
schema (`x-rerun: false` marks an operational key), and read from there by the rules' params, by the
jobs' config completion and by training's resume identity. The Snakemake side (a finished run's
dry-run after each key's edit) is tests/test_pipeline_e2e.py; this file is the resume side and the
transport of operational values to the jobs."""

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers.config_edits import another_value, block_keys
from helpers.train_data import TINY_TRAIN, first_difference, packed_dataset, tiny_train_config

from rectrain.config import OPERATIONAL_ENV, output_part, stage_block
from rectrain.snakefile.jobenv import export_operational
from rectrain.snakefile.params import block_params, report_params
from rectrain.train.lifecycle import identity as runid

TRAIN_OPERATIONAL = [(key, spec) for block, key, spec, op in block_keys() if block == "train" and op]
TRAIN_OUTPUT = [(key, spec) for block, key, spec, op in block_keys() if block == "train" and not op]
# ... of which the process count and batch keys, whose effect the identity compares as its world_size
# and batch items (a run moved from 2 GPUs to 1 with its global batch kept is the same run).
TRAIN_CONFIG = [(key, spec) for key, spec in TRAIN_OUTPUT if key not in runid.PLAN_KEYS]


def identity(cfg: dict) -> runid.RunIdentity:
    return runid.RunIdentity(runid.maths_config(cfg), 8, 1, 2, {"idx_sha256": "a"}, {"train.py": "b"})


@pytest.mark.parametrize("key,spec", TRAIN_OPERATIONAL, ids=[k for k, _ in TRAIN_OPERATIONAL])
def test_a_checkpoint_resumes_across_an_operational_train_key(key, spec):
    cfg = tiny_train_config()
    state = {"config": cfg, **identity(cfg).stamp()}
    edited = dict(cfg, **{key: another_value("train", key, spec, cfg[key])})
    assert first_difference(state, identity(edited)) is None


@pytest.mark.parametrize("key,spec", TRAIN_CONFIG, ids=[k for k, _ in TRAIN_CONFIG])
def test_a_checkpoint_is_another_run_after_an_output_train_key_changes_naming_it(key, spec):
    cfg = tiny_train_config()
    state = {"config": cfg, **identity(cfg).stamp()}
    edited = dict(cfg, **{key: another_value("train", key, spec, cfg[key])})
    assert first_difference(state, identity(edited)) == f"the train config changed ({key})"


def test_the_process_count_and_batch_keys_are_output_keys_judged_by_the_plan_they_make():
    assert {key for key, _ in TRAIN_OUTPUT} >= set(runid.PLAN_KEYS), "an edit still reruns the train job"
    cfg = tiny_train_config()
    state = {"config": cfg, **identity(cfg).stamp()}
    edited = dict(cfg, cpu_processes=1, batch_size=16, grad_accum=1)
    assert first_difference(state, identity(edited)) is None, "the same plan and world size: the same run"
    moved = runid.RunIdentity(runid.maths_config(edited), 16, 1, 1, {"idx_sha256": "a"}, {"train.py": "b"})
    assert [d.item for d in runid.differences(state, moved)] == ["batch", "world_size"]


def test_rule_params_and_the_resume_identity_hold_the_same_keys():
    config = {"dataset": "demo", "train": tiny_train_config()}
    params = json.loads(block_params("train", config["train"]))
    assert params == runid.maths_config(config["train"]) == output_part("train", config["train"])
    assert not set(params) & {key for key, _ in TRAIN_OPERATIONAL}
    assert json.loads(report_params(config))["train"] == params


def test_a_job_gets_the_configured_operational_values_back(monkeypatch):
    """The Snakefile exports them (not params); stage_block puts them under the given block, so the
    stage's config holds what was configured, not the schema's defaults."""
    # set, then removed: monkeypatch then takes back what export_operational writes (a bare delenv of
    # an absent variable records nothing, and the export leaked into later tests on this worker)
    monkeypatch.setenv(OPERATIONAL_ENV, "{}")
    monkeypatch.delenv(OPERATIONAL_ENV)
    config = {
        "pack": {"threads": 3, "read_order": "storage", "progress_s": 2.5, "quality": 80},
        "train": {"progress_s": 7, "workers": "auto", "lr": 0.2},
    }
    export_operational(config)
    assert json.loads(os.environ[OPERATIONAL_ENV]) == {
        "pack": {"threads": 3, "read_order": "storage", "progress_s": 2.5},
        "train": {"progress_s": 7, "workers": "auto"},
    }
    pack = stage_block("pack", json.dumps(output_part("pack", config["pack"])))
    assert (pack["threads"], pack["read_order"], pack["progress_s"], pack["quality"]) == (3, "storage", 2.5, 80)
    train = stage_block("train", json.dumps({"lr": 0.2, "workers": 1}))
    assert (train["progress_s"], train["workers"], train["lr"]) == (7, 1, 0.2), "a value given by hand wins"


def test_without_the_snakefile_a_partial_block_gets_the_schema_defaults(monkeypatch):
    monkeypatch.delenv(OPERATIONAL_ENV, raising=False)
    assert stage_block("pack", "{}")["progress_s"] == 10


@pytest.mark.slow
def test_a_killed_run_resumes_across_every_operational_train_key_edited_at_once(tmp_path):
    """Killed after epoch 0 (as a crash would), then started again with every operational key of the
    train block changed - through the environment, as the Snakefile hands them over - it resumes at
    epoch 1 instead of starting over. compile is left out here: changing it on this CPU would compile
    the model (minutes); its identity is covered by the unit test above."""
    data = packed_dataset(tmp_path / "data")
    out = tmp_path / "out"
    fast = {"model": "squeezenet1_1", "precision": "fp32", "epochs": 2}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}

    def run(ops: dict, **extra_env):
        cmd = [sys.executable, "-m", "rectrain.train", "--config-json", json.dumps({**TINY_TRAIN, **fast})]
        cmd += [*data, "--out", str(out), "--single-process", "--threads", "1"]
        job_env = dict(env, **extra_env, **{OPERATIONAL_ENV: json.dumps({"train": ops})})
        return subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=300)

    base = tiny_train_config(**fast)
    first = {k: base[k] for k, _ in TRAIN_OPERATIONAL if k not in fast and k not in TINY_TRAIN}
    killed = run(first, RECTRAIN_KILL_AFTER_EPOCH="0")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    edits = {k: another_value("train", k, spec, base[k]) for k, spec in TRAIN_OPERATIONAL if k != "compile"}
    resumed = run(edits)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing at epoch 1" in resumed.stderr, resumed.stderr[-3000:]
    assert "not resuming" not in resumed.stderr
    assert json.loads((out / "run.json").read_text())["config"]["progress_s"] == edits["progress_s"]
