"""SLURM allocation -> rendezvous decisions, with scontrol faked (no cluster needed)."""

import subprocess

import pytest

from rectrain.train.cluster import (
    STEP_ENV,
    ClusterError,
    hostnames,
    plan_node_launch,
    rendezvous_port,
    slurm_endpoint,
    srun_per_node,
)
from rectrain.train.local_copy import stage_key

EXPANSIONS = {"gpu[07-09]": "gpu07\ngpu08\ngpu09\n", "gpu[08-09]": "gpu08\ngpu09\n", "n1": "n1\n"}


def fake_scontrol(argv, **_):
    assert argv[:3] == ["scontrol", "show", "hostnames"]
    out = EXPANSIONS.get(argv[3])
    return subprocess.CompletedProcess(argv, 0 if out else 1, out or "", "" if out else "Invalid hostlist")


def test_hostnames_uses_scontrol_order():
    assert hostnames("gpu[07-09]", run=fake_scontrol) == ["gpu07", "gpu08", "gpu09"]


def test_hostnames_failure_says_where_to_run():
    with pytest.raises(ClusterError, match="inside a SLURM allocation"):
        hostnames("bad[", run=fake_scontrol)


def test_port_is_deterministic_from_job_id_and_overridable():
    assert rendezvous_port("123456", {}) == 29500 + 456
    assert rendezvous_port("123456", {}) == rendezvous_port("123456", {"SLURM_JOB_ID": "x"})
    assert rendezvous_port("777_3", {}) == 29500 + 777  # array task: the parent job id
    assert rendezvous_port("123456", {"RECTRAIN_RDZV_PORT": "41000"}) == 41000


