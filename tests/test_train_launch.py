"""The torchrun command the train rule runs: process count and devices from train.devices/nodes."""

import json
import subprocess
import sys

import pytest

from rectrain.config import stage_block
from rectrain.distributed import plan_processes, torchrun_command

ARGS = ["--config-json", "{}", "--out", "o"]


def command(cfg, gpus, **kw):
    """What the launcher runs for a (partial) train block on a machine with `gpus` GPUs."""
    cfg = stage_block("train", json.dumps(cfg))
    plan = plan_processes(cfg, gpus)
    argv, env = torchrun_command(plan, "rectrain.train", ARGS, nodes=cfg["nodes"], python="python", base_env={}, **kw)
    return argv, env, plan


def test_auto_uses_every_visible_gpu():
    argv, env, plan = command({"devices": "auto"}, gpus=2)
    assert argv[:5] == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert argv[-len(ARGS) - 2 :] == ["-m", "rectrain.train", *ARGS]
    assert "CUDA_VISIBLE_DEVICES" not in env and plan.kind == "gpu"


def test_auto_without_gpu_falls_back_to_cpu_processes():
    argv, _, plan = command({"devices": "auto", "cpu_processes": 3}, gpus=0)
    assert "--nproc_per_node=3" in argv and plan.kind == "cpu" and "no GPU" in plan.reason


def test_gpu_list_sets_cuda_visible_devices():
    argv, env, _ = command({"devices": [1, 3]}, gpus=4)
    assert "--nproc_per_node=2" in argv and env["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_cpu_hides_gpus_and_uses_cpu_processes():
    argv, env, _ = command({"devices": "cpu", "cpu_processes": 2}, gpus=2)
    assert "--nproc_per_node=2" in argv and env["CUDA_VISIBLE_DEVICES"] == ""


def test_failure_is_bounded_no_restarts():
    argv, _, _ = command({"devices": "cpu"}, gpus=0)
    assert "--max_restarts=0" in argv and any(a.startswith("--monitor_interval=") for a in argv)


def test_multi_node_uses_c10d_rendezvous():
    argv, _, _ = command({"devices": "auto", "nodes": 2}, gpus=8, rdzv_endpoint="node01:29400", run_id="job7")
    assert "--standalone" not in argv
    for opt in (
        "--nnodes=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node01:29400",
        "--rdzv_id=job7",
        "--nproc_per_node=8",
    ):
        assert opt in argv


def test_multi_node_without_endpoint_names_the_fix():
    with pytest.raises(ValueError, match="rdzv-endpoint|RECTRAIN_RDZV_ENDPOINT"):
        command({"devices": "auto", "nodes": 2}, gpus=2)


@pytest.mark.parametrize(
    "devices,gpus,match", [([0, 2], 2, "only 2 GPU"), ([0], 0, "no GPU is visible"), ("gpu", 1, "must be 'auto'")]
)
def test_bad_devices_name_the_key(devices, gpus, match):
    with pytest.raises(ValueError, match=match):
        plan_processes({"devices": devices, "cpu_processes": 2}, gpus)


def test_cli_prints_the_command_it_would_exec():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rectrain.train.launch",
            "--config-json",
            '{"devices": "cpu", "cpu_processes": 2}',
            "--out",
            "x",
            "--print-only",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "CPU processes" in proc.stderr
    assert "torch.distributed.run --standalone --nproc_per_node=2" in proc.stderr
    assert "-m rectrain.train --config-json" in proc.stderr and "--print-only" not in proc.stderr.split("[launch]")[-1]
