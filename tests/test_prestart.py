"""What the Snakefile's onstart hook decides before the first job starts (rectrain.snakefile.prestart):
train.devices against this machine's GPUs only when the jobs run here (the executor plugins' own
settings), the message naming the key, the GPUs seen and the fix, and whether Snakemake forced the
train job.  The Snakemake run that proves nothing is removed is tests/test_finished_run_survives.py."""

from types import SimpleNamespace

import pytest
from helpers.train_data import train_settings
from snakemake.exceptions import WorkflowError
from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry

from rectrain.driver_check import Gpus
from rectrain.snakefile import prestart
from rectrain.snakefile.checks import device_problems, node_problems, precision_problems
from rectrain.train.lifecycle.status import FORCED_ENV

NO_GPU = Gpus(0, None, None, "/dev/nvidia[0-9]*")
FOUR = Gpus(4, "580.65.06", "13.0", "NVML")  # a driver every pinned torch build runs on


def executor(name: str):
    return ExecutorPluginRegistry().get_plugin(name).common_settings


@pytest.mark.parametrize(("name", "here"), [("local", True), ("slurm", False), ("touch", False), ("dryrun", False)])
def test_gpus_are_checked_only_when_the_executor_runs_the_jobs_on_this_machine(name, here):
    assert prestart.checks_gpus_here(executor(name)) is here


def fake_workflow(name: str, train_reason=None):
    """What before_jobs reads of Snakemake's workflow: the executor and the planned jobs with their reasons."""
    jobs = [] if train_reason is None else [SimpleNamespace(rule=SimpleNamespace(name="train"))]
    dag = SimpleNamespace(needrun_jobs=lambda: iter(jobs), reason=lambda job: train_reason)
    return SimpleNamespace(executor_plugin=SimpleNamespace(common_settings=executor(name)), dag=dag)


def test_a_slurm_run_does_not_check_the_login_nodes_gpus_but_a_local_one_refuses_them(monkeypatch):
    monkeypatch.delenv(FORCED_ENV, raising=False)  # before_jobs sets or clears it in this process
    monkeypatch.setattr(prestart, "device_problems", lambda devices: device_problems(devices, env={}, gpus=NO_GPU))
    train = train_settings({"devices": [0], "nodes": 1, "precision": "bf16"})
    parts = ({"main": (train.launch, train.batch, train.network.precision)},)
    prestart.before_jobs(fake_workflow("slurm", SimpleNamespace(forced=False)), *parts)
    with pytest.raises(WorkflowError, match=r"config key 'train.devices' = \[0\]"):
        prestart.before_jobs(fake_workflow("local", SimpleNamespace(forced=False)), *parts)
    prestart.before_jobs(fake_workflow("local"), *parts)  # no train job to run: nothing to refuse


def test_a_gpu_asked_for_where_none_is_names_the_key_the_gpus_seen_and_the_fix():
    (line,) = device_problems([0], env={}, gpus=NO_GPU)
    assert "'train.devices' = [0] asks for GPU id(s) [0], but no GPU is visible here" in line
    assert "0 GPU(s) seen through /dev/nvidia[0-9]*" in line and "Fix: set train.devices: auto" in line


def test_ids_beyond_the_visible_gpus_are_named_and_cuda_visible_devices_is_honoured():
    assert device_problems([0, 3], env={}, gpus=FOUR) == []
    (line,) = device_problems([0, 3], env={"CUDA_VISIBLE_DEVICES": "2,3"}, gpus=FOUR)
    assert "GPU id(s) [3], but only 2 GPU(s) are visible here (ids 0..1; 4 GPU(s) seen through NVML" in line
    assert "CUDA_VISIBLE_DEVICES='2,3'" in line
    assert device_problems([0], env={"CUDA_VISIBLE_DEVICES": ""}, gpus=FOUR) != []


@pytest.mark.parametrize("devices", ["auto", "cpu"])
def test_auto_and_cpu_run_on_a_machine_without_gpus(devices):
    assert device_problems(devices, env={}, gpus=NO_GPU) == []


def test_the_train_job_learns_whether_snakemake_forced_it():
    env = {FORCED_ENV: "1"}
    prestart.mark_forced(False, env)
    assert FORCED_ENV not in env, "a value left from an earlier run in this shell must not force this one"
    prestart.mark_forced(True, env)
    assert env[FORCED_ENV] == "1"


def test_several_nodes_outside_a_slurm_job_are_refused_naming_the_key_and_the_ways_to_run_them():
    (line,) = node_problems(2, env={})
    assert line.startswith("config key 'train.nodes' = 2: train.nodes is 2 but this is not a SLURM job")
    assert "--workflow-profile profiles/slurm" in line and "RECTRAIN_RDZV_ENDPOINT" in line
    assert node_problems(2, env={"RECTRAIN_RDZV_ENDPOINT": "node01:29400"}) == []
    assert node_problems(2, env={"SLURM_JOB_ID": "7"}) == [], "inside an allocation the launcher runs srun"
    assert node_problems(1, env={}) == []


def test_fp16_where_training_would_run_on_cpu_processes_is_refused_naming_the_fix():
    """The reference box's fp16 (Turing) copied onto a CPU machine: 0.2 img/s against 33 in bf16."""
    (line,) = precision_problems("auto", "fp16", env={}, gpus=NO_GPU)
    assert "config key 'train.precision' = 'fp16', but train.devices is 'auto' and no GPU is visible here" in line
    assert "Fix: set train.precision: bf16 (or fp32)" in line
    assert precision_problems("cpu", "fp16", env={}, gpus=FOUR) != [], "cpu: CPU processes whatever the GPUs"
    assert precision_problems("auto", "fp16", env={"CUDA_VISIBLE_DEVICES": ""}, gpus=FOUR) != []
    assert precision_problems("auto", "fp16", env={}, gpus=FOUR) == [], "GPUs here: fp16 is theirs"
    assert precision_problems("auto", "bf16", env={}, gpus=NO_GPU) == precision_problems([0], "fp16", gpus=NO_GPU) == []