def test_endpoint_is_first_node_of_the_step():
    env = {"SLURM_JOB_ID": "1042", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_STEP_NODELIST": "gpu[08-09]"}
    assert slurm_endpoint(env, run=fake_scontrol) == "gpu08:29542"
    del env["SLURM_STEP_NODELIST"]
    assert slurm_endpoint(env, run=fake_scontrol) == "gpu07:29542"


def test_single_node_is_standalone_even_inside_slurm():
    plan = plan_node_launch(1, {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1"}, run=fake_scontrol)
    assert plan.relaunch is None and plan.rdzv_endpoint is None


def test_multi_node_batch_script_relaunches_once_per_node_with_srun():
    # The snakemake SLURM job step strips SLURM_JOB_NODELIST; the job id is enough for srun.
    plan = plan_node_launch(3, {"SLURM_JOB_ID": "1042"}, run=fake_scontrol)
    assert plan.relaunch == srun_per_node(3)
    assert plan.relaunch[0] == "srun"
    assert {"--nodes=3", "--ntasks-per-node=1", f"--export=ALL,{STEP_ENV}=1"} <= set(plan.relaunch)
    assert plan.rdzv_endpoint is None


def test_per_node_task_gets_shared_endpoint_and_run_id():
    base = {"SLURM_JOB_ID": "1042", "SLURM_JOB_NODELIST": "gpu[07-09]", STEP_ENV: "1"}
    plans = [plan_node_launch(3, dict(base, SLURM_NODEID=str(i)), run=fake_scontrol) for i in range(3)]
    assert {p.rdzv_endpoint for p in plans} == {"gpu07:29542"}
    assert {p.run_id for p in plans} == {"rectrain-1042"}
    assert all(p.relaunch is None for p in plans)


def test_explicit_endpoint_wins_outside_slurm():
    plan = plan_node_launch(2, {"RECTRAIN_RDZV_ENDPOINT": "10.0.0.1:29400"})
    assert plan.rdzv_endpoint == "10.0.0.1:29400" and plan.relaunch is None


def test_multi_node_outside_slurm_explains_the_ways_out():
    with pytest.raises(ClusterError, match="--executor slurm.*train.nodes: 1"):
        plan_node_launch(2, {})


def test_train_rule_resources_book_one_task_per_node():
    from rectrain.snakefile.resources import train_rule_resources

    assert train_rule_resources(1) == {"nodes": 1}
    res = train_rule_resources(4)
    assert res["nodes"] == 4 and res["tasks"] == 4 and res["mpi"]


def test_gpu_request_per_node_from_environment():
    from rectrain.snakefile.resources import ResourceError, gpu_gres, gpus_per_node

    assert gpus_per_node({"RECTRAIN_GPUS_PER_NODE": "4"}) == 4
    assert gpu_gres({}) == "gpu:1"
    assert gpu_gres({"RECTRAIN_GPUS_PER_NODE": "8"}) == "gpu:8"
    assert gpu_gres({"RECTRAIN_GPUS_PER_NODE": "0"}) == ""
    with pytest.raises(ResourceError, match="RECTRAIN_GPUS_PER_NODE='all'"):
        gpu_gres({"RECTRAIN_GPUS_PER_NODE": "all"})


def test_cpus_booked_per_node_scale_with_gpus():
    from rectrain.snakefile.resources import cpus_per_node

    assert cpus_per_node({}) == 8
    assert cpus_per_node({"RECTRAIN_GPUS_PER_NODE": "4", "RECTRAIN_CPUS_PER_GPU": "12"}) == 48
    assert cpus_per_node({"RECTRAIN_GPUS_PER_NODE": "0"}) == 0  # the rule's threads decide


# The data arguments a training command needs (print-only: never opened)
DUMMY_DATA = ["--rec", "t.rec", "--idx", "t.idx", "--classes", "c.tsv"]


# --- python -m rectrain.train wired to the allocation (print-only: nothing is started) --------------------


def _launch_print(monkeypatch, capsys, env, cfg, extra=(), rc=0):
    import json

    from rectrain import distributed
    from rectrain.train import direct

    for var in (
        "SLURM_JOB_ID",
        "SLURM_JOB_NODELIST",
        "SLURM_STEP_NODELIST",
        "SLURM_NODELIST",
        STEP_ENV,
        "RECTRAIN_RDZV_ENDPOINT",
        "RECTRAIN_RDZV_PORT",
    ):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(distributed, "visible_gpu_count", lambda: 0)
    assert direct.main(["--config-json", json.dumps(cfg), "--print-only", *extra, *DUMMY_DATA, "--out", "o"]) == rc
    return capsys.readouterr().err


def test_launch_in_multi_node_batch_script_execs_srun_per_node(monkeypatch, capsys):
    err = _launch_print(
        monkeypatch, capsys, {"SLURM_JOB_ID": "4321"}, {"nodes": 2, "devices": "cpu", "cpu_processes": 1}
    )
    line = next(x for x in err.splitlines() if "one launcher per node" in x)
    assert "srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in line and "-m rectrain.train --config-json" in line
    assert "rectrain._torchrun" not in err


def test_launch_in_per_node_task_uses_head_node_rendezvous(monkeypatch, capsys):
    from rectrain.train import cluster

    monkeypatch.setattr(cluster, "hostnames", lambda nodelist, run=None: ["gpu07", "gpu08"])
    err = _launch_print(
        monkeypatch,
        capsys,
        {"SLURM_JOB_ID": "4321", "SLURM_JOB_NODELIST": "gpu[07-08]", STEP_ENV: "1"},
        {"nodes": 2, "devices": "cpu", "cpu_processes": 1},
    )
    cmd = err.strip().splitlines()[-1]
    assert "--nnodes=2" in cmd and "--rdzv_backend=c10d" in cmd
    assert "--rdzv_endpoint=gpu07:29821" in cmd and "--rdzv_id=rectrain-4321" in cmd
    assert "--standalone" not in cmd


def test_launch_single_node_is_standalone_inside_slurm(monkeypatch, capsys):
    err = _launch_print(
        monkeypatch, capsys, {"SLURM_JOB_ID": "4321"}, {"nodes": 1, "devices": "cpu", "cpu_processes": 1}
    )
    assert "--standalone" in err and "srun" not in err


def test_launch_multi_node_without_slurm_fails_with_the_fix(monkeypatch, capsys):
    err = _launch_print(monkeypatch, capsys, {}, {"nodes": 2, "devices": "cpu", "cpu_processes": 1}, rc=1)
    assert "[train" in err and "not a SLURM job" in err


def test_launch_stages_pairs_before_torchrun(monkeypatch, capsys, tmp_path):
    fast = tmp_path / "fast" / "demo"
    fast.mkdir(parents=True)
    for name in ("train.rec", "train.idx"):
        (fast / name).write_bytes(b"x" * 1000)
    err = _launch_print(
        monkeypatch,
        capsys,
        {},
        {"nodes": 1, "devices": "cpu", "cpu_processes": 1},
        [
            "--stage-to-local",
            str(tmp_path / "local"),
            "--rec",
            str(fast / "train.rec"),
            "--idx",
            str(fast / "train.idx"),
        ],
    )
    cmd = err.strip().splitlines()[-1]
    staged = tmp_path / "local" / stage_key(fast / "train.rec")  # demo-<hash of the source folder's real path>
    assert staged.name.startswith("demo-")
    assert f"--rec {staged / 'train.rec'}" in cmd
    assert "--stage-to-local" not in cmd
    assert (staged / "train.idx").is_file()
