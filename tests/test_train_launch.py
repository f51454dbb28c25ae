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
    plan = plan_processes(cfg["devices"], cfg["cpu_processes"], gpus)
    argv, env = torchrun_command(plan, "rectrain.train", ARGS, nodes=cfg["nodes"], python="python", base_env={}, **kw)
    return argv, env, plan


def test_auto_uses_every_visible_gpu():
    argv, env, plan = command({"devices": "auto"}, gpus=2)
    assert argv[:5] == ["python", "-m", "rectrain._torchrun", "--standalone", "--nproc_per_node=2"]
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
        plan_processes(devices, 2, gpus)


def test_cli_prints_the_command_it_would_exec():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rectrain.train",
            "--config-json",
            '{"devices": "cpu", "cpu_processes": 2}',
            *("--rec", "t.rec", "--idx", "t.idx", "--classes", "c.tsv"),
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
    assert "rectrain._torchrun --standalone --nproc_per_node=2" in proc.stderr
    assert "-m rectrain.train --config-json" in proc.stderr and "--print-only" not in proc.stderr.split("[train]")[-1]


def test_a_gpu_listed_twice_runs_two_ranks_on_it():
    argv, env, plan = command({"devices": [0, 0]}, gpus=1)
    assert "--nproc_per_node=2" in argv and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "shared by that many ranks" in plan.reason and "gloo" in plan.reason


def test_ranks_beyond_the_gpus_share_them_round_robin():
    from rectrain.distributed import rank_device

    assert [rank_device(r, 2, 2) for r in range(2)] == [(0, False), (1, False)]
    assert [rank_device(r, 2, 1) for r in range(2)] == [(0, True), (0, True)]
    assert [rank_device(r, 3, 2) for r in range(3)] == [(0, True), (1, True), (0, True)]


@pytest.mark.parametrize("gpus, backend, device", [(2, "nccl", 1), (1, "gloo", 0)], ids=["own GPU", "shared GPU"])
def test_shared_gpu_ranks_join_over_gloo_and_own_gpu_ranks_over_nccl(monkeypatch, gpus, backend, device):
    """Rank 1 of 2 with `gpus` visible: NCCL refuses two ranks on one GPU, so sharing ranks use gloo."""
    import torch
    import torch.distributed

    from rectrain import distributed

    joined = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: joined.setdefault("set", dev))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda backend, **kw: joined.update(backend=backend, **kw)
    )
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: joined["backend"])
    d = distributed.setup(True, 60)
    assert d.device == torch.device("cuda", device) == joined["set"]
    assert joined["backend"] == d.backend == backend and ("device_id" in joined) == (backend == "nccl")


def test_slurm_books_a_shared_gpu_once():
    from rectrain.snakefile.resources import scheduled_gpus

    assert scheduled_gpus([0, 0]) == 1 and scheduled_gpus([0, 1]) == 2


def test_scheduled_gpus_asks_nvml_only_where_its_library_loads(monkeypatch):
    from rectrain.snakefile import resources
    from rectrain.train import telemetry

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    def inventory_not_expected():
        raise AssertionError("pynvml was imported on a machine without the NVML library")

    monkeypatch.setattr(resources.ctypes, "CDLL", no_library)
    monkeypatch.setattr(telemetry, "gpu_inventory", inventory_not_expected)
    assert resources.scheduled_gpus("auto") == 0
    monkeypatch.setattr(resources.ctypes, "CDLL", lambda name: object())
    monkeypatch.setattr(telemetry, "gpu_inventory", lambda: [{"index": 0}, {"index": 1}])
    assert resources.scheduled_gpus("auto") == 2


def test_the_launcher_imports_no_torch_so_each_training_start_skips_its_seconds_of_import():
    """`python -m rectrain.train` before it is a rank only plans processes and starts torchrun (which
    imports torch itself); torch at its import cost ~2-3 s of CPU per training start on the 2-core CI machine."""
    probe = "import sys, rectrain.train.direct; print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_no_gpu_device_node_means_no_gpu_without_asking_torch(monkeypatch):
    from rectrain import distributed

    monkeypatch.setattr(distributed.glob, "glob", lambda pattern: [])
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch now fails: it must not be asked
    assert distributed.visible_gpu_count() == 0


def test_a_direct_run_that_relaunches_imports_no_torch_before_torchrun():
    """`python -m rectrain.train` decides to relaunch (rectrain.train.direct) before importing the trainer:
    the process that only starts torchrun skips torch's seconds of import and of teardown."""
    probe = "import sys, rectrain.train.direct; print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.parametrize(
    ("argv", "env", "relaunches"),
    [
        (["--config-json", '{"devices": "cpu", "cpu_processes": 2}', "--out", "o"], {}, True),
        (["--config-json", '{"devices": "cpu", "cpu_processes": 1}'], {}, False),
        (["--config-json", '{"devices": "cpu", "cpu_processes": 2}', "--single-process"], {}, False),
        (["--config-json", '{"devices": "cpu", "cpu_processes": 2, "nodes": 2}'], {}, True),
        (
            ["--config-json", '{"devices": "cpu", "cpu_processes": 2}'],
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
            False,
        ),
        (["--config-json", '{"devices": "cpu", "cpu_processes": 2}', "--help"], {}, False),
        (["--config-json", '{"not_a_key": 1}'], {}, False),
        (["--config-json", "{not json"], {}, False),
        (["--rec", "x.rec"], {}, False),
    ],
    ids=["two-cpu", "one-cpu", "single-process", "two-nodes", "launched", "help", "bad-key", "bad-json", "no-config"],
)
def test_only_a_run_torchrun_must_start_relaunches_early_and_the_trainer_reports_everything_else(
    monkeypatch, argv, env, relaunches
):
    from rectrain.train import direct

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert direct.relaunches(argv) is relaunches


def test_the_trainers_help_and_argument_errors_name_the_one_command_python_m_rectrain_train(capsys):
    """The usage line a user copies is the command that trains, not the module that parses its options
    (rectrain.train.direct, which `python -m` would run to no effect)."""
    from rectrain.train import direct

    with pytest.raises(SystemExit) as help_exit:
        direct.main(["--help"])
    assert help_exit.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m rectrain.train [-h] --config-json")
    with pytest.raises(SystemExit) as error_exit:
        direct.main(["--config-json", "{}"])
    err = capsys.readouterr().err
    assert error_exit.value.code == 2
    assert "python -m rectrain.train: error: the following arguments are required: --rec, --idx" in err, err
    assert "direct" not in err, err
