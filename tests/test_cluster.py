"""SLURM allocation -> rendezvous decisions, with scontrol faked (no cluster needed)."""
import subprocess

import pytest

from rectrain.cluster import (STEP_ENV, ClusterError, hostnames, plan_node_launch, rendezvous_port,
                              slurm_endpoint, srun_per_node)

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
    assert rendezvous_port("777_3", {}) == 29500 + 777          # array task: the parent job id
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
    from rectrain.cluster import train_rule_resources
    assert train_rule_resources(1) == {"nodes": 1}
    res = train_rule_resources(4)
    assert res["nodes"] == 4 and res["tasks"] == 4 and res["mpi"]


def test_gpu_request_per_node_from_environment():
    from rectrain.cluster import gpu_gres
    assert gpu_gres({}) == "gpu:1"
    assert gpu_gres({"RECTRAIN_GPUS_PER_NODE": "8"}) == "gpu:8"
    assert gpu_gres({"RECTRAIN_GPUS_PER_NODE": "0"}) == ""
    with pytest.raises(ClusterError, match="RECTRAIN_GPUS_PER_NODE='all'"):
        gpu_gres({"RECTRAIN_GPUS_PER_NODE": "all"})


def test_cpus_booked_per_node_scale_with_gpus():
    from rectrain.cluster import cpus_per_node
    assert cpus_per_node({}) == 8
    assert cpus_per_node({"RECTRAIN_GPUS_PER_NODE": "4", "RECTRAIN_CPUS_PER_GPU": "12"}) == 48
    assert cpus_per_node({"RECTRAIN_GPUS_PER_NODE": "0"}) == 0      # the rule's threads decide
